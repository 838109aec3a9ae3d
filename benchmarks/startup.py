"""Start-up cost of the command line: CPU seconds of short commands, each in a fresh process.

    python benchmarks/startup.py [--repeats 5] [--json]

Runs, ``--repeats`` times each (default 5), in a fresh ``python`` process: ``import stg.cli``,
``stg --help``, ``stg predict --help`` and ``stg generate --help`` (which list the models and
predictors), ``stg feed`` on a one-rank trace (``stg generate --model gpt --num_stacks 2``,
written once into a temporary directory) and ``stg
predict --predictor analytical`` for GPT-3 175B on 1,024 A100s (tp 8, pp 16, dp 8, batch
1,536, 192 micro-batches), and prints the median CPU time (user + system) of each, with the
number of modules the command imported, how many of them had no current bytecode cache (so
were compiled from source in every run: ``PYTHONDONTWRITEBYTECODE`` set, or a tree that
cannot be written) and whether sympy was among them.

Installed plugins load as they would for a user (set ``STG_DISABLE_PLUGIN_AUTOLOAD=1`` to
measure stg alone). The analytical prediction reads the one- and two-layer workloads it
prices from a cache folder that an unmeasured run filled, as a user's repeated predictions do;
the rows after it build them every time (``STG_CACHE_DIR=``), and build and store them in an
empty cache folder (a first run). It also runs against an older stg
(``PYTHONPATH=old/tree python benchmarks/startup.py``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable

GPT3_1024 = [
    "--model", "gpt3-175b", "--tp", "8", "--pp", "16", "--dp", "8",
    "--batch", "1536", "--micro_batch", "8", "--predictor", "analytical", "--json",
]  # fmt: skip

WARM_CACHE = "stg predict analytical 175B/1024"
"""Reads its reduced workloads from a cache folder that a run before the measured ones filled."""
NO_CACHE = "  the same, no cache (builds)"
"""The analytical row again with ``STG_CACHE_DIR=`` (its reduced workloads built each time)."""
COLD_CACHE = "  the same, empty cache (stores)"
"""The analytical row again with ``STG_CACHE_DIR`` a new empty folder each run."""

# Runs the CLI (or only imports it), then reports the modules imported, on stderr's last line.
PROBE = """
import atexit, json, os, sys
def from_source():
    count = 0
    for module in list(sys.modules.values()):
        spec = getattr(module, "__spec__", None)
        origin, cached = getattr(spec, "origin", None), getattr(spec, "cached", None)
        if not (isinstance(origin, str) and origin.endswith(".py") and cached):
            continue
        try:
            count += os.stat(cached).st_mtime_ns < os.stat(origin).st_mtime_ns
        except OSError:
            count += 1
    return count
def report():
    mods = sorted(sys.modules)
    sys.stderr.write("\\nSTARTUP " + json.dumps({"modules": len(mods),
                     "sympy": "sympy" in sys.modules, "from_source": from_source()}) + "\\n")
atexit.register(report)
args = sys.argv[1:]
if args == ["--import-only"]:
    import stg.cli
else:
    from stg.cli import main
    sys.argv[0] = "stg"
    main(args)
"""


def cases(trace: str) -> dict[str, list[str]]:
    """The commands measured, by label (``trace``: the one-rank trace that feed reads)."""
    return {
        "import stg.cli": ["--import-only"],
        "stg --help": ["--help"],
        "stg predict --help": ["predict", "--help"],
        "stg generate --help": ["generate", "--help"],
        "stg feed (1 rank)": ["feed", trace],
        WARM_CACHE: ["predict", *GPT3_1024],
        NO_CACHE: ["predict", *GPT3_1024],
        COLD_CACHE: ["predict", *GPT3_1024],
    }


def run_once(args: list[str], env: dict[str, str] | None = None) -> tuple[float, dict]:
    """CPU seconds (user + system) of one fresh process running ``args`` (with ``env`` added
    to the environment), and its probe."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        # -P: not the working directory first on sys.path, which would shadow PYTHONPATH's stg
        [sys.executable, "-P", "-c", PROBE, *args],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **(env or {})},
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{args}: exit {done.returncode}\n{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    line = next(x for x in reversed(done.stderr.splitlines()) if x.startswith("STARTUP "))
    return cpu, json.loads(line[len("STARTUP ") :])


def _median(args: list[str], repeats: int, env: Callable[[], dict[str, str]]) -> tuple[float, dict]:
    """The median CPU seconds of ``repeats`` runs of ``args`` (each with ``env()`` added to
    the environment), and the last run's probe."""
    runs = [run_once(args, env()) for _ in range(repeats)]
    return statistics.median(cpu for cpu, _ in runs), runs[-1][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    ns = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="stg-startup-") as tmp:
        generate = ["generate", "--model", "gpt", "--num_stacks", "2", "--output_dir", tmp]
        run_once(generate)
        warm = {"STG_CACHE_DIR": os.path.join(tmp, "cache")}
        run_once(cases(tmp)[WARM_CACHE], warm)  # fills it
        fresh = itertools.count()

        def env_of(label: str) -> Callable[[], dict[str, str]]:
            if label == NO_CACHE:
                return lambda: {"STG_CACHE_DIR": ""}
            if label == COLD_CACHE:  # a folder of its own for each run
                return lambda: {"STG_CACHE_DIR": os.path.join(tmp, f"cache-{next(fresh)}")}
            return lambda: warm

        measured = {
            label: _median(args, ns.repeats, env_of(label)) for label, args in cases(tmp).items()
        }
    for label, (cpu, probe) in measured.items():
        results[label] = {"cpu_s": cpu, **probe}
    if ns.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{'command':36} {'CPU s (median)':>15} {'modules':>8} {'compiled':>9}  sympy")
    for label, r in results.items():
        print(
            f"{label:36} {r['cpu_s']:15.3f} {r['modules']:8d} {r['from_source']:9d}  "
            f"{'yes' if r['sympy'] else 'no'}"
        )
    if any(r["from_source"] for r in results.values()):
        print(
            "compiled: modules without a current bytecode cache, compiled from source in every "
            "run (PYTHONDONTWRITEBYTECODE set, or a read-only tree): the CPU times include it"
        )


if __name__ == "__main__":
    main()
