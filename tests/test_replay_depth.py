"""Deep pipelines replay: the symmetric units of a plan are as alike as its ranks.

The replay simulates one rank per class of alike ranks. A difference between ranks (a
pipeline peer across a node boundary, a data-parallel group split over two nodes) travels
along the pipeline one stage per refinement round; with a fixed number of rounds, a plan of
pp 35 and dp 9 on 8-GPU nodes kept ranks together whose peers differ, and its replay ended
in ``replay deadlocked: ... waits for the other members of communicator 9``. Here every such
plan replays, and the units give the time that replaying every rank gives.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.perf.system import load_system
from stg.predictors.time import predict_problem, problem_from_nodes, problem_from_workload

TINY = {"dmodel": 64, "dff": 256, "head": 4, "kvhead": 4, "seq": 32, "dvocal": 128}


def _both_ways(options: GenerateOptions, system_name: str = "a100-80g") -> tuple[dict, dict]:
    """The prediction from the workload's units, and from every rank replayed on its own."""
    workload = build_workload(options, load_registry(autoload=False))
    system = load_system(system_name)
    units = predict_problem(problem_from_workload(workload, system), system)
    every = {g.rank: list(g.nodes()) for g in workload.ranks}
    ranks = predict_problem(problem_from_nodes(every, workload.comm_groups), system)
    return units, ranks


def test_the_reported_deep_pipeline_replays() -> None:
    """The plan of the report: 105 layers on pp 35, dp 9 (315 ranks on 8-GPU nodes)."""
    options = GenerateOptions(
        model="gpt", dmodel=256, dff=1024, head=8, kvhead=8, seq=128, dvocal=1024,
        num_stacks=105, tp=1, pp=35, dp=9, batch=315, micro_batch=9, tpsp=False,
        dtype="fp16", mixed_precision=True,
    )  # fmt: skip
    workload = build_workload(options, load_registry(autoload=False))
    preset = load_system("a100-80g")
    # a spine oversubscribed 2:1 prices sends across rails apart from those within one
    nvlink, rail, spine = preset.network
    spine = dataclasses.replace(spine, oversubscription=2.0)
    system = dataclasses.replace(preset, network=(nvlink, rail, spine))
    problem = problem_from_workload(workload, system)
    result = predict_problem(problem, system)
    assert result["iteration_time_s"] > 0
    # stage 8 (ranks 72..80) sits on two nodes: its ranks split into two units, and so do
    # those of every stage whose pipeline peers they are
    stage7 = [u.ranks for u in problem.units if u.stage == 7]
    assert sorted(stage7) == [tuple(range(63, 70)), (70, 71)]
    # the preset's rail and spine are alike: every send costs the same, one unit per stage
    assert len(problem_from_workload(workload, preset).units) == 35


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pp=st.integers(2, 40),
    dp=st.sampled_from([1, 3, 5, 7, 9]),
    tp=st.sampled_from([1, 2]),
    micro_batches=st.integers(1, 3),
    interleave=st.booleans(),
    recompute=st.sampled_from(["none", "full"]),
)
def test_units_replay_as_every_rank_does(
    pp: int, dp: int, tp: int, micro_batches: int, interleave: bool, recompute: str
) -> None:
    virtual = 2 if interleave and micro_batches % pp == 0 and pp > 1 else 1
    options = GenerateOptions(
        model="gpt",
        num_stacks=pp * virtual,
        pp=pp,
        dp=dp,
        tp=tp,
        batch=dp * micro_batches,
        micro_batch=dp,
        virtual_stages=virtual,
        pipeline_schedule="interleaved" if virtual > 1 else "1f1b",
        activation_recompute=recompute,
        **TINY,
    )
    units, ranks = _both_ways(options)
    assert units["iteration_time_s"] == pytest.approx(ranks["iteration_time_s"], rel=1e-9)
