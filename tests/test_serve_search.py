"""Capacity planning for serving: the fewest replicas of each shape within the limits."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions, resolve_model
from stg.errors import UserError
from stg.explore.serve import EngineConfig, simulate
from stg.explore.serve_cost import kv_transfer, replica_blocks, replica_pricer
from stg.explore.serve_defaults import TOKENIZE_TOKENS_PER_S
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


def test_a_process_pool_plans_what_this_process_plans(setting) -> None:
    from stg.explore.sweep import Engine

    registry, base, system, stream = setting
    kw = dict(max_gpus=4, tps=(1, 2), budgets=(512, 2048), layouts=("aggregated",))
    alone = serving_capacity(stream, base, system, registry, LIMITS, **kw)
    pool = Engine(2)
    try:
        spread = serving_capacity(stream, base, system, registry, LIMITS, runner=pool, **kw)
    finally:
        pool.close()
    assert [p.as_dict() for p in spread.plans] == [p.as_dict() for p in alone.plans]
    assert spread.simulations == alone.simulations
    assert {p.max_num_batched_tokens for p in alone.plans} == {512, 2048}


# -- stg search --phase serve -------------------------------------------------------------------

SEARCH = [
    "search", "--phase", "serve", "--model", "llama3-8b", "--num_stacks", "2", "-s", "h100-80g",
    "--gpus", "4", "--tp", "1,2", "--rate", "200", "--duration", "10", "--prompt", "fixed:2048",
    "--output", "fixed:64", "--max-ttft", "p99:100ms", "--max-tpot", "p90:2ms", "--jobs", "1",
]  # fmt: skip


def test_cli_plans_as_the_library_does(setting) -> None:
    registry, base, system, stream = setting
    result = CliRunner().invoke(app, [*SEARCH, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    tokenizing = EngineConfig(tokenize_rate=TOKENIZE_TOKENS_PER_S)  # as stg serve's default
    want = serving_capacity(
        stream, base, system, registry, LIMITS, max_gpus=4, tps=(1, 2), engine=tokenizing
    )
    assert data["best"] == [p.as_dict() for p in want.plans[:5]]
    assert data["limits"] == {
        "ttft": {"percentile": 99.0, "seconds": 0.1},
        "tpot": {"percentile": 90.0, "seconds": 0.002},
    }
    text = CliRunner().invoke(app, SEARCH)
    assert text.exit_code == 0 and "cheapest layouts" in text.stdout


def test_cli_limits_default_to_p99_ttft_and_p90_tpot() -> None:
    args = [a.replace("p99:", "").replace("p90:", "") for a in SEARCH]
    data = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert data["limits"]["ttft"]["percentile"] == 99.0
    assert data["limits"]["tpot"]["percentile"] == 90.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ep", "2"], "--ep 2: model 'llama' has no experts to split"),
        (["--ep", "0"], "--pp and --ep take positive integers"),
        (["--pp", "0"], "--pp and --ep take positive integers"),
        (["--replica-batch", "8"], "--replica-batch is not searched by capacity planning"),
        (["--layouts", "mixed"], "--layouts 'mixed' is not allowed; allowed: aggregated"),
        (["--routing", "random"], "--routing 'random': allowed values are"),
        (["--max-ttft", "p0:1s"], "--max-ttft 'p0:1s': the percentile is pNN"),
        (["--rate", "fast"], "--rate 'fast': expected a number"),
        (["--engine", "dask"], "--engine dask needs --scheduler"),
    ],
)
def test_cli_errors_are_one_line(extra, message) -> None:
    result = CliRunner().invoke(app, [*SEARCH, *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_stream_options_need_phase_serve() -> None:
    result = CliRunner().invoke(
        app, ["search", "--model", "llama3-8b", "--gpus", "8", "--rate", "2"]
    )
    assert result.exit_code == 2
    assert "--rate is an option of capacity planning; give --phase serve" in result.output
