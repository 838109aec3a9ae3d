"""Run time of the per-group precision planner on a hybrid cluster, with the figures it finds.

Run: ``python benchmarks/bench_hybrid_plan.py [--exact]``. Needs the example kernel plugin
(``pip install -e plugins/stg-int8-kernels``). The cluster is docs/hybrid.md's: 4 x V100
(NVLink) + 4 x T4 (PCIe), 25 GB/s per GPU between the two nodes, dp 8, fp16. Workloads: a GPT
with BERT-base sizes (dmodel 768, 12 layers, sequence 128, 256 samples) and the docs' wide
GPT (dmodel 4096, 2 layers, sequence 512, 32 samples). Prints, per workload, the predicted
iteration time of the all-fp32 and all-fp16 plans and of the plan found, the per-group local
times, the number of plans evaluated and the wall time of the search.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import stg_int8_kernels

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.explore.hybrid_search import exact_hybrid_precision, search_hybrid_precision
from stg.host.registry import load_registry
from stg.perf.hybrid import hybrid_from_dict

SYSTEM = {
    "name": "v100+t4",
    "groups": [
        {"name": "v100", "device": "v100-32g", "gpus_per_node": 4},
        {"name": "t4", "device": "t4-16g", "gpus_per_node": 4},
    ],
    "network": {"name": "infiniband", "bandwidth_gbps": 25, "latency_us": 3, "efficiency": 0.9},
}
WORKLOADS = {
    "bert-base-sized gpt": dict(
        model="gpt", dmodel=768, dff=3072, head=12, kvhead=12, num_stacks=12, seq=128,
        batch=256, dvocal=30522, dp=8,
    ),
    "wide gpt (docs)": dict(
        model="gpt", dmodel=4096, dff=16384, head=32, kvhead=32, num_stacks=2, seq=512,
        batch=32, dvocal=32000, dp=8,
    ),
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exact", action="store_true", help="the exact search, not greedy")
    args = parser.parse_args()
    registry = load_registry(autoload=False, plugins=[stg_int8_kernels])
    system = hybrid_from_dict(SYSTEM, "bench")
    kernels = list(registry.kernels)
    predict = registry.predictors.get("time").predict
    search = exact_hybrid_precision if args.exact else search_hybrid_precision
    for name, dims in WORKLOADS.items():
        options = GenerateOptions(**dims, dtype="fp16", placement=(("v100", 4), ("t4", 4)))
        fp32 = predict(build_workload(replace(options, dtype="fp32"), registry), system)
        start = time.perf_counter()
        result = search(options, registry, system, dtypes=("fp16", "int8"), kernels=kernels)
        seconds = time.perf_counter() - start
        print(f"{name}:")
        print(f"  fp32      {fp32['iteration_time_s'] * 1e3:9.1f} ms")
        for label, ev in (("fp16", result.baseline), ("planned", result.best)):
            local = ", ".join(f"{g} {t * 1e3:.1f} ms" for g, t in ev.local_s.items())
            line = f"  {label:9s} {ev.time_s * 1e3:9.1f} ms  (local: {local}; "
            print(line + f"straggler {ev.straggler})")
        print(f"  plan      {dict(result.best.plan) or 'no change'}")
        print(
            f"  target {result.target_s * 1e3:.1f} ms ({result.target_source}), "
            f"{'met' if result.met else 'not met'}; lost precision {result.lost:.4g}; "
            f"{result.evaluations} plans evaluated in {seconds:.2f} s"
        )


if __name__ == "__main__":
    main()
