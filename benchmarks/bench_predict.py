"""Wall time of ``stg predict`` (time and memory) on generated workloads.

Run: ``python benchmarks/bench_predict.py [CASE ...]`` (prints one line per case). Cases:
dp 8 tp 4 pp 4 with the default model sizes and 8 micro-batches (128 ranks), dp 64 tp 4 pp 4
(1,024 ranks), and a 405B-class Llama on 16,384 ranks (dp 128, tp 8, pp 16, 1F1B, 16
micro-batches). Generation is timed separately from prediction.
"""

from __future__ import annotations

import sys
import time

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.predictors.memory import predict_memory
from stg.predictors.time import predict_time

CASES = {
    "dp8-tp4-pp4 (128 ranks)": GenerateOptions(dp=8, tp=4, pp=4, batch=64, micro_batch=8),
    "dp64-tp4-pp4 (1024 ranks)": GenerateOptions(dp=64, tp=4, pp=4, batch=512, micro_batch=64),
    "llama-405b dp128-tp8-pp16 (16384 ranks)": GenerateOptions(
        model="llama", dmodel=16384, dff=53248, head=128, kvhead=8, num_stacks=126, seq=8192,
        dvocal=128256, dp=128, tp=8, pp=16, batch=2048, micro_batch=128, causal=True,
    ),
}


def main() -> None:
    registry = load_registry(autoload=False)
    chosen = sys.argv[1:]
    for name, options in CASES.items():
        if chosen and not any(c in name for c in chosen):
            continue
        start = time.perf_counter()
        workload = build_workload(options, registry)
        generated = time.perf_counter()
        report = predict_time(workload, "a100-80g")
        predicted = time.perf_counter()
        predict_memory(workload, "a100-80g")
        done = time.perf_counter()
        nodes = sum(len(c.nodes) for c in workload.rank_classes)
        print(
            f"{name}: generate {generated - start:.2f} s, predict time "
            f"{predicted - generated:.2f} s ({report['simulated_ranks']} simulated ranks, "
            f"{nodes:,} nodes per rank-class set), memory {done - predicted:.3f} s; "
            f"iteration {report['iteration_time_s']:.3f} s, MFU {100 * report['mfu']:.1f} %",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
