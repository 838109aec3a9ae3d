"""Measure Muon's Newton-Schulz iteration as Megatron-Core runs it, per weight matrix.

    python benchmarks/measure_newton_schulz.py --out DIR [--prefix h100]

Writes ``PREFIX-newton-schulz.jsonl`` (JSON lines; the first describes the machine and the
method), the measurement ``tests/test_muon.py`` checks stg's price of ``--optimizer muon``
against. Megatron-Core's Muon (``emerging_optimizers.orthogonalized_optimizers``,
``newton_schulz``) orthogonalizes each 2-D weight's momentum: transposed so that ``m <= n``,
normalised, cast to bf16 under ``muon_fp32_matmul_prec = "medium"`` (Megatron's default), then
``steps`` iterations of ``newton_schulz_step``: ``A = X @ X.mT``;
``B = torch.addmm(A, A, A, alpha=c, beta=b)``; ``X = torch.addmm(X, B, X, alpha=1, beta=a)``,
and cast back to fp32. Each row is one matrix shape: ``step_ms``, one iteration (three GEMMs)
per CUDA-graph replay, and ``whole_ms``, the whole orthogonalization of 5 iterations with its
normalisation and casts from an fp32 momentum; medians of 15 timings of 3 replays by CUDA
events. The shapes are weight matrices of the models in tests/data/runs (``role``). Needs
PyTorch and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from stg.bench import MissingDependencyError, require_cuda
from stg.bench.runner import time_graph

STEPS = 5
"""Megatron-Core's ``muon_num_ns_steps``."""

QUINTIC = (4.0848, -6.8946, 2.9270)
"""The first of emerging_optimizers' ``quintic`` coefficient sets (Megatron's default
``muon_coefficient_type``); the time does not depend on the values."""

SHAPES: list[tuple[int, int, str]] = [
    (768, 2048, "qwen3-30b-a3b expert gate, up or down"),
    (1536, 2048, "qwen3-30b-a3b expert fc1 (gate and up fused)"),
    (2048, 7168, "deepseek-v3 / kimi-k2 expert gate, up or down"),
    (4096, 7168, "deepseek-v3 / kimi-k2 expert fc1 (fused)"),
    (1024, 4096, "llama3-8b k or v"),
    (4096, 4096, "llama3-8b q or o"),
    (4096, 14336, "llama3-8b gate, up or down"),
    (4096, 28672, "llama3-8b fc1 (fused)"),
    (1024, 8192, "llama3-70b k or v"),
    (8192, 8192, "llama3-70b q or o"),
    (8192, 28672, "llama3-70b gate, up or down"),
    (512, 32768, "deepseek-v3 kv up-projection (k and v)"),
    (1536, 24576, "deepseek-v3 q up-projection"),
    (7168, 16384, "deepseek-v3 attention output"),
    (576, 7168, "deepseek-v3 kv down-projection"),
]
"""(m, n, role): m <= n, the orientation the iteration runs in."""


def measure(torch: Any, m: int, n: int) -> dict[str, float]:
    a, b, c = QUINTIC
    momentum = torch.randn(n, m, device="cuda")  # stored (n, m): transposed first, as m <= n
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) / (m * n) ** 0.5

    def step() -> None:
        gram = x @ x.mT
        poly = torch.addmm(gram, gram, gram, alpha=c, beta=b)
        torch.addmm(x, poly, x, alpha=1.0, beta=a)

    def whole() -> None:
        y = torch.nn.functional.normalize(momentum.mT, p=2, dim=(-2, -1), eps=1e-7)
        y = y.to(torch.bfloat16)
        for _ in range(STEPS):
            gram = y @ y.mT
            poly = torch.addmm(gram, gram, gram, alpha=c, beta=b)
            y = torch.addmm(y, poly, y, alpha=1.0, beta=a)
        y.to(torch.float32).mT.contiguous()

    return {
        "step_ms": time_graph(torch, step, replays=3),
        "whole_ms": time_graph(torch, whole, replays=3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prefix", default="gpu")
    args = parser.parse_args()
    try:
        torch = require_cuda("measure_newton_schulz.py")
    except MissingDependencyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    head = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "method": "Newton-Schulz as emerging_optimizers runs it under fp32_matmul_prec medium "
        "(bf16 I/O): step = X@X.mT, addmm(A,A,A), addmm(X,B,X); whole = normalize (fp32), "
        f"cast to bf16, {STEPS} steps, cast to fp32; each in a CUDA graph, median of 15 x "
        "(3 replays) by CUDA events",
        "script": "benchmarks/measure_newton_schulz.py",
    }
    with (args.out / f"{args.prefix}-newton-schulz.jsonl").open("w") as out:
        out.write(json.dumps(head) + "\n")
        for m, n, role in SHAPES:
            row: dict[str, Any] = {"m": m, "n": n, **measure(torch, m, n)}
            row["step_tflops"] = (4 * m * m * n + 2 * m**3) / row["step_ms"] / 1e9
            out.write(json.dumps({**row, "role": role}) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
