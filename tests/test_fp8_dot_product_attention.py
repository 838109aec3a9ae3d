"""``--fp8_attention``: Transformer Engine's fp8 dot-product attention (``fp8_dpa``) in training.

The fused attention nodes run in fp8 (per-tensor scales, or MXFP8 under the ``mxfp8`` recipe),
carry the bytes of their casts, and are priced at cuDNN's measured fp8 speed over bf16
(``stg.perf.kernel_time.FP8_ATTENTION_SPEED``) plus those casts; refused plans get one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from consumers import assert_trace_checks_out_and_predicts_as_options
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.recipes import FP8_ATTENTION_CAST_KERNELS
from stg.host.registry import load_registry
from stg.perf.costs import compute_time, memory_bound_time
from stg.perf.kernel_time import FP8_ATTENTION_SPEED, attention_time
from stg.perf.system import load_system
from stg.predictors.time import predict_time_options

BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 1024, 8, 2, 128
LLAMA = dict(
    model="llama", dmodel=HEADS * HEAD_DIM, dff=2048, head=HEADS, kvhead=KV_HEADS,
    num_stacks=2, seq=SEQ, dvocal=2048, dp=1, batch=BATCH, micro_batch=BATCH,
    dtype="fp8", mixed_precision=True, causal=True, low_precision_recipe="tensorwise",
)  # fmt: skip
LONG = {**LLAMA, "dmodel": 4096, "head": 32, "kvhead": 8, "seq": 8192, "num_stacks": 1}


def _attention_nodes(options: dict) -> list:
    workload = build_workload(GenerateOptions(**options), load_registry(autoload=False))
    (rank_class,) = workload.rank_classes
    return [n for n in rank_class.nodes if "attention" in (n.attrs or {})]


@pytest.mark.parametrize(("recipe", "scaling"), [("tensorwise", "fp8"), ("mxfp8", "mxfp8")])
def test_attention_nodes_run_in_fp8_with_their_casts(recipe: str, scaling: str) -> None:
    """Each attention node is fp8, names its scaling, and its casts move 3 bytes per element
    of Q, K, V and the output (forward) or of dO, dQ, dK, dV (backward): 2 B read and 1 B
    written per element in, 1 B read and 2 B written out."""
    nodes = _attention_nodes({**LLAMA, "low_precision_recipe": recipe, "fp8_attention": True})
    q = o = BATCH * SEQ * HEADS * HEAD_DIM
    kv = BATCH * SEQ * KV_HEADS * HEAD_DIM
    casts = 3 * (q + 2 * kv + o)
    assert len(nodes) == 2 * LLAMA["num_stacks"]  # a forward and a backward per layer
    for node in nodes:
        assert node.dtype == "fp8"
        assert node.attrs["attention_dtype"] == "fp8"
        assert node.attrs["attention_scaling"] == scaling
        assert node.attrs["attention_casts"] == casts  # dQ, dK, dV and dO the same sizes
    plain = _attention_nodes(LLAMA)
    assert plain and all("attention_casts" not in n.attrs for n in plain)
    assert all("attention_dtype" not in n.attrs for n in plain)


def test_gb200_prices_the_measured_speed_and_the_casts() -> None:
    """On a GB200 an fp8 attention node costs the bf16 kernel's time over cuDNN's measured fp8
    speed-up, plus its casts at the fused cast's rate. At 8k tokens of 32 heads the step gets
    faster; at this file's 1k tokens of 8 heads the casts' launches outweigh the saving."""
    system = load_system("gb200-nvl72")
    gpu = system.gpu
    fp8 = _attention_nodes({**LLAMA, "fp8_attention": True})
    for node in fp8:
        shape = node.attrs["attention"]
        backward = bool(shape[6])
        kernel = attention_time(
            gpu, "cudnn", *shape[:5], causal=bool(shape[5]), backward=backward, dtype="fp8"
        )
        plain = attention_time(gpu, "cudnn", *shape[:5], causal=bool(shape[5]), backward=backward)
        speed = FP8_ATTENTION_SPEED["10.0"]["fp8"][int(backward)]
        assert 0.9 * speed < plain / kernel <= speed
        casts = memory_bound_time(gpu, node.attrs["attention_casts"], "quantize")
        casts += FP8_ATTENTION_CAST_KERNELS * system.kernel_overhead
        launch = system.kernel_overhead  # the attention kernel's own
        assert compute_time(node, system, "fp8") == pytest.approx(kernel + casts + launch)
    registry = load_registry(autoload=False)
    times = [
        predict_time_options(GenerateOptions(**o), system, registry=registry)["iteration_time_s"]
        for o in (LLAMA, {**LLAMA, "fp8_attention": True}, LONG, {**LONG, "fp8_attention": True})
    ]
    assert times[1] > times[0] and times[3] < times[2]


def test_trace_checks_out_and_predicts_as_options(tmp_path: Path) -> None:
    out = tmp_path / "trace"
    options = {**LLAMA, "fp8_attention": True}
    flags = [a for k, v in options.items() for a in (f"--{k}", str(v).lower())]
    result = CliRunner().invoke(app, ["generate", *flags, "--output_dir", str(out)])
    assert result.exit_code == 0, result.output
    assert_trace_checks_out_and_predicts_as_options(out, options, "gb200-nvl72")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--dtype", "bf16", "--low_precision_recipe", "delayed"],
         "fp8_attention runs Transformer Engine's fused attention in fp8 (fp8_dpa): it needs "
         "dtype=fp8, profile=megatron and low_precision_recipe one of delayed, tensorwise, "
         "mxfp8, nvfp4"),
        (["--low_precision_recipe", "rowwise"],
         "fp8_attention runs Transformer Engine's fused attention in fp8 (fp8_dpa): it needs "
         "dtype=fp8, profile=megatron and low_precision_recipe one of delayed, tensorwise, "
         "mxfp8, nvfp4"),
        (["--profile", "compiled"],
         "fp8_attention runs Transformer Engine's fused attention in fp8 (fp8_dpa): it needs "
         "dtype=fp8, profile=megatron and low_precision_recipe one of delayed, tensorwise, "
         "mxfp8, nvfp4"),
        (["--attention_backend", "flash"],
         "fp8_attention runs cuDNN's fp8 fused attention: attention_backend=flash is not "
         "allowed with it (FlashAttention has no fp8 training kernel); allowed: auto, fused"),
        (["--sp", "2"],
         "fp8_attention with context parallelism (sp=2) is not modelled yet: the ring's keys "
         "and values would move in fp8 and be cast once, not per step; allowed: sp=1"),
        (["--attention", "unfused"],
         "fp8_attention=true does not apply to model 'llama' with attention=unfused: none of "
         "its layers runs fused attention (leave it false)"),
    ],
)  # fmt: skip
def test_refused_plans_get_one_line(args: list[str], message: str) -> None:
    flags = [a for k, v in LLAMA.items() for a in (f"--{k}", str(v).lower())]
    result = CliRunner().invoke(
        app, ["predict", "--json", *flags, "--fp8_attention", "true", *args]
    )
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"error: {message}"


def test_analytical_prices_keep_fp8_attention_apart() -> None:
    """The analytical predictor memoises prices on the system: plans with and without
    ``fp8_attention``, and with its two scalings, are priced apart (as on a fresh system)."""
    from stg.predictors.analytical import predict_options

    registry = load_registry(autoload=False)
    plans = [LONG, {**LONG, "fp8_attention": True},
             {**LONG, "fp8_attention": True, "low_precision_recipe": "mxfp8"}]  # fmt: skip
    shared = load_system("gb200-nvl72")
    again = [predict_options(GenerateOptions(**p), shared, registry=registry) for p in plans]
    fresh = [  # a new system object each: no memoised prices
        predict_options(GenerateOptions(**p), dataclasses.replace(shared), registry=registry)
        for p in plans
    ]
    assert [r["iteration_time_s"] for r in again] == [r["iteration_time_s"] for r in fresh]
    assert len({r["iteration_time_s"] for r in again}) == 3
