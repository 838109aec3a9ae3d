"""Measure fused attention with DeepSeek's multi-head latent attention head sizes.

    python benchmarks/measure_mla_attention.py --out DIR [--prefix h100]

Writes ``PREFIX-mla-attention.jsonl`` (JSON lines; the first describes the machine and the
method). Megatron-Core runs multi-head latent attention's core as one fused attention whose
queries and keys have ``qk_head_dim + qk_pos_emb_head_dim`` = 128 + 64 = 192 channels per
head and whose values have 128 (``v_head_dim``), through Transformer Engine's cuDNN kernel.
Each row is one causal ``scaled_dot_product_attention`` of one sequence under one SDPA
backend (cuDNN, memory-efficient, flash), forward and backward, for the head sizes
``(d_qk, d_v)`` (192, 128) and the references (128, 128) and (192, 192): median milliseconds
of 10 timed runs after 3 warm-ups by CUDA events; the backward through
``torch.autograd.grad`` (no accumulation into ``.grad``). A backend that refuses a shape is
written with its error. Needs PyTorch and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from stg.bench import MissingDependencyError, require_cuda
from stg.bench.runner import time_back_to_back

HEADS = (16, 128)
"""DeepSeek-V3's 128 heads on one GPU and 16 of them a rank at tensor parallelism 8."""

SEQS = (4096,)
HEAD_DIMS = ((192, 128), (128, 128), (192, 192))


def median_ms(torch: Any, run: Any) -> float:
    times, _ = time_back_to_back(torch, run, warmup=3, iterations=10, min_event_ms=0, reps=1)
    return statistics.median(times[3:])


def measure(
    torch: Any, backend: Any, heads: int, seq: int, dqk: int, dv: int, batch: int = 1
) -> dict[str, Any]:
    """Median forward and backward milliseconds of one causal SDPA call of ``batch``
    sequences under ``backend``, or the error of a backend that refuses the shape."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def tensor(d: int) -> Any:
        shape = (batch, heads, seq, d)
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_()

    q, k, v = tensor(dqk), tensor(dqk), tensor(dv)
    grad = torch.randn(batch, heads, seq, dv, device="cuda", dtype=torch.bfloat16)
    try:
        with sdpa_kernel([backend]):
            forward = median_ms(torch, lambda: sdpa(q, k, v, is_causal=True))

            def both() -> None:
                out = sdpa(q, k, v, is_causal=True)
                torch.autograd.grad(out, (q, k, v), grad)

            total = median_ms(torch, both)
    except RuntimeError as error:
        return {"error": str(error).splitlines()[0][:200]}
    return {"forward_ms": forward, "backward_ms": total - forward}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prefix", default="gpu")
    args = parser.parse_args()
    try:
        torch = require_cuda("measure_mla_attention.py")
    except MissingDependencyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from torch.nn.attention import SDPBackend

    backends = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    head = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "method": "causal F.scaled_dot_product_attention of one sequence, bf16, under one SDPA "
        "backend; forward alone and forward + torch.autograd.grad, median of 10 after 3 "
        "warm-ups by CUDA events; backward_ms = the difference",
        "script": "benchmarks/measure_mla_attention.py",
    }
    with (args.out / f"{args.prefix}-mla-attention.jsonl").open("w") as out:
        out.write(json.dumps(head) + "\n")
        for name, backend in backends.items():
            for heads in HEADS:
                for seq in SEQS:
                    for dqk, dv in HEAD_DIMS:
                        row = {"backend": name, "heads": heads, "seq": seq, "d_qk": dqk, "d_v": dv}
                        row |= measure(torch, backend, heads, seq, dqk, dv)
                        if "forward_ms" in row:
                            # causal: half of the 2·s²·h·(d_qk + d_v) forward FLOPs
                            flops = heads * seq * seq * (dqk + dv)
                            row["forward_tflops"] = flops / row["forward_ms"] / 1e9
                            row["backward_tflops"] = 2.5 * flops / row["backward_ms"] / 1e9
                        out.write(json.dumps(row) + "\n")
                        out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
