"""Measure the fp8 expert GEMMs of the Qwen3 MoE cluster rows as Transformer Engine runs them.

    python benchmarks/measure_expert_streams.py --out DIR [--prefix h100]

Writes ``PREFIX-expert-streams.jsonl`` (JSON lines; the first describes the machine and the
method), the measurement ``tests/test_expert_gemm_streams.py`` checks stg's expert GEMMs
against: Megatron-Core runs a rank's experts through Transformer Engine's ``GroupedLinear``,
one cuBLAS GEMM per expert spread round-robin over its compute streams
(``nvte_multi_stream_cublas_gemm``), gate and up fused into one fc1 GEMM. Each expert here is
one ``torch._scaled_mm`` (cuBLASLt; fp8 e4m3 operands with unit tensorwise scales, bf16 out),
``groups`` of them per CUDA-graph replay (no host time), on one stream or round-robin over
:data:`STREAMS` (a single GEMM on one); each row the median of 15 timings of 5 replays by
CUDA events. ``m`` rows, ``n`` columns, ``k`` the reduction; the shapes are those of
``tests/data/runs/cluster_runs.json``'s Qwen3-30B-A3B rows at EP 8 (4,096 rows per expert, 16
experts a rank) and Qwen3-235B-A22B at EP 32 (4 experts a rank), forward and backward, and one
large GEMM for reference. Needs PyTorch and a CUDA GPU with fp8 (Hopper or later).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from stg.bench import MissingDependencyError, require_cuda
from stg.bench.runner import time_graph

STREAMS = 4
"""Transformer Engine's default number of GEMM streams (``num_gemm_streams``)."""

CASES: list[tuple[int, int, int, int, str]] = [
    (16, 4096, 1536, 2048, "qwen3-30b-a3b ep8 tokendrop: fc1 forward (gate and up fused)"),
    (16, 4096, 768, 2048, "qwen3-30b-a3b: fc2 dgrad; stg's gate or up forward alone"),
    (16, 4096, 2048, 768, "qwen3-30b-a3b: fc2 forward; stg's gate or up dgrad alone"),
    (16, 4096, 2048, 1536, "qwen3-30b-a3b: fc1 dgrad (fused)"),
    (16, 1536, 2048, 4096, "qwen3-30b-a3b: fc1 wgrad (fused)"),
    (16, 2048, 768, 4096, "qwen3-30b-a3b: fc2 wgrad; stg's gate or up wgrad alone (transposed)"),
    (4, 4096, 3072, 4096, "qwen3-235b-a22b ep32: fc1 forward (fused)"),
    (4, 4096, 1536, 4096, "qwen3-235b-a22b: fc2 dgrad; stg's gate or up forward alone"),
    (4, 4096, 4096, 1536, "qwen3-235b-a22b: fc2 forward; stg's gate or up dgrad alone"),
    (4, 4096, 4096, 3072, "qwen3-235b-a22b: fc1 dgrad (fused)"),
    (4, 3072, 4096, 4096, "qwen3-235b-a22b: fc1 wgrad (fused)"),
    (1, 8192, 8192, 8192, "reference"),
]
"""(groups, m, n, k, role)."""


def median_ms(torch: Any, groups: int, m: int, n: int, k: int, streams: int) -> float:
    """Median milliseconds of one replay of ``groups`` fp8 GEMMs on ``streams`` streams."""
    fp8 = torch.float8_e4m3fn
    one = torch.ones((), device="cuda")
    a = [torch.randn(m, k, device="cuda").to(fp8) for _ in range(groups)]
    b = [torch.randn(n, k, device="cuda").to(fp8).t() for _ in range(groups)]
    side = [torch.cuda.Stream() for _ in range(streams)] if streams > 1 else []

    def run() -> None:
        current = torch.cuda.current_stream()
        start = current.record_event()
        for i in range(groups):
            stream = side[i % streams] if side else current
            if side:
                stream.wait_event(start)
            with torch.cuda.stream(stream):
                torch._scaled_mm(a[i], b[i], one, one, out_dtype=torch.bfloat16)
        for stream in side:
            current.wait_stream(stream)

    return time_graph(torch, run, replays=5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prefix", default="gpu")
    args = parser.parse_args()
    try:
        torch = require_cuda("measure_expert_streams.py")
    except MissingDependencyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    head = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "method": "torch._scaled_mm fp8 e4m3 tensorwise (unit scales), bf16 out; g GEMMs per "
        f"CUDA-graph replay on 1 stream or round-robin over {STREAMS} streams; median of 15 x "
        "(5 replays) by CUDA events",
        "script": "benchmarks/measure_expert_streams.py",
    }
    with (args.out / f"{args.prefix}-expert-streams.jsonl").open("w") as out:
        out.write(json.dumps(head) + "\n")
        for groups, m, n, k, role in CASES:
            for streams in (1, STREAMS) if groups > 1 else (1,):
                ms = median_ms(torch, groups, m, n, k, streams)
                row = {"groups": groups, "m": m, "n": n, "k": k, "streams": streams}
                row |= {"median_ms": ms, "tflops": 2 * groups * m * n * k / ms / 1e9}
                out.write(json.dumps({**row, "role": role}) + "\n")
                out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
