"""Megatron's MoE expert-parallel communication overlap (``--overlap_moe_ep_comm true``,
Megatron-core's ``--overlap-moe-expert-parallel-comm``): combined 1F1B steps, the forward of
one micro-batch beside the backward of another, laid out in the trace's dependencies so that
each one's dispatch and combine all-to-alls run while the other computes. Bounds on the
replay, the schedule's groups, the trace's bytes and dependencies, and the refusals."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
from consumers import assert_ranks_decode_and_feed
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.schedules import ep_overlap_groups, interleaved, one_f_one_b
from stg.core.workload import (
    LAYER_ATTR,
    CollectiveType,
    NodeType,
    Phase,
    Workload,
    node_micro_batch,
    node_phase,
)
from stg.host.registry import load_registry
from stg.perf.periodic import replay_periodic
from stg.perf.replay import UnitResult
from stg.perf.system import System, load_system
from stg.predictors.time import problem_from_workload, replay

REGISTRY = load_registry(autoload=False)
H100 = load_system("h100-80g")
# links without a kind contend with nothing: the schedule's effect alone
PLAIN = dataclasses.replace(
    H100, network=tuple(dataclasses.replace(d, link=None) for d in H100.network)
)
MICRO_BATCHES = 4
MOE = dict(model="moe", dp=1, ep=2, num_stacks=2, seq=1024, micro_batch=2, batch=2 * MICRO_BATCHES)


def _slowed(system: System, factor: float) -> System:
    network = tuple(dataclasses.replace(d, bandwidth=d.bandwidth / factor) for d in system.network)
    return dataclasses.replace(system, network=network)


def _workload(**kw: Any) -> Workload:
    return build_workload(GenerateOptions(**{**MOE, **kw}), REGISTRY)  # type: ignore[arg-type]


def _compute_idle(res: UnitResult, start: float, end: float) -> float:
    """How long the compute stream is idle within [start, end]."""
    busy = sum(
        max(0.0, min(end, res.end[i]) - max(start, res.start[i]))
        for i, kind in enumerate(res.kind)
        if kind == 0
    )
    return end - start - busy


def _all_to_alls(res: UnitResult) -> dict[bool, tuple[float, float]]:
    """Per whether its step is paired (forwards after the first micro-batch's, backwards
    before the last's): the all-to-alls' transfer time and the part of it the compute stream
    sits idle."""
    sums = {True: [0.0, 0.0], False: [0.0, 0.0]}
    for i, node in enumerate(res.unit.nodes):
        if node.type is not NodeType.COMM_COLL or node.comm_type is not CollectiveType.ALL_TO_ALL:
            continue
        mb, phase = node_micro_batch(node), node_phase(node)
        paired = (phase == Phase.FORWARD and mb >= 1) or (
            phase == Phase.BACKWARD and mb <= MICRO_BATCHES - 2
        )
        start = res.transfer_start[i]
        sums[paired][0] += res.end[i] - start
        sums[paired][1] += _compute_idle(res, start, res.end[i])
    return {k: (v[0], v[1]) for k, v in sums.items()}


def test_groups_follow_megatrons_combined_1f1b() -> None:
    """pp 1: micro-batch 0's forward alone, then forward i + 1 beside backward i, then the
    last backward alone (combined_1f1b_schedule_for_no_pipelining); interleaved: one more
    warm-up forward, then each steady-state forward beside the next backward."""
    groups = ep_overlap_groups(one_f_one_b(0, 1, 3))
    assert groups == [
        (("F", 0, 0),),
        (("F", 1, 0), ("B", 0, 0)),
        (("F", 2, 0), ("B", 1, 0)),
        (("B", 2, 0),),
    ]
    order = interleaved(1, 2, 4, 2)
    groups = ep_overlap_groups(order)
    warmup = next(i for i, step in enumerate(order) if step[0] == "B") - 1
    assert all(len(g) == 1 and g[0][0] == "F" for g in groups[: warmup + 1])
    assert len(groups[warmup + 1]) == 2
    # every step once, forwards and backwards each in the schedule's order
    flat = [step for g in groups for step in g]
    assert sorted(flat) == sorted(order)
    assert [s for s in flat if s[0] == "F"] == [s for s in order if s[0] == "F"]
    assert [s for s in flat if s[0] == "B"] == [s for s in order if s[0] == "B"]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_paired_all_to_alls_hide_behind_the_other_micro_batch(dtype: str) -> None:
    """Compute much longer than the all-to-alls: without the overlap each all-to-all stalls
    the compute stream; with it, the paired steps' all-to-alls run while the other
    micro-batch computes, and only the unpaired steps' (micro-batch 0's forward, the last
    backward) stay exposed. The iteration saves at most the all-to-all time it hides. fp8
    (Transformer Engine's delayed scaling): the amax reductions wait for the combined step's
    end and gate neither micro-batch inside it."""
    off = replay(problem_from_workload(_workload(dtype=dtype), PLAIN), PLAIN)
    on = replay(
        problem_from_workload(_workload(dtype=dtype, overlap_moe_ep_comm=True), PLAIN), PLAIN
    )
    before, after = _all_to_alls(off.units[0]), _all_to_alls(on.units[0])
    paired, exposed = before[True]
    assert paired > 0 and exposed > 0.9 * paired
    assert after[True][0] == pytest.approx(paired, rel=1e-6)
    assert after[True][1] < 0.05 * paired
    alone, alone_exposed = after[False]
    assert alone_exposed == pytest.approx(alone, rel=1e-6)
    saved = off.iteration_time - on.iteration_time
    assert 0.5 * (exposed - after[True][1]) < saved <= exposed + 1e-9


def test_a_slow_network_stays_exposed() -> None:
    """All-to-alls far longer than the compute: the other micro-batch's compute hides at most
    itself, so the paired all-to-alls stay exposed by at least their time less all compute."""
    slow = _slowed(PLAIN, 1000)
    off = replay(problem_from_workload(_workload(), slow), slow)
    res = replay(problem_from_workload(_workload(overlap_moe_ep_comm=True), slow), slow)
    unit = res.units[0]
    compute = sum(d for d, kind in zip(unit.duration, unit.kind, strict=True) if kind == 0)
    paired, exposed = _all_to_alls(unit)[True]
    assert paired > 5 * compute
    assert exposed >= paired - compute
    assert off.iteration_time - res.iteration_time <= compute


def test_combined_steps_keep_megatrons_issue_order() -> None:
    """The forward of the pair never waits for the backward's last node (no step barrier),
    and on the expert-parallel communicator each layer pair runs Megatron's order: combine
    backward, dispatch forward, dispatch backward, combine forward."""
    nodes = _workload(overlap_moe_ep_comm=True).rank_classes[0].nodes
    by_name = {n.name: n for n in nodes}
    fwd = by_name["mb1/layer0/fwd/attention_norm"]
    bwd = [n for n in nodes if n.name.startswith("mb0/layer") and "/bwd/" in n.name]
    assert min(n.id for n in bwd) < fwd.id < max(n.id for n in bwd)
    pair = [
        (node_micro_batch(n), node_phase(n), n.attrs[LAYER_ATTR])
        for n in nodes
        if n.type is NodeType.COMM_COLL
        and n.comm_type is CollectiveType.ALL_TO_ALL
        and (node_micro_batch(n), node_phase(n)) in ((0, Phase.BACKWARD), (1, Phase.FORWARD))
    ]
    b, f = Phase.BACKWARD, Phase.FORWARD
    assert pair == [(0, b, 1), (1, f, 0)] * 2 + [(0, b, 0), (1, f, 1)] * 2


def test_amax_reductions_follow_the_combined_step() -> None:
    """Megatron-core wraps a combined step in one fp8 autocast under delayed scaling: the
    backward's amax reduction comes after the paired forward's layers, not between them."""
    nodes = _workload(dtype="fp8", overlap_moe_ep_comm=True).rank_classes[0].nodes
    by_name = {n.name: n.id for n in nodes}
    forward_layers = [n.id for n in nodes if n.name.startswith("mb1/layer") and "/fwd/" in n.name]
    assert by_name["mb0/chunk0/bwd/fp8_amax_concat"] > max(forward_layers)
    assert by_name["mb1/chunk0/fwd/fp8_amax_concat"] > max(forward_layers)


def test_same_options_without_the_overlap_keep_their_bytes(tmp_path: Path) -> None:
    """Off by default: the same trace as before the option existed; on: recorded in the
    metadata, the trace differs, validates, decodes and feeds."""
    runner = CliRunner()
    base = ["--model_type", "moe", "--dp", "2", "--ep", "2", "--num_stacks", "2"]
    base += ["--batch", "16", "--micro_batch", "4"]
    outputs = {}
    for name, extra in [("default", []), ("off", ["--overlap_moe_ep_comm", "false"])]:
        out = tmp_path / name
        result = runner.invoke(app, ["generate", *base, *extra, "--output_dir", str(out)])
        assert result.exit_code == 0, result.output
        outputs[name] = [p.read_bytes() for p in sorted(out.glob("workload.*.et"))]
    assert outputs["default"] == outputs["off"]
    out = tmp_path / "on"
    args = ["generate", *base, "--overlap_moe_ep_comm", "true", "--output_dir", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    assert [p.read_bytes() for p in sorted(out.glob("workload.*.et"))] != outputs["default"]
    for command in (["validate", str(out)], ["feed", str(out), "--json"]):
        result = runner.invoke(app, command)
        assert result.exit_code == 0, result.output
    assert_ranks_decode_and_feed(out)
    result = runner.invoke(app, ["predict", str(out), "--system", "h100-80g", "--json"])
    assert result.exit_code == 0, result.output
    from_trace = json.loads(result.output)["time"]["iteration_time_s"]
    args = ["predict", *base, "--overlap_moe_ep_comm", "true", "--system", "h100-80g", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["time"]["iteration_time_s"] == pytest.approx(from_trace)


def test_periodic_replay_agrees_with_the_full_replay() -> None:
    """The combined steady state repeats (pp 1): the periodic replay answers, with the full
    replay's iteration time."""
    problem = problem_from_workload(_workload(overlap_moe_ep_comm=True, batch=32), PLAIN)
    periodic = replay_periodic(problem, PLAIN, only_if_cheaper=False)
    assert periodic is not None
    full = replay(problem, PLAIN)
    assert periodic.iteration_time == pytest.approx(full.iteration_time, rel=1e-9)


def test_interleaved_pipeline_replays_with_the_extra_warmup_forward() -> None:
    """pp 2 with virtual stages (Megatron's requirement): the combined steps across stages
    replay to the end, and hide all-to-all time."""
    kw = dict(pp=2, num_stacks=4, pipeline_schedule="interleaved", virtual_stages=2, batch=16)
    off = replay(problem_from_workload(_workload(**kw), PLAIN), PLAIN)
    on = replay(problem_from_workload(_workload(overlap_moe_ep_comm=True, **kw), PLAIN), PLAIN)
    assert 0 < on.iteration_time < off.iteration_time


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ep", "1"], "allowed: ep > 1"),
        (["--activation_recompute", "full"], "allowed: none, selective"),
        (["--pp", "2", "--num_stacks", "4"], "allowed: interleaved \\(or pp=1\\)"),
        (["--phase", "decode"], "allowed: phase=training"),
        (["--predictor", "analytical"], "does not model overlap_moe_ep_comm=true"),
    ],
)
def test_unsupported_combinations_are_one_line(flags: list[str], message: str) -> None:
    args = ["predict", "--model_type", "moe", "--dp", "2", "--ep", "2", "--num_stacks", "2"]
    args += ["--batch", "16", "--micro_batch", "4", "--overlap_moe_ep_comm", "true", *flags]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert re.search(message, lines[0]), lines[0]


def _periodic_as_the_whole(options: GenerateOptions) -> None:
    """The options' lowered periodic replay gives the whole replay's iteration (1e-9)."""
    from stg.predictors.time import predict_time_options

    fast = predict_time_options(options, "gb300-nvl72", registry=REGISTRY)
    whole = predict_time_options(options, "gb300-nvl72", registry=REGISTRY, exact=True)
    assert fast["replay"]["kind"] == "periodic"
    assert fast["replay"]["lowered_micro_batches"] < options.micro_batches
    assert fast["iteration_time_s"] == pytest.approx(whole["iteration_time_s"], rel=1e-9)


@pytest.mark.parametrize("layers", [None, [2, 2, 2, 1]])
def test_interleaved_overlap_replays_periodically_as_the_whole(layers: list[int] | None) -> None:
    """Under ``overlap_moe_ep_comm`` the interleaved schedule's warm-up runs one forward chunk
    more (Megatron-core's extra warm-up micro-batch): the periodic replay's fill counts it, so
    a workload lowered for the fill, two periods and the drain proves its steady state and
    extrapolates to the iteration of the whole replay (within 1e-9), even or uneven stages."""
    options = GenerateOptions(
        model="moe", dmodel=512, dff=256, head=8, kvhead=4, dhead=64, experts=16, kexperts=2,
        seq=256, dvocal=1024, dp=8, ep=8, ep_layout="fold", mixed_precision=True, causal=True,
        pp=2, virtual_stages=2, pipeline_schedule="interleaved", batch=8 * 64, micro_batch=8,
        num_stacks=7 if layers else 8, pipeline_layers=layers, overlap_moe_ep_comm=True,
    )  # fmt: skip
    _periodic_as_the_whole(options)


def test_a_chunk_of_the_loss_alone_replays_periodically_as_the_whole() -> None:
    """Deep interleaving with the embedding and the loss counted as layers (Megatron's
    ``account_for_*_in_pipeline_split``): the last stage's last chunk holds only the loss.
    Its gradient reduction waits for a micro-batch counted from the end of the schedule, and
    the stages settle a few periods after the fill; the periodic replay proves the steady
    state there and matches the whole replay (within 1e-9)."""
    options = GenerateOptions(
        model="moe", dmodel=512, dff=512, head=8, kvhead=8, seq=512, dvocal=1024,
        num_stacks=46, experts=8, kexperts=2, ep=2, pp=4, virtual_stages=12,
        pipeline_schedule="interleaved", account_for_embedding_in_pipeline_split=True,
        account_for_loss_in_pipeline_split=True, overlap_moe_ep_comm=True,
        batch=512, micro_batch=8,
    )  # fmt: skip
    _periodic_as_the_whole(options)
