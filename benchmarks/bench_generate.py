"""Wall time and peak RSS of `stg generate` for the reference cases of the issues.

Run: python benchmarks/bench_generate.py [--only NAME] [--repeat N]
(`--only dp100k` measures generation cost at 100,000 ranks, which must stay under 60 s.)
Each case runs `stg generate` in a fresh process (so imports count, as for a user) writing
into a temporary directory; peak RSS is the child's ru_maxrss from os.wait4.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

SMALL_MODEL = [
    "--num_stacks",
    "1",
    "--dmodel",
    "64",
    "--dff",
    "256",
    "--head",
    "4",
    "--kvhead",
    "4",
    "--seq",
    "32",
    "--dvocal",
    "128",
]

CASES: dict[str, list[str]] = {
    "a: dp2 tp2 pp2 (default sizes, 80 layers)": ["--dp", "2", "--tp", "2", "--pp", "2"],
    "b: dp8 tp4 pp4 (128 ranks, 1 micro-batch)": ["--dp", "8", "--tp", "4", "--pp", "4"],
    "c: dp8 tp4 pp4, 8 micro-batches": [
        "--dp",
        "8",
        "--tp",
        "4",
        "--pp",
        "4",
        "--batch",
        "64",
        "--micro_batch",
        "8",
    ],
    # generation and writing must stay linear in the number of ranks (issue 8): 100,000 ranks
    # of a one-layer model in the default format (chakra-v0.0.4), one file per rank
    "dp100k: dp 100000, one small layer (100,000 rank files)": [
        "--dp",
        "100000",
        "--batch",
        "100000",
        *SMALL_MODEL,
    ],
    # dp·ep = 16 replicas need micro-batches of 16 samples: batch 128 gives 8 micro-batches
    "moe: dp4 tp2 pp4 ep4, batch 128, 8 micro-batches, 16 experts": [
        "--model",
        "moe",
        "--dp",
        "4",
        "--tp",
        "2",
        "--pp",
        "4",
        "--ep",
        "4",
        "--batch",
        "128",
        "--micro_batch",
        "16",
        "--experts",
        "16",
    ],
    # serving (issue 17): 64 decode steps of Llama 3 70B over tp 8 x pp 2, 2 micro-batches,
    # the graph bound once per step (the cache grows by one token each)
    "decode: llama3-70b tp8 pp2, 64 steps, 2 micro-batches": [
        "--model",
        "llama3-70b",
        "--phase",
        "decode",
        "--tp",
        "8",
        "--pp",
        "2",
        "--batch",
        "64",
        "--micro_batch",
        "32",
        "--steps",
        "64",
        "--context",
        "4096",
    ],
    "fsdp: dp8 tp4 pp4, 8 micro-batches, weight_sharded": [
        "--dp",
        "8",
        "--tp",
        "4",
        "--pp",
        "4",
        "--micro_batch",
        "8",
        "--weight_sharded",
        "true",
    ],
    "all: moe dp2 tp2 sp2 pp4 ep4, 8 mb, fsdp, full recompute, mixed precision": [
        "--model",
        "moe",
        "--dp",
        "2",
        "--tp",
        "2",
        "--sp",
        "2",
        "--pp",
        "4",
        "--ep",
        "4",
        "--micro_batch",
        "8",
        "--experts",
        "16",
        "--weight_sharded",
        "true",
        "--activation_recompute",
        "full",
        "--mixed_precision",
        "true",
    ],
    "interleaved: dp8 tp4 pp4, 8 mb, 2 virtual stages, zero 1": [
        "--dp",
        "8",
        "--tp",
        "4",
        "--pp",
        "4",
        "--micro_batch",
        "8",
        "--pipeline_schedule",
        "interleaved",
        "--virtual_stages",
        "2",
        "--zero",
        "1",
    ],
}


def run(args: list[str]) -> tuple[float, float, int]:
    out = tempfile.mkdtemp(prefix="stg-bench-")
    try:
        cmd = [
            sys.executable,
            "-m",
            "stg",
            "generate",
            *args,
            "--output_dir",
            os.path.join(out, "trace"),
        ]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
        elapsed = time.perf_counter() - start
        if status != 0:
            raise SystemExit(
                f"failed: {' '.join(cmd)}\n{proc.stderr.read().decode() if proc.stderr else ''}"
            )
        size = sum(
            os.path.getsize(os.path.join(out, "trace", f))
            for f in os.listdir(os.path.join(out, "trace"))
        )
        return elapsed, usage.ru_maxrss / 1024, size
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", help="run the cases whose name starts with this")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case; the best is reported")
    ns = parser.parse_args()
    print(f"{'case':72} {'wall s':>8} {'peak RSS MB':>12} {'output MB':>10}")
    for name, args in CASES.items():
        if ns.only and not name.startswith(ns.only):
            continue
        results = [run(args) for _ in range(ns.repeat)]
        wall = min(r[0] for r in results)
        rss = max(r[1] for r in results)
        print(f"{name:72} {wall:8.2f} {rss:12.0f} {results[0][2] / 2**20:10.1f}", flush=True)


if __name__ == "__main__":
    main()
