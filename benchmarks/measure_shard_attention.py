"""Measure causal fused attention at the sizes one tensor-parallel rank runs.

    python benchmarks/measure_shard_attention.py --out DIR [--prefix h100]

Writes ``PREFIX-shard-attention.jsonl`` (JSON lines; the first describes the machine and the
method). A training run with tensor parallelism hands each rank a few heads of one or two
sequences (Llama 3 70B at tp 8: 8 query heads, micro-batch 1), fewer query blocks than the
H100 has SMs times a few waves: the regime where a fused attention kernel's fixed costs and
its causal blocks' uneven work show. Each row is one causal
``scaled_dot_product_attention`` of ``batch`` sequences of ``heads`` heads of 128 (keys and
values as many heads) under cuDNN or FlashAttention-2, forward and backward: median
milliseconds of 10 timed runs after 3 warm-ups by CUDA events; the backward through
``torch.autograd.grad``, which returns the gradients without adding them into ``.grad`` (a
``.backward()`` would time three accumulation kernels too). With ``--kernels`` it writes
instead ``PREFIX-shard-attention-kernels.jsonl``: for the calls of :data:`PROFILED`, each
kernel's device microseconds per forward and backward under ``torch.profiler`` (3 profiled
calls after 3 warm-ups): which kernels a call runs beside the attention kernel itself. Needs
PyTorch and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure_mla_attention import measure

from stg.bench import MissingDependencyError, require_cuda

CASES = [(1, heads, seq) for heads in (4, 8, 16, 32, 64) for seq in (2048, 4096, 8192, 16384)]
CASES += [(2, heads, seq) for heads in (8, 16) for seq in (4096, 8192)]
"""(batch, heads, seq)."""

PROFILED = [(1, 4, 2048), (1, 8, 4096), (1, 64, 8192)]
"""The calls whose kernels ``--kernels`` lists: two too short for stg's price, one saturated."""


def kernels(torch: Any, backend: Any, batch: int, heads: int, seq: int) -> dict[str, Any]:
    """Device microseconds per call of each kernel of a forward and backward under
    ``backend``."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    shape = (batch, heads, seq, 128)
    q, k, v = (
        torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3)
    )
    grad = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([backend]):
        for _ in range(3):
            torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), grad)
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(3):
                torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), grad)
            torch.cuda.synchronize()
    return {
        e.key[:160]: [e.self_device_time_total / 3, e.count / 3]
        for e in prof.key_averages()
        if e.self_device_time_total > 0
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prefix", default="gpu")
    parser.add_argument("--kernels", action="store_true", help="list each call's kernels")
    args = parser.parse_args()
    try:
        torch = require_cuda("measure_shard_attention.py")
    except MissingDependencyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from torch.nn.attention import SDPBackend

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    args.out.mkdir(parents=True, exist_ok=True)
    head = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "method": "causal F.scaled_dot_product_attention, bf16, head size 128, under one SDPA "
        "backend; forward alone and forward + torch.autograd.grad, median of 10 after 3 "
        "warm-ups by CUDA events; backward_ms = the difference",
        "script": "benchmarks/measure_shard_attention.py",
    }
    if args.kernels:
        head["method"] = (
            "kernels of a causal SDPA forward and backward (head size 128, bf16) under "
            "torch.profiler: self device us per call and calls per call, 3 calls after 3 warm-ups"
        )
        with (args.out / f"{args.prefix}-shard-attention-kernels.jsonl").open("w") as out:
            out.write(json.dumps(head) + "\n")
            for name, backend in backends.items():
                for batch, heads, seq in PROFILED:
                    row = {"backend": name, "batch": batch, "heads": heads, "seq": seq}
                    row["device_us"] = kernels(torch, backend, batch, heads, seq)
                    out.write(json.dumps(row) + "\n")
        return 0
    with (args.out / f"{args.prefix}-shard-attention.jsonl").open("w") as out:
        out.write(json.dumps(head) + "\n")
        for name, backend in backends.items():
            for batch, heads, seq in CASES:
                row: dict[str, Any] = {"backend": name, "batch": batch, "heads": heads}
                timed = measure(torch, backend, heads, seq, 128, 128, batch)
                row |= {"seq": seq, "head_dim": 128, **timed}
                out.write(json.dumps(row) + "\n")
                out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
