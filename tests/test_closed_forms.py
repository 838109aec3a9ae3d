"""Generated FLOPs and bytes against the closed forms of VALIDATION.md."""

from __future__ import annotations

import itertools

import pytest
from workload_checks import (
    ATTENTION,
    GPT_GEMMS,
    LLAMA_GEMMS,
    check_runs_to_completion,
    comm_bytes,
    flops_by_root,
    total_flops,
)

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry

# The closed forms split the attention core into its score and context einsums, which the
# unfused attention keeps as separate nodes (the fused kernel has the same FLOPs in one node:
# test_fused_attention_keeps_the_flops_and_drops_the_scores).
SMALL = dict(
    dvocal=512, dmodel=64, dff=256, seq=32, head=8, kvhead=4, num_stacks=4, attention="unfused"
)


@pytest.fixture(scope="module")
def registry():
    return load_registry(autoload=False)


def build(registry, **kw):
    return build_workload(GenerateOptions(**{**SMALL, "batch": 8, **kw}), registry)


def gpt_closed_forms(B, s, h, F, L, V, recompute_factor=1):
    return {
        "gemm": 6 * B * s * L * (4 * h * h + 2 * h * F) * recompute_factor,
        "attention": 12 * B * s * s * L * h * recompute_factor,
        "head": 6 * B * s * h * V,
    }


def parts(flops, gemms):
    return {
        "gemm": sum(v for k, v in flops.items() if k in gemms),
        "attention": sum(v for k, v in flops.items() if k in ATTENTION),
        "head": flops["logits"],
    }


LAYOUTS = [
    dict(dp=dp, tp=tp, pp=pp, tpsp=tpsp, micro_batch=8 // m)
    for dp, tp, pp, tpsp, m in itertools.product(
        (1, 2, 4), (1, 2, 4), (1, 2, 4), (True, False), (1, 2, 4)
    )
    if (8 // m) % dp == 0 and not (tp == 1 and not tpsp)
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_gpt_flops_match_closed_forms_on_every_layout(registry, layout):
    w = build(registry, model="gpt", **layout)
    got = parts(flops_by_root(w), GPT_GEMMS)
    assert got == gpt_closed_forms(8, 32, 64, 256, 4, 512)


@pytest.mark.parametrize(
    "layout", LAYOUTS[::5], ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items())
)
def test_llama_flops_match_closed_forms(registry, layout):
    B, s, h, F, L, V, a, kv = 8, 32, 64, 256, 4, 512, 8, 4
    w = build(registry, model="llama", **layout)
    got = parts(flops_by_root(w), LLAMA_GEMMS)
    assert got["gemm"] == 6 * B * s * L * (2 * h * h + 2 * h * h * kv // a + 3 * h * F)
    assert got["attention"] == 12 * B * s * s * L * h
    assert got["head"] == 6 * B * s * h * V


def test_gpt_total_matches_textbook_formula_within_elementwise_remainder(registry):
    # Realistic proportions (h >> a, s), where the elementwise remainder is small.
    B, s, h, L, V = 8, 512, 2048, 4, 32000
    w = build_workload(
        GenerateOptions(
            model="gpt",
            dvocal=V,
            dmodel=h,
            dff=4 * h,
            seq=s,
            head=16,
            num_stacks=L,
            batch=B,
            tp=2,
            pp=2,
        ),
        registry,
    )
    textbook = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    total = total_flops(w)
    assert textbook <= total < textbook * 1.02


def test_full_recompute_gives_megatron_96_formula(registry):
    B, s, h, L, V = 8, 32, 64, 4, 512
    w = build(registry, model="gpt", tp=2, pp=2, activation_recompute="full")
    got = parts(flops_by_root(w), GPT_GEMMS)
    expect = gpt_closed_forms(B, s, h, 256, L, V, recompute_factor=sympy_fraction(4, 3))
    assert got == expect
    # 96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)) for the matmuls
    assert sum(got.values()) == 96 * B * s * L * h * h + 16 * B * s * s * L * h + 6 * B * s * h * V


def sympy_fraction(a, b):
    from fractions import Fraction

    return Fraction(a, b)


def test_selective_recompute_recomputes_attention_core_only(registry):
    w = build(registry, model="gpt", tp=2, activation_recompute="selective")
    got = parts(flops_by_root(w), GPT_GEMMS)
    assert got["gemm"] == 6 * 8 * 32 * 4 * (4 * 64 * 64 + 2 * 64 * 256)
    assert got["attention"] == 16 * 8 * 32 * 32 * 4 * 64


def test_causal_masking_halves_attention(registry):
    got = parts(flops_by_root(build(registry, model="gpt", causal=True)), GPT_GEMMS)
    assert got["attention"] == 6 * 8 * 32 * 32 * 4 * 64


def layer_comm(w, rank):
    """Bytes per collective type of the layer stack only (not embedding/head/grad reduce)."""
    out = {}
    for n in w.ranks[rank].rank_class.nodes:
        if n.type.name == "COMM_COLL" and "/layer" in n.name:
            out[n.comm_type.name] = out.get(n.comm_type.name, 0) + n.comm_size
            out[n.comm_type.name + "_count"] = out.get(n.comm_type.name + "_count", 0) + 1
    return out


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("m", [1, 2])
def test_tp_without_sp_all_reduces_four_times_per_layer(registry, tp, m):
    B, s, h, L, e = 8, 32, 64, 4, 2
    w = build(registry, tp=tp, tpsp=False, micro_batch=B // m)
    b = B // m
    got = layer_comm(w, 0)
    assert got == {"ALL_REDUCE": 4 * L * m * b * s * h * e, "ALL_REDUCE_count": 4 * L * m}


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_with_sp_uses_allgather_reducescatter_pairs(registry, tp):
    B, s, h, L, e, m = 8, 32, 64, 4, 2, 2
    w = build(registry, tp=tp, tpsp=True, micro_batch=B // m)
    b = B // m
    got = layer_comm(w, 0)
    assert got["ALL_GATHER_count"] == got["REDUCE_SCATTER_count"] == 4 * L * m
    # all-gather comm_size is this rank's shard, reduce-scatter the full buffer (TRACES.md)
    assert got["ALL_GATHER"] == 4 * L * m * b * s * h * e // tp
    assert got["REDUCE_SCATTER"] == 4 * L * m * b * s * h * e
    assert "ALL_REDUCE" not in got


@pytest.mark.parametrize(
    "layout", [dict(dp=2, tp=2), dict(dp=4, tp=1, pp=2), dict(dp=2, tp=4, pp=2, tpsp=False)]
)
def test_dp_reduces_each_gradient_once_per_iteration(registry, layout):
    w = build(registry, micro_batch=4, **layout)
    for graph in w.ranks:
        cls = graph.rank_class
        grad = [
            n
            for n in cls.nodes
            if n.type.name == "COMM_COLL"
            and "grad_" in n.name.rsplit("/", 1)[-1]
            and not n.name.startswith("mb")
        ]
        assert all(n.comm_type.name == "ALL_REDUCE" for n in grad)
        # with sequence parallelism, one more all-reduce per stage over tp only: the replicated
        # weights' gradients (Megatron-LM's finalize_model_grads), already reduced over dp
        over_dp = [n for n in grad if "dp" in n.group_axes]
        over_tp = [n for n in grad if "dp" not in n.group_axes]
        assert len(over_tp) == (1 if layout["tp"] > 1 and layout.get("tpsp", True) else 0)
        assert all(tuple(n.group_axes) == ("tp",) for n in over_tp)
        assert sum(n.comm_size for n in over_dp) == cls.facts["parameters"] * 2


def test_gpt_parameters_per_rank_follow_megatron_split(registry):
    h, F, V, s, L, t = 64, 256, 512, 32, 4, 2
    w = build(registry, tp=t)
    # matrices and q/k/v/fc1 biases split over tp; out-proj/fc2 biases and norms replicated
    layer = (4 * h * h + 2 * h * F) // t + (3 * h + F) // t + 2 * h + 4 * h
    assert (
        w.ranks[0].rank_class.facts["parameters"]
        == L * layer + V * h // t + s * h + 2 * h + V * h // t
    )


@pytest.mark.parametrize("tpsp", [True, False])
def test_pp_sends_one_activation_and_one_gradient_per_microbatch_per_boundary(registry, tpsp):
    B, s, h, e, m, t = 8, 32, 64, 2, 4, 2
    w = build(registry, pp=4, tp=t, tpsp=tpsp, micro_batch=B // m)
    b = B // m
    size = b * s * h * e // (t if tpsp else 1)
    for rank in range(w.world_size):
        stage = w.layout.stage(rank)
        sends = [n for n in w.ranks[rank].rank_class.nodes if n.type.name == "COMM_SEND"]
        expected = (stage < 3) * m + (stage > 0) * m
        assert len(sends) == expected
        assert all(n.comm_size == size for n in sends)


@pytest.mark.parametrize(
    "kw",
    [
        dict(dp=2, tp=2, pp=2, micro_batch=2),
        dict(pp=4, micro_batch=1, pipeline_schedule="gpipe"),
        dict(pp=2, micro_batch=2, pipeline_schedule="interleaved", virtual_stages=2),
        dict(tp=2, sp=2, pp=2, micro_batch=4, activation_recompute="selective"),
        dict(model="llama", dp=2, tp=2, pp=2, micro_batch=2, activation_recompute="full"),
    ],
)
def test_all_ranks_run_to_completion_without_deadlock(registry, kw):
    w = build(registry, **kw)
    assert check_runs_to_completion(w) == sum(len(g) for g in w.ranks)


def test_model_flops_do_not_depend_on_layout(registry):
    base = None
    for kw in [
        dict(),
        dict(dp=2, tp=2, pp=2),
        dict(tp=4, sp=2, micro_batch=2),
        dict(dp=4, pp=4, micro_batch=4),
    ]:
        got = parts(flops_by_root(build(registry, **kw)), GPT_GEMMS)
        base = base or got
        assert got == base


def test_comm_bytes_helper_counts_sends(registry):
    w = build(registry, pp=2, micro_batch=4)
    assert comm_bytes(w, 0)[("SEND", ())] == 2 * 4 * 32 * 64 * 2


@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("cp_comm_type", ["p2p", "all_gather"])
def test_fused_attention_keeps_the_flops_and_drops_the_scores(
    registry, model, recompute, cp_comm_type
):
    cp = 2
    kw = dict(
        model=model,
        tp=2,
        sp=cp,
        activation_recompute=recompute,
        causal=True,
        cp_comm_type=cp_comm_type,
    )
    unfused = build(registry, **kw)
    fused = build(registry, **kw, attention="fused")
    assert total_flops(fused) == total_flops(unfused)
    s = SMALL["seq"]
    nodes = [n for g in fused.ranks for n in g.nodes()]
    core = [n for n in nodes if "attention" in n.attrs]
    assert core and not any(n.name.rsplit("/", 1)[-1] in ATTENTION for n in nodes)
    forward = [n for n in core if n.attrs["attention"][6] == 0]
    # one causal kernel per forward pass: the whole pass (all_gather) or the ring's step on the
    # rank's own chunks (p2p), whose other cp - 1 steps attend to half a rank's queries' worth
    # of keys each, unmasked
    passes = [n for n in forward if n.attrs["attention"][5] == 1]
    steps = 1 if cp_comm_type == "all_gather" else cp
    assert passes and len(forward) == steps * len(passes)
    backward = [n for n in core if n.attrs["attention"][6] == 1]
    backward_passes = [n for n in backward if n.attrs["attention"][5] == 1]
    assert backward_passes and len(backward) == steps * len(backward_passes)
    pass_bytes = 0
    for n in forward:
        batch, heads, s_q, s_kv, d, causal, _ = n.attrs["attention"]
        assert s_q == s // cp
        if cp_comm_type == "all_gather":
            assert s_kv == s
        else:
            assert s_kv == (s_q if causal else s_q // 2)
        assert heads == SMALL["head"] // 2  # tp 2
        pass_bytes += n.tensor_size
    # per pass: bf16 Q and the output (s_q rows of every query head; a causal kernel masks each
    # query head's own triangle), K and V (all s keys of the kv heads under GQA), fp32 softmax
    # statistics; no score matrix; the ring's steps share them
    kv_heads = (SMALL["kvhead"] if model == "llama" else SMALL["head"]) // 2
    tokens = 2 * batch * d * (2 * heads * s_q + 2 * kv_heads * s)
    assert pass_bytes == len(passes) * (tokens + 4 * batch * heads * s_q)
