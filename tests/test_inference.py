"""Serving phases (prefill, decode, mixed): closed forms, collectives, traces, predictions."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from chakra.schema.protobuf import et_def_pb2
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_astra_rules import official_nodes
from test_symbolic_core import FusedPlugin
from typer.testing import CliRunner
from workload_checks import (
    ATTENTION,
    GPT_GEMMS,
    LLAMA_GEMMS,
    check_runs_to_completion,
    flops_by_root,
)

import stg
from stg.cli import app
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import CollectiveType, NodeType
from stg.errors import UserError
from stg.host.registry import load_registry
from stg.predictors.memory import predict_memory
from stg.predictors.serving import predict_serving
from stg.trace.validate import validate_trace, validate_workload
from stg.trace.writer import write_workload

SMALL = dict(dvocal=512, dmodel=64, dff=256, seq=32, head=8, kvhead=4, num_stacks=4, experts=4)
B, S, H, F, L, V, HEADS, KVH = 8, 32, 64, 256, 4, 512, 8, 4
DH = H // HEADS


@pytest.fixture(scope="module")
def registry():
    return load_registry(autoload=False)


def build(registry, **kw):
    return build_workload(GenerateOptions(**{**SMALL, "batch": B, **kw}), registry)


def llama_matmul_params() -> int:
    """Weights of one Llama layer's matmuls: q, k, v, o and the SwiGLU MLP."""
    return H * HEADS * DH + 2 * H * KVH * DH + HEADS * DH * H + 3 * H * F


LAYOUTS = [
    dict(),
    dict(tp=2),
    dict(tp=4, pp=2, micro_batch=4),
    dict(dp=2, tp=2),
    dict(sp=2, tp=2),
    dict(pp=4, micro_batch=2),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kw", LAYOUTS, ids=str)
def test_prefill_flops_are_two_params_per_token_plus_attention(registry, kw, causal):
    w = build(registry, model="llama", phase="prefill", attention="unfused", causal=causal, **kw)
    f = flops_by_root(w)
    tokens = B * S
    # every matmul weight once per prompt token; the LM head on the last position only
    assert sum(f[k] for k in LLAMA_GEMMS) == 2 * llama_matmul_params() * L * tokens
    sp = kw.get("sp", 1)
    assert f["logits"] == 2 * V * H * B * sp  # one position per sequence (per cp rank)
    pairs = S * (S + 1) // 2 if causal else S * S  # (query, key) pairs the prompt computes
    assert sum(f[k] for k in ATTENTION) == 4 * B * pairs * HEADS * DH * L
    assert validate_workload(w).ok
    assert check_runs_to_completion(w) == sum(len(g) for g in w.ranks)


def test_fused_prefill_has_the_flops_of_the_unfused_one(registry):
    fused = build(registry, model="gpt", phase="prefill", tp=2)
    unfused = build(registry, model="gpt", phase="prefill", tp=2, attention="unfused")
    f, u = flops_by_root(fused), flops_by_root(unfused)
    # new keys and values written into the cache: one op per element written
    appended = sum(v for k, v in u.items() if k.endswith(".cache_append"))
    assert appended == 2 * B * S * H * L
    assert f["core_attention"] == u["scores"] + u["softmax"] + u["context"] + appended
    assert sum(f[k] for k in GPT_GEMMS) == sum(u[k] for k in GPT_GEMMS)


def _layer_nodes(w, rank=0, layer=0):
    prefix = f"layer{layer}/"
    return [n for n in w.ranks[rank].rank_class.nodes if prefix in n.name]


@pytest.mark.parametrize("kv_dtype,width", [(None, 2), ("fp8", 1), ("int8", 1)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_one_decode_step_reads_every_weight_once_and_the_kv_cache_once(
    registry, tp, kv_dtype, width
):
    ctx = 100
    w = build(registry, model="llama", phase="decode", context=ctx, tp=tp, kv_dtype=kv_dtype)
    rank = w.ranks[0].rank_class
    gemm_weights = attention_cache = 0
    for n in rank.nodes:
        if "gemm" in n.attrs:
            batch, m, nn, k = n.attrs["gemm"]
            gemm_weights += n.tensor_size - 2 * batch * (m * k + m * nn)  # minus activations
        if "attention" in n.attrs:
            heads, kv_heads = HEADS // tp, KVH // tp
            q = o = B * heads * DH * 2
            new = 2 * B * kv_heads * DH  # one new key and value per sequence
            stats = 4 * B * heads
            attention_cache += n.tensor_size - (q + o + stats + new * 2 + new * width)
    # every matmul weight of the rank is read exactly once (the LM head included)
    assert gemm_weights == 2 * (llama_matmul_params() * L + V * H) // tp
    # the whole cache (context + the new token) once: 2·layers·kv_heads·head_dim·len·batch·size
    kv = 2 * L * (KVH // tp) * DH * (ctx + 1) * B * width
    assert attention_cache == kv
    assert rank.facts["kv_cache_bytes"] == kv


@pytest.mark.parametrize("model,kv_heads", [("llama", KVH), ("gpt", HEADS)])
def test_kv_cache_bytes_closed_form(registry, model, kv_heads):
    ctx, steps, tp = 200, 3, 2
    w = build(
        registry, model=model, phase="decode", context=ctx, steps=steps, tp=tp, kv_dtype="fp8"
    )
    facts = w.rank_classes[0].facts
    per_token = 2 * L * (kv_heads // tp) * DH * B * 1
    assert facts["kv_cache_bytes_per_step"] == [per_token * (ctx + i) for i in (1, 2, 3)]
    report = predict_memory(w, "h100-80g")
    (cls,) = report["classes"]
    assert cls["kv_cache"] == per_token * (ctx + steps)
    assert cls["weights"] == facts["parameters"] * 2
    assert cls["peak"] == cls["weights"] + cls["kv_cache"] + cls["activations"]
    assert report["max_batch"] > B and report["max_context"] > ctx + steps


def test_decode_steps_grow_the_attention_and_chain_the_steps(registry):
    w = build(registry, model="gpt", phase="decode", context=40, steps=3, tp=2, pp=2, micro_batch=4)
    assert validate_workload(w).ok
    assert check_runs_to_completion(w) == sum(len(g) for g in w.ranks)
    last = w.rank_classes[-1].nodes
    kv = sorted(
        {n.attrs["attention"][3] for n in last if "attention" in n.attrs}
    )  # s_kv of each step
    assert kv == [41, 42, 43]
    first = w.rank_classes[0].nodes
    recv = [n for n in first if n.type is NodeType.COMM_RECV and "tokens" in n.name]
    sent = [n for n in last if n.type is NodeType.COMM_SEND and "tokens" in n.name]
    assert len(recv) == len(sent) == 2 * 2  # steps 1 and 2, two micro-batches each
    assert {n.comm_size for n in sent} == {4 * 4}  # one int32 token per sequence


def _collectives(w, rank=0):
    count: Counter[tuple[str, tuple[str, ...]]] = Counter()
    for n in w.ranks[rank].rank_class.nodes:
        if n.type is NodeType.COMM_COLL and "/layer" in n.name:
            count[(n.comm_type.name, n.group_axes)] += 1
    return count


def test_tp8_decode_has_two_all_reduces_per_layer_and_nothing_else(registry):
    w = build(registry, model="llama", phase="decode", tp=8, head=8, kvhead=8)
    assert _collectives(w) == {("ALL_REDUCE", ("tp",)): 2 * L}
    for layer in range(L):
        reduces = [n for n in _layer_nodes(w, 0, layer) if n.comm_type is CollectiveType.ALL_REDUCE]
        assert [n.comm_size for n in reduces] == [B * H * 2] * 2  # one token per sequence


def test_moe_decode_with_ep4_has_its_all_to_alls(registry):
    w = build(registry, model="moe", phase="decode", ep=4, batch=16)
    count = _collectives(w)
    assert count[("ALL_TO_ALL", ("ep",))] == 2 * L  # dispatch and combine in every layer
    assert set(count) == {("ALL_TO_ALL", ("ep",))}  # no gradient collectives
    assert validate_workload(w).ok


def test_data_parallel_replicas_are_independent(registry):
    w = build(registry, model="llama", phase="decode", dp=4)
    assert not w.comm_groups
    assert all(n.type is NodeType.COMP for g in w.rank_classes for n in g.nodes)


def test_no_backward_optimizer_or_gradient_collectives(registry):
    w = build(registry, model="moe", phase="prefill", dp=2, ep=2, tp=2)
    names = [n.name for g in w.rank_classes for n in g.nodes]
    assert not [n for n in names if "bwd" in n or "grad" in n or "optimizer" in n]


def test_mixed_iteration_runs_one_gemm_over_both_groups(registry):
    kw = dict(model="llama", phase="mixed", batch=8, context=60, prefill_batch=2, chunk=16)
    w = build(registry, prefill_context=16, attention="unfused", tp=2, **kw)
    f = flops_by_root(w)
    tokens = 2 * 16 + 8  # prefill chunks beside one token per decoding sequence
    assert sum(f[k] for k in LLAMA_GEMMS) == 2 * llama_matmul_params() * L * tokens
    # attention: the chunk sees 16 cached + its own 16, a decoding token 60 + 1
    assert sum(f[k] for k in ATTENTION) == 4 * HEADS * DH * L * (2 * 16 * 32 + 8 * 61)
    fused = build(registry, prefill_context=16, tp=2, **kw)
    rank = fused.rank_classes[0].nodes
    attention = [n.attrs["attention"] for n in rank if "attention" in n.attrs]
    assert len(attention) == 2 * L  # one kernel per group and layer
    q = next(n for n in rank if n.name.endswith("layer0/fwd/q"))
    assert q.attrs["gemm"][1] == tokens  # one GEMM over every token of the iteration
    assert validate_workload(fused).ok
    assert check_runs_to_completion(fused) == sum(len(g) for g in fused.ranks)


PHASES = [
    dict(model="llama", phase="prefill", tp=2, sp=2, causal=True),
    dict(model="gpt", phase="prefill", pp=2, micro_batch=4, kv_dtype="fp8"),
    dict(model="gpt", phase="decode", tp=2, pp=2, micro_batch=4, steps=3),
    dict(model="moe", phase="decode", ep=2, tp=2, batch=16),
    dict(model="llama", phase="mixed", tp=2, pp=2, prefill_batch=2, chunk=8, context=40),
    dict(model="moe", phase="mixed", ep=2, batch=16, prefill_batch=4, kv_dtype="int8"),
    dict(model="deepseek", phase="decode", tp=2, ep=2, batch=16, steps=2),
    dict(model="deepseek", phase="mixed", tp=2, ep=2, batch=16, prefill_batch=2, chunk=8),
    dict(model="deepseek", phase="prefill", tp=2, sp=2, causal=True, dense_layers=1),
    dict(model="deepseek", phase="decode", pp=2, micro_batch=4, steps=2, dense_layers=1),
]


@pytest.mark.parametrize("kw", PHASES, ids=str)
def test_every_phase_validates_and_decodes_with_the_official_reader(registry, tmp_path, kw):
    w = build(registry, **kw)
    out = tmp_path / "out"
    write_workload(w, registry.emitters.get("chakra-v0.0.4"), out, "workload.%d.et")
    report = validate_trace(out)  # ASTRA-sim's rules
    assert report.ok, [v.message for v in report.errors[:3]]
    for rank in range(w.world_size):
        nodes = official_nodes(out / f"workload.{rank}.et")
        assert len(nodes) == len(w.ranks[rank])
        for node in nodes:
            if node.type == et_def_pb2.COMP_NODE:
                attrs = {a.name: a for a in node.attr}
                assert attrs["num_ops"].int64_val > 0 or attrs["tensor_size"].uint64_val == 0
    result = CliRunner().invoke(app, ["feed", str(out)])
    assert result.exit_code == 0, result.output


def test_a_plugin_model_serves_unchanged(registry):
    plugin = load_registry(autoload=False, plugins=[FusedPlugin()])
    for phase in ("prefill", "decode"):
        w = build_workload(
            GenerateOptions(
                dvocal=512, dmodel=64, dff=256, seq=32, head=8, num_stacks=2, batch=8,
                model="fused", tp=2, phase=phase,
            ),
            plugin,
        )  # fmt: skip
        assert validate_workload(w).ok
        assert check_runs_to_completion(w) == sum(len(g) for g in w.ranks)
        # its attention (not tagged core_attention: unfused) reads the cache
        scores = [n.attrs["gemm"] for n in w.rank_classes[0].nodes if n.name.endswith("/scores")]
        assert scores and {g[2] for g in scores} == {32 if phase == "prefill" else 33}
        assert {g[1] for g in scores} == {32 if phase == "prefill" else 1}


def test_decode_prediction_respects_the_memory_bandwidth_bound(registry):
    o = dict(model="llama", dmodel=1024, dff=4096, head=16, kvhead=4, num_stacks=4, dvocal=4096)
    w = build_workload(GenerateOptions(**o, phase="decode", batch=32, seq=1024, tp=2), registry)
    report = predict_serving(w, "h100-80g", explain=True)
    bound = report["memory_bandwidth_bound_s"]
    assert report["time_per_output_token_s"] >= bound > 0
    facts = w.rank_classes[0].facts
    assert bound == pytest.approx(
        (facts["weight_bytes"] + facts["kv_cache_bytes"]) / 3.35e12, rel=1e-9
    )
    assert report["tokens_per_s"] == pytest.approx(32 / report["time_per_output_token_s"])
    split = report["explain"]["per_step_s"]
    assert set(split) == {
        "weights_read_s", "kv_read_s", "compute_s", "elementwise_s", "communication_s"
    }  # fmt: skip
    assert sum(split.values()) == pytest.approx(report["time_per_output_token_s"], rel=1e-6)
    assert split["weights_read_s"] > 0 and split["kv_read_s"] > 0


def test_prefill_prediction_gives_time_to_first_token(registry):
    w = build(registry, model="llama", phase="prefill", tp=2)
    report = predict_serving(w, "h100-80g")
    assert report["ttft_s"] > 0
    assert report["tokens_per_s"] == pytest.approx(B * S / report["ttft_s"])


BAD = [
    (["--phase", "serve"], "phase='serve' must be one of training, prefill, decode, mixed"),
    (["--context", "5"], "context=5 applies to the serving phases"),
    (["--phase", "decode", "--sp", "2"], "sp=2 is not allowed with phase=decode"),
    (["--phase", "prefill", "--zero", "1"], "zero=1 is a training option"),
    (["--phase", "decode", "--steps", "0"], "steps=0 must be a positive integer"),
    (["--phase", "prefill", "--steps", "2"], "steps=2 applies to phase=decode only"),
    (["--phase", "mixed"], "phase=mixed batches prompts being prefilled with the decoding"),
    (["--phase", "decode", "--chunk", "8"], "chunk=8 applies to phase=mixed only"),
    (["--phase", "decode", "--kv_dtype", "int4"], "kv_dtype='int4' must be one of"),
    (["--phase", "prefill", "--context", "9"], "context=9 applies to phase=decode or mixed"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_serving_options_are_one_line_errors(tmp_path, args, message):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["generate", "--model", "debug", "--output_dir", str(out), *args]
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.output
    assert not Path(out).exists()


def test_training_traces_do_not_record_the_serving_options(registry):
    w = build(registry, model="gpt")
    assert "phase" not in w.metadata["options"] and "tokens" not in w.metadata


def test_decode_attention_splits_the_cache_over_the_sms():
    from stg.perf.kernel_time import attention_time
    from stg.perf.system import load_system

    gpu = load_system("h100-80g").gpu
    # one sequence, one kv head with 8 query rows, 4097 keys: Flash-Decoding splits the keys
    one = attention_time(gpu, "cudnn", 1, 1, 8, 4097, 128, causal=False)
    whole_sm = 4 * 128 * 4224 * 128 / (989.4e12 * 1.38 / 1.83 * 0.822 / 132)  # one CTA, all keys
    assert one < whole_sm / 10
    # training shapes (as many query rows as keys) keep the unsplit model
    assert attention_time(gpu, "cudnn", 1, 8, 4096, 4096, 128, causal=True) == pytest.approx(
        6.158076170530441e-05
    )


def test_a_written_decode_trace_predicts_as_the_generated_workload(tmp_path):
    import json

    out = tmp_path / "out"
    args = ["--model", "debug", "--phase", "decode", "--tp", "2", "--batch", "8", "--steps", "2"]
    made = CliRunner().invoke(
        app, ["generate", *args, "--output_dir", str(out), "--predict", "--json"]
    )
    assert made.exit_code == 0, made.output
    predictions = json.loads(made.stdout)["predictions"]
    serving = predictions["serving"]
    assert serving["time_per_output_token_s"] == pytest.approx(serving["time_s"] / 2)
    read = CliRunner().invoke(app, ["predict", str(out), "--json"])
    assert read.exit_code == 0, read.output
    time = json.loads(read.stdout)["time"]
    assert time["tokens_per_s"] == pytest.approx(predictions["time"]["tokens_per_s"])
    assert time["tokens_per_s"] == pytest.approx(8 * 2 / serving["time_s"])


@st.composite
def serving_options(draw) -> dict:
    model = draw(st.sampled_from(["gpt", "llama", "moe"]))
    phase = draw(st.sampled_from(["prefill", "decode", "mixed"]))
    kw: dict = dict(model=model, phase=phase, batch=16)
    kw.update({a: draw(st.sampled_from([1, 2])) for a in ("dp", "tp", "pp")})
    kw["ep"] = draw(st.sampled_from([1, 2])) if model == "moe" else 1
    kw["kv_dtype"] = draw(st.sampled_from([None, "fp8"]))
    kw["causal"] = draw(st.booleans())
    kw["attention"] = draw(st.sampled_from(["fused", "unfused"]))
    if phase == "prefill":
        kw["sp"] = draw(st.sampled_from([1, 2]))
    if phase == "decode":
        kw["steps"] = draw(st.sampled_from([1, 2]))
        kw["context"] = draw(st.sampled_from([7, 64]))
    if phase == "mixed":
        kw.update(prefill_batch=4, chunk=draw(st.sampled_from([8, 16])), context=40)
    else:
        kw["micro_batch"] = draw(st.sampled_from([8, 16]))
    return kw


@settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
)
@given(serving_options())
def test_random_serving_runs_validate_and_complete(registry, kw):
    try:
        w = build(registry, **kw)
    except UserError:
        assume(False)  # an invalid combination (degrees that do not divide, ...)
    report = validate_workload(w)
    assert report.ok, [v.message for v in report.errors[:3]]
    assert check_runs_to_completion(w) == sum(len(g) for g in w.ranks)
    assert predict_serving(w, "h100-80g")["time_s"] > 0


def test_context_parallel_prefill_gathers_the_cache_before_attention(registry):
    w = build(registry, model="llama", phase="prefill", sp=2, tp=2)
    nodes = w.rank_classes[0].nodes
    attention = next(n for n in nodes if "layer0/" in n.name and "attention" in n.attrs)
    gathers = [
        n.id
        for n in nodes
        if "layer0/" in n.name
        and n.comm_type is CollectiveType.ALL_GATHER
        and n.group_axes == ("sp",)
    ]
    assert len(gathers) == 2 and set(gathers) <= set(attention.data_deps)  # keys and values
    # each context-parallel rank keeps its half of the prompt's cache
    assert w.rank_classes[0].facts["kv_cache_bytes"] == 2 * L * (KVH // 2) * DH * (S // 2) * B * 2


class CachedLlama:
    """A plugin model that declares its cached state: Llama's keys (after RoPE) and values."""

    @staticmethod
    def attention(b, x):
        from stg.models.gpt import SOFTMAX_FLOPS

        tp = {"kvhead": "tp"}
        wq = b.weight("wq", "dmodel kvhead qgroup dhead", shard=tp)
        q = b.elementwise("rope_q", b.einsum("bsh,hgrk->bsgrk", x, wq, name="q"), flops=3)
        wk = b.weight("wk", "dmodel kvhead dhead", shard=tp)
        k = b.elementwise("rope_k", b.einsum("bsh,hgk->bsgk", x, wk, name="k"), flops=3)
        wv = b.weight("wv", "dmodel kvhead dhead", shard=tp)
        v = b.einsum("bsh,hgk->bsgk", x, wv, name="v")
        k, v = b.cached(k, "k"), b.cached(v)
        with b.tag("core_attention"):
            scores = b.einsum("bsgrk,btgk->bgrst", q, k, name="scores")
            probs = b.elementwise("softmax", scores, flops=SOFTMAX_FLOPS, reduce=(-1,))
            ctx = b.einsum("bgrst,btgk->bsgrk", probs, v, name="context")
        wo = b.weight("wo", "kvhead qgroup dhead dmodel", shard=tp)
        return b.residual(b.einsum("bsgrk,grkh->bsh", ctx, wo, name="attn_out"))

    @staticmethod
    def block(b, x):
        from stg.models import llama

        x = b.add(x, CachedLlama.attention(b, b.rmsnorm(x, "attention_norm")), name="residual1")
        return b.add(x, llama.mlp(b, b.rmsnorm(x, "ffn_norm")), name="residual2")

    @stg.hookimpl
    def stg_register_models(self, register):
        from stg.api import Model
        from stg.models import llama

        register(Model("cached-llama", llama.embedding, CachedLlama.block, llama.head))


def test_a_plugin_model_declares_its_cached_state(registry):
    """b.cached: training unchanged (the tensor itself); serving caches what it declares, with
    the generic rule's bytes and FLOPs (the appends are nodes of their own)."""
    plugin = load_registry(autoload=False, plugins=[CachedLlama()])
    train = build_workload(GenerateOptions(**SMALL, batch=B, model="cached-llama", tp=2), plugin)
    llama_train = build(registry, model="llama", tp=2)
    assert flops_by_root(train) == flops_by_root(llama_train)
    w = build_workload(
        GenerateOptions(**SMALL, batch=B, model="cached-llama", tp=2, phase="decode", context=50),
        plugin,
    )
    generic = build(registry, model="llama", tp=2, phase="decode", context=50)
    facts = w.rank_classes[0].facts
    assert facts["kv_cache_bytes"] == generic.rank_classes[0].facts["kv_cache_bytes"]
    assert facts["kv_cache_bytes"] == 2 * L * (KVH // 2) * DH * 51 * B * 2
    flops = flops_by_root(w)
    assert sum(flops.values()) == sum(flops_by_root(generic).values())
    assert flops["k.cache_append"] == flops["v.cache_append"] == B * KVH * DH * L
    assert validate_workload(w).ok
    assert check_runs_to_completion(w) == sum(len(g) for g in w.ranks)


def test_a_cached_tensor_needs_one_row_per_token(registry):
    class Bad(CachedLlama):
        @staticmethod
        def block(b, x):
            b.cached(b.weight("w", "dmodel dff"))
            return x

        @stg.hookimpl
        def stg_register_models(self, register):
            from stg.api import Model
            from stg.models import llama

            register(Model("bad-cache", llama.embedding, Bad.block, llama.head))

    plugin = load_registry(autoload=False, plugins=[Bad()])
    options = GenerateOptions(**SMALL, batch=B, model="bad-cache", phase="decode")
    with pytest.raises(UserError, match=r"cached\(w\): a cached tensor has one row per token"):
        build_workload(options, plugin)
