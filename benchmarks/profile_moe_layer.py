"""Measure the kernels of the experts layer of ``benchmarks/eager_step.py`` on a GPU.

    python benchmarks/profile_moe_layer.py --out DIR [--prefix h200]

Writes two JSON-lines files (the measurements that ``tests/data/kernels/h200-moe-*.jsonl``
hold, taken on an H200 with PyTorch 2.11):

- ``PREFIX-moe-layer.jsonl``: for each mixture of ``eager_step.MOE`` at 1,024 and 8,192
  tokens, one layer's ``Experts`` module (that script's model with one layer) run forward and
  backward under bf16 autocast over fp32 weights, 3 warm-ups then 3 calls under
  ``torch.profiler``; ``device_us`` maps every profiler key (a kernel name, an ``aten::``
  operator, an autograd function) to ``[self device µs, device µs, calls]`` per call;
- ``PREFIX-moe-routing.jsonl``: the routing kernels alone, CUDA events around 10 back-to-back
  calls after 3 warm-ups, for ``rows`` routed rows of ``d`` values (``rows / k`` tokens, each
  sent to ``k`` of 64 experts by a random top-k, rows sorted by expert as the layer sorts
  them): ``x.index_select(0, token)`` (the dispatch's gather), ``out.zero_()`` and
  ``out.zero_().index_add_(0, token, y)`` (the combine's scatter-add, atomics), ``y * w``
  (the gate weight, one per row) and the stable ``argsort`` of the ``rows`` expert ids.

Kernel-level measurements: stg's kernel constants may cite them. Needs PyTorch and a CUDA
GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eager_step import MODELS, MOE, build

from stg.bench import MissingDependencyError, require_cuda

PROFILED_CALLS = 3
ROUTING_CASES = [
    (rows, k, d) for d in (2048, 4096) for k in (2, 8) for rows in (8192, 65536, 262144)
]


def profile_layer(torch: Any, name: str, tokens: int) -> dict[str, Any]:
    family, d, _, heads, kv, ffn, vocab = MODELS[name]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build(torch, family, d, 1, heads, kv, ffn, vocab, tokens, MOE[name])
    layer = model.blocks[0].experts
    x = torch.randn(1, tokens, d, device="cuda", requires_grad=True)
    grad = torch.randn(1, tokens, d, device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        torch.autograd.backward(y, grad.to(y.dtype))

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(PROFILED_CALLS):
            step()
        torch.cuda.synchronize()
    device_us = {
        e.key: [
            e.self_device_time_total / PROFILED_CALLS,
            e.device_time_total / PROFILED_CALLS,
            e.count / PROFILED_CALLS,
        ]
        for e in prof.key_averages()
        if e.device_time_total > 0
    }
    return {"model": name, "tokens": tokens, "device_us": device_us}


def _ms(torch: Any, fn: Any) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 10


def time_routing(torch: Any, rows: int, k: int, d: int, dtype: Any) -> dict[str, Any]:
    tokens = rows // k
    x = torch.randn(tokens, d, device="cuda", dtype=dtype)
    y = torch.randn(rows, d, device="cuda", dtype=dtype)
    chosen = torch.rand(tokens, 64, device="cuda").topk(k, -1).indices
    token = torch.argsort(chosen.view(-1), stable=True) // k
    out = torch.zeros_like(x)
    w = torch.randn(rows, 1, device="cuda", dtype=dtype)
    return {
        "rows": rows,
        "k": k,
        "d": d,
        "dtype": str(dtype),
        "index_select_ms": _ms(torch, lambda: x.index_select(0, token)),
        "zero_ms": _ms(torch, lambda: out.zero_()),
        "zero_index_add_ms": _ms(torch, lambda: out.zero_().index_add_(0, token, y)),
        "mul_ms": _ms(torch, lambda: y * w),
        "argsort_ms": _ms(torch, lambda: torch.argsort(chosen.view(-1), stable=True)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prefix", default="gpu")
    args = parser.parse_args()
    try:
        torch = require_cuda("profile_moe_layer.py")
    except MissingDependencyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    device = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / f"{args.prefix}-moe-layer.jsonl").open("w") as out:
        for name in MOE:
            for tokens in (1024, 8192):
                out.write(json.dumps({**profile_layer(torch, name, tokens), **device}) + "\n")
                torch.cuda.empty_cache()
    with (args.out / f"{args.prefix}-moe-routing.jsonl").open("w") as out:
        for rows, k, d in ROUTING_CASES:
            for dtype in (torch.bfloat16, torch.float32):
                out.write(json.dumps({**time_routing(torch, rows, k, d, dtype), **device}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
