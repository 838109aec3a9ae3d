"""``stg serve`` against published serving measurements (dev points, tests/data/serving/):
each point's requests are replayed through the simulation twice, without the engine's
profile and multi-step setting ("before": one step per scheduler call, no CPU cost) and with
them ("after"), and the errors on the latency percentiles are printed in the run's summary.
The constants of stg and of its engine profiles are not tuned to these points; the test
asserts only that every point runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stg.core.options import GenerateOptions, resolve_model
from stg.explore.serve import EngineConfig, request_table, simulate
from stg.explore.serve_cost import replica_blocks, replica_pricer
from stg.explore.serve_profiles import engine_profile
from stg.explore.serve_requests import Stream
from stg.perf.system import load_system
from stg.testing import make_registry

DATA = Path(__file__).parent / "data" / "serving" / "lambda_vllm.json"
POINTS = json.loads(DATA.read_text(encoding="utf-8"))["points"]
TITLE = "stg serve against published serving measurements (error = predicted / measured - 1)"


def _predict(point: dict, *, engine_settings: bool) -> dict[str, np.ndarray]:
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
    # a request whose text came back empty (output 0, no first chunk) was still prefilled and
    # sampled one token (end of sequence): it runs, and is left out of the percentiles
    requests = point["requests"]
    stream = Stream(
        np.array([r["arrival_s"] for r in requests]),
        np.array([r["prompt"] for r in requests]),
        np.array([max(r["output"], 1) for r in requests]),
    )
    profile = engine_profile(engine["profile"] if engine_settings else "none")
    config = EngineConfig(
        scheduler=engine["scheduler"],
        max_num_seqs=engine["max_num_seqs"],
        max_num_batched_tokens=engine["max_num_batched_tokens"],
        blocks=blocks,
        num_scheduler_steps=engine["num_scheduler_steps"] if engine_settings else 1,
        iteration_overhead_s=profile.scheduler_overhead_s,
        stream_round_end=profile.stream_round_end,
        output_lag=profile.output_lag,
    )
    table = request_table(simulate(stream, pricer, config))
    answered = np.array([r["output"] > 0 for r in requests])
    return {k: v[answered] for k, v in table.items()}


def _rows(point: dict, table: dict[str, np.ndarray]) -> list[tuple[str, float, float]]:
    """(percentile, predicted, measured) in seconds."""
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
    return rows


@pytest.mark.parametrize("point", POINTS, ids=[p["id"] for p in POINTS])
def test_published_serving_points(point: dict, report_table) -> None:
    before = _rows(point, _predict(point, engine_settings=False))
    after = _rows(point, _predict(point, engine_settings=True))
    engine = point["engine"]
    lines = [
        f"{point['id']} ({point['source']['url']}); after: --engine-profile "
        f"{engine['profile']} --num-scheduler-steps {engine['num_scheduler_steps']}",
        f"  {'':9} {'measured':>10} {'before':>10} {'error':>7} {'after':>10} {'error':>7}",
    ]
    for (name, old, measured), (_, new, _) in zip(before, after, strict=True):
        assert old > 0 and new > 0 and measured > 0
        lines.append(
            f"  {name:9} {1e3 * measured:7.1f} ms {1e3 * old:7.1f} ms "
            f"{100 * (old / measured - 1):+6.1f}% {1e3 * new:7.1f} ms "
            f"{100 * (new / measured - 1):+6.1f}%"
        )
    report_table(f"{TITLE}: {point['id']}", lines)
    print("\n".join(lines))


def test_published_serving_summary(report_table) -> None:
    """Mean |error| over every latency percentile of every point, before and after."""
    errors: dict[str, list[float]] = {"before": [], "after": []}
    for point in POINTS:
        for key, settings in (("before", False), ("after", True)):
            rows = _rows(point, _predict(point, engine_settings=settings))
            errors[key].extend(abs(p / m - 1) for _, p, m in rows)
    lines = [
        f"{key}: mean |error| {100 * float(np.mean(v)):.1f}% over {len(v)} latency percentiles "
        f"of {len(POINTS)} points"
        for key, v in errors.items()
    ]
    assert len(errors["before"]) == len(errors["after"]) > 0
    report_table(f"{TITLE}: summary", lines)
    print("\n".join(lines))
