"""``stg serve`` against published serving measurements (dev points, tests/data/serving/):
each point's requests are replayed through the simulation with the engine's settings, and
the errors on the latency percentiles are printed in the run's summary. The constants of
stg are not tuned to these points; the test asserts only that every point runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stg.core.options import GenerateOptions, resolve_model
from stg.explore.serve import EngineConfig, request_table, simulate
from stg.explore.serve_cost import replica_blocks, replica_pricer
from stg.explore.serve_requests import Stream
from stg.perf.system import load_system
from stg.testing import make_registry

DATA = Path(__file__).parent / "data" / "serving" / "lambda_vllm.json"
POINTS = json.loads(DATA.read_text(encoding="utf-8"))["points"]
TITLE = "stg serve against published serving measurements (error = predicted / measured - 1)"


def _predict(point: dict) -> dict[str, np.ndarray]:
    registry = make_registry()
    values, _ = resolve_model(
        {"model": point["model"], "tp": point["tp"], "causal": True}, registry
    )
    base = GenerateOptions(**{**values, "phase": "decode", "batch": 1, "dtype": point["dtype"]})
    pricer = replica_pricer(base, load_system(point["system"]), registry)
    engine = point["engine"]
    blocks = replica_blocks(
        pricer,
        base,
        registry,
        tokens=engine["max_num_batched_tokens"],
        block_size=16,
        memory_fraction=engine["gpu_memory_utilization"],
    )
    served = [r for r in point["requests"] if r["output"] > 0]
    stream = Stream(
        np.array([r["arrival_s"] for r in served]),
        np.array([r["prompt"] for r in served]),
        np.array([r["output"] for r in served]),
    )
    config = EngineConfig(
        scheduler=engine["scheduler"],
        max_num_seqs=engine["max_num_seqs"],
        max_num_batched_tokens=engine["max_num_batched_tokens"],
        blocks=blocks,
    )
    return request_table(simulate(stream, pricer, config))


@pytest.mark.parametrize("point", POINTS, ids=[p["id"] for p in POINTS])
def test_published_serving_points(point: dict, report_table) -> None:
    table = _predict(point)
    measured_ttft = np.array([r["ttft_s"] for r in point["requests"] if r["output"] > 0])
    rows = [
        ("TTFT p50", np.percentile(table["ttft_s"], 50), np.percentile(measured_ttft, 50)),
        ("TTFT p99", np.percentile(table["ttft_s"], 99), np.percentile(measured_ttft, 99)),
    ]
    tpot = table["tpot_s"][~np.isnan(table["tpot_s"])]
    rows.append(("TPOT p50", np.median(tpot), point["measured"]["median_tpot_ms"] / 1e3))
    if point["measured"]["median_latency_ms"] is not None:
        latency = point["measured"]["median_latency_ms"] / 1e3
        rows.append(("E2E p50", np.median(table["e2e_s"]), latency))
    lines = [f"{point['id']} ({point['source']['url']}):"]
    for name, predicted, measured in rows:
        assert predicted > 0 and measured > 0
        lines.append(
            f"  {name:9} predicted {1e3 * predicted:9.1f} ms  measured {1e3 * measured:9.1f} ms"
            f"  error {100 * (predicted / measured - 1):+6.1f}%"
        )
    report_table(f"{TITLE}: {point['id']}", lines)
    print("\n".join(lines))
