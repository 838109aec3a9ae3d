"""CPU time and peak memory of the time predictor on GPT-3 175B on 1,024 A100s.

Run: ``python benchmarks/predict_speed.py [MICRO_BATCHES ...] [--exact]`` (default 12 48 192
768). Tensor parallelism 8, pipeline parallelism 16 (1F1B), data parallelism 8, 8 samples per
micro-batch over the replicas (one per replica), so the global batch is 8 x micro-batches (192
micro-batches: Brown et al.'s 1,536). Each count runs in a fresh process, so that peak memory
(``resource.getrusage``'s ``ru_maxrss`` of that process) is its own; CPU time is
``time.process_time``, split into building the workload and predicting (symmetry, replay,
report). ``--exact`` replays every micro-batch (``stg predict --exact``).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

GPT3_175B = dict(
    model="gpt", dmodel=12288, dff=49152, head=96, kvhead=96, num_stacks=96, seq=2048,
    dvocal=51200, tp=8, pp=16, dp=8, micro_batch=8,
)  # fmt: skip
DEFAULT_COUNTS = (12, 48, 192, 768)


def measure(micro_batches: int, exact: bool) -> dict[str, float | int | str]:
    """One prediction in this process: CPU seconds of each step and peak RSS in MB."""
    from stg.core.options import GenerateOptions
    from stg.core.pipeline import build_workload
    from stg.host.registry import load_registry
    from stg.predictors.time import predict_time

    start = time.process_time()
    options = GenerateOptions(**GPT3_175B, batch=8 * micro_batches)
    workload = build_workload(options, load_registry(autoload=False))
    built = time.process_time()
    kwargs = {"exact": True} if exact else {}
    report = predict_time(workload, "a100-80g", **kwargs)
    done = time.process_time()
    return {
        "micro_batches": micro_batches,
        "build_cpu_s": built - start,
        "predict_cpu_s": done - built,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "iteration_time_s": report["iteration_time_s"],
        "replay": (report.get("replay") or {}).get("kind", "full"),
    }


def main(argv: list[str]) -> int:
    exact = "--exact" in argv
    counts = [int(a) for a in argv if a != "--exact" and a != "--one"] or list(DEFAULT_COUNTS)
    if "--one" in argv:  # the child: one count, one JSON line
        print(json.dumps(measure(counts[0], exact)))
        return 0
    for count in counts:
        flags = ["--one", str(count)] + (["--exact"] if exact else [])
        out = subprocess.run(
            [sys.executable, __file__, *flags], check=True, capture_output=True, text=True
        ).stdout
        row = json.loads(out.strip().splitlines()[-1])
        print(
            f"{row['micro_batches']:>4} micro-batches: build {row['build_cpu_s']:.2f} s, "
            f"predict {row['predict_cpu_s']:.2f} s ({row['replay']} replay), peak RSS "
            f"{row['peak_rss_mb']:.0f} MB; iteration {row['iteration_time_s']:.6f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
