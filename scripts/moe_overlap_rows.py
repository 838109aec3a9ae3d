"""The MoE rows of tests/data/runs/cluster_runs.json predicted with and without
``--overlap_moe_ep_comm`` (the time predictor, as tests/test_cluster_runs.py runs it).

Usage: python scripts/moe_overlap_rows.py [ROW_ID ...]   (default: every row with ep > 1)
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_cluster_runs import HEADER, RUNS, run_options, table_row

from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.predictors.time import predict_time


def main(ids: list[str]) -> int:
    registry = load_registry(autoload=False)
    print(f"{'overlap':<8} {HEADER}")
    for entry in RUNS:
        if entry["options"].get("ep", 1) <= 1 or (ids and entry["id"] not in ids):
            continue
        options = run_options(entry, registry)
        for overlap in (False, True):
            run = dataclasses.replace(options, overlap_moe_ep_comm=overlap)
            workload = build_workload(run, registry)
            report = predict_time(workload, entry["system"], kernels=list(registry.kernels))
            line, _, _ = table_row(entry, run, report["iteration_time_s"])
            mark = "*" if overlap == options.overlap_moe_ep_comm else " "
            print(f"{str(overlap).lower() + mark:<8} {line}", flush=True)
    print("* the row's own setting (cluster_runs.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
