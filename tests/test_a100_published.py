"""The a100-80g preset against published kernel-level A100 measurements, each row citing its
source (tests/data/kernels/a100-published.jsonl): cuBLAS GEMMs timed in short runs (which an
A100 starts near its 1.41 GHz boost clock) and under sustained load (>= 3 s, power-capped at
400 W), FlashAttention-2's forward and backward maxima from its paper, and streaming bandwidth.
No A100 was at hand to measure with benchmarks/measure_kernels.py: these are other people's
measurements."""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from pathlib import Path

import pytest

from stg.perf.kernel_time import GEMM_PIPE_EFFICIENCY, Gpu, attention_time, gemm_time
from stg.perf.system import load_system

POINTS = [
    json.loads(line)
    for line in (Path(__file__).parent / "data" / "kernels" / "a100-published.jsonl").open()
]
"""The published rows."""

A100 = load_system("a100-80g")


def _rows(kind: str, **match: object) -> list[dict]:
    rows = [p for p in POINTS if p["kind"] == kind and all(p[k] == v for k, v in match.items())]
    assert rows, (kind, match)
    return rows


def _at_boost(gpu: Gpu) -> Gpu:
    """The same GPU running at the clock its data-sheet peaks assume."""
    return dataclasses.replace(gpu, sustained_clock_ghz=gpu.peak_clock_ghz)


def _gemm_tflops(gpu: Gpu, m: int, n: int, k: int) -> float:
    return 2 * m * n * k / gemm_time(gpu, m, n, k, "bf16") / 1e12


def test_every_point_cites_its_source() -> None:
    for point in POINTS:
        assert point["source"].startswith("https://") and point["where"].strip(), point


def test_sustained_gemm_is_a_known_gap_of_the_preset() -> None:
    """A GEMM timed over seconds runs at the power-capped clock. The one published (2022
    software) runs 8-12 % below the preset's rate at the HPL clock, 1305 MHz: the preset keeps
    that clock (see its comment: Megatron-LM's A100 runs of that year support it), and this
    test pins the gap so that a change of either shows."""
    for row in _rows("gemm", run="sustained"):
        tflops = _gemm_tflops(A100.gpu, row["m"], row["n"], row["k"])
        assert 1.08 * row["tflops"] <= tflops <= 1.12 * row["tflops"], (row, tflops)


def test_short_gemms_lie_between_the_sustained_and_the_boost_clock() -> None:
    """Short runs (dozens of iterations) start at up to the boost clock and throttle as they
    heat: each lies between the preset's sustained rate and its rate at 1.41 GHz."""
    gpu, boost = A100.gpu, _at_boost(A100.gpu)
    shaped = [(r, [(r["m"], r["n"], r["k"])]) for r in _rows("gemm", run="short")]
    squares = [(r, [(s, s, s) for s in r["sizes"]]) for r in _rows("gemm_best_square")]
    for row, shapes in (*shaped, *squares):
        low = max(_gemm_tflops(gpu, *shape) for shape in shapes)
        high = max(_gemm_tflops(boost, *shape) for shape in shapes)
        assert 0.97 * low <= row["tflops"] <= 1.03 * high, (row, low, high)


def test_the_pipeline_efficiency_holds_on_the_a100_at_its_boost_clock() -> None:
    """The best short run (Stas Bekman's maximum-achievable-matmul search) reaches the tile
    model's rate at the boost clock with the H100's pipeline efficiency."""
    (row,) = _rows("gemm", run="short", dtype="bf16")
    tflops = _gemm_tflops(_at_boost(A100.gpu), row["m"], row["n"], row["k"])
    assert tflops == pytest.approx(row["tflops"], rel=0.03)
    assert A100.gpu.gemm_efficiency == GEMM_PIPE_EFFICIENCY


def test_the_sustained_clock_sits_below_the_boost_clock() -> None:
    """Under load the clock drops below the boost clock, and by no more than the sustained
    GEMM's rate drops below the best short one's."""
    (sustained,) = _rows("gemm", run="sustained")
    short = max(r["tflops"] for r in _rows("gemm", run="short"))
    ratio = A100.sustained_clock_ghz / A100.peak_clock_ghz
    assert sustained["tflops"] / short < ratio < 1


@pytest.mark.parametrize("backward", [False, True])
def test_flash_attention_2_reaches_its_published_maximum(backward: bool) -> None:
    """FlashAttention-2's paper benchmark (16k tokens, hidden 2048, head size 64 or 128, with
    and without causal masking): the model's best case at the boost clock (the paper's short
    runs) is the paper's 'up to' fraction of the 312 TFLOP/s peak."""
    (row,) = _rows("attention_max", backward=backward)
    setting = row["setting"]
    boost = _at_boost(A100.gpu)
    best = 0.0
    for d, seq, causal in itertools.product(
        setting["head_dims"], setting["seqs"], setting["causal"]
    ):
        batch, heads = setting["tokens"] // seq, setting["hidden"] // d
        flops = 4 * batch * heads * seq * seq * d / (2 if causal else 1)
        flops *= 2.5 if backward else 1
        seconds = attention_time(
            boost, "flash2", batch, heads, seq, seq, d, causal=causal, backward=backward
        )
        best = max(best, flops / seconds / 1e12)
    assert best / (A100.peak("bf16") / 1e12) == pytest.approx(row["fraction_of_peak"], abs=0.02)
    if "tflops" in row:
        assert best == pytest.approx(row["tflops"], rel=0.03)


def test_streaming_bandwidth_matches_the_published_kernels() -> None:
    rows = _rows("stream")
    streaming = A100.hbm_bandwidth * A100.memory_efficiency / 1e12
    assert streaming == pytest.approx(statistics.mean(r["tbps"] for r in rows), rel=0.01)
    for row in rows:
        assert streaming == pytest.approx(row["tbps"], rel=0.03), row
