"""Expert parallelism folded over the dense ranks (Megatron-LM's MoE parallel folding) with
expert tensor parallelism: the groups match Megatron's rank generators, FLOPs and bytes read
back from the written files match their closed forms, the predictors agree, the default
(multiplying) layout is unchanged, and impossible combinations are refused with one line."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
from chakra.schema.protobuf import et_def_pb2
from chakra.src.third_party.utils import protolib
from typer.testing import CliRunner

from stg.cli import app
from stg.core.layout import LayoutError, fold_mesh
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import CollectiveType, NodeType, Role, node_micro_batch, node_op, node_role
from stg.host.registry import load_registry
from stg.predictors.analytical import predict_options
from stg.predictors.memory import analytic_memory, count_parameters, predict_memory
from stg.predictors.time import predict_time
from stg.trace.feeder import ETFeeder, replay
from stg.trace.reader import read_nodes
from stg.trace.validate import read_comm_groups, validate_trace, validate_workload
from stg.trace.writer import write_workload

MOE = dict(
    model="moe", dvocal=1024, dmodel=256, dff=512, head=8, kvhead=8, seq=64, num_stacks=2,
    experts=8, kexperts=2, batch=8, micro_batch=8,
)  # fmt: skip
EXPERT_GEMMS = ("expert_gate", "expert_up", "expert_down")


def options(**kw: object) -> GenerateOptions:
    return GenerateOptions(**{**MOE, **kw})  # type: ignore[arg-type]


def megatron_groups(o: GenerateOptions, rank: int) -> dict[str, tuple[int, ...]]:
    """The groups of ``rank`` as Megatron-LM's RankGenerators number them (the order string
    ``rank_order``, sp as cp; default tp-cp-ep-dp-pp): dense ``tp, cp, dp, pp`` meshes (ep
    1) and expert ``etp, ep, edp, pp`` ones (cp 1) in that order."""
    etp, ep = o.expert_tp, o.ep
    edp = o.tp * o.sp * o.dp // (ep * etp)

    def groups(mesh: list[tuple[str, int]]) -> dict[str, tuple[int, ...]]:
        strides, stride = {}, 1
        for name, size in mesh:
            strides[name] = stride
            stride *= size
        coords = {name: rank // strides[name] % size for name, size in mesh}
        return {
            name: tuple(sorted(rank + (i - coords[name]) * strides[name] for i in range(size)))
            for name, size in mesh
        }

    order = o.rank_order.split(",")
    dense_sizes = {"tp": ("tp", o.tp), "sp": ("cp", o.sp), "dp": ("dp", o.dp), "pp": ("pp", o.pp)}
    expert_sizes = {"tp": ("etp", etp), "ep": ("ep", ep), "dp": ("edp", edp), "pp": ("pp", o.pp)}
    dense = groups([dense_sizes[a] for a in order if a in dense_sizes])
    expert = groups([expert_sizes[a] for a in order if a in expert_sizes])
    return {**dense, **expert}


FOLDED = [
    dict(tp=2, dp=4, ep=8, etp=1),  # ep spans all of tp x dp
    dict(tp=2, dp=4, ep=4, etp=2),  # ep inside dp, experts split like the dense layers
    dict(tp=4, dp=2, ep=4, etp=2),  # ep spans half of tp and all of dp
    dict(tp=2, dp=2, ep=2, etp=1, pp=2),
    dict(tp=2, sp=2, dp=2, ep=4, etp=1, causal=True),  # ep spans tp and cp
    dict(tp=2, dp=4, ep=4, etp=1, rank_order="dp,tp,sp,ep,pp"),  # Megatron's order dp-tp-...
]


@pytest.mark.parametrize("kw", FOLDED)
def test_folded_groups_are_megatrons(kw: dict) -> None:
    o = options(**kw)
    workload = build_workload(o, load_registry())
    assert workload.world_size == o.dp * o.tp * o.sp * o.pp  # ep does not multiply
    assert validate_workload(workload).ok
    layout = workload.layout
    for graph in workload.ranks:
        rank = graph.rank
        want = megatron_groups(o, rank)
        reductions = set()
        for t in graph.rank_class.nodes:
            if t.type is not NodeType.COMM_COLL:
                continue
            members = workload.comm_groups[layout.group_id(rank, t.group_axes)]
            name = node_op(t) or ""
            if t.comm_type is CollectiveType.ALL_TO_ALL:
                assert members == want["ep"], name
            elif node_role(t) in (Role.TP_ALL_GATHER, Role.TP_REDUCE_SCATTER):
                assert members == want["tp"], name
            elif node_micro_batch(t) is None:  # the gradient reductions, once per iteration
                reductions.add(members)
            elif "dispatch" in name or "expert_down" in name:  # etp's gather / reduce-scatter
                assert members == want["etp"], name
            else:  # nothing else but context parallelism's keys and values (one collective
                # per group, never one per piece of a cut group)
                assert members == want["cp"], name

        # dense weights over dp; experts over expert data parallelism; sequence-parallel
        # norms over dp (x cp), then over tp (once per stage: finalize_model_grads)
        def span(*names: str, rank: int = rank) -> tuple[int, ...]:
            ranks = {rank}
            for name in names:
                ranks = {m for r in ranks for m in megatron_groups(o, r)[name]}
            return tuple(sorted(ranks))

        wanted = {span("dp"), span("edp"), span("tp"), span("dp", "cp")} - {(rank,)}
        assert reductions <= wanted and {want["dp"], want["edp"]} - {(rank,)} <= reductions


def _write(tmp_path: Path, **kw: object) -> tuple[Path, GenerateOptions]:
    o = options(**kw)
    args = ["generate", "--output_dir", str(tmp_path / "out")]
    for key, value in {**MOE, **kw}.items():
        args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return tmp_path / "out", o


@pytest.mark.parametrize("kw", [FOLDED[0], FOLDED[2]])
def test_folded_flops_and_bytes_read_back_match_closed_forms(tmp_path, kw: dict) -> None:  # type: ignore[no-untyped-def]
    out, o = _write(tmp_path, **kw)
    assert validate_trace(out).ok
    world = o.world_size
    e, c, h, f, layers = o.experts, o.kexperts * o.batch * o.seq // o.experts, 256, 512, 2
    expert_flops = 0
    per_rank_a2a = Counter()
    gathers = Counter()
    groups = read_comm_groups(out / "workload.json")
    for rank in range(world):
        for n in read_nodes(out / f"workload.{rank}.et"):
            op = node_op(n) or ""
            if n.type is NodeType.COMP and op.split(".grad_")[0] in EXPERT_GEMMS:
                expert_flops += n.num_ops
            if n.type is NodeType.COMM_COLL and n.comm_type is CollectiveType.ALL_TO_ALL:
                per_rank_a2a[rank] += n.comm_size
                assert len(groups[n.comm_group]) == o.ep
            if (
                n.type is NodeType.COMM_COLL
                and n.comm_type is CollectiveType.ALL_GATHER
                and op.endswith(":dispatch")
            ):
                gathers[rank] += n.comm_size
                assert len(groups[n.comm_group]) == o.expert_tp
    # three expert GEMMs, forward and two backward GEMMs each: 18·E·C·h·F per layer, split
    # E/ep · C/edp · F/etp over the ranks (C: capacity-factor-1 slots of one expert)
    assert expert_flops == 18 * e * c * h * f * layers
    # dispatch and combine forward and backward: 4 all-to-alls of E·C·h/N bf16 per layer
    assert set(per_rank_a2a.values()) == {4 * e * c * h * 2 // world * layers}
    # etp's all-gather of the dispatched tokens: E/ep experts, C/(edp·etp) slots each
    edp = world // (o.ep * o.expert_tp)
    expected = (e // o.ep) * (c // (edp * o.expert_tp)) * h * 2 * layers
    assert set(gathers.values()) == ({expected} if o.expert_tp > 1 else set())


def test_fold_within_dp_is_the_multiplying_layout_renamed() -> None:
    """Megatron's EP inside DP with tp = 1 is stg's multiplying ep (dp·ep replicas): the
    same ranks per group, FLOPs and bytes, whichever way it is spelled."""
    registry = load_registry()
    multiply = build_workload(options(dp=1, ep=4), registry)
    fold = build_workload(options(dp=4, ep=4, ep_layout="fold"), registry)
    assert fold.world_size == multiply.world_size == 4

    def summary(w):  # type: ignore[no-untyped-def]
        flops = sum(n.num_ops for n in w.ranks[0].rank_class.nodes if n.type is NodeType.COMP)
        comm = Counter()
        for n in w.ranks[0].rank_class.nodes:
            if n.type is NodeType.COMM_COLL:
                members = w.comm_groups[w.layout.group_id(0, n.group_axes)]
                comm[(n.comm_type, members)] += n.comm_size
        return flops, comm

    assert summary(fold) == summary(multiply)


@pytest.mark.parametrize(
    "kw", [*FOLDED[:4], dict(tp=2, dp=2, ep=4, etp=1, zero=1), dict(tp=2, dp=2, ep=4, etp=1,
                                                                     weight_sharded=True)]
)  # fmt: skip
def test_folded_plans_predict_alike(kw: dict) -> None:
    registry = load_registry()
    kernels = list(registry.kernels)
    o = options(**{**kw, "dmodel": 512, "dff": 1024, "seq": 256, "num_stacks": 4, "batch": 16})
    workload = build_workload(o, registry)
    dag = predict_time(workload, "h100-80g", kernels=kernels)
    fast = predict_options(o, "h100-80g", registry=registry, kernels=kernels)
    assert abs(fast["iteration_time_s"] / dag["iteration_time_s"] - 1) <= 0.10
    by_stage = {c.stage: c for c in workload.rank_classes}
    counted = count_parameters(o)
    held = [by_stage[s].facts.get("replica_parameters") or by_stage[s].facts["parameters"]
            for s in range(o.pp)]  # fmt: skip
    assert held == [p.total for p in counted]
    peaks = {c["stage"]: c["peak"] for c in predict_memory(workload, "h100-80g")["classes"]}
    for memory in analytic_memory(o):
        assert peaks[memory.stage] == pytest.approx(memory.peak, rel=1e-9)


@pytest.mark.parametrize(
    ("kw", "expert_dp"),
    [
        (dict(tp=2, dp=2, ep=4, etp=1), 1),  # ep spans dp: no other rank holds the experts
        (dict(tp=4, dp=2, ep=2, etp=1), 4),  # edp is half of tp and all of dp
    ],
)
def test_zero_shards_folded_experts_over_expert_data_parallelism(kw: dict, expert_dp: int) -> None:
    """Megatron's distributed optimizer: dense weights over dp, routed experts over edp."""
    registry = load_registry()
    o = options(zero=1, **kw)
    assert o.expert_dp == expert_dp
    workload = build_workload(o, registry)
    (cls,) = workload.rank_classes
    routed = 2 * (o.experts // o.ep) * 3 * 256 * 512  # two layers of E/ep experts, etp 1
    dense = cls.facts["parameters"] - routed
    assert cls.facts["shard_parameters"] == math.ceil(dense / o.dp) + routed // expert_dp
    groups = {  # the experts' gradients reduce-scatter over edp
        workload.comm_groups[workload.layout.group_id(0, t.group_axes)]
        for t in cls.nodes
        if t.comm_type is CollectiveType.REDUCE_SCATTER and node_micro_batch(t) is None
    }
    assert groups == {megatron_groups(o, 0)["dp"], megatron_groups(o, 0)["edp"]} - {(0,)}


def test_fold_mesh_cuts_the_dense_axes_into_expert_pieces() -> None:
    mesh = fold_mesh({"tp": 4, "sp": 1, "dp": 2, "pp": 2}, ("tp", "sp", "ep", "dp", "pp"), 2, 4)
    assert mesh.degrees == {"tp.etp": 2, "tp.ep": 2, "dp.ep": 2, "pp": 2}
    assert mesh.rank_order == ("tp.etp", "tp.ep", "dp.ep", "pp")
    assert mesh.axes["ep"] == {"tp.ep", "dp.ep"} and mesh.axes["tp"] == {"tp.etp", "tp.ep"}
    assert mesh.axes["edp"] == frozenset()
    with pytest.raises(LayoutError, match="every product of the leading degrees"):
        fold_mesh({"tp": 3, "dp": 2}, ("tp", "sp", "ep", "dp", "pp"), 2, 3)


def test_the_multiplying_layout_stays_the_default_and_unrecorded() -> None:
    o = options(dp=2, ep=2)
    assert not o.ep_folded and o.world_size == 4 and o.data_replicas == 4
    assert "ep_layout" not in o.recorded() and "etp" not in o.recorded()
    assert options(etp=1).ep_folded  # --etp implies folding, as Megatron's options do
    assert options(ep_layout="fold").recorded()["ep_layout"] == "fold"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ep", "2", "--ep_layout", "multiply", "--etp", "1"],
         "etp=1 splits experts over ranks that ep folds over: ep_layout=multiply is not "
         "allowed with it; allowed: ep_layout=fold"),
        (["--ep", "2", "--ep_layout", "stacked"],
         "ep_layout='stacked' must be one of multiply, fold"),
        (["--ep", "4", "--dp", "2", "--etp", "1"],
         "ep·etp=4 must divide dp·tp·sp=2"),
        (["--ep", "2", "--tp", "2", "--dp", "2", "--etp", "1", "--tpsp", "false"],
         "needs sequence parallelism (tpsp=true), as Megatron-LM requires for MoE with tensor "
         "parallelism; allowed: tpsp=true, or tp=1"),
        (["--ep", "3", "--dp", "3", "--experts", "8", "--etp", "1", "--batch", "9",
          "--micro_batch", "9"],
         "ep=3 must divide experts=8"),
        (["--ep", "2", "--tp", "2", "--dp", "2", "--etp", "3"],
         "etp=3 must divide dff=512"),
        (["--ep", "2", "--etp", "0"], "etp=0 must be a positive integer"),
    ],
)  # fmt: skip
def test_impossible_folds_are_refused_with_one_line(tmp_path, args, message) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    base = ["generate", "--model", "moe", "--dvocal", "1024", "--dmodel", "256", "--dff",
            "512", "--head", "8", "--kvhead", "8", "--seq", "64", "--num_stacks", "2"]  # fmt: skip
    result = CliRunner().invoke(app, [*base, *args, "--output_dir", str(out)])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert message in text and "Traceback" not in text
    assert not out.exists()


@pytest.mark.parametrize(
    "kw",
    [
        dict(phase="decode", steps=2, context=32),
        dict(phase="prefill"),
        dict(dtype="fp8", pp=2, micro_batch=4),  # Transformer Engine's amax group
    ],
)
def test_folded_serving_and_fp8_runs_validate_and_predict(kw: dict) -> None:
    registry = load_registry()
    o = options(tp=2, dp=2, ep=4, etp=1, **kw)
    workload = build_workload(o, registry)
    assert workload.world_size == 4 * o.pp and validate_workload(workload).ok
    a2a = {
        workload.comm_groups[workload.layout.group_id(0, t.group_axes)]
        for t in workload.ranks[0].rank_class.nodes
        if t.comm_type is CollectiveType.ALL_TO_ALL
    }
    ep = megatron_groups(o, 0)["ep"]
    if o.inference:  # tokens replicated over tp: each tp rank keeps its own experts' slots,
        # the all-to-all runs over the rest of the ep group and the outputs gather over tp
        assert a2a == {tuple(r for r in ep if r % o.tp == 0)}
    else:
        assert a2a == {ep}
    report = predict_time(workload, "h100-80g", kernels=list(registry.kernels))
    assert report["iteration_time_s"] > 0


def test_folded_serving_memory_counts_dense_replicas() -> None:
    """A folded run's sequences split over dp alone: its KV cache per rank is that of the
    multiplying layout with the same replicas (dp·ep there)."""
    registry = load_registry()
    serving = dict(phase="decode", context=32, tp=2, ep=4)
    folded = build_workload(options(dp=4, etp=1, **serving), registry)
    multiplied = build_workload(options(dp=1, **serving), registry)
    caches = [
        [c["kv_cache"] for c in predict_memory(w, "h100-80g")["classes"]]
        for w in (folded, multiplied)
    ]
    assert caches[0] == caches[1] and caches[0][0] > 0


def test_pieces_of_one_axis_move_in_one_collective() -> None:
    """On a folded mesh the pieces of tp reduce-scatter together and the pieces of ep
    all-to-all together; pieces of different axes (tp and sp) and an unfolded mesh's axes
    keep a collective each."""
    from stg.core.sharding import Sharding, plan_reshard

    pieces = {"tp.etp": ("tp", "etp"), "tp.ep": ("tp", "ep"), "dp.ep": ("dp", "ep")}
    pieces["sp.edp"] = ("sp", "edp")
    none = frozenset()
    partial = Sharding((none, none), frozenset({"tp.etp", "tp.ep", "sp.edp"}))
    scattered = Sharding((frozenset({"tp.etp", "tp.ep", "sp.edp"}), none))
    steps = plan_reshard(partial, scattered, pieces)
    assert [(s.kind, s.axes) for s in steps] == [
        (CollectiveType.REDUCE_SCATTER, {"sp.edp"}),
        (CollectiveType.REDUCE_SCATTER, {"tp.etp", "tp.ep"}),
    ]
    assert len(plan_reshard(partial, scattered)) == 3
    tokens = Sharding((none, frozenset({"dp.ep", "tp.ep"})))
    experts = Sharding((frozenset({"dp.ep", "tp.ep"}), none))
    (step,) = plan_reshard(tokens, experts, pieces)
    assert step.kind is CollectiveType.ALL_TO_ALL and step.axes == {"dp.ep", "tp.ep"}
    assert len(plan_reshard(tokens, experts)) == 2


@pytest.mark.parametrize(
    "kw",
    [
        dict(tp=2, dp=4, ep=8, etp=1),
        dict(tp=2, dp=2, ep=2, etp=1, pp=2, micro_batch=4, pipeline_layers=(0, 2)),
    ],
)
def test_folded_traces_decode_with_mlc_chakra_and_feed(tmp_path, kw: dict) -> None:  # type: ignore[no-untyped-def]
    """What ASTRA-sim reads: mlc-chakra's own decoder reads every rank file whole (node ids
    as stg wrote them) and every rank drains through the feeder in dependency order."""
    workload = build_workload(options(**kw), load_registry())
    out = tmp_path / "out"
    write_workload(workload, load_registry().emitters.get("chakra-v0.0.4"), out, "w.%d.et")
    for rank in range(workload.world_size):
        path = out / f"w.{rank}.et"
        ids = []
        with path.open("rb") as f:
            assert protolib.decodeMessage(f, et_def_pb2.GlobalMetadata())
            node = et_def_pb2.Node()
            while protolib.decodeMessage(f, node):
                ids.append(node.id)
                node = et_def_pb2.Node()
        expected = sorted(n.id for n in workload.ranks[rank].nodes())
        assert sorted(ids) == expected
        issued = [nid for kind, nid in replay(ETFeeder(path)) if kind == "issue"]
        assert sorted(issued) == expected
