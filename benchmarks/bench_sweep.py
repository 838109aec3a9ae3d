"""Configurations per second of ``stg sweep`` with the analytical predictor.

1. In one process: the analytical predictor and the memory predictor on distinct
   configurations of GPT-3 175B (dp x tp x pp x micro-batch x recompute x ZeRO, up to 1,024
   ranks), as a sweep's worker evaluates them: configurations per CPU second.
2. ``stg sweep`` of 10,000+ configurations end to end with ``--engine local`` (``--jobs``
   workers): wall time and CPU time (this process and its children).
3. The same sweep on a Dask LocalCluster of 2 worker processes (``--scheduler local:2``).

Run: ``python benchmarks/bench_sweep.py [--skip-dask]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPEC = """\
model = "gpt3-175b"
dvocal = 50304
batch = 1536
dp = "pow2:1..64"
tp = [1, 2, 4, 8]
pp = [1, 2, 4, 8, 16]
micro_batch = [48, 64, 96, 128, 192, 384, 768, 1536]
activation_recompute = ["none", "selective", "full"]
zero = [0, 1, 2]
"""


def cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def in_process(limit: int) -> dict[str, float]:
    from stg.core.options import resolve_model
    from stg.core.pipeline import validate_options
    from stg.explore.sweep import Context, evaluate
    from stg.host.registry import load_registry
    from stg.perf.system import load_system

    registry = load_registry()
    base, _ = resolve_model({"model": "gpt3-175b", "dvocal": 50304, "batch": 1536}, registry)
    from stg.core.options import GenerateOptions

    tasks = []
    for dp, tp, pp, micro, recompute, zero in itertools.product(
        (1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8), (1, 2, 4, 8, 16), (64, 128, 384, 1536),
        ("none", "selective", "full"), (0, 1, 2),
    ):
        if dp * tp * pp > 1024:
            continue
        o = GenerateOptions(
            **{**base, "dp": dp, "tp": tp, "pp": pp, "micro_batch": micro,
               "activation_recompute": recompute, "zero": zero}
        )
        try:
            validate_options(o, registry)
        except Exception:
            continue
        tasks.append((str(len(tasks)), len(tasks), o, "h100-80g"))
    random.Random(0).shuffle(tasks)  # a sample over the whole space, up to 1,024 ranks
    tasks = tasks[:limit]
    context = Context("analytical", {"h100-80g": load_system("h100-80g").as_dict()})
    start_cpu, start = time.process_time(), time.perf_counter()
    rows = [evaluate(context, t) for t in tasks]
    cpu, wall = time.process_time() - start_cpu, time.perf_counter() - start
    assert all(r["status"] == "ok" for r in rows), [r["error"] for r in rows if r["error"]][:3]
    return {"configurations": len(rows), "cpu_s": cpu, "wall_s": wall,
            "per_cpu_second": len(rows) / cpu, "max_ranks": max(t[2].world_size for t in tasks)}


def sweep(args: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.toml"
        spec.write_text(SPEC)
        before_cpu, start = cpu_seconds(), time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "stg", "sweep", str(spec), "-s", "h100-80g", "-o",
             str(Path(tmp) / "out"), "--json", *args],
            capture_output=True, text=True, check=False,
        )
        wall, cpu = time.perf_counter() - start, cpu_seconds() - before_cpu
        if done.returncode:
            raise SystemExit(done.stderr)
        summary = json.loads(done.stdout)
    return {"configurations": summary["configurations"], "valid": summary["valid"],
            "wall_s": wall, "cpu_s": cpu, "valid_per_second": summary["valid"] / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-dask", action="store_true")
    parser.add_argument("--limit", type=int, default=2000)
    options = parser.parse_args()
    print(f"cores: {os.cpu_count()}")
    print("in process:", json.dumps(in_process(options.limit)))
    print("stg sweep --engine local -j 2:", json.dumps(sweep(["-j", "2"])))
    if not options.skip_dask:
        print(
            "stg sweep --engine dask --scheduler local:2:",
            json.dumps(sweep(["--engine", "dask", "--scheduler", "local:2"])),
        )


if __name__ == "__main__":
    main()
