"""Pipelined serving replicas (``stg serve --pp``, ``stg search --phase serve --pp``): the
pricer against the replay of the pipeline's workloads, the cache of the fullest stage, vLLM
V0's virtual engines, and the capacity plans that count their GPUs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions, resolve_model
from stg.core.pipeline import build_workload
from stg.explore.serve import EngineConfig, simulate, summary
from stg.explore.serve_cost import Batch, pipeline_pricer, replica_blocks, replica_pricer
from stg.explore.serve_requests import generate
from stg.explore.serve_search import Limits, serving_capacity
from stg.perf.system import load_system
from stg.testing import make_registry


@pytest.fixture(scope="module")
def registry():
    return make_registry()


def replica(registry, **extra) -> GenerateOptions:
    values, _ = resolve_model({"model": "llama3-8b", "num_stacks": 4, "causal": True}, registry)
    return GenerateOptions(**{**values, "phase": "decode", "batch": 1, **extra})


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 2), (1, 4)])
def test_one_group_iterations_are_the_pipelines_step(registry, tp: int, pp: int) -> None:
    """A prefill or a decode step of a pipeline, one micro-batch: every stage in turn and the
    activations sent between them, as the replay of its workload."""
    system = load_system("h100-80g")
    base = replica(registry, tp=tp, pp=pp)
    pricer = pipeline_pricer(base, system, registry)
    serving = registry.predictors.get("serving")
    kernels = list(registry.kernels)
    for options, batch in (
        (replace(base, phase="prefill", batch=3, seq=200), Batch(((200, 200),) * 3, ())),
        (replace(base, batch=5, context=700, steps=1), Batch((), (701,) * 5)),
    ):
        want = serving.predict(build_workload(options, registry), system, kernels=kernels)
        assert pricer.price(batch) == pytest.approx(want["time_s"], rel=1e-9)
    flat = replica_pricer(replace(base, pp=1), system, registry)
    assert pricer.price(Batch((), (701,) * 5)) > flat.price(Batch((), (701,) * 5))


def test_a_pipeline_holds_the_cache_of_its_fullest_stage(registry) -> None:
    """Three stages of a 4-layer model: the stage of two layers holds twice the cache per
    token of the others, and decides the blocks."""
    system = load_system("h100-80g")
    flat_options = replica(registry)
    flat = replica_pricer(flat_options, system, registry)
    kw = dict(tokens=2048, block_size=16, memory_fraction=0.9)
    whole = replica_blocks(flat, flat_options, registry, **kw)
    staged = replica_blocks(flat, replace(flat_options, pp=3), registry, **kw)
    # its fullest GPU holds half the layers (2 of 4): about twice the blocks of one GPU
    assert 1.8 * whole < staged < 2.2 * whole


def test_cli_runs_pp_virtual_engines(registry) -> None:
    args = [
        "serve", "--model", "llama3-8b", "--num_stacks", "4", "--rate", "50", "--duration",
        "5", "--prompt", "fixed:512", "--output", "fixed:64", "--json",
    ]  # fmt: skip
    result = CliRunner().invoke(app, [*args, "--pp", "2", "--tp", "2"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["replicas"], report["pp"], report["virtual_engines"]) == (1, 2, 2)
    assert report["gpus"] == 4
    law = report["littles_law"]
    assert law["mean_in_system"] == pytest.approx(law["rate_times_time"], rel=1e-9)
    # the same as simulating two virtual engines with half the blocks each
    system = load_system("h100-80g")
    base = replica(registry, tp=2, pp=2, steps=1)
    pricer = pipeline_pricer(base, system, registry)
    blocks = replica_blocks(pricer, base, registry, tokens=2048, block_size=16, memory_fraction=0.9)
    stream = generate(
        arrival="poisson", rate=50, duration=5, prompt="fixed:512", output="fixed:64", seed=0
    )
    from stg.explore.serve_defaults import TOKENIZE_TOKENS_PER_S

    config = EngineConfig(replicas=2, blocks=blocks // 2, tokenize_rate=TOKENIZE_TOKENS_PER_S)
    want = summary(simulate(stream, pricer, config))
    assert report["ttft_s"] == pytest.approx(want["ttft_s"], rel=1e-12)
    assert report["kv_blocks_per_replica"] == blocks // 2
    bad = CliRunner().invoke(app, [*args, "--pp", "2", "--prefill-replicas", "1"])
    assert bad.exit_code == 2 and "--pp 2: a pipelined replica takes neither" in bad.output


def test_capacity_planning_searches_pipelines(registry) -> None:
    system = load_system("h100-80g")
    base = replica(registry, steps=1)
    stream = generate(
        arrival="poisson", rate=300, duration=5, prompt="fixed:1024", output="fixed:64", seed=0
    )
    limits = Limits(ttft=(99, 0.2), tpot=(90, 0.0015))
    result = serving_capacity(
        stream, base, system, registry, limits, max_gpus=8, tps=(1, 2), pps=(1, 2),
        layouts=("aggregated",),
    )  # fmt: skip
    staged = [p for p in result.plans if p.pp > 1]
    assert staged, result.skipped
    for plan in staged:
        assert plan.gpus == plan.tp * plan.pp * plan.replicas
        assert plan.as_dict()["pp"] == plan.pp
    # the fewest replicas: one fewer misses the limits
    [plan] = staged
    assert (plan.tp, plan.pp, plan.replicas) == (2, 2, 2)
    if plan.replicas > 1:
        options = replace(base, tp=plan.tp, pp=plan.pp)
        pricer = pipeline_pricer(options, system, registry)
        blocks = replica_blocks(
            pricer, options, registry, tokens=2048, block_size=16, memory_fraction=0.9
        )
        config = EngineConfig(replicas=(plan.replicas - 1) * plan.pp, blocks=blocks // plan.pp)
        assert not limits.met(limits.measure(simulate(stream, pricer, config)))
