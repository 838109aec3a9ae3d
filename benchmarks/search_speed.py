"""Plans per CPU second of ``stg search`` for GPT-3 175B on 1,024 A100s (batch 1,536).

Run: ``python benchmarks/search_speed.py [--refine N ...] [--tree DIR] [--repeat R]``
(default ``--refine 5 0``). Each search runs in a fresh process (``--jobs 1``: the pricing in
that process), so that its CPU time (user + system of the child, from
``resource.getrusage(RUSAGE_CHILDREN)``) is its own; the figure is the plans the search
enumerated over that CPU time, as the issue counts them. ``--tree DIR`` also runs another
checkout of stg (e.g. ``git archive REV | tar -x -C DIR``) in turn with this one, so that both
share the machine's load; ``--repeat`` runs each search that many times.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

COMMAND = [
    "search", "--model", "gpt3-175b", "--gpus", "1024", "--batch", "1536",
    "--system", "a100-80g", "--jobs", "1", "--json",
]  # fmt: skip


def measure(refine: int, tree: str | None = None) -> dict[str, float | int | str | None]:
    """One search in a child process (of the checkout ``tree``, else the installed stg): CPU
    seconds, plans enumerated and the best plan."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    args = [sys.executable, "-m", "stg", *COMMAND, "--refine", str(refine)]
    done = subprocess.run(args, capture_output=True, text=True, check=True, env=env, cwd=tree)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = json.loads(done.stdout)
    best = result["best"][0]
    return {
        "tree": tree or "installed",
        "refine": refine,
        "cpu_s": round(cpu, 2),
        "enumerated": result["enumerated"],
        "plans_per_cpu_s": round(result["enumerated"] / cpu, 1),
        "refined": result["refined"],
        "best": json.dumps(best["plan"], sort_keys=True),
        "best_time_s": (best.get("time") or best.get("analytical") or {}).get("iteration_time_s"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--refine", type=int, nargs="*", default=[5, 0])
    parser.add_argument("--tree", help="another stg checkout to measure in turn with this one")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    trees = [None] if args.tree is None else [args.tree, None]
    for _ in range(args.repeat):
        for refine in args.refine:
            for tree in trees:
                print(json.dumps(measure(refine, tree)), flush=True)


if __name__ == "__main__":
    main()
