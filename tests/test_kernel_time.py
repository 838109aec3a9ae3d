"""The kernel sub-models of stg.perf.kernel_time against the H100 kernel measurements.

The measurements (../shared/data/kernels, PARAM result format) are kernel-level: the models
are derived from and tested on them, one model per kernel family, with the error band stated
here and printed as a table at the end of the run.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

from stg.perf.kernel_time import attention_time, gemm_time, memory_bound_time
from stg.perf.system import load_system

KERNELS = Path(__file__).resolve().parents[2] / "shared" / "data" / "kernels"
H100 = load_system("h100-80g").gpu
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8", "float": "fp32"}
BACKENDS = {"flash": "flash2", "cudnn": "cudnn", "math": "unfused"}
MEMORY_KINDS = {
    "torch.add": "stream",
    "torch.mul": "stream",
    "torch.nn.functional.gelu": "stream",
    "torch.nn.functional.silu": "stream",
    "torch.Tensor.copy_": "stream",
    "torch.nn.functional.dropout": "dropout",
    "torch.nn.functional.layer_norm": "norm",
    "torch.nn.functional.rms_norm": "norm",
    "torch.softmax": "softmax",
}


def _cases(name: str) -> list[dict]:
    path = KERNELS / name
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line for line in lines if "extra" in line and "metric" in line]


class Errors:
    """Relative errors per group, and the table row of each."""

    def __init__(self) -> None:
        self.groups: dict[str, list[float]] = {}

    def add(self, group: str, predicted: float, measured: float) -> None:
        self.groups.setdefault(group, []).append(abs(predicted - measured) / measured)

    def stats(self, group: str) -> tuple[float, float, float]:
        errors = sorted(self.groups[group])
        return statistics.median(errors), errors[int(0.9 * (len(errors) - 1))], errors[-1]

    def lines(self) -> list[str]:
        out = [f"{'cases':<44}{'n':>5}{'median':>9}{'p90':>8}{'max':>8}"]
        for group in sorted(self.groups):
            median, p90, worst = self.stats(group)
            n = len(self.groups[group])
            out.append(f"{group:<44}{n:>5}{median:>9.1%}{p90:>8.1%}{worst:>8.1%}")
        return out


def _dtype(extra: dict) -> str:
    return "tf32" if extra["dtype"] == "float" and extra["tf32"] else DTYPES[extra["dtype"]]


def test_gemm_model(report_table: Callable[[str, list[str]], None]) -> None:
    errors = Errors()
    for case in _cases("h100-gemm.jsonl"):
        e = case["extra"]
        if e["family"] == "grid" and min(e["m"], e["n"], e["k"]) < 1024:
            continue  # below ~1024 a call is bound by eager PyTorch's launch cost, not the GPU
        predicted = gemm_time(H100, e["m"], e["n"], e["k"], _dtype(e))
        errors.add(f"gemm {e['family']} {_dtype(e)}", predicted, e["median_ms"] * 1e-3)
    report_table("GEMM model vs H100 measurements (relative time error)", errors.lines())
    for dtype in ("bf16", "fp8"):  # the GEMMs of GPT-3 and Llama 3 layers at tp 1-8
        median, p90, _ = errors.stats(f"gemm model {dtype}")
        assert median < 0.06 and p90 < 0.15, (dtype, median, p90)
    for dtype in ("bf16", "fp16", "fp32"):
        median, p90, _ = errors.stats(f"gemm grid {dtype}")
        assert median < 0.08 and p90 < 0.25, (dtype, median, p90)
    # the cold reference run (boost clock, not power-capped) is faster than the model by design
    assert errors.stats("gemm reference bf16")[0] < 0.25


def test_gemm_model_physics() -> None:
    a100 = load_system("a100-80g").gpu
    large = 2 * 8192**3 / gemm_time(a100, 8192, 8192, 8192)
    assert 0.8 * 312e12 < large < 0.95 * 312e12  # cuBLAS on A100: ~85-90 % of peak
    # wave quantisation: one row more than a full wave of tiles costs a partial second wave
    one_wave = gemm_time(H100, 132 * 128, 256, 8192)
    assert gemm_time(H100, 132 * 128 + 1, 256, 8192) > 1.2 * one_wave
    # memory-bound: a matrix-vector product moves its matrix once
    gemv = gemm_time(H100, 8192, 1, 8192)
    assert gemv == pytest.approx(8192 * 8192 * 2 / (3.35e12 * 0.89), rel=0.05)


def test_attention_model(report_table: Callable[[str, list[str]], None]) -> None:
    errors = Errors()
    for case in _cases("h100-attention.jsonl"):
        e = case["extra"]
        impl = BACKENDS[e["backend"]]
        for backward, key in ((False, "median_fwd_ms"), (True, "median_bwd_ms")):
            predicted = attention_time(
                H100, impl, e["b"], e["heads"], e["seq"], e["seq"], e["head_dim"],
                causal=e["causal"], backward=backward,
            )
            regime = "seq>=2k" if e["seq"] >= 2048 else "seq<2k"
            group = f"attention {impl} {'bwd' if backward else 'fwd'} {regime}"
            errors.add(group, predicted, e[key] * 1e-3)
    report_table("Attention model vs H100 measurements (relative time error)", errors.lines())
    for group in errors.groups:
        median, p90, _ = errors.stats(group)
        if "seq>=2k" in group:
            assert median < 0.12 and p90 < 0.20, (group, median, p90)
        else:
            assert median < 0.35, (group, median)


def test_attention_fused_beats_unfused_and_causal_halves() -> None:
    args = (H100, 4, 32, 4096, 4096, 128)
    fused = attention_time(*args[:1], "cudnn", *args[1:], causal=False)
    flash = attention_time(*args[:1], "flash2", *args[1:], causal=False)
    unfused = attention_time(*args[:1], "unfused", *args[1:], causal=False)
    assert fused < flash < unfused
    causal = attention_time(*args[:1], "cudnn", *args[1:], causal=True)
    assert 0.45 < causal / fused < 0.6


def test_memory_bound_model(report_table: Callable[[str, list[str]], None]) -> None:
    errors = Errors()
    for case in _cases("h100-elementwise.jsonl"):
        e = case["extra"]
        if "rows" not in e or e["bytes_fwd"] < 256 * 2**20:
            continue  # small kernels are bound by eager PyTorch's per-op cost
        kind = MEMORY_KINDS[case["op_name"]]
        dtype = DTYPES[e["dtype"]]
        nbytes = e["bytes_fwd"]
        if kind == "dropout":  # PARAM's bytes leave out the 1-byte mask that dropout writes
            nbytes += e["rows"] * e["cols"]
            # the backward reads the gradient and the mask and writes one: as many bytes
            predicted = memory_bound_time(H100, nbytes, "stream", dtype)
            errors.add(f"memory-bound dropout.grad {dtype}", predicted, e["median_bwd_ms"] * 1e-3)
        predicted = memory_bound_time(H100, nbytes, kind, dtype)
        errors.add(f"memory-bound {kind} {dtype}", predicted, e["median_fwd_ms"] * 1e-3)
    report_table("Memory-bound model vs H100 measurements (>= 256 MiB)", errors.lines())
    for group in errors.groups:
        median, _, worst = errors.stats(group)
        assert median < 0.06 and worst < 0.25, (group, median, worst)
