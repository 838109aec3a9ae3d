"""Predicted iteration times against Korthikanti et al. Table 5 (full recompute, A100).

Each published point must be predicted within 10 % with the a100-80g preset, whose
efficiency factors are physical (see stg/perf/system.py), not fitted to these points. GPT-530B
and GPT-1T take about a minute each (millions of nodes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.predictors.time import predict_time

GROUNDTRUTH = Path(__file__).resolve().parents[1].parent / "shared/data/groundtruth-dev.json"
TOLERANCE = 0.10


def table5() -> list[dict]:
    if not GROUNDTRUTH.exists():
        return []
    data = json.loads(GROUNDTRUTH.read_text())
    return [e for e in data["entries"] if e["metric"] == "iteration_time"]


def options_of(entry: dict) -> GenerateOptions:
    m, p = entry["model"], entry["parallel"]
    chunks = p["pipeline_interleaving"]
    return GenerateOptions(
        model="gpt",
        dmodel=m["hidden"],
        dff=m["ffn_hidden"],
        head=m["heads"],
        kvhead=m["heads"],
        num_stacks=m["layers"],
        seq=m["seq_len"],
        dvocal=m["vocab"],
        batch=p["global_batch"],
        micro_batch=p["micro_batch"] * p["dp"],
        dp=p["dp"],
        tp=p["tp"],
        pp=p["pp"],
        virtual_stages=chunks,
        pipeline_schedule="interleaved" if chunks > 1 else "1f1b",
        activation_recompute="full",
        tpsp=p.get("sequence_parallel", False),
        mixed_precision=True,
        dtype="fp16",
    )


@pytest.mark.parametrize("entry", table5(), ids=lambda e: e["id"])
def test_table5_iteration_time(entry: dict) -> None:
    workload = build_workload(options_of(entry), load_registry(autoload=False))
    report = predict_time(workload, "a100-80g")
    predicted = report["iteration_time_s"]
    assert predicted == pytest.approx(entry["value"], rel=TOLERANCE), (
        f"{entry['id']}: predicted {predicted:.3f} s, published {entry['value']} s"
    )
