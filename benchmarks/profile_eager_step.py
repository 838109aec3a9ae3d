"""Profile whole training steps of ``benchmarks/eager_step.py``'s models, kernel by kernel.

    python benchmarks/profile_eager_step.py --out DIR [--prefix h200] [--models llama-1b]
        [--tokens 1024,8192]

Writes ``PREFIX-eager-step-kernels.jsonl``: for each model and token count, the step that
``eager_step.py`` times (``eager_step.training_step``: bf16 autocast over fp32 weights, forward,
backward, AdamW) run 3 times to warm up and then 2 times under ``torch.profiler``, with
``kernels`` mapping every CUDA kernel (and memcpy/memset) name to ``[device µs, calls]`` per
step, their sum ``device_us``, and the step's wall time measured apart from the profiler
(``step_s``, the median of 5 as ``eager_step.py`` takes it). The sum against the wall time says
how much of a step the GPU was busy; the kernels by name say which of stg's kernel models to
check. Kernel-level measurements: stg's kernel constants may cite them. Needs PyTorch and a CUDA
GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eager_step import MODELS, time_steps, training_step, warm_up

from stg.bench import MissingDependencyError, require_cuda

PROFILED_STEPS = 2


def profile_step(torch: Any, name: str, tokens: int) -> dict[str, Any]:
    """One model's step at ``tokens``: per-kernel device time and the step's wall time."""
    step, _ = training_step(torch, name, tokens)
    warm_up(torch, step)
    times = time_steps(torch, step)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        entry = kernels.setdefault(event.name, [0.0, 0.0])
        entry[0] += event.time_range.elapsed_us() / PROFILED_STEPS
        entry[1] += 1 / PROFILED_STEPS
    return {
        "model": name,
        "tokens": tokens,
        "step_s": statistics.median(times),
        "device_us": sum(us for us, _ in kernels.values()),
        "kernels": kernels,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prefix", default="gpu")
    parser.add_argument("--models", default="llama-1b,gpt-1.3b")
    parser.add_argument("--tokens", default="1024,8192")
    args = parser.parse_args()
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        print(f"unknown model {unknown[0]!r}; allowed: {', '.join(MODELS)}", file=sys.stderr)
        return 2
    try:
        torch = require_cuda("profile_eager_step.py")
    except MissingDependencyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    device = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / f"{args.prefix}-eager-step-kernels.jsonl").open("w") as out:
        for name in args.models.split(","):
            for tokens in (int(t) for t in args.tokens.split(",")):
                row = {**profile_step(torch, name, tokens), **device}
                print(
                    f"{name:<18}{tokens:>6}  step {row['step_s'] * 1e3:7.1f} ms  "
                    f"kernels {row['device_us'] / 1e3:7.1f} ms",
                    flush=True,
                )
                out.write(json.dumps(row) + "\n")
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
