"""Capacity planning for serving: the fewest replicas of each shape within the limits."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stg.core.options import GenerateOptions, resolve_model
from stg.errors import UserError
from stg.explore.serve import EngineConfig, simulate
from stg.explore.serve_cost import kv_transfer, replica_blocks, replica_pricer
from stg.explore.serve_requests import generate
from stg.explore.serve_search import Limits, serving_capacity
from stg.perf.system import load_system
from stg.testing import make_registry

LIMITS = Limits(ttft=(99, 0.1), tpot=(90, 0.002))


@pytest.fixture(scope="module")
def setting():
    registry = make_registry()
    values, _ = resolve_model({"model": "llama3-8b", "num_stacks": 2, "causal": True}, registry)
    base = GenerateOptions(**{**values, "phase": "decode", "batch": 1})
    stream = generate(
        arrival="poisson", rate=200, duration=10, prompt="fixed:2048", output="fixed:64", seed=0
    )
    return registry, base, load_system("h100-80g"), stream


def test_each_plan_is_the_fewest_replicas_within_the_limits(setting) -> None:
    registry, base, system, stream = setting
    result = serving_capacity(stream, base, system, registry, LIMITS, max_gpus=16, tps=(1, 2, 32))
    assert "tp 32, KV bf16, budget 2048" in result.skipped
    assert result.plans and result.simulations > 0
    gpus = [p.gpus for p in result.plans]
    assert gpus == sorted(gpus)
    for plan in [p for p in result.plans if not p.prefill_replicas]:
        options = replace(base, tp=plan.tp)
        pricer = replica_pricer(options, system, registry)
        blocks = replica_blocks(
            pricer, options, registry, tokens=2048, block_size=16, memory_fraction=0.9
        )
        for replicas, meets in ((plan.replicas, True), (plan.replicas - 1, False)):
            if replicas < 1:
                continue
            sim = simulate(
                stream,
                pricer,
                EngineConfig(replicas=replicas, blocks=blocks),
                transfer_time=kv_transfer(pricer),
            )
            assert LIMITS.met(LIMITS.measure(sim)) is meets, (plan, replicas)
    assert any(p.prefill_replicas for p in result.plans)


def test_capacity_planning_refuses_what_it_cannot_do(setting) -> None:
    registry, base, system, stream = setting
    with pytest.raises(UserError, match="needs a latency limit"):
        serving_capacity(stream, base, system, registry, Limits(), max_gpus=4)
    with pytest.raises(UserError, match="allowed values are aggregated, disaggregated"):
        serving_capacity(stream, base, system, registry, LIMITS, max_gpus=4, layouts=("mixed",))
    tight = Limits(tpot=(50, 1e-6))  # no layout decodes a token in a microsecond
    assert serving_capacity(stream, base, system, registry, tight, max_gpus=2, tps=(1,)).plans == []
