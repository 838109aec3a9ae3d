"""DeepSeek-V3's parts: multi-head latent attention's FLOPs against the closed form of
docs/presets.md, the stack of dense and MoE layers, and the memory predictor's parameters and
activations for latent attention, shared and routed experts and --dhead."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stg.core.modelinfo import model_parameters
from stg.core.options import GenerateOptions, resolve_model
from stg.core.pipeline import build_workload, symbol_values
from stg.core.routing import ACTIVE_EXPERTS_ATTR, EXPERT_WEIGHT_BYTES_ATTR
from stg.errors import UserError
from stg.host.registry import load_registry
from stg.predictors.memory import (
    activation_bytes_per_layer,
    count_parameters,
    predict_analytic,
    predict_memory,
    total_parameters,
)
from stg.testing import check_model

REGISTRY = load_registry(autoload=False)
TINY = dict(
    model="deepseek", dvocal=64, dmodel=32, dff=16, head=4, kvhead=4, dhead=8, seq=16,
    num_stacks=3, experts=4, kexperts=2, shared_experts=1, dense_layers=1, dense_dff=48,
    q_lora_rank=12, kv_lora_rank=16, drope=4, batch=2,
)  # fmt: skip
UP_PROJ_RECOMPUTE = dict(
    activation_recompute="selective", recompute_modules=("core_attn", "mla_up_proj")
)
MLP_RECOMPUTE = dict(activation_recompute="selective", recompute_modules=("mla_up_proj", "mlp"))
MLA_OPS = {
    "q_down", "q_norm", "q", "q_rope", "rope_q", "kv_latent", "kv_norm", "rope_k", "k", "v",
    "k_rope_expand", "scores", "scores_rope", "scores_sum", "softmax", "context", "attn_out",
}  # fmt: skip


def mla_forward_flops(o: GenerateOptions, causal: bool, expanded: bool = True) -> int:
    """docs/presets.md, "FLOPs of a latent attention layer" (B samples, tp 1); ``expanded``:
    with training's copy of the shared RoPE key to every head (serving keeps one key)."""
    B, s, h, a = o.batch, o.seq, o.dmodel, o.head
    d, r, c, q = o.dhead, o.drope, o.kv_lora_rank, o.q_lora_rank
    sigma = 0.5 if causal else 1
    projections = 2 * B * s * (h * q + q * a * (d + r) + h * (c + r) + 2 * c * a * d + a * d * h)
    core = 2 * B * a * s * s * sigma * (2 * d + r)
    elementwise = 4 * B * s * (q + c) + 3 * B * s * r * (a + 1) + 6 * B * a * s * s
    copy = B * s * a * r if expanded else 0  # k_rope_expand: one op per element written
    return int(projections + core + elementwise + copy)


def layer_forward_flops(workload, layer: int, ops: set[str] | None = None) -> int:
    prefix = f"mb0/layer{layer}/fwd/"
    return sum(
        node.num_ops
        for node in workload.ranks[0].nodes()
        if node.name.startswith(prefix) and (ops is None or node.name[len(prefix) :] in ops)
    )


@pytest.mark.parametrize("causal", [False, True])
def test_mla_flops_in_the_trace_are_the_closed_form(causal: bool) -> None:
    o = GenerateOptions(**TINY, causal=causal, attention="unfused")
    workload = build_workload(o, REGISTRY)
    expected = mla_forward_flops(o, causal)
    for layer in range(o.num_stacks):  # the dense layer 0 and the MoE layers share the MLA
        assert layer_forward_flops(workload, layer, MLA_OPS) == expected
    fused = build_workload(GenerateOptions(**TINY, causal=causal), REGISTRY)
    (core,) = [n for n in fused.ranks[0].nodes() if n.name == "mb0/layer0/fwd/core_attention"]
    B, s, a, d, r = o.batch, o.seq, o.head, o.dhead, o.drope
    # the kernel's head size is the mean of q·k's (d + r) and p·v's (d): 4·B·a·s²·(1 or 1/2)·that
    assert core.attrs["attention"] == (B, a, s, s, (2 * d + r) // 2, int(causal), 0)
    assert sum(n.num_ops for n in fused.ranks[0].nodes() if "/fwd/" in n.name) == sum(
        n.num_ops for n in workload.ranks[0].nodes() if "/fwd/" in n.name
    )


def test_deepseek_v3_mla_flops_per_token() -> None:
    """The closed form at DeepSeek-V3's sizes: 374.2 MFLOPs per token in the projections."""
    values, _ = resolve_model({"model": "deepseek-v3"}, REGISTRY)
    o = GenerateOptions(**{**values, "batch": 1})
    per_token = (
        2
        * o.seq
        * (7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 2 * 512 * 128 * 128 + 128 * 128 * 7168)
    )
    assert per_token / o.seq == 374_210_560
    core = 2 * 128 * o.seq * o.seq * (2 * 128 + 64)
    elementwise = 4 * o.seq * (1536 + 512) + 3 * o.seq * 64 * 129 + 6 * 128 * o.seq**2
    copy = o.seq * 128 * 64
    assert mla_forward_flops(o, causal=False) == per_token + core + elementwise + copy


def test_the_stack_is_dense_layers_then_moe_layers() -> None:
    workload = build_workload(GenerateOptions(**TINY), REGISTRY)
    names = {n.name for n in workload.ranks[0].nodes()}
    assert "mb0/layer0/fwd/gate" in names and "mb0/layer0/fwd/router" not in names
    for layer in (1, 2):
        assert {f"mb0/layer{layer}/fwd/router", f"mb0/layer{layer}/fwd/shared_gate"} <= names
    assert workload.ranks[0].rank_class.facts["layer_kinds"] == {"dense": 1, "moe": 2}
    # --num_stacks n keeps min(dense_layers, n - 1) dense layers: one MoE layer at least
    for stacks, kinds in ((1, {"moe": 1}), (2, {"dense": 1, "moe": 1})):
        o = GenerateOptions(**{**TINY, "num_stacks": stacks, "dense_layers": 3})
        facts = build_workload(o, REGISTRY).ranks[0].rank_class.facts
        assert facts["layer_kinds"] == kinds
    pipelined = build_workload(GenerateOptions(**{**TINY, "pp": 3}), REGISTRY)
    kinds = [c.facts["layer_kinds"] for c in pipelined.rank_classes]
    assert kinds == [{"dense": 1}, {"moe": 1}, {"moe": 1}]


def test_the_cached_latent_is_a_tensor_of_kv_lora_rank_plus_drope() -> None:
    o = GenerateOptions(**TINY)
    workload = build_workload(o, REGISTRY)
    (latent,) = [n for n in workload.ranks[0].nodes() if n.name == "mb0/layer0/fwd/kv_latent"]
    per_token = o.kv_lora_rank + o.drope
    assert latent.num_ops == 2 * o.batch * o.seq * o.dmodel * per_token
    assert latent.attrs["gemm"] == (1, o.batch * o.seq, per_token, o.dmodel)


@pytest.mark.parametrize(
    "plan",
    [dict(tp=2, ep=2, pp=2), dict(dp=2, tp=2, zero=1), dict(ep=2, weight_sharded=True)],
)
def test_parallel_plans_build_and_validate(plan: dict) -> None:
    dims = {k: v for k, v in TINY.items() if k != "model"}
    check_model("deepseek", **{**dims, "batch": 4, "micro_batch": 4, **plan})


def test_bad_mla_option_is_one_clear_error() -> None:
    with pytest.raises(UserError, match="kv_lora_rank=0 must be an integer >= 1"):
        build_workload(GenerateOptions(**{**TINY, "kv_lora_rank": 0}), REGISTRY)
    with pytest.raises(UserError, match="drope=3/2 must be a whole number"):
        build_workload(GenerateOptions(**{**TINY, "drope": None, "dhead": 3}), REGISTRY)


# -- the memory predictor ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "plan"),
    [
        ("deepseek-v3", dict(tp=2, ep=2, pp=3)),
        ("deepseek-v3", dict(ep=2, pp=2, mtp_depth=1)),
        ("deepseek-v3", dict(tp=2, ep=2, pp=2, **UP_PROJ_RECOMPUTE)),
        ("deepseek-v3", dict(tp=2, ep=2, pp=2, **MLP_RECOMPUTE)),
        ("deepseek-v3", dict(ep=4, pp=2, virtual_stages=2, pipeline_schedule="interleaved")),
        ("qwen3-moe-30b-a3b", dict(tp=2, ep=2, pp=2)),
        ("mixtral-8x7b", dict(tp=2, ep=2)),
        ("llama3-8b", dict(tp=2, pp=2, dhead=256)),
        ("gpt-7.5b", dict(tp=2, pp=2, dhead=64)),
    ],
)
def test_memory_parameters_are_what_the_generator_builds(name: str, plan: dict) -> None:
    """The predictor's closed forms (MLA, routed and shared experts, dense layers, --dhead)
    give every stage's parameters exactly as the generator counts them from the graph."""
    replicas = plan.get("ep", 1) * plan.get("dp", 1)
    given = {"model": name, "num_stacks": 8, "seq": 64, "batch": 4 * replicas,
             "micro_batch": replicas, **plan}  # fmt: skip
    o = GenerateOptions(**resolve_model(given, REGISTRY)[0])
    workload = build_workload(o, REGISTRY)
    analytic = count_parameters(o)
    for cls in workload.rank_classes:
        assert cls.facts["parameters"] == analytic[cls.stage].total, cls.stage
        assert cls.facts["layer_kinds"] == dict(analytic[cls.stage].kinds)
    by_file = predict_memory(workload, "h100-80g")["classes"]
    by_options = predict_analytic(o, "h100-80g")["classes"]
    for a, b in zip(by_file, by_options, strict=True):
        for key in ("weights", "gradients", "optimizer", "activations", "buffers"):
            assert a[key] == b[key], key


def test_deepseek_v3_total_parameters_in_the_memory_predictor() -> None:
    o = GenerateOptions(**resolve_model({"model": "deepseek-v3"}, REGISTRY)[0])
    counts = model_parameters(REGISTRY.models.get("deepseek"), o, symbol_values(o))
    assert total_parameters(o) == counts["parameters"] == 671_026_404_352


def test_mla_and_moe_activations_closed_form() -> None:
    """Bytes one rank keeps per layer (16-bit, no recompute, fused attention), tp 2 with
    sequence parallelism, ep 2: the docstring of activation_bytes_per_layer term by term."""
    o = GenerateOptions(**{**TINY, "tp": 2, "ep": 2, "batch": 4})
    s, b, h, a, t = o.seq, 2, o.dmodel, o.head, 2  # b: samples per replica (4 over ep 2)
    d, r, c, q, f = o.dhead, o.drope, o.kv_lora_rank, o.q_lora_rank, o.dff
    sb = s * b
    attention = 2 * (4 * sb * h / t + sb * a * (4 * d + 2 * r) / t + sb * (2 * q + 2 * (c + r)))
    attention += 4 * a * sb / t  # fp32 log-sum-exp per query row and head
    dense = 2 * 3 * sb * o.dense_dff / t
    capacity = -(-(4 * s * o.kexperts) // o.experts)  # global micro-batch tokens · k / E
    slots = o.experts * capacity / 2  # this rank's (E/ep experts, all their slots)
    moe = 2 * (slots * (2 * h + 3 * f / t) + 2 * sb * o.experts / t + 3 * sb * f / t)
    assert activation_bytes_per_layer(o, kind="dense") == pytest.approx(attention + dense)
    assert activation_bytes_per_layer(o, kind="moe") == pytest.approx(attention + moe)


# -- the time predictor -------------------------------------------------------------------------


def test_time_predictor_prices_balanced_experts_router_and_latent_attention() -> None:
    """Routed experts run as one batched GEMM of E/ep experts of ``capacity`` tokens each (a
    balanced load), the router as a GEMM over the experts plus a memory-bound top-k, and the
    fused MLA core at head size (2d + r)/2; model FLOPs are the trace's compute FLOPs."""
    from stg.api import attention_time, gemm_time, load_system
    from stg.predictors.time import compute_time, predict_time

    o = GenerateOptions(**{**TINY, "experts": 8, "batch": 4, "ep": 2, "tp": 2})
    workload = build_workload(o, REGISTRY)
    system = load_system("h800-80g")
    nodes = {n.name: n for n in workload.ranks[0].nodes() if n.name.startswith("mb0/layer1/fwd/")}
    capacity = -(-(o.batch * o.seq * o.kexperts) // o.experts)  # tokens per expert
    gate = nodes["mb0/layer1/fwd/expert_gate"]
    assert gate.attrs["gemm"] == (o.experts // 2, capacity, o.dff // 2, o.dmodel)
    expected = gemm_time(system.gpu, capacity, o.dff // 2, o.dmodel, "bf16", o.experts // 2)
    assert compute_time(gate, system) == pytest.approx(expected + system.kernel_overhead)
    router = nodes["mb0/layer1/fwd/router"]
    local_tokens = o.batch // 2 * o.seq // 2  # ep splits the batch, tp (with SP) the sequence
    assert router.attrs["gemm"] == (1, local_tokens, o.experts, o.dmodel)
    assert nodes["mb0/layer1/fwd/router_topk"].num_ops == 6 * local_tokens * o.experts
    core = nodes["mb0/layer1/fwd/core_attention"]
    heads, mean = o.head // 2, (2 * o.dhead + o.drope) // 2
    assert core.attrs["attention"] == (o.batch // 2, heads, o.seq, o.seq, mean, 0, 0)
    kernel = attention_time(system.gpu, "cudnn", o.batch // 2, heads, o.seq, o.seq, mean,
                            causal=False)  # fmt: skip
    assert compute_time(core, system) == pytest.approx(kernel + system.kernel_overhead)
    report = predict_time(workload, system)
    trace_flops = sum(n.num_ops for g in workload.ranks for n in g.nodes() if n.type.name == "COMP")
    assert report["model_flops"] == report["hardware_flops"] == trace_flops


def test_mla_bytes_in_the_trace_are_the_closed_form() -> None:
    """Bytes each MLA node moves (its tensor_size, bf16): a GEMM reads both operands and
    writes its output; the shared RoPE key is copied to every head (read once, written a
    times); the fused core reads Q, K, V, the RoPE query and that per-head RoPE key, writes
    the output and 4 bytes of softmax statistics per query row and head; tp 2 splits the
    heads, ep 2 the batch."""
    o = GenerateOptions(**{**TINY, "tp": 2, "ep": 2, "batch": 4, "tpsp": False})
    workload = build_workload(o, REGISTRY)
    nodes = {n.name.rsplit("/", 1)[1]: n for n in workload.ranks[0].nodes()
             if n.name.startswith("mb0/layer1/fwd/")}  # fmt: skip
    B, s, h, a = 2, o.seq, o.dmodel, o.head // 2  # this rank's samples and heads
    d, r, c, q = o.dhead, o.drope, o.kv_lora_rank, o.q_lora_rank
    tokens = B * s
    gemms = {  # (m, k, n) of each projection on this rank
        "q_down": (tokens, h, q),
        "q": (tokens, q, a * d),
        "q_rope": (tokens, q, a * r),
        "kv_latent": (tokens, h, c + r),
        "k": (tokens, c, a * d),
        "v": (tokens, c, a * d),
        "attn_out": (tokens, a * d, h),
    }
    for name, (m, k, n) in gemms.items():
        assert nodes[name].tensor_size == 2 * (m * k + k * n + m * n), name
    assert nodes["k_rope_expand"].tensor_size == 2 * tokens * (r + a * r)
    core = 2 * tokens * (4 * a * d + 2 * a * r) + 4 * B * a * s
    assert nodes["core_attention"].tensor_size == core


# -- multi-token prediction ---------------------------------------------------------------------


def test_multi_token_prediction_flops_and_parameters_apart() -> None:
    """--mtp_depth 1 adds to the head, and only there: the embedding's copy, 3 norms, the
    2h-to-h projection and one MoE layer (parameters); that MoE layer's FLOPs, the
    projection, the embedding lookup and concat, the norms, the second LM head and loss."""
    plain = GenerateOptions(**TINY)
    mtp = GenerateOptions(**{**TINY, "mtp_depth": 1})
    model = REGISTRY.models.get("deepseek")
    base = model_parameters(model, plain, symbol_values(plain))
    more = model_parameters(model, mtp, symbol_values(mtp))
    h, V, T = plain.dmodel, plain.dvocal, plain.batch * plain.seq
    moe_layer = model_parameters(model, GenerateOptions(**{**TINY, "num_stacks": 1}),
                                 symbol_values(plain))["parameters"] - 2 * V * h - h  # fmt: skip
    assert more["parameters"] - base["parameters"] == V * h + 3 * h + 2 * h * h + moe_layer
    with_mtp, without = build_workload(mtp, REGISTRY), build_workload(plain, REGISTRY)

    def forward(workload, prefix):
        return sum(n.num_ops for n in workload.ranks[0].nodes() if n.name.startswith(prefix))

    layer = forward(without, "mb0/layer2/fwd/")  # a MoE layer
    extra = forward(with_mtp, "mb0/head/fwd/") - forward(without, "mb0/head/fwd/")
    # projection 2T·2h·h, LM head 2T·h·V, loss 5T·V, 3 norms 12T·h, lookup and concat 3T·h,
    # the sum of the losses T
    projection, lm_head = 2 * T * 2 * h * h, 2 * T * h * V
    assert extra == layer + projection + lm_head + 5 * T * V + 12 * T * h + 3 * T * h + T
    assert forward(with_mtp, "mb0/layer") == forward(without, "mb0/layer")


def test_deepseek_v3_multi_token_prediction_module_size() -> None:
    """V3's MTP module (depth 1): 12.54e9 parameters in stg (the released checkpoint's 14B,
    685B - 671B, also stores a copy of the LM head, which stg's module shares)."""
    o = GenerateOptions(**resolve_model({"model": "deepseek-v3", "mtp_depth": 1}, REGISTRY)[0])
    counts = model_parameters(REGISTRY.models.get("deepseek"), o, symbol_values(o))
    module = counts["parameters"] - 671_026_404_352
    assert module == 129280 * 7168 + 3 * 7168 + 2 * 7168**2 + 11_507_286_016
    assert abs(module + 129280 * 7168 - 14e9) / 14e9 < 0.04
    assert total_parameters(o) == counts["parameters"]


# -- serving: the cached latent and absorbed decode -------------------------------------------

MLA_DECODE_OPS = {
    "q_down", "q_norm", "q", "q_rope", "rope_q", "kv_latent", "kv_norm", "rope_k",
    "c_kv.cache_append", "k_rope.cache_append", "q_absorb", "scores", "scores_rope",
    "scores_sum", "softmax", "context", "v_absorb", "attn_out",
}  # fmt: skip


def mla_decode_flops(o: GenerateOptions, sequences: int, length: int, tp: int = 1) -> int:
    """docs/presets.md, "FLOPs of an MLA decode step": one new token for each of B sequences
    against L = context + 1 cached latents, W_UK and W_UV absorbed (a heads per tp rank)."""
    B, L, h, a = sequences, length, o.dmodel, o.head // tp
    d, r, c, q = o.dhead, o.drope, o.kv_lora_rank, o.q_lora_rank
    projections = 2 * B * (h * q + q * a * (d + r) + h * (c + r) + 2 * a * c * d + a * d * h)
    core = 2 * B * a * L * (2 * c + r)
    elementwise = 4 * B * (q + c) + 3 * B * r * (a + 1) + 6 * B * a * L + B * (c + r)
    return projections + core + elementwise


@pytest.mark.parametrize("tp", [1, 2])
def test_mla_decode_flops_are_the_absorbed_closed_form(tp: int) -> None:
    ctx, B = 40, 8
    o = GenerateOptions(**{**TINY, "batch": B, "phase": "decode", "context": ctx, "tp": tp})
    unfused = build_workload(replace(o, attention="unfused"), REGISTRY)
    expected = mla_decode_flops(o, B, ctx + 1, tp)
    for layer in range(o.num_stacks):  # the dense layer and the MoE layers
        assert layer_forward_flops(unfused, layer, MLA_DECODE_OPS) == expected
    fused = build_workload(o, REGISTRY)
    assert layer_forward_flops(fused, 1) == layer_forward_flops(unfused, 1)
    (core,) = [n for n in fused.ranks[0].nodes() if n.name == "mb0/layer1/fwd/core_attention"]
    # the MQA-like kernel: every head of a sequence is a query row against one latent head of
    # kv_lora_rank + drope (q·k) and kv_lora_rank (p·v): mean head size (2c + r) / 2
    a, c, r = o.head // tp, o.kv_lora_rank, o.drope
    assert core.attrs["attention"] == (B, 1, a, ctx + 1, (2 * c + r) // 2, 0, 0)
    names = {n.name.rsplit("/", 1)[1] for n in fused.ranks[0].nodes() if "/layer1/" in n.name}
    assert {"q_absorb", "v_absorb"} <= names and not {"k", "v"} & names  # no up-projection


@pytest.mark.parametrize("kv_dtype,width", [(None, 2), ("fp8", 1)])
def test_mla_kv_cache_bytes_closed_form(kv_dtype: str | None, width: int) -> None:
    """KV cache = layers·(kv_lora_rank + drope)·context·sequences·bytes: the latent, the same
    on every tp rank (not divided by tp), the sequences split over the dp·ep replicas."""
    ctx, steps, B = 100, 3, 8
    o = GenerateOptions(**{**TINY, "batch": B, "phase": "decode", "context": ctx, "steps": steps,
                           "tp": 2, "ep": 2, "kv_dtype": kv_dtype})  # fmt: skip
    w = build_workload(o, REGISTRY)
    facts = w.rank_classes[0].facts
    per_token = o.num_stacks * (o.kv_lora_rank + o.drope) * (B // 2) * width
    assert facts["kv_cache_bytes_per_step"] == [per_token * (ctx + i) for i in (1, 2, 3)]
    (cls,) = predict_memory(w, "h100-80g")["classes"]
    assert cls["kv_cache"] == per_token * (ctx + steps)
    per_stage = build_workload(replace(o, pp=3, micro_batch=B), REGISTRY).rank_classes
    assert [c.facts["kv_cache_bytes"] for c in per_stage] == [per_token // 3 * (ctx + steps)] * 3


def test_one_mla_decode_step_reads_every_weight_once_and_the_latent_cache_once() -> None:
    """... every weight but the routed experts no token of the step reaches."""
    ctx, B, tp, ep = 60, 8, 2, 2
    o = GenerateOptions(**{**TINY, "batch": B, "phase": "decode", "context": ctx, "tp": tp,
                           "ep": ep})  # fmt: skip
    rank = build_workload(o, REGISTRY).rank_classes[0]
    h, a, d, r, c, q = o.dmodel, o.head // tp, o.dhead, o.drope, o.kv_lora_rank, o.q_lora_rank
    E, f, V = o.experts, o.dff, o.dvocal
    attention = h * q + q * a * (d + r) + h * (c + r) + 2 * c * a * d + a * d * h
    dense = 3 * h * o.dense_dff // tp
    moe = h * E + E // ep * 3 * h * f // tp + 3 * h * f // tp  # router, routed, shared
    weights = 3 * attention + dense + 2 * moe + V * h // tp  # the LM head
    gemm_weights = cache_read = appended = unread = 0
    seqs = B // ep
    share = 1 - (1 - o.kexperts / E) ** B  # the experts the step's B tokens reach
    for n in rank.nodes:
        if "gemm" in n.attrs:
            batch, m, nn, k = n.attrs["gemm"]
            gemm_weights += n.tensor_size - 2 * batch * (m * k + m * nn)  # minus activations
        if ACTIVE_EXPERTS_ATTR in n.attrs:  # the weights of experts no token reaches
            assert n.attrs[ACTIVE_EXPERTS_ATTR] == pytest.approx(E // ep * share)
            unread += round(n.attrs[EXPERT_WEIGHT_BYTES_ATTR] * (1 - share))
        if "attention" in n.attrs:
            q_and_out = 2 * seqs * a * (c + r + c)  # latent query, RoPE query, latent output
            cache_read += n.tensor_size - q_and_out - 4 * seqs * a
        if n.name.endswith(".cache_append"):
            appended += n.tensor_size
    assert 0 < unread < 2 * (2 * E // ep * 3 * h * f // tp)  # routed weights, 2 MoE layers
    assert gemm_weights + unread == 2 * weights
    latent = o.num_stacks * (c + r) * seqs * 2
    assert cache_read == latent * (ctx + 1) == rank.facts["kv_cache_bytes"]
    assert appended == 2 * latent  # the new token's latent read, then written into the cache


def test_mla_prefill_up_projects_the_cached_latent() -> None:
    """Prefill keeps the trained form (keys and values up-projected from the latent it caches,
    the one shared RoPE key read from the cache as it is): the FLOPs of training's forward
    closed form without the key's copy, plus one op per cached element."""
    o = GenerateOptions(**{**TINY, "batch": 4, "phase": "prefill", "attention": "unfused"})
    w = build_workload(o, REGISTRY)
    appends = o.batch * o.seq * (o.kv_lora_rank + o.drope)
    ops = MLA_OPS | {"c_kv.cache_append", "k_rope.cache_append"}
    expected = mla_forward_flops(o, causal=False, expanded=False) + appends
    assert layer_forward_flops(w, 0, ops) == expected
    assert w.rank_classes[0].facts["kv_cache_bytes"] == o.num_stacks * appends * 2


def test_serving_builds_the_stack_with_the_generator_parameters() -> None:
    o = GenerateOptions(**{**TINY, "batch": 4, "phase": "decode", "tp": 2, "pp": 3})
    w = build_workload(o, REGISTRY)
    analytic = count_parameters(replace(o, phase="training"))
    for cls in w.rank_classes:
        assert cls.facts["parameters"] == analytic[cls.stage].total
        assert cls.facts["layer_kinds"] == dict(analytic[cls.stage].kinds)
    names = {n.name for n in w.ranks[0].nodes()}
    assert "mb0/layer0/fwd/gate" in names and "mb0/layer0/fwd/router" not in names


def test_the_mtp_embedding_waits_for_its_micro_batch_and_the_pipeline_replays_periodically():
    """The multi-token prediction's embedding needs no activation, yet runs when its
    micro-batch reaches the head (after the last stage receives it), not at the start of
    the iteration: so a 1F1B pipeline with MTP repeats after its fill, and the periodic
    replay of a lowered workload gives the whole replay's iteration (within 1e-9)."""
    from stg.predictors.time import predict_time_options

    o = GenerateOptions(
        **{**TINY, "num_stacks": 8, "mtp_depth": 1, "pp": 4, "batch": 64, "micro_batch": 2}
    )
    workload = build_workload(replace(o, batch=8), REGISTRY)
    last = workload.rank_classes[-1]
    names = {n.id: n.name for n in last.nodes}
    embedding = next(n for n in last.nodes if n.name == "mb1/head/fwd/mtp1_embedding")
    waits = [names[d] for d in (*embedding.data_deps, *embedding.ctrl_deps)]
    assert waits and all(w.startswith("mb1/") for w in waits), waits
    fast = predict_time_options(o, "h100-80g", registry=REGISTRY)
    whole = predict_time_options(o, "h100-80g", registry=REGISTRY, exact=True)
    assert fast["replay"]["kind"] == "periodic"
    assert fast["iteration_time_s"] == pytest.approx(whole["iteration_time_s"], rel=1e-9)
