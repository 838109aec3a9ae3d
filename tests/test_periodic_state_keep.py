"""The periodic replay of the fewest micro-batches: the fill and two periods, proved by the state.

A workload lowered for :func:`stg.perf.periodic.state_keep` micro-batches and one period more
(``pp + 2`` for 1F1B, not ``2 pp + 2``) is replayed once; the engine's state at the start of
two micro-batches a period apart on the first stage is checked to repeat, the shorter replay
read off, and the iteration time, every unit's breakdown and the critical path (its kinds,
seconds per kind and nodes, repeated periods counted) extrapolated. Wherever it answers they
are the whole workload's full replay's within 1e-9; where the state does not repeat it does not
answer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload, name_in_micro_batch
from stg.core.workload import NodeType, node_micro_batch
from stg.host.registry import load_registry
from stg.perf.periodic import PeriodicReplay, first_keep, replay_periodic, state_keep
from stg.perf.replay import Problem, critical_path, problem_from_workload, replay, unit_breakdown
from stg.perf.system import load_system
from stg.predictors.time import lowered_micro_batches, predict_time_options

SMALL = {"dmodel": 1024, "dff": 4096, "head": 8, "kvhead": 8, "seq": 512, "dvocal": 128}
SYSTEM = load_system("a100-80g")
REGISTRY = load_registry(autoload=False)
RELATIVE = 1e-9

PLANS = {
    "1f1b-pp4": dict(num_stacks=4, pp=4, dp=1, tp=1, batch=40),
    "1f1b-pp2-dp2": dict(num_stacks=4, pp=2, dp=2, tp=1, batch=64, micro_batch=2),
    "full-recompute": dict(num_stacks=4, pp=4, dp=1, tp=1, batch=40, activation_recompute="full"),
    "selective-recompute": dict(
        num_stacks=4, pp=4, dp=1, tp=1, batch=40, activation_recompute="selective"
    ),
    "interleaved": dict(
        num_stacks=8, pp=4, dp=1, tp=1, batch=40, pipeline_schedule="interleaved",
        virtual_stages=2,
    ),
}  # fmt: skip


def _options(plan: dict[str, Any]) -> GenerateOptions:
    return GenerateOptions(**{"model": "gpt", "micro_batch": 1, **SMALL, **plan})


def _period(options: GenerateOptions) -> int:
    return options.pp if options.virtual_stages > 1 else 1


def _lowered(options: GenerateOptions, built: int) -> Problem:
    workload = build_workload(options, REGISTRY, lowered_micro_batches=built)
    return problem_from_workload(workload, SYSTEM)


def _periodic(options: GenerateOptions, problem: Problem, **flags: Any) -> PeriodicReplay | None:
    return replay_periodic(
        problem,
        SYSTEM,
        micro_batches=options.micro_batches,
        only_period=_period(options),
        name_at=name_in_micro_batch,
        only_if_cheaper=False,
        chunks=options.virtual_stages,
        **flags,
    )


def _path_totals(path: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds per kind along a critical path and its nodes, a run of ``repeats`` counted that
    many times."""
    totals: dict[str, float] = {"nodes": 0}
    for run in path:
        repeats = run.get("repeats", 1)
        totals[run["kind"]] = totals.get(run["kind"], 0.0) + repeats * (
            run["end_s"] - run["start_s"]
        )
        totals["nodes"] += repeats * run["nodes"]
    return totals


def _assert_equals_full(periodic: PeriodicReplay, options: GenerateOptions) -> None:
    full = replay(problem_from_workload(build_workload(options, REGISTRY), SYSTEM), SYSTEM)
    scale = full.iteration_time
    assert periodic.iteration_time == pytest.approx(scale, rel=RELATIVE)
    assert len(periodic.breakdowns) == len(full.units)
    for res, breakdown in zip(full.units, periodic.breakdowns, strict=True):
        exact = unit_breakdown(res, full.iteration_time)
        assert exact.keys() == breakdown.keys()
        for key, value in exact.items():
            assert breakdown[key] == pytest.approx(value, abs=RELATIVE * scale), key
    path, exact_path = periodic.critical_path, critical_path(full)
    assert path[0]["first"] == exact_path[0]["first"]
    assert path[-1]["last"] == exact_path[-1]["last"]
    assert path[-1]["end_s"] == pytest.approx(scale, rel=RELATIVE)
    totals, exact_totals = _path_totals(path), _path_totals(exact_path)
    assert totals.keys() == exact_totals.keys()
    assert totals["nodes"] == exact_totals["nodes"]
    for kind, seconds in exact_totals.items():
        assert totals[kind] == pytest.approx(seconds, abs=RELATIVE * scale), kind


@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_the_fewest_micro_batches_give_the_full_replay(plan: dict[str, Any]) -> None:
    """One replay of the fill and two periods (6 micro-batches of 40 at pp 4, 1F1B; 16 with
    two model chunks, whose fill spans 5 micro-batches, 8 in whole periods of 4) gives the
    whole workload's figures."""
    options = _options(plan)
    period = _period(options)
    keep = state_keep(options.pp, period, options.virtual_stages)
    assert keep < first_keep(options.pp, period, options.virtual_stages)
    assert lowered_micro_batches(options, SYSTEM)[0] == (keep + period, period)
    periodic = _periodic(options, _lowered(options, keep + period))
    assert periodic is not None
    assert (periodic.replays, periodic.replayed_micro_batches) == (1, keep)
    _assert_equals_full(periodic, options)


def test_stg_predict_lowers_the_fewest_micro_batches() -> None:
    """The time predictor from options lowers ``pp + 2`` micro-batches of a 1F1B pipeline and
    reports the whole workload's figures."""
    options = _options(PLANS["1f1b-pp4"])
    fast = predict_time_options(options, SYSTEM, registry=REGISTRY)
    exact = predict_time_options(options, SYSTEM, registry=REGISTRY, exact=True)
    assert fast["replay"]["lowered_micro_batches"] == options.pp + 2
    assert fast["iteration_time_s"] == pytest.approx(exact["iteration_time_s"], rel=RELATIVE)
    for a, b in zip(fast["ranks"], exact["ranks"], strict=True):
        for key, value in b.items():
            if isinstance(value, float):
                assert a[key] == pytest.approx(value, abs=RELATIVE * exact["iteration_time_s"])


def test_overlapped_parameter_gathers_lower_the_fewest_micro_batches() -> None:
    """With overlapped parameter gathers (issued at the start, every forward of a part waiting
    for its gather, long ended at the instants compared) the state check applies: the fewest
    micro-batches are lowered first, replayed once, and give the whole workload's figures."""
    plan = dict(
        num_stacks=4, pp=4, dp=2, tp=1, batch=80, micro_batch=2, zero=1,
        overlap_param_gather=True,
    )  # fmt: skip
    options = _options(plan)
    smallest = state_keep(options.pp, 1) + 1
    assert lowered_micro_batches(options, SYSTEM)[0] == (smallest, 1)
    flags = {"overlap_param_gather": True}
    periodic = _periodic(options, _lowered(options, smallest), **flags)
    assert periodic is not None and periodic.replays == 1
    full = replay(problem_from_workload(build_workload(options, REGISTRY), SYSTEM), SYSTEM, **flags)
    assert periodic.iteration_time == pytest.approx(full.iteration_time, rel=RELATIVE)


def test_a_state_that_does_not_repeat_is_rejected() -> None:
    """The last lowered micro-batch computes twice as much: at the second instant compared its
    nodes stand for those of the micro-batch before, whose costs differ, so the check fails
    and no extrapolation is given (the same workload unchanged passes it)."""
    options = _options(PLANS["1f1b-pp4"])
    built = state_keep(options.pp, 1) + 1
    problem = _lowered(options, built)
    assert _periodic(options, problem) is not None
    units = [
        dataclasses.replace(
            unit,
            nodes=[
                dataclasses.replace(n, num_ops=2 * n.num_ops)
                if n.type is NodeType.COMP and node_micro_batch(n) == built - 1
                else n
                for n in unit.nodes
            ],
        )
        for unit in problem.units
    ]
    changed = Problem(units, problem.unit_of_rank, problem.comm_groups, problem.world_size)
    assert _periodic(options, changed) is None


def test_a_schedule_without_a_steady_state_is_rejected() -> None:
    """GPipe runs every backward after every forward: one more micro-batch delays every
    backward, so the state a period later never repeats."""
    options = _options(dict(num_stacks=4, pp=4, dp=1, tp=1, batch=40, pipeline_schedule="gpipe"))
    assert _periodic(options, _lowered(options, state_keep(options.pp, 1) + 1)) is None


def test_a_reduced_longer_replay_is_not_read_off_at_the_fewest() -> None:
    """Context parallelism: a reduced problem's backward gather waits for the compute before
    the dropped forward's gather too, which the schedule of as many micro-batches does not,
    so reduced replays of 5 and 6 micro-batches repeat alike but not as the whole workload.
    The fewest are read off only where the longer replay is the lowered workload itself (here
    the check then fails): the figures are the whole workload's."""
    options = _options(dict(num_stacks=4, pp=4, dp=1, tp=1, sp=2, batch=40))
    assert _periodic(options, _lowered(options, state_keep(options.pp, 1) + 1)) is None
    fast = predict_time_options(options, SYSTEM, registry=REGISTRY)
    exact = predict_time_options(options, SYSTEM, registry=REGISTRY, exact=True)
    scale = exact["iteration_time_s"]
    for a, b in zip(fast["ranks"], exact["ranks"], strict=True):
        for key, value in b.items():
            if isinstance(value, float):
                assert a[key] == pytest.approx(value, abs=RELATIVE * scale), key


def test_implied_dependencies_walk_no_lower_than_the_lowest_candidate() -> None:
    """``_implied`` finds the same candidates with and without the topological floor, and the
    floor keeps the walk off nodes below the lowest candidate."""
    from stg.perf.periodic import _implied

    # 0 -> 1 -> 2 -> 4, 3 -> 4, 1 -> 3; node 5 waits for 2, 3 and 4
    parents = {0: set(), 1: {0}, 2: {1}, 3: {1}, 4: {2, 3}, 5: {2, 3, 4}}
    visited: list[int] = []

    def walk(x: int) -> set[int]:
        visited.append(x)
        return parents[x]

    for candidates in ({2}, {3}, {2, 3}, {1}):
        plain = _implied(candidates, {2, 3, 4}, parents.__getitem__, lambda d: True)
        visited.clear()
        floored = _implied(candidates, {2, 3, 4}, walk, lambda d: True, topological=True)
        assert floored == plain
        assert all(x >= min(candidates) for x in visited[3:])  # past the deps themselves
    assert _implied({2, 3}, {2, 3, 4}, parents.__getitem__, lambda d: True) == {2, 3}


def test_topological_checks_both_problems_against_the_longer_ones_positions() -> None:
    """``_topological``: every dependency at a lower position of the longer problem: its
    nodes as the engine found them (``_dependencies``), and the shorter one's rewritten ones
    by the positions of their dependencies."""
    from stg.core.workload import NodeTemplate
    from stg.perf.periodic import _topological
    from stg.perf.replay import _dependencies

    comp = NodeType.COMP
    chain = [NodeTemplate(i, f"n{i}", comp, data_deps=(i - 1,) if i else ()) for i in range(4)]
    ordered = _dependencies(chain, 0)[2]
    assert ordered and _topological(ordered, {})
    back = dataclasses.replace(chain[1], ctrl_deps=(3,))
    assert not _topological(_dependencies([chain[0], back, *chain[2:]], 0)[2], {})
    assert not _topological(ordered, {2: {0, 3}})  # a rewritten node after a later one
    assert _topological(ordered, {2: {0}})
    # ids 10, 11, 12, 13 at positions 0..3
    renamed = [
        NodeTemplate(10 + i, f"n{i}", comp, data_deps=(9 + i,) if i else ()) for i in range(4)
    ]
    assert _topological(_dependencies(renamed, 0)[2], {})
    late = dataclasses.replace(renamed[1], data_deps=(12,))
    assert not _topological(_dependencies([renamed[0], late, *renamed[2:]], 0)[2], {})
