"""The time predictor from options lowers only the micro-batches its replay needs.

:func:`stg.predictors.time.predict_time_options` builds the workload of a pipeline's fill, two
periods and its drain (``build_workload``'s ``lowered_micro_batches``), checks that its steady
state repeats and extrapolates to every micro-batch. Wherever it answers so, the report is the
whole workload's full replay's (``--exact``) within 1e-9; where the check fails it builds and
replays the whole workload. Prediction from options and from the written trace agree on every
plan that validates, at any pipeline depth (the property test of issue 24).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stg import hookimpl
from stg.cli import main
from stg.cli._shared import print_reports
from stg.core.options import GenerateOptions, OptionError
from stg.core.pipeline import build_workload, name_in_micro_batch, validate_options
from stg.host.records import PipelineSchedule
from stg.host.registry import load_registry
from stg.perf.periodic import reduced_problem, replay_periodic
from stg.perf.replay import problem_from_nodes, problem_from_workload, replay
from stg.perf.system import load_system
from stg.predictors.time import predict_time, predict_time_options

SMALL = {"dmodel": 1024, "dff": 4096, "head": 8, "kvhead": 8, "seq": 512, "dvocal": 128}
TINY = {"dmodel": 64, "dff": 256, "head": 4, "kvhead": 4, "seq": 32, "dvocal": 128}
SYSTEM = load_system("a100-80g")
RELATIVE = 1e-9
REGISTRY = load_registry(autoload=False)


def _assert_same_report(fast: dict[str, Any], exact: dict[str, Any]) -> None:
    scale = exact["iteration_time_s"]
    assert fast["iteration_time_s"] == pytest.approx(scale, rel=RELATIVE)
    assert fast["model_flops"] == exact["model_flops"]
    assert fast["hardware_flops"] == exact["hardware_flops"]
    assert fast["mfu"] == pytest.approx(exact["mfu"], rel=RELATIVE)
    assert fast["simulated_ranks"] == exact["simulated_ranks"]
    for a, b in zip(fast["ranks"], exact["ranks"], strict=True):
        assert a.keys() == b.keys()
        for key, value in b.items():
            if isinstance(value, float):
                assert a[key] == pytest.approx(value, rel=RELATIVE, abs=RELATIVE * scale), key
            else:
                assert a[key] == value, key
    # the path ends on the same node, named as in the whole workload
    assert fast["critical_path"][-1]["end_s"] == pytest.approx(scale, rel=RELATIVE)
    assert fast["critical_path"][-1]["last"] == exact["critical_path"][-1]["last"]
    assert fast["critical_path"][0]["first"] == exact["critical_path"][0]["first"]


PLANS = {
    "1f1b": dict(num_stacks=4, pp=4, dp=1, tp=1, batch=40),
    "1f1b-pp2-dp2": dict(num_stacks=4, pp=2, dp=2, tp=1, batch=64, micro_batch=2),
    "full-recompute": dict(num_stacks=4, pp=4, dp=1, tp=1, batch=40, activation_recompute="full"),
    "selective-recompute": dict(
        num_stacks=4, pp=4, dp=1, tp=1, batch=40, activation_recompute="selective"
    ),
    "odd-dp": dict(num_stacks=4, pp=4, dp=3, tp=1, batch=120, micro_batch=3),
    "tp2-sp": dict(num_stacks=4, pp=4, dp=1, tp=2, batch=40, tpsp=True),
    "overlap": dict(
        num_stacks=4, pp=4, dp=2, tp=2, batch=80, micro_batch=2, zero=1,
        overlap_param_gather=True, tp_comm_overlap=True, tpsp=True,
    ),
    "fsdp": dict(num_stacks=4, pp=4, dp=2, tp=1, batch=80, micro_batch=2, weight_sharded=True),
    "cp": dict(num_stacks=4, pp=4, dp=1, tp=1, sp=2, batch=40),
    "moe-ep": dict(
        model="moe", num_stacks=4, pp=4, dp=2, tp=1, ep=2, batch=160, micro_batch=4, experts=4,
        kexperts=2,
    ),
    "interleaved": dict(
        num_stacks=8, pp=2, dp=1, tp=1, batch=32, pipeline_schedule="interleaved",
        virtual_stages=2,
    ),
    "gpipe": dict(num_stacks=4, pp=2, dp=1, tp=1, batch=32, pipeline_schedule="gpipe"),
}  # fmt: skip


@pytest.mark.parametrize("plan", list(PLANS.values()), ids=list(PLANS))
def test_the_lowered_prediction_is_the_exact_one(plan: dict[str, Any]) -> None:
    options = GenerateOptions(**{"model": "gpt", "micro_batch": 1, **SMALL, **plan})
    fast = predict_time_options(options, SYSTEM, registry=REGISTRY)
    exact = predict_time(build_workload(options, REGISTRY), SYSTEM, exact=True)
    assert exact["replay"] == {"kind": "full"}
    _assert_same_report(fast, exact)


def test_most_plans_replay_only_a_lowered_workload() -> None:
    """The fast path is taken, not only fallen back from: a 1F1B pipeline of 40
    micro-batches at pp 4 lowers 6 of them (the fill, two periods) and replays them once, the
    shorter replay of 5 read off its states."""
    options = GenerateOptions(model="gpt", micro_batch=1, **SMALL, **PLANS["1f1b"])
    report = predict_time_options(options, SYSTEM, registry=REGISTRY)
    assert report["replay"] == {
        "kind": "periodic",
        "micro_batches": 40,
        "replayed_micro_batches": 5,
        "period_micro_batches": 1,
        "period_s": pytest.approx(report["replay"]["period_s"]),
        "lowered_micro_batches": 6,
    }
    exact = predict_time_options(options, SYSTEM, registry=REGISTRY, exact=True)
    assert exact["replay"] == {"kind": "full"}
    _assert_same_report(report, exact)


def test_an_interleaved_pipeline_replays_only_a_lowered_workload() -> None:
    """Interleaved 1F1B's fill spans more micro-batches than its stages (Megatron's warm-up of
    2 * (pp - 1) + (v - 1) * pp forward chunks on the first stage: 10 chunks, 5 micro-batches
    at pp 4, v 2, in whole periods 8): the replays keep 12 and 16 micro-batches, their states
    compared at the start of micro-batches 8 and 12, so the check holds and the figures are
    the exact ones (a fill of one micro-batch per stage failed the check and replayed all
    40)."""
    options = GenerateOptions(
        model="gpt", micro_batch=1, **SMALL, num_stacks=8, pp=4, dp=1, tp=1, batch=40,
        pipeline_schedule="interleaved", virtual_stages=2,
    )  # fmt: skip
    report = predict_time_options(options, SYSTEM, registry=REGISTRY)
    assert report["replay"] == {
        "kind": "periodic",
        "micro_batches": 40,
        "replayed_micro_batches": 12,
        "period_micro_batches": 4,
        "period_s": pytest.approx(report["replay"]["period_s"]),
        "lowered_micro_batches": 16,
    }
    exact = predict_time(build_workload(options, REGISTRY), SYSTEM, exact=True)
    _assert_same_report(report, exact)


def test_a_lowered_workload_is_the_schedule_of_its_micro_batches() -> None:
    """Lowering the first k micro-batches gives what cutting the whole workload to its first
    k gives (:func:`stg.perf.periodic.reduced_problem`), and keeps the whole iteration's
    metadata."""
    options = GenerateOptions(
        model="gpt", **SMALL, num_stacks=4, pp=4, dp=2, tp=2, batch=64, micro_batch=2
    )
    whole = problem_from_workload(build_workload(options, REGISTRY), SYSTEM)
    lowered = build_workload(options, REGISTRY, lowered_micro_batches=9)
    assert lowered.metadata["micro_batches"] == 32
    assert lowered.metadata["lowered_micro_batches"] == 9
    a = replay(reduced_problem(whole, 9), SYSTEM)
    b = replay(problem_from_workload(lowered, SYSTEM), SYSTEM)
    assert a.iteration_time == b.iteration_time
    for x, y in zip(a.units, b.units, strict=True):
        starts = {n.name: t for n, t in zip(y.unit.nodes, y.start, strict=True)}
        assert {n.name: t for n, t in zip(x.unit.nodes, x.start, strict=True)} == starts


def test_a_schedule_whose_shorter_orders_are_no_prefixes_is_lowered_whole() -> None:
    """A plugin schedule that reorders with the micro-batch count cannot be lowered in part
    (ValueError), and the time predictor then builds the whole workload."""

    def backwards_first_when_short(stage: int, stages: int, micro_batches: int, chunks: int):  # type: ignore[no-untyped-def]
        forwards = [("F", mb, 0) for mb in range(micro_batches)]
        backwards = [("B", mb, 0) for mb in range(micro_batches)]
        if micro_batches < 20:
            backwards.reverse()
        return forwards + backwards

    class Plugin:
        @hookimpl
        def stg_register_parallelisms(self, register: Any) -> None:
            register(PipelineSchedule("odd", backwards_first_when_short))

    registry = load_registry(autoload=False)
    assert registry.add_plugin(Plugin(), "odd-schedule")
    options = GenerateOptions(
        model="gpt", **SMALL, num_stacks=4, pp=2, batch=40, micro_batch=1, pipeline_schedule="odd"
    )
    with pytest.raises(ValueError, match="is not the first 10"):
        build_workload(options, registry, lowered_micro_batches=10)
    report = predict_time_options(options, SYSTEM, registry=registry)
    assert "lowered_micro_batches" not in report["replay"]
    exact = predict_time(build_workload(options, registry), SYSTEM, exact=True)
    assert report["iteration_time_s"] == pytest.approx(exact["iteration_time_s"], rel=RELATIVE)


def test_names_of_other_micro_batches() -> None:
    workload = build_workload(
        GenerateOptions(model="gpt", **TINY, num_stacks=2, batch=2, micro_batch=1),
        REGISTRY,
    )
    nodes = list(workload.ranks[0].nodes())
    node = next(n for n in nodes if n.name.startswith("mb1/"))
    assert name_in_micro_batch(node, 250) == "mb250/" + node.name[len("mb1/") :]
    step = next(n for n in nodes if n.name == "optimizer_step")
    assert name_in_micro_batch(step, 3) == "optimizer_step"


def _cli_time(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    assert not info.value.code, err
    return json.loads(out)["time"]


def test_stg_predict_lowers_from_options(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["predict", "--predictor", "time", "--json", "--model", "gpt", "--num_stacks", "4"]
    args += ["--dmodel", "1024", "--dff", "4096", "--head", "8", "--kvhead", "8", "--seq", "512"]
    args += ["--dvocal", "128", "--pp", "4", "--batch", "40", "--micro_batch", "1"]
    fast = _cli_time(capsys, *args)
    exact = _cli_time(capsys, *args, "--exact")
    assert fast["replay"]["lowered_micro_batches"] == 6
    assert exact["replay"] == {"kind": "full"}
    _assert_same_report(fast, exact)


# -- every plan that validates predicts, from options and from its trace ------------------------


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    pp=st.sampled_from([2, 3, 5, 8, 16, 35, 64]),
    dp=st.sampled_from([1, 3]),
    chunks=st.sampled_from([1, 2]),
    recompute=st.sampled_from(["none", "selective", "full"]),
    per_stage=st.sampled_from([1, 2]),
    data=st.data(),
)
def test_options_and_trace_predict_alike(
    tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str],
    pp: int,
    dp: int,
    chunks: int,
    recompute: str,
    per_stage: int,
    data: st.DataObject,
) -> None:
    # deep pipelines with few micro-batches (their fill and drain), to keep each case short
    if chunks > 1 and pp > 16:
        chunks = 1
    if chunks > 1:
        micro_batches = pp * (per_stage if pp <= 8 else 1)
    else:
        micro_batches = data.draw(st.integers(1, min(2 * pp, 16)))
    plan = dict(
        TINY,
        model="gpt",
        num_stacks=pp * chunks,
        pp=pp,
        dp=dp,
        batch=micro_batches * dp,
        micro_batch=dp,
        activation_recompute=recompute,
        pipeline_schedule="interleaved" if chunks > 1 else "1f1b",
        virtual_stages=chunks,
    )
    try:
        validate_options(GenerateOptions(**plan), REGISTRY)
    except OptionError:
        return
    flags = [f"--{k}={v}" for k, v in plan.items()]
    out: Path = tmp_path_factory.mktemp("trace")
    with pytest.raises(SystemExit) as info:
        main(["generate", *flags, "--output_dir", str(out)])
    assert not info.value.code
    capsys.readouterr()
    from_options = _cli_time(capsys, "predict", "--predictor", "time", "--json", *flags)
    from_trace = _cli_time(capsys, "predict", str(out), "--predictor", "time", "--json", "-j", "1")
    assert from_trace["iteration_time_s"] == pytest.approx(
        from_options["iteration_time_s"], rel=RELATIVE
    )
    assert from_trace["model_flops"] == from_options["model_flops"]


def test_keeps_that_failed_the_check_are_not_replayed_again() -> None:
    """``checked``: the shorter replays a lowered workload already found not periodic are
    skipped on the whole workload (the next longer one is tried)."""
    options = GenerateOptions(model="gpt", micro_batch=1, **SMALL, **PLANS["1f1b"])
    problem = problem_from_workload(build_workload(options, REGISTRY), SYSTEM)
    first = replay_periodic(problem, SYSTEM, only_if_cheaper=False)
    again = replay_periodic(problem, SYSTEM, only_if_cheaper=False, checked={1: 9})
    assert first is not None and again is not None
    assert (first.replayed_micro_batches, again.replayed_micro_batches) == (9, 18)
    assert again.iteration_time == pytest.approx(first.iteration_time, rel=RELATIVE)


def test_sends_over_alike_links_fold_their_ranks() -> None:
    """A rail and a spine of the same links price a send alike: the data-parallel replicas
    whose pipeline sends cross the rail boundary are not told apart (one unit per stage of
    a tp 2, dp 3, pp 3 run on 2-GPU nodes, 4 nodes per rail: 9 units by the dimension), and
    the replay is every rank's own one's."""
    nvlink, rail, spine = SYSTEM.network
    system = dataclasses.replace(
        SYSTEM,
        network=(dataclasses.replace(nvlink, size=2), dataclasses.replace(rail, size=4), spine),
    )
    options = GenerateOptions(
        model="gpt", **SMALL, num_stacks=3, tp=2, dp=3, pp=3, batch=6, micro_batch=3
    )
    workload = build_workload(options, REGISTRY)
    folded = problem_from_workload(workload, system)
    assert len(folded.units) == 3
    every_rank = problem_from_nodes(
        {g.rank: list(g.nodes()) for g in workload.ranks}, workload.comm_groups
    )
    a, b = replay(folded, system), replay(every_rank, system)
    assert a.iteration_time == b.iteration_time
    for res in a.units:
        own = b.units[every_rank.unit_of_rank[res.unit.rank]]
        assert res.end == own.end


def test_the_lowered_workload_is_refused_when_too_large(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The lowered workload passes the same size check as the whole one before it is built:
    a huge stack, or more nodes than ``--max-nodes``, is one ``error:`` line."""
    args = ["predict", "--predictor", "time", "--batch", "64", "--micro_batch", "1"]
    for extra in (["--num_stacks", str(10**9)], [*_TINY_FLAGS, "--max-nodes", "10"]):
        with pytest.raises(SystemExit) as info:
            main([*args, *extra])
        out, err = capsys.readouterr()
        assert info.value.code == 2 and out == ""
        assert err.startswith("error: this workload ") and err.count("\n") == 1, err


_TINY_FLAGS = [f"--{k}={v}" for k, v in TINY.items()] + ["--num_stacks=2"]


def test_the_text_report_counts_a_summarised_path_whole(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A periodic replay's critical path gives its repeated period once (``repeats``); the
    text report counts its runs that many times and splits the same time per kind as the
    full replay's path."""
    options = GenerateOptions(model="gpt", micro_batch=1, **SMALL, **PLANS["1f1b"])
    fast = predict_time_options(options, SYSTEM, registry=REGISTRY)
    exact = predict_time_options(options, SYSTEM, registry=REGISTRY, exact=True)
    repeated = [run for run in fast["critical_path"] if "repeats" in run]
    assert repeated and len(fast["critical_path"]) < len(exact["critical_path"])
    lines = []
    for report in (fast, exact):
        print_reports({"time": report}, "plan")
        out = " ".join(capsys.readouterr().out.split())
        lines.append(out[out.index("critical path: ") :])
    runs = sum(run.get("repeats", 1) for run in fast["critical_path"])
    assert lines[0].startswith(f"critical path: {runs} runs of nodes;")
    assert lines[0].split(";")[1] == lines[1].split(";")[1]
