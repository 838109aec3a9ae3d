"""Overhead of ``stg bench compute``'s timing harness per measured iteration, on the CPU.

    python benchmarks/bench_harness.py [--iterations 20000] [--repeats 7] [--threads 1]

A tiny op (``torch.add`` of two 1-element float32 tensors, about a microsecond) is timed
``--iterations`` times, ``--repeats`` times over, three ways:

* ``bare``: the loop one would write by hand: ``t0 = perf_counter_ns(); torch.add(a, b);
  t1 = perf_counter_ns(); times.append(t1 - t0)``;
* ``harness``: :func:`stg.bench.runner.time_call`, the loop ``stg bench compute`` runs;
* ``case``: a whole case through :class:`stg.bench.runner.Runner` (data made from the
  config, the op resolved from the registry, the loop, medians, FLOPs and rates), per
  measured iteration.

For each it reports the median of the recorded per-call times (what a result line holds) and
the wall time per iteration of the loop (what the harness costs), and the harness's overhead
over the bare loop on both. Nothing here is timed by the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from stg.bench.config import Case
from stg.bench.ops import BUILTIN_OPS
from stg.bench.runner import Runner, RunOptions, op_table, time_call


def bare(fn: Callable[..., Any], args: tuple[Any, ...], count: int) -> list[float]:
    times = []
    clock = time.perf_counter_ns
    for _ in range(count):
        t0 = clock()
        fn(*args)
        t1 = clock()
        times.append((t1 - t0) / 1e6)
    return times


def measure(label: str, run: Callable[[], list[float]], count: int, repeats: int) -> dict:
    recorded, wall = [], []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        times = run()
        wall.append((time.perf_counter_ns() - start) / 1e3 / count)
        recorded.append(statistics.median(times) * 1e3)
    return {"label": label, "recorded_us": statistics.median(recorded),
            "wall_us": statistics.median(wall)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    opts = parser.parse_args()
    count = opts.iterations
    torch.set_num_threads(opts.threads)
    a, b = torch.rand(1), torch.rand(1)
    options = RunOptions("cpu", warmup=0, iterations=count, backward=False, threads=opts.threads)
    device = torch.device("cpu")

    def harness() -> list[float]:
        metric, _ = time_call(torch, device, torch.add, (a, b), {}, options)
        return metric["forward"]["measure.time"]

    runner = Runner(options, op_table(BUILTIN_OPS))
    spec = {"type": "tensor", "dtype": "float", "shape": [1], "requires_grad": False}
    case = Case("torch.add", "0|0|0", None, {"args": [spec, spec]})

    def whole_case() -> list[float]:
        record = runner.run_case(case)
        return record["metric"]["forward"]["measure.time"]

    for _ in range(3):  # warm the allocator, the dispatcher and the caches
        bare(torch.add, (a, b), count // 10)
    rows = [
        measure("bare", lambda: bare(torch.add, (a, b), count), count, opts.repeats),
        measure("harness", harness, count, opts.repeats),
        measure("case", whole_case, count, opts.repeats),
    ]
    base = rows[0]
    print(f"torch {torch.__version__}, {opts.threads} thread(s), {count} iterations x "
          f"{opts.repeats} repeats (medians)")  # fmt: skip
    print(f"{'loop':8} {'recorded/call':>14} {'overhead':>9} {'wall/iter':>10} {'overhead':>9}")
    for row in rows:
        recorded, wall = row["recorded_us"], row["wall_us"]
        print(
            f"{row['label']:8} {recorded:11.3f} us {recorded - base['recorded_us']:+6.3f} us"
            f" {wall:7.3f} us {wall - base['wall_us']:+6.3f} us"
        )


if __name__ == "__main__":
    main()
