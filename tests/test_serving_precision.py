"""Serving weight formats (stg.core.quantization): weights stored at their width with their
scales, the bytes a decode step reads, the memory report, the GEMM prices, and refusals."""

from __future__ import annotations

import json
from math import ceil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.quantization import DTYPE_BITS, WEIGHT_FORMATS, Scaling
from stg.errors import UserError
from stg.host.registry import load_registry
from stg.perf.costs import compute_time, serving_gemm_dtype
from stg.perf.kernel_time import attention_kernel_for, attention_time, gemm_time
from stg.perf.system import load_system, normalize_dtype
from stg.predictors.memory import predict_memory
from stg.predictors.serving import predict_serving

H, F, HEADS, KVH, L, V = 256, 1024, 8, 2, 2, 1024
DH = H // HEADS
SMALL = dict(
    model="llama", dvocal=V, dmodel=H, dff=F, head=HEADS, kvhead=KVH, num_stacks=L, seq=128
)
LINEAR = ("q", "k", "v", "attn_out", "gate", "up", "down")
# (k, n) of each linear layer's weight: k is what the matmul reduces over
SHAPES = {
    "q": (H, HEADS * DH),
    "k": (H, KVH * DH),
    "v": (H, KVH * DH),
    "attn_out": (HEADS * DH, H),
    "gate": (H, F),
    "up": (H, F),
    "down": (F, H),
}


@pytest.fixture(scope="module")
def registry():
    return load_registry(autoload=False)


def plan(value: str, ops=LINEAR) -> tuple[tuple[str, str], ...]:
    return tuple((op, value) for op in ops)


def decode(registry, precision=(), **kw):
    options = dict(SMALL, phase="decode", batch=8, context=512, precision=precision)
    return build_workload(GenerateOptions(**{**options, **kw}), registry)


def scale_bytes(scaling: Scaling, k: int, n: int) -> int:
    """The scales of a ``[k, n]`` weight, from the format's definition."""
    if scaling.block is None:
        count = 1
    elif scaling.block == 0:
        count = n
    else:
        count = n * ceil(k / scaling.block)
    return ceil(count * scaling.bits / 8) + scaling.tensor_bits // 8


def stored_layer_bytes(name: str) -> int:
    """One layer's linear weights stored in format ``name``, scales included."""
    fmt = WEIGHT_FORMATS[name]
    return sum(
        k * n * DTYPE_BITS[fmt.weight_dtype] // 8 + scale_bytes(fmt.weight_scaling, k, n)
        for k, n in SHAPES.values()
    )


LINEAR_PARAMS = sum(k * n for k, n in SHAPES.values())


def test_scales_follow_each_format_definition():
    # NVFP4: an fp8 E4M3 scale per 16 elements and an fp32 one per tensor; MX: an E8M0 per 32
    assert WEIGHT_FORMATS["nvfp4"].weight_scaling.nbytes(4096 * 128, 4096) == 128 * 256 + 4
    assert WEIGHT_FORMATS["mxfp8"].weight_scaling.nbytes(4096 * 128, 4096) == 128 * 128
    assert WEIGHT_FORMATS["mxfp4"].weight_scaling.nbytes(4096 * 128, 4096) == 128 * 128
    assert WEIGHT_FORMATS["w4a16"].weight_scaling.nbytes(4096 * 128, 4096) == 128 * 32 * 2
    assert WEIGHT_FORMATS["int8"].weight_scaling.nbytes(4096 * 128, 4096) == 128 * 4
    assert WEIGHT_FORMATS["fp8"].weight_scaling.nbytes(4096 * 128, 4096) == 4


@pytest.mark.parametrize("name", list(WEIGHT_FORMATS))
def test_decode_step_reads_weights_at_their_stored_width(registry, name):
    """The bytes a decode step must read: the linear weights at the format's width with their
    scales, the other weights (embedding, norms, head) in bf16, and the KV cache."""
    base = decode(registry).rank_classes[0].facts
    stored = decode(registry, plan(name)).rank_classes[0].facts
    expected = base["weight_bytes"] - L * LINEAR_PARAMS * 2 + L * stored_layer_bytes(name)
    assert stored["weight_bytes"] == expected
    assert stored["kv_cache_bytes_per_step"] == base["kv_cache_bytes_per_step"]
    h100 = load_system("h100-80g")
    report = predict_serving(decode(registry, plan(name)), h100)
    kv = 2 * L * KVH * DH * (512 + 1) * 8 * 2  # keys and values, bf16, 8 sequences
    assert stored["kv_cache_bytes_per_step"] == [kv]
    assert report["bandwidth"]["weight_bytes_per_rank"] == expected
    assert report["memory_bandwidth_bound_s"] == pytest.approx((expected + kv) / 3.35e12)


@pytest.mark.parametrize("name", list(WEIGHT_FORMATS))
def test_memory_predictor_holds_weights_at_their_stored_width(registry, name):
    base = predict_memory(decode(registry), "h100-80g")["classes"][0]["weights"]
    memory = predict_memory(decode(registry, plan(name)), "h100-80g")["classes"][0]
    assert memory["weights"] == base - L * LINEAR_PARAMS * 2 + L * stored_layer_bytes(name)


def nodes(workload, layer=0):
    return {
        n.name.rsplit("/", 1)[-1]: n
        for n in workload.rank_classes[0].nodes
        if f"layer{layer}/" in n.name
    }


@pytest.mark.parametrize("name", list(WEIGHT_FORMATS))
def test_no_weight_is_cast_and_activations_are_quantized_with_their_scales(registry, name):
    fmt = WEIGHT_FORMATS[name]
    found = nodes(decode(registry, plan(name)))
    assert not [n for n in found if ".cast_w" in n]  # weights are stored, never cast
    casts = {n: node for n, node in found.items() if ".cast_" in n}
    if fmt.weight_only:
        assert not casts
        return
    assert set(casts) == {f"{op}.cast_{src}" for op, src in ACTIVATION_SOURCES.items()}
    for op, (k, n) in SHAPES.items():
        node = found[op]
        assert node.attrs["weight_dtype"] == fmt.weight_dtype
        assert node.dtype == fmt.activation_dtype
        tokens = 8
        assert fmt.activation_scaling is not None
        activation = tokens * k * DTYPE_BITS[fmt.activation_dtype] // 8 + scale_bytes(
            fmt.activation_scaling, k, tokens
        )
        weight = k * n * DTYPE_BITS[fmt.weight_dtype] // 8 + scale_bytes(fmt.weight_scaling, k, n)
        assert node.tensor_size == activation + weight + tokens * n * 2
        cast = found[f"{op}.cast_{ACTIVATION_SOURCES[op]}"]
        assert cast.attrs["quantize"] == fmt.activation_dtype
        assert cast.tensor_size == tokens * k * 2 + activation


ACTIVATION_SOURCES = {
    "q": "attention_norm",
    "k": "attention_norm",
    "v": "attention_norm",
    "attn_out": "context",
    "gate": "ffn_norm",
    "up": "ffn_norm",
    "down": "swiglu",
}


def test_weight_only_gemm_computes_in_16_bits_and_reads_int4(registry):
    """W4A16: the GEMM runs at the bf16 rate and moves the int4 weight, its fp16 group scales,
    the bf16 activation and output."""
    node = nodes(decode(registry, plan("w4a16")))["down"]
    k, n = SHAPES["down"]
    assert node.dtype == "bf16" and node.attrs["weight_dtype"] == "int4"
    assert node.tensor_size == 8 * k * 2 + k * n // 2 + n * ceil(k / 128) * 2 + 8 * n * 2
    h100 = load_system("h100-80g")
    expected = gemm_time(h100.gpu, 8, n, k, "bf16", 1, node.tensor_size) + h100.kernel_overhead
    assert compute_time(node, h100) == pytest.approx(expected)


def test_fp4_gemm_runs_at_the_fp4_peak_where_the_gpu_has_it(registry):
    node = nodes(decode(registry, plan("nvfp4"), batch=4096))["gate"]
    b200, h100 = load_system("b200-180g"), load_system("h100-80g")
    _, m, n, k = node.attrs["gemm"]
    assert node.dtype == "fp4"
    fp4 = gemm_time(b200.gpu, m, n, k, "fp4", 1, node.tensor_size) + b200.kernel_overhead
    assert compute_time(node, b200) == pytest.approx(fp4)
    # an H100 has no fp4 tensor cores: the weight-only path (Marlin), at the bf16 rate
    bf16 = gemm_time(h100.gpu, m, n, k, "bf16", 1, node.tensor_size) + h100.kernel_overhead
    assert compute_time(node, h100) == pytest.approx(bf16)
    assert gemm_time(b200.gpu, m, n, k, "fp4") < gemm_time(b200.gpu, m, n, k, "fp8")
    quantize = nodes(decode(registry, plan("nvfp4"), batch=4096))["gate.cast_ffn_norm"]
    assert compute_time(quantize, h100) == 0.0  # weight-only: activations stay bf16
    assert compute_time(quantize, b200) > 0.0


def test_which_gpu_runs_what():
    assert serving_gemm_dtype(load_system("b200-180g"), "fp4", "bf16") == "fp4"
    assert serving_gemm_dtype(load_system("h100-80g"), "fp8", "bf16") == "fp8"
    assert serving_gemm_dtype(load_system("h100-80g"), "fp4", "bf16") == "bf16"
    assert serving_gemm_dtype(load_system("a100-80g"), "fp8", "bf16") == "bf16"
    assert serving_gemm_dtype(load_system("mi300x-192g"), "fp8", "bf16") == "fp8"
    assert serving_gemm_dtype(load_system("mi355x-288g"), "fp4", "bf16") == "fp4"
    for system, dtype in (("v100-32g", "fp8"), ("t4-16g", "fp4"), ("mi300x-192g", "fp4")):
        with pytest.raises(UserError, match="weight formats it runs: "):
            serving_gemm_dtype(load_system(system), dtype, "bf16")


def test_fp4_is_a_dtype_name_of_nodes_only():
    assert normalize_dtype("e2m1") == normalize_dtype("FP4") == "fp4"
    with pytest.raises(UserError, match=r"allowed: .*fp4"):
        normalize_dtype("fp3")


def test_llama3_8b_decode_is_faster_with_fp8_weights_than_bf16(registry):
    """The issue's case: an fp8 plan on the linear layers of a Llama 3 8B decode step (batch
    64, context 4096, H100) read 16.06 GB of bf16 weights and cast them every step (18.2 ->
    31.2 ms); served fp8 weights are read at one byte and never cast."""
    options = dict(
        model="llama",
        dvocal=128256,
        dmodel=4096,
        dff=14336,
        head=32,
        kvhead=8,
        num_stacks=32,
        phase="decode",
        batch=64,
        seq=4096,
    )
    bf16 = build_workload(GenerateOptions(**options), registry)
    fp8 = build_workload(GenerateOptions(**options, precision=plan("fp8")), registry)
    h100 = load_system("h100-80g")
    before, after = predict_serving(bf16, h100), predict_serving(fp8, h100)
    linear = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    weights = before["bandwidth"]["weight_bytes_per_rank"]
    assert weights == pytest.approx(16.06e9, rel=1e-3)
    assert after["bandwidth"]["weight_bytes_per_rank"] == weights - linear + 32 * 7 * 4
    assert after["time_per_output_token_s"] < before["time_per_output_token_s"]
    assert after["memory_bandwidth_bound_s"] < before["memory_bandwidth_bound_s"]


def write_plan(tmp_path: Path, value: str) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"ops": dict(plan(value))}))
    return path


def one_line_error(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def test_a_gpu_that_cannot_run_a_format_is_refused(tmp_path):
    small = ["--model", "llama", "--dmodel", "256", "--dff", "1024", "--head", "8"]
    small += ["--kvhead", "2", "--num_stacks", "2", "--dvocal", "1024"]
    small += ["--phase", "decode", "--batch", "8", "--seq", "128", "--system", "v100-32g"]
    line = one_line_error(
        ["predict", *small, "--precision_plan", str(write_plan(tmp_path, "nvfp4"))]
    )
    assert "v100-32g" in line and "weight formats it runs: int8, w4a16" in line


def test_a_training_plan_refuses_serving_formats(tmp_path):
    out = tmp_path / "out"
    plan_file = str(write_plan(tmp_path, "nvfp4"))
    line = one_line_error(
        ["generate", "--model", "debug", "--output_dir", str(out), "--precision_plan", plan_file]
    )
    assert "serving weight format" in line and "bf16" in line
    assert not out.exists()


def test_plan_precision_dtypes_refuse_fp4():
    line = one_line_error(["plan", "precision", "--model", "debug", "--dtypes", "bf16,fp4"])
    assert "fp4" in line and "allowed: fp32, tf32, bf16, fp16, fp8, int8" in line


def prefill_attention(registry, precision=(), kv_dtype=None):
    options = dict(SMALL, phase="prefill", batch=4, seq=4096, head=8, kvhead=8)
    workload = build_workload(
        GenerateOptions(**options, precision=precision, kv_dtype=kv_dtype), registry
    )
    return next(n for n in workload.rank_classes[0].nodes if "attention" in (n.attrs or {}))


FP8_ATTENTION = (("scores", "fp8"), ("context", "fp8"))


def test_fp8_attention_reads_an_fp8_cache_and_computes_at_the_fp8_rate(registry):
    """FP8 attention in serving (FlashAttention-3, FlashInfer): the query quantized, the fp8
    cache read as stored, the kernel at the fp8 peak on GPUs with fp8 tensor cores."""
    fp8 = prefill_attention(registry, FP8_ATTENTION, kv_dtype="fp8")
    cache_only = prefill_attention(registry, kv_dtype="fp8")
    assert fp8.dtype == "fp8" and fp8.attrs["attention_dtype"] == "fp8"
    assert "attention_dtype" not in cache_only.attrs
    h100, a100 = load_system("h100-80g"), load_system("a100-80g")
    shape = fp8.attrs["attention"]
    impl = attention_kernel_for(h100.arch, "megatron")
    expected = attention_time(h100.gpu, impl, *shape[:5], causal=False, dtype="fp8")
    assert compute_time(fp8, h100) == pytest.approx(expected + h100.kernel_overhead)
    assert compute_time(fp8, h100) < 0.6 * compute_time(cache_only, h100)
    # an A100 has no fp8 tensor cores: its attention computes in bf16
    assert compute_time(fp8, a100) == pytest.approx(compute_time(cache_only, a100))


def test_fp8_attention_needs_an_fp8_cache(registry):
    with pytest.raises(UserError, match="give --kv_dtype fp8"):
        prefill_attention(registry, FP8_ATTENTION)
    with pytest.raises(UserError, match="attention core takes a dtype"):
        prefill_attention(registry, (("scores", "nvfp4"),), kv_dtype="fp8")


@pytest.mark.parametrize("phase", ["prefill", "mixed"])
def test_every_serving_phase_stores_the_weights(registry, phase):
    """Prefill and mixed iterations read the same stored weights as a decode step, and a
    mixed iteration's merged GEMM reads the weight (and its scales) once."""
    extra = dict(prefill_batch=2, chunk=64) if phase == "mixed" else {}
    options = dict(SMALL, phase=phase, batch=8, **extra)
    base = build_workload(GenerateOptions(**options), registry).rank_classes[0].facts
    workload = build_workload(GenerateOptions(**options, precision=plan("nvfp4")), registry)
    facts = workload.rank_classes[0].facts
    expected = base["weight_bytes"] - L * LINEAR_PARAMS * 2 + L * stored_layer_bytes("nvfp4")
    assert facts["weight_bytes"] == expected
    down = nodes(workload)["down"]
    k, n = SHAPES["down"]
    tokens = down.attrs["gemm"][1]
    fmt = WEIGHT_FORMATS["nvfp4"]
    assert fmt.activation_scaling is not None
    activation = tokens * k // 2 + scale_bytes(fmt.activation_scaling, k, tokens)
    # a mixed iteration merges the two groups' GEMMs: each group's activation keeps its own
    # per-tensor fp32 scale (4 bytes)
    activation += 4 if phase == "mixed" else 0
    weight = k * n // 2 + scale_bytes(fmt.weight_scaling, k, n)
    assert down.tensor_size == activation + weight + tokens * n * 2


def test_fp8_attention_keeps_a_sliding_window(registry):
    """FP8 attention reads only the keys its window reaches, as bf16 attention does: the
    window's fraction and the cache's span hold on the fp8 path too."""

    def decode_attention(precision):
        options = dict(
            SMALL, phase="decode", batch=4, context=2048, head=8, kvhead=8, causal=True,
            attention_window=64,
        )  # fmt: skip
        workload = build_workload(
            GenerateOptions(**options, precision=precision, kv_dtype="fp8"), registry
        )
        return next(n for n in workload.rank_classes[0].nodes if "attention" in (n.attrs or {}))

    fp8, plain = decode_attention(FP8_ATTENTION), decode_attention(())
    assert fp8.attrs["attention_window"] == plain.attrs["attention_window"] == 64
    # (batch, heads, queries, keys, ...): 64 keys, not the 2,048 of the cache
    assert fp8.attrs["attention"] == plain.attrs["attention"] and plain.attrs["attention"][3] == 64
