"""CPU time of ``stg predict --predictor time`` on the plans of the published runs that the
tests predict (tests/data/runs/cluster_runs.json and blackwell_runs.json): how many of today's
plans take the periodic replay (the fill, a period or two and the drain, extrapolated) and how
many fall back to replaying every micro-batch, and what each costs.

Run: ``python benchmarks/predict_published_plans.py [--tree DIR] [--only ID ...] [--slow]``
(``--slow``: also the runs a table keeps as ``slow_entries``, spelled but left out of the
tests for their replay's cost).

Each row is one ``stg predict`` process of the run's plan, as its entry spells it (its system
preset and options; the ``stg`` of the checkout ``--tree`` where given, else the installed
one): CPU is its user + system time (``os.wait4``), startup included; ``replay`` is the
report's (``periodic``, with the micro-batches lowered, or ``full``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import predict_speed

RUNS = Path(__file__).resolve().parent.parent / "tests" / "data" / "runs"
TABLES = ("cluster_runs.json", "blackwell_runs.json")


def flag_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def predict_args(entry: dict) -> list[str]:
    options = {"model": entry["model"], **entry["options"]}
    flags = [f"--{k}={flag_value(v)}" for k, v in options.items() if v is not None]
    system = entry["system"]  # a preset, or a system file named relative to the data
    if system.endswith(".json"):
        system = str(RUNS / system)
    return ["predict", "--predictor", "time", "--system", system, "--json", *flags]


def measure(entry: dict, tree: str | None) -> dict[str, object]:
    result = predict_speed.run(predict_args(entry), tree=tree)
    if result["error"]:
        return {"cpu_s": result["cpu_s"], "error": result["error"]}
    report = result["report"]
    report = report.get("time", report)  # type: ignore[union-attr]
    return {
        "cpu_s": result["cpu_s"],
        "replay": report.get("replay", {}),
        "time_s": report["iteration_time_s"],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", help="a checkout whose stg runs the predictions")
    parser.add_argument("--only", nargs="*", default=[], help="entry ids to run (default: all)")
    parser.add_argument(
        "--slow", action="store_true", help="also the spelled runs the tests leave out as slow"
    )
    args = parser.parse_args(argv)
    lists = ("entries", "slow_entries") if args.slow else ("entries",)
    entries = [
        e
        for name in TABLES
        for key in lists
        for e in json.loads((RUNS / name).read_text()).get(key, [])
    ]
    if args.only:
        entries = [e for e in entries if e["id"] in args.only]
    print(f"{'run':<50} {'replay':<18} {'CPU s':>7} {'iteration s':>12}")
    total = 0.0
    counted = 0
    for entry in entries:
        result = measure(entry, args.tree)
        total += float(result["cpu_s"])  # type: ignore[arg-type]
        if "error" in result:
            print(f"{entry['id']:<50} error: {result['error']}")
            continue
        replay = result["replay"]
        kind = replay.get("kind", "?")  # type: ignore[union-attr]
        if kind == "periodic":
            counted += 1
            kind = f"periodic ({replay.get('lowered_micro_batches')} mb)"  # type: ignore[union-attr]
        print(f"{entry['id']:<50} {kind:<18} {result['cpu_s']:7.2f} {result['time_s']:12.4f}")
    print(f"{counted} of {len(entries)} plans periodic; CPU {total:.1f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
