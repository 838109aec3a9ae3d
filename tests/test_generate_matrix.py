"""A grid of feature combinations: generated, written, decoded by the official reader, validated,
drained by the feeder, and simulated together across ranks."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from chakra.schema.protobuf import et_def_pb2
from chakra.src.third_party.utils import protolib
from workload_checks import check_runs_to_completion, flops_by_root

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.errors import UserError
from stg.host.registry import load_registry
from stg.trace.feeder import ETFeeder
from stg.trace.validate import validate_trace, validate_workload
from stg.trace.writer import write_workload

SMALL = dict(
    dvocal=256, dmodel=64, dff=128, seq=32, head=8, kvhead=4, num_stacks=4, batch=8, experts=4
)

GRID = [
    dict(model="gpt", dp=2, tp=2, pp=2, micro_batch=4),
    dict(model="llama", tp=2, tpsp=False, pp=2, micro_batch=2),
    dict(model="gpt", sp=2, pp=2, micro_batch=4, activation_recompute="selective"),
    dict(model="llama", sp=2, tp=2, pp=2, micro_batch=4, weight_sharded=True),
    dict(model="moe", ep=2, pp=2, micro_batch=2),
    dict(model="moe", ep=2, sp=2, tp=2, pp=2, micro_batch=4, activation_recompute="full"),
    dict(model="moe", dp=2, ep=2, tp=2, micro_batch=8, zero=2, mixed_precision=True),
    dict(model="gpt", dp=2, pp=2, micro_batch=4, weight_sharded=True, mixed_precision=True),
    dict(model="llama", pp=2, micro_batch=2, pipeline_schedule="interleaved", virtual_stages=2),
    dict(model="gpt", pp=4, micro_batch=2, pipeline_schedule="gpipe", causal=True),
    dict(
        model="moe",
        dp=2,
        ep=2,
        sp=2,
        tp=2,
        pp=2,
        micro_batch=4,
        weight_sharded=True,
        activation_recompute="full",
        mixed_precision=True,
        rank_order="dp,tp,sp,ep,pp",
    ),
]


@pytest.fixture(scope="module")
def registry():
    return load_registry(autoload=False)


def ids(kw):
    return "-".join(f"{k}={v}" for k, v in kw.items())


def official_decode(path: Path) -> list:
    nodes = []
    with path.open("rb") as f:
        meta = et_def_pb2.GlobalMetadata()
        assert protolib.decodeMessage(f, meta)
        assert meta.version == "0.0.4"
        while True:
            node = et_def_pb2.Node()
            if not protolib.decodeMessage(f, node):
                break
            nodes.append(node)
    return nodes


@pytest.mark.parametrize("kw", GRID, ids=ids)
def test_combination_generates_valid_traces(registry, tmp_path, kw):
    workload = build_workload(GenerateOptions(**{**SMALL, **kw}), registry)
    assert validate_workload(workload).ok
    assert check_runs_to_completion(workload) == sum(len(g) for g in workload.ranks)
    files = write_workload(
        workload, registry.emitters.get("chakra-v0.0.4"), tmp_path / "out", "workload.%d.et"
    )
    assert len(files) == workload.world_size + 1
    report = validate_trace(tmp_path / "out")
    assert report.ok, report.errors[:3]
    for rank in (0, workload.world_size - 1):
        nodes = official_decode(tmp_path / "out" / f"workload.{rank}.et")
        assert len(nodes) == len(workload.ranks[rank])
        ours = list(workload.ranks[rank].nodes())
        assert [n.id for n in nodes] == [n.id for n in ours]
        flops = sum(a.int64_val for n in nodes for a in n.attr if a.name == "num_ops")
        assert flops == sum(n.num_ops for n in ours)
        feeder = ETFeeder(tmp_path / "out" / f"workload.{rank}.et", deps="data+ctrl", window=64)
        drained = 0
        while feeder.has_nodes_to_issue():
            node = feeder.get_next_issuable_node()
            assert node is not None
            feeder.free_children_nodes(node.id)
            feeder.remove_node(node.id)
            drained += 1
        assert drained == len(nodes)


def test_same_input_gives_identical_bytes(registry, tmp_path):
    kw = {**SMALL, **GRID[-1]}
    digests = []
    for run in range(2):
        out = tmp_path / f"run{run}"
        write_workload(
            build_workload(GenerateOptions(**kw), registry),
            registry.emitters.get("chakra-v0.0.4"),
            out,
            "w.%d.et",
        )
        digests.append(
            {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())}
        )
    assert digests[0] == digests[1]


def test_moe_expert_flops_do_not_depend_on_ep_and_scale_with_k(registry):
    def expert_flops(**kw):
        w = build_workload(GenerateOptions(**{**SMALL, "model": "moe", **kw}), registry)
        f = flops_by_root(w)
        return sum(f[k] for k in ("expert_gate", "expert_up", "expert_down"))

    base = expert_flops(kexperts=1)
    assert expert_flops(kexperts=1, ep=2) == base == expert_flops(kexperts=1, ep=4, micro_batch=4)
    assert expert_flops(kexperts=2) == 2 * base
    # capacity = k·tokens/E per expert; three SwiGLU matmuls, forward and backward
    B, s, h, F, L = 8, 32, 64, 128, 4
    assert base == 6 * 3 * B * s * h * F * L


def test_moe_all_to_all_bytes_per_layer(registry):
    B, s, h, e, k = 8, 32, 64, 2, 2
    ep = 2
    w = build_workload(
        GenerateOptions(**{**SMALL, "model": "moe", "ep": ep, "kexperts": k}), registry
    )
    a2a = [
        n
        for n in w.ranks[0].rank_class.nodes
        if n.type.name == "COMM_COLL" and n.comm_type.name == "ALL_TO_ALL"
    ]
    per_layer = [n for n in a2a if "/layer0/" in n.name]
    # dispatch and combine forward, and both again backward: this rank's k·tokens·h buffer
    tokens_here = B * s // ep
    assert [n.comm_size for n in per_layer] == [k * tokens_here * h * e] * 4
    assert all(n.group_axes == ("ep",) for n in a2a)


def test_moe_gradients_reduce_experts_over_dp_and_the_rest_over_dp_ep(registry):
    w = build_workload(
        GenerateOptions(**{**SMALL, "model": "moe", "ep": 2, "dp": 2, "micro_batch": 4}), registry
    )
    reduce = {
        n.group_axes: n.comm_size
        for n in w.ranks[0].rank_class.nodes
        if n.name.startswith("layer0/grad_")
    }
    h, F, E, e = 64, 128, 4, 2
    assert reduce[("dp",)] == 3 * (E // 2) * h * F * e
    assert ("dp", "ep") in reduce


def test_context_parallel_exchanges_k_and_v(registry):
    B, s, h, e, sp = 8, 32, 64, 2, 2
    w = build_workload(GenerateOptions(**{**SMALL, "model": "gpt", "sp": sp}), registry)
    nodes = [
        n for n in w.ranks[0].rank_class.nodes if "/layer0/" in n.name and n.group_axes == ("sp",)
    ]
    kinds = [(n.comm_type.name, n.comm_size) for n in nodes]
    shard = B * s * h * e // sp
    # the p2p ring at cp 2 (Transformer Engine): one transfer of K and V (one buffer) beside
    # step 0; the backward passes them round again, then their gradients (the bytes of a
    # reduce-scatter of both)
    assert kinds == [
        ("ALL_GATHER", 2 * shard),
        ("ALL_GATHER", 2 * shard),
        ("REDUCE_SCATTER", 4 * shard),
    ]
    options = GenerateOptions(**{**SMALL, "model": "gpt", "sp": sp, "cp_comm_type": "all_gather"})
    nodes = [
        n
        for n in build_workload(options, registry).ranks[0].rank_class.nodes
        if "/layer0/" in n.name and n.group_axes == ("sp",)
    ]
    assert [(n.comm_type.name, n.comm_size) for n in nodes] == [
        ("ALL_GATHER", shard),
        ("ALL_GATHER", shard),
        # Transformer Engine keeps only the local K and V chunks: gathered again backward
        ("ALL_GATHER", shard),
        ("ALL_GATHER", shard),
        ("REDUCE_SCATTER", 2 * shard),
        ("REDUCE_SCATTER", 2 * shard),
    ]


def test_fsdp_gathers_weights_before_forward_and_backward_and_reduce_scatters_grads(registry):
    dp, e = 2, 2
    w = build_workload(
        GenerateOptions(**{**SMALL, "dp": dp, "micro_batch": 4, "weight_sharded": True}), registry
    )
    cls = w.ranks[0].rank_class
    layer_params = cls.facts["parameters"]  # stored shard of this rank
    per_layer = [n for n in cls.nodes if "/layer1/" in n.name and n.group_axes == ("dp",)]
    m = 2
    kinds = [n.comm_type.name for n in per_layer]
    assert kinds == ["ALL_GATHER", "ALL_GATHER", "REDUCE_SCATTER"] * m
    block = per_layer[0].comm_size // e  # elements of this rank's shard of one layer
    assert all(n.comm_size == block * e for n in per_layer if n.comm_type.name == "ALL_GATHER")
    assert all(
        n.comm_size == block * dp * e for n in per_layer if n.comm_type.name == "REDUCE_SCATTER"
    )
    assert layer_params > 4 * block


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_reduce_scatters_gradients_and_all_gathers_weights(registry, zero):
    dp = 2
    w = build_workload(
        GenerateOptions(**{**SMALL, "dp": dp, "zero": zero, "mixed_precision": True}), registry
    )
    cls = w.ranks[0].rank_class
    it = [n for n in cls.nodes if not n.name.startswith("mb") and n.type.name == "COMM_COLL"]
    rs = sum(n.comm_size for n in it if n.comm_type.name == "REDUCE_SCATTER")
    ag = sum(n.comm_size for n in it if n.comm_type.name == "ALL_GATHER")
    params = cls.facts["parameters"]
    assert rs == params * 4  # fp32 gradients, full buffer
    assert ag == params // dp * 2  # bf16 weights, this rank's shard
    assert not [n for n in it if n.comm_type.name == "ALL_REDUCE"]


def test_mixed_precision_reduces_gradients_in_fp32(registry):
    w = build_workload(GenerateOptions(**{**SMALL, "dp": 2, "mixed_precision": True}), registry)
    cls = w.ranks[0].rank_class
    grads = sum(
        n.comm_size
        for n in cls.nodes
        if n.name.split("/")[0] in {"embedding", "head"} or n.name.startswith("layer")
    )
    assert grads == cls.facts["parameters"] * 4
    w = build_workload(
        GenerateOptions(**{**SMALL, "dp": 2, "mixed_precision": True, "grad_reduce_dtype": "bf16"}),
        registry,
    )
    cls = w.ranks[0].rank_class
    grads = sum(
        n.comm_size
        for n in cls.nodes
        if n.name.split("/")[0] in {"embedding", "head"} or n.name.startswith("layer")
    )
    assert grads == cls.facts["parameters"] * 2


BAD = [
    (dict(tp=3), "tp=3 must divide head=8"),
    (
        dict(model="llama", tp=8, head=16, kvhead=4, dff=128, dvocal=256),
        "tp=8 must divide kvhead=4",
    ),
    (dict(pp=5), "pp=5 must not exceed num_stacks=4"),
    (dict(dp=2, micro_batch=1), "dp·ep=2 must divide micro_batch=1"),
    (dict(micro_batch=3), "micro_batch=3 must divide batch=8"),
    (dict(model="moe", ep=3, batch=6), "ep=3 must divide experts=4"),
    (dict(model="moe", kexperts=5), "kexperts=5 must not exceed experts=4"),
    (dict(sp=3), "sp=3 must divide seq=32"),
    (dict(zero=2, weight_sharded=True), "cannot be combined with weight_sharded"),
    (dict(virtual_stages=2, pp=2), "virtual_stages=2 needs pipeline_schedule=interleaved"),
    (dict(pipeline_schedule="interleaved", pp=2, micro_batch=8), "divisible by pp=2"),
    (
        dict(activation_recompute="some"),
        "activation_recompute='some' must be one of none, selective, selective_op, full",
    ),
    (dict(model="bart"), "unknown model 'bart'"),
    (dict(pipeline_schedule="zb"), "unknown pipeline schedule 'zb'"),
    (dict(rank_order="tp,dp"), "rank_order='tp,dp' must list each of"),
]


@pytest.mark.parametrize(("kw", "message"), BAD, ids=[m for _, m in BAD])
def test_impossible_options_raise_one_clear_error(registry, kw, message):
    with pytest.raises(UserError) as info:
        build_workload(GenerateOptions(**{**SMALL, **kw}), registry)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
