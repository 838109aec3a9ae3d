"""Time torchao's float8 training linear (compiled) against a bf16 linear, forward and backward.

    python benchmarks/measure_float8_linear.py --out DIR [--prefix h200]

Writes ``PREFIX-float8-linear.jsonl`` (JSON lines; the first describes the machine, the
method and the torchao version). Each case is one bias-free linear layer of torchtitan's Llama 3
at tensor parallelism 8 (the local shard of ``wq``, ``wk``/``wv``, ``wo``, ``w1``/``w3``,
``w2``) on the tokens of one rank of tests/data/runs/cluster_runs.json's tt2506 rows (8B:
local batch 12 x 8,192 tokens; 70B: 16 x 8,192), in three forms:

- ``bf16``: ``torch.nn.Linear`` in bf16, eager (three cuBLAS GEMMs);
- ``tensorwise`` and ``rowwise``: the same layer converted by torchao's
  ``convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name(...)`` (what
  torchtitan's float8 converter does), then ``torch.compile``d as torchtitan compiles each
  block: the casts, amax reductions and scales are inductor kernels, the GEMMs
  ``torch._scaled_mm``.

One timed call is the forward and ``torch.autograd.grad`` of the output with respect to the
input and the weight (no gradient accumulation), with bf16 activations and weights (FSDP2's
``param_dtype``); median of 10 timings of ``reps`` calls between CUDA events after 3 warm-up
timings. Needs PyTorch with a CUDA GPU with fp8 (Hopper or later) and torchao.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from stg.bench import MissingDependencyError, require_cuda
from stg.bench.runner import time_back_to_back

WARMUP = 3
ITERATIONS = 10
MIN_EVENT_MS = 5.0

# name: (hidden, ffn, heads, kv heads, head dim) from each model's config.json
MODELS = {"llama3-8b": (4096, 14336, 32, 8, 128), "llama3-70b": (8192, 28672, 64, 8, 128)}
RUNS = (("llama3-8b", 8, 12 * 8192), ("llama3-70b", 8, 16 * 8192))
FORMS = ("bf16", "tensorwise", "rowwise")


def cases() -> list[tuple[str, int, int, int]]:
    """(role, tokens, in features, out features) of each distinct local linear of :data:`RUNS`."""
    out = []
    for model, tp, tokens in RUNS:
        hidden, ffn, heads, kv, dhead = MODELS[model]
        for name, (k_in, n_out) in {
            "wq": (hidden, heads * dhead // tp),
            "wk_wv": (hidden, kv * dhead // tp),
            "wo": (heads * dhead // tp, hidden),
            "w1_w3": (hidden, ffn // tp),
            "w2": (ffn // tp, hidden),
        }.items():
            out.append((f"{model}/tp{tp}/t{tokens}/{name}", tokens, k_in, n_out))
    return out


def layer(torch: Any, form: str, k_in: int, n_out: int) -> Any:
    module = torch.nn.Sequential(torch.nn.Linear(k_in, n_out, bias=False))
    module = module.to(device="cuda", dtype=torch.bfloat16)
    if form == "bf16":
        return module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(form))
    return torch.compile(module, fullgraph=True)


def timings(torch: Any, module: Any, x: Any, grad: Any) -> tuple[list[float], int]:
    params = [p for p in module.parameters()]

    def step() -> None:
        y = module(x)
        torch.autograd.grad(y, [x, *params], grad)

    for _ in range(3):
        step()
    return time_back_to_back(
        torch,
        step,
        warmup=WARMUP,
        iterations=ITERATIONS,
        min_event_ms=MIN_EVENT_MS,
        max_reps=20,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prefix", default="gpu")
    args = parser.parse_args()
    try:
        torch = require_cuda("measure_float8_linear.py")
        import torchao
    except (MissingDependencyError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    lines: list[dict[str, Any]] = [
        {
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "torchao": torchao.__version__,
            "cuda": torch.version.cuda,
            "method": "forward + autograd.grad (input, weight) of one bias-free linear, bf16 "
            "eager or torchao float8 (recipe) compiled; median of 10 x (reps calls) by CUDA "
            "events after 3 warm-up timings",
            "script": "benchmarks/measure_float8_linear.py",
            "start_time": datetime.datetime.now().isoformat(timespec="seconds"),
        }
    ]
    path = args.out / f"{args.prefix}-float8-linear.jsonl"
    for role, tokens, k_in, n_out in cases():
        x = torch.randn(tokens, k_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(tokens, n_out, device="cuda", dtype=torch.bfloat16)
        for form in FORMS:
            row: dict[str, Any] = {"role": role, "tokens": tokens, "in": k_in, "out": n_out}
            row["form"] = form
            try:
                times, reps = timings(torch, layer(torch, form, k_in, n_out), x, grad)
            except Exception as error:  # recorded: the form failed on this machine
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                print(role, form, row["error"], flush=True)
            else:
                row |= {
                    "median_ms": statistics.median(times[WARMUP:]),
                    "measure_ms": times[WARMUP:],
                    "reps_per_event": reps,
                }
                print(role, form, f"{row['median_ms']:.3f} ms", flush=True)
            lines.append(row)
            torch._dynamo.reset()
        del x, grad
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    lines.append({"finish_time": datetime.datetime.now().isoformat(timespec="seconds")})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
