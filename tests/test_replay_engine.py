"""The replay engine (stg.perf.replay) reads what a node is for from its typed attributes.

Generated nodes carry ``phase``, ``micro_batch``, ``part``, ``role`` and ``op``
(:data:`stg.core.workload.NODE_SEMANTICS`); the trace writers store them as Chakra attributes
and the readers give them back, so a prediction from the options and one from the written
trace agree, and renaming every node changes nothing. A trace without them (a foreign one)
still replays, with neutral behaviour: no overlap rewiring, nothing counted as recomputed.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stg.cli import main
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import (
    NODE_SEMANTICS,
    NodeType,
    Phase,
    RankClass,
    RankGraph,
    Role,
    Workload,
    node_micro_batch,
    node_op,
    node_part,
    node_phase,
    node_role,
)
from stg.host.registry import load_registry
from stg.perf.replay import Costs, Problem, Unit, problem_from_workload, replay
from stg.perf.system import load_system
from stg.predictors.time import predict_time
from stg.trace.reader import read_nodes
from stg.trace.writer import write_workload

TINY = {"dmodel": 64, "dff": 256, "head": 4, "kvhead": 4, "seq": 32, "dvocal": 128}
GPT_FP8 = tuple((op, "fp8") for op in ("q", "k", "v", "attn_out", "fc1", "fc2"))
H100 = load_system("h100-80g")


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    assert info.value.code in (0, None), err
    return out


@st.composite
def _plans(draw: st.DrawFn) -> dict[str, Any]:
    """A tiny GPT on up to 64 pipeline stages: odd dp, tp 1 or 2, interleaving (then one
    micro-batch per stage), recompute, and the overlap options where they apply; at most 128
    ranks so that the trace stays small."""
    pp = draw(st.integers(1, 64))
    interleave = 1 < pp <= 16 and draw(st.booleans())
    tp = draw(st.sampled_from([1, 2]))
    dp = draw(st.sampled_from([d for d in (1, 3, 5) if pp * tp * d <= 128]))
    micro_batches = pp if interleave else draw(st.integers(1, 3))
    plan: dict[str, Any] = {
        "num_stacks": 2 * pp if interleave else pp,
        "pp": pp,
        "dp": dp,
        "tp": tp,
        "batch": dp * micro_batches,
        "micro_batch": dp,
        "activation_recompute": draw(st.sampled_from(["none", "selective", "full"])),
    }
    if interleave:
        plan.update(virtual_stages=2, pipeline_schedule="interleaved")
    if dp > 1 and draw(st.booleans()):
        plan.update(zero=1, overlap_param_gather="true")
    if tp > 1 and draw(st.booleans()):
        plan.update(tp_comm_overlap="true")
    return plan


_DEEP = {"num_stacks": 64, "pp": 64, "dp": 1, "tp": 2, "batch": 3, "micro_batch": 1}
_INTERLEAVED = {
    **{"num_stacks": 32, "pp": 16, "dp": 3, "tp": 2, "batch": 48, "micro_batch": 3},
    **{"virtual_stages": 2, "pipeline_schedule": "interleaved", "zero": 1},
    **{"overlap_param_gather": "true", "tp_comm_overlap": "true"},
}


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(plan=_plans())
@example(plan={**_DEEP, "activation_recompute": "full"})
@example(plan={**_INTERLEAVED, "activation_recompute": "selective"})
def test_options_and_the_written_trace_predict_the_same_time(
    capsys: pytest.CaptureFixture[str], plan: dict[str, Any]
) -> None:
    flags = ["--model", "gpt"]
    for name, value in {**TINY, **plan}.items():
        flags += [f"--{name}", str(value)]
    predict = ["--system", "h100-80g", "--predictor", "time", "--json"]
    from_options = json.loads(_run(capsys, "predict", *flags, *predict))["time"]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "trace")
        _run(capsys, "generate", *flags, "--output_dir", out)
        from_trace = json.loads(_run(capsys, "predict", out, *predict))["time"]
    assert from_trace["iteration_time_s"] == pytest.approx(
        from_options["iteration_time_s"], rel=1e-9
    )
    assert from_trace["model_flops"] == from_options["model_flops"]


def _overlapping(precision: tuple[tuple[str, str], ...] = GPT_FP8) -> Workload:
    """fp8 GEMMs (amax reductions, weight casts), full recompute, the distributed optimizer's
    gathers overlapped with the forward and sequence parallelism's collectives with their
    GEMMs."""
    options = GenerateOptions(
        model="gpt", num_stacks=4, pp=2, tp=2, dp=2, batch=8, micro_batch=2, zero=1,
        overlap_param_gather=True, tp_comm_overlap=True, activation_recompute="full",
        precision=precision, **TINY,
    )  # fmt: skip
    return build_workload(options, load_registry(autoload=False))


def _with_nodes(workload: Workload, change: Any) -> Workload:
    """``workload`` with every node template passed through ``change``."""
    classes: dict[int, RankClass] = {}
    for rc in workload.rank_classes:
        classes[rc.index] = dataclasses.replace(rc, nodes=tuple(change(t) for t in rc.nodes))
    ranks = tuple(RankGraph(g.rank, classes[g.rank_class.index], g.layout) for g in workload.ranks)
    return dataclasses.replace(workload, ranks=ranks)


def _without_options(workload: Workload) -> Workload:
    options = dict(workload.metadata["options"])
    options.pop("overlap_param_gather")
    options.pop("tp_comm_overlap")
    return dataclasses.replace(workload, metadata={**workload.metadata, "options": options})


def test_node_names_carry_no_meaning() -> None:
    workload = _overlapping()
    renamed = _with_nodes(workload, lambda t: dataclasses.replace(t, name=f"n{t.id}"))
    before = predict_time(workload, H100, explain=True)
    after = predict_time(renamed, H100, explain=True)
    assert after["iteration_time_s"] == before["iteration_time_s"]
    assert after["model_flops"] == before["model_flops"] < before["hardware_flops"]
    assert after["explain"] == before["explain"]
    # the overlap options took effect (the baseline without them is slower)
    plain = predict_time(_without_options(workload), H100)
    assert before["iteration_time_s"] < plain["iteration_time_s"]


def test_a_trace_without_typed_attributes_replays_neutrally() -> None:
    """No parameter gather moves, no collective overlaps its GEMM, nothing is recomputed:
    the time of the workload without the overlap options, every FLOP a model FLOP (in bf16:
    an fp8 weight cast would also run in every micro-batch, not only the first)."""
    workload = _overlapping(precision=())
    stripped = _with_nodes(
        workload,
        lambda t: dataclasses.replace(
            t, attrs={k: v for k, v in t.attrs.items() if k not in NODE_SEMANTICS}
        ),
    )
    report = predict_time(stripped, H100)
    plain = predict_time(_without_options(workload), H100)
    assert report["iteration_time_s"] == pytest.approx(plain["iteration_time_s"], rel=1e-12)
    assert report["model_flops"] == report["hardware_flops"] == plain["hardware_flops"]


def _semantics(node: Any) -> tuple[Any, ...]:
    return (
        node_phase(node),
        node_micro_batch(node),
        node_part(node),
        node_role(node),
        node_op(node),
    )


@pytest.mark.parametrize("emitter", ["chakra-v0.0.4", "json"])
def test_written_traces_carry_the_typed_attributes(tmp_path: Path, emitter: str) -> None:
    workload = _overlapping()
    registry = load_registry(autoload=False)
    paths = write_workload(workload, registry.emitters.get(emitter), tmp_path / "out", "w")
    rank = 0
    expected = [
        _semantics(workload.ranks[rank].resolve(t)) for t in workload.ranks[rank].rank_class.nodes
    ]
    got = [_semantics(n) for n in read_nodes(paths[rank])]
    assert got == expected
    roles = {s[3] for s in expected}
    phases = {s[0] for s in expected}
    assert {Role.OPTIMIZER_STEP, Role.PARAM_ALL_GATHER, Role.TP_ALL_GATHER, Role.FP8_AMAX} <= roles
    assert phases == set(Phase)


def test_the_official_reader_decodes_the_typed_attributes(tmp_path: Path) -> None:
    et_def = pytest.importorskip("chakra.schema.protobuf.et_def_pb2")
    protolib = pytest.importorskip("chakra.src.third_party.utils.protolib")
    registry = load_registry(autoload=False)
    paths = write_workload(
        _overlapping(), registry.emitters.get("chakra-v0.0.4"), tmp_path / "out", "w"
    )
    handle = protolib.openFileRd(str(paths[0]))
    assert protolib.decodeMessage(handle, et_def.GlobalMetadata())
    kinds: dict[str, set[str]] = {}
    while True:
        node = et_def.Node()
        if not protolib.decodeMessage(handle, node):
            break
        for attr in node.attr:
            if attr.name in NODE_SEMANTICS:
                kinds.setdefault(attr.name, set()).add(attr.WhichOneof("value"))
    handle.close()
    # small integer codes; every op is its node's name after the last "/", so none is written
    assert kinds == {
        "phase": {"int64_val"},
        "micro_batch": {"int64_val"},
        "layer": {"int64_val"},
        "part": {"int64_val"},
        "role": {"int64_val"},
        "chunk": {"int64_val"},
    }


def test_alike_compute_nodes_share_one_cost_key() -> None:
    """The replay keeps each distinct compute cost key once (``Costs.keys``): alike nodes of
    every micro-batch and layer hold one key object, not one tuple each."""
    options = GenerateOptions(model="gpt", **TINY, num_stacks=4, pp=2, batch=8, micro_batch=1)
    problem = problem_from_workload(build_workload(options, load_registry()), H100)
    costs = Costs()
    replay(problem, H100, costs=costs)
    keys = [key for memo in costs.by_node.values() for _, key, _ in memo.values()]
    assert len(keys) > 4 * len(costs.keys)
    assert all(costs.keys[key] is key for key in keys)


def test_node_costs_are_kept_only_where_a_replay_may_reuse_them() -> None:
    """``Costs(nodes_again=False)`` (no later replay of the same node objects) keeps no cost
    per node object where each unit has its own rank class, and still keeps those of a rank
    class that several units share; the replay is the same either way."""
    options = GenerateOptions(model="gpt", **TINY, num_stacks=4, pp=2, dp=2, batch=8)
    workload = build_workload(options, load_registry())
    problem = problem_from_workload(workload, H100)
    assert len({u.rank_class for u in problem.units}) == len(problem.units)
    kept, once = Costs(), Costs(nodes_again=False)
    first, second = replay(problem, H100, costs=kept), replay(problem, H100, costs=once)
    assert [r.end for r in first.units] == [r.end for r in second.units]
    assert any(kept.by_node.values()) and not any(once.by_node.values())
    # the two data-parallel ranks of a one-stage plan as two units of one rank class
    options = GenerateOptions(model="gpt", **TINY, num_stacks=2, dp=2, batch=4)
    COMM = (NodeType.COMM_COLL, NodeType.COMM_SEND, NodeType.COMM_RECV)
    graphs = list(build_workload(options, load_registry()).ranks)
    # as problem_from_workload makes them: the compute nodes are the class's own objects
    units = [
        Unit(k, g.rank, (g.rank,), [g.resolve(t) if t.type in COMM else t for t in own], 0, 0)
        for k, g in enumerate(graphs)
        for own in [g.rank_class.nodes]
    ]
    for unit, graph in zip(units, graphs, strict=True):
        assert graph.rank_class is graphs[0].rank_class
        unit.group_keys = {
            i: tuple(sorted(t.group_axes))
            for i, t in enumerate(graph.rank_class.nodes)
            if t.type is NodeType.COMM_COLL
        }
    groups = graphs[0].layout.comm_groups
    split = Problem(units, {g.rank: k for k, g in enumerate(graphs)}, groups, len(graphs))
    once = Costs(nodes_again=False)
    replay(split, H100, costs=once)
    shared = sum(t.type is NodeType.COMP for t in graphs[0].rank_class.nodes)
    assert sum(len(memo) for memo in once.by_node.values()) == shared
