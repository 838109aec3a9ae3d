"""Plans per CPU second of ``stg search`` for GPT-3 175B on 1,024 A100s (batch 1,536).

Run: ``python benchmarks/search_speed.py [--refine N ...]`` (default 5 and 0). Each search
runs in a fresh process (``--jobs 1``: the pricing in that process), so that its CPU time
(user + system of the child, from ``resource.getrusage(RUSAGE_CHILDREN)``) is its own; the
figure is the plans the search enumerated over that CPU time, as the issue counts them.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

COMMAND = [
    "search", "--model", "gpt3-175b", "--gpus", "1024", "--batch", "1536",
    "--system", "a100-80g", "--jobs", "1", "--json",
]  # fmt: skip


def measure(refine: int) -> dict[str, float | int | str]:
    """One search in a child process: CPU seconds, plans enumerated and the best plan."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    args = [sys.executable, "-m", "stg", *COMMAND, "--refine", str(refine)]
    done = subprocess.run(args, capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = json.loads(done.stdout)
    best = result["best"][0]
    return {
        "refine": refine,
        "cpu_s": round(cpu, 2),
        "enumerated": result["enumerated"],
        "plans_per_cpu_s": round(result["enumerated"] / cpu, 1),
        "best": json.dumps(best["plan"], sort_keys=True),
        "best_time_s": (best.get("time") or best.get("analytical") or {}).get("iteration_time_s"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--refine", type=int, nargs="*", default=[5, 0])
    for refine in parser.parse_args().refine:
        print(json.dumps(measure(refine)))


if __name__ == "__main__":
    main()
