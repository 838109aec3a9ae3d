"""Expert parallelism in request-level serving: the experts of an MoE model split over ``ep``
of a replica's ``tp`` GPUs (vLLM's ``--enable-expert-parallel``) or over ``ep`` data-parallel
attention ranks of ``tp`` GPUs each, priced per iteration with the collectives of that
iteration's tokens, and searched by capacity planning."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions, resolve_model
from stg.core.pipeline import build_workload
from stg.core.workload import CollectiveType
from stg.errors import UserError
from stg.explore.serve import EngineConfig, request_table, simulate
from stg.explore.serve_cost import (
    Batch,
    expert_parallel,
    kv_transfer,
    replica_blocks,
    replica_pricer,
)
from stg.explore.serve_requests import Stream, generate
from stg.explore.serve_search import Limits, serving_capacity
from stg.perf.system import load_system
from stg.testing import make_registry


@pytest.fixture(scope="module")
def registry():
    return make_registry()


@pytest.fixture(scope="module")
def system():
    return load_system("h100-80g")


def replica(registry, model: str, num_stacks: int | None = 2, **extra) -> GenerateOptions:
    values = {"model": model, "causal": True}
    if num_stacks is not None:
        values["num_stacks"] = num_stacks
    resolved, _ = resolve_model(values, registry)
    return GenerateOptions(**{**resolved, "phase": "decode", "batch": 1, **extra})


def step_time(registry, system, options: GenerateOptions) -> float:
    serving = registry.predictors.get("serving")
    return serving.predict(
        build_workload(options, registry), system, kernels=list(registry.kernels)
    )["time_s"]


def gathers(registry, options: GenerateOptions) -> int:
    """All-gathers of one rank: with the experts split by ep every GPU computes its experts'
    slots of all the tokens (which the tp GPUs all hold) and their outputs are gathered."""
    workload = build_workload(replace(options, batch=4), registry)
    return sum(n.comm_type is CollectiveType.ALL_GATHER for n in workload.rank_classes[0].nodes)


CASES = [
    ("mixtral-8x7b", 2, 2, "capacity"),
    ("mixtral-8x7b", 2, 2, "dropless"),
    ("mixtral-8x7b", 4, 2, "dropless"),
    ("qwen3-30b-a3b", 4, 4, "capacity"),
]


@pytest.mark.parametrize(("model", "tp", "ep", "routing"), CASES)
def test_one_group_iterations_are_the_step_predictor(registry, system, model, tp, ep, routing):
    """Prefills and decode steps of one group cost what the step predictor says for the same
    expert-parallel replica: expert GEMMs and collectives of that batch's tokens."""
    base = expert_parallel(replica(registry, model, tp=tp, moe_routing=routing), ep, registry)
    assert (base.ep, base.expert_tp, base.world_size) == (ep, tp // ep, tp)
    assert gathers(registry, base) > 0
    pricer = replica_pricer(base, system, registry)
    for batch, prompt in ((1, 300), (3, 77), (2, 1500)):
        want = step_time(registry, system, replace(base, phase="prefill", batch=batch, seq=prompt))
        assert pricer.price(Batch(((prompt, prompt),) * batch, ())) == pytest.approx(
            want, rel=1e-12
        )
    for batch, context in ((1, 500), (5, 1234), (64, 200)):
        options = replace(base, phase="decode", batch=batch, context=context, steps=1)
        got = pricer.price(Batch((), (context + 1,) * batch))
        assert got == pytest.approx(step_time(registry, system, options), rel=1e-12)


def test_expert_parallelism_changes_the_iteration(registry, system) -> None:
    """The same tp GPUs with the experts split by ep gather the experts' outputs where tp
    all-reduces them, and run whole experts: another time for the same batch."""
    base = replica(registry, "mixtral-8x7b", tp=2)
    assert gathers(registry, base) == 0
    split = replica_pricer(expert_parallel(base, 2, registry), system, registry)
    whole = replica_pricer(base, system, registry)
    batch = Batch(((512, 512),), (300,) * 16)
    assert split.price(batch) != whole.price(batch)


def test_a_single_request_is_the_step_predictor(registry, system) -> None:
    base = expert_parallel(replica(registry, "mixtral-8x7b", tp=2), 2, registry)
    pricer = replica_pricer(base, system, registry)
    prompt, output = 700, 5
    stream = Stream(np.array([0.0]), np.array([prompt]), np.array([output]))
    sim = simulate(stream, pricer, EngineConfig(blocks=4000), transfer_time=kv_transfer(pricer))
    row = {k: v[0] for k, v in request_table(sim).items()}
    prefill = step_time(registry, system, replace(base, phase="prefill", batch=1, seq=prompt))
    assert row["ttft_s"] == pytest.approx(prefill, rel=1e-12)
    decode = sum(
        step_time(registry, system, replace(base, phase="decode", context=prompt + i, steps=1))
        for i in range(output - 1)
    )
    assert row["e2e_s"] - row["ttft_s"] == pytest.approx(decode, rel=1e-12)


def test_each_gpu_holds_its_share_of_the_experts(registry, system) -> None:
    """ep 2 on tp 2: each GPU holds half the experts whole instead of half of each: the same
    bytes, so the same KV-cache blocks; with ep 2 on tp 4 each expert is split in two as
    well, a quarter of the experts' bytes per GPU."""
    weights = {}
    for tp, ep in ((1, 1), (2, 1), (2, 2), (4, 2), (4, 4)):
        options = expert_parallel(replica(registry, "mixtral-8x7b", tp=tp), ep, registry)
        weights[tp, ep] = replica_pricer(options, system, registry).weight_bytes
    assert weights[2, 2] == weights[2, 1] < weights[1, 1]
    assert weights[4, 2] == weights[4, 4] < weights[2, 2]
    tp2 = replica(registry, "mixtral-8x7b", tp=2)
    blocks = [
        replica_blocks(
            replica_pricer(o, system, registry), o, registry, tokens=2048, block_size=16,
            memory_fraction=0.9,
        )
        for o in (tp2, expert_parallel(tp2, 2, registry))
    ]  # fmt: skip
    assert blocks[0] == blocks[1] > 0


def test_expert_parallelism_is_refused_where_it_cannot_split(registry) -> None:
    mixtral = replica(registry, "mixtral-8x7b", tp=2)
    with pytest.raises(UserError, match="allowed: a positive divisor of --tp 2"):
        expert_parallel(mixtral, 4, registry)
    with pytest.raises(UserError, match="has no experts to split"):
        expert_parallel(replica(registry, "llama3-8b", tp=2), 2, registry)
    with pytest.raises(UserError, match="must divide the 8 experts"):
        expert_parallel(replace(mixtral, tp=6), 6, registry)
    assert expert_parallel(mixtral, 1, registry) is mixtral


# -- capacity planning ------------------------------------------------------------------------


def test_the_search_plans_expert_parallel_replicas_of_mixtral(registry, system) -> None:
    """Mixtral 8x7B's 46.7B bf16 parameters (93 GB) do not fit one 80 GB GPU: tp 1 is
    skipped; on two GPUs the experts split by tp or by ep, and each plan is the fewest
    replicas of its shape by direct simulation."""
    base = replica(registry, "mixtral-8x7b", num_stacks=None)
    stream = generate(
        arrival="poisson", rate=20, duration=10, prompt="fixed:512", output="fixed:32", seed=0
    )
    limits = Limits(tpot=(90, 0.05))
    result = serving_capacity(
        stream, base, system, registry, limits, max_gpus=4, tps=(1, 2), eps=(1, 2),
        layouts=("aggregated",),
    )  # fmt: skip
    assert list(result.skipped) == ["tp 1, KV bf16, budget 2048"]
    assert "no KV-cache block" in result.skipped["tp 1, KV bf16, budget 2048"]
    assert sorted((p.tp, p.ep) for p in result.plans) == [(2, 1), (2, 2)]
    for plan in result.plans:
        options = expert_parallel(replace(base, tp=plan.tp), plan.ep, registry)
        assert plan.gpus == plan.tp * plan.replicas
        assert plan.as_dict()["ep"] == plan.ep
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
            assert limits.met(limits.measure(sim)) is meets, (plan, replicas)


SEARCH = [
    "search", "--phase", "serve", "--model", "mixtral-8x7b", "--num_stacks", "2", "-s",
    "h100-80g", "--gpus", "4", "--tp", "2", "--rate", "5", "--duration", "5", "--prompt",
    "fixed:256", "--output", "fixed:16", "--max-tpot", "p90:50ms", "--jobs", "1",
]  # fmt: skip


def test_cli_search_takes_ep() -> None:
    result = CliRunner().invoke(app, [*SEARCH, "--ep", "1,2", "--json"])
    assert result.exit_code == 0, result.output
    import json

    plans = json.loads(result.stdout)["best"]
    assert {p["ep"] for p in plans} == {1, 2}
    text = CliRunner().invoke(app, [*SEARCH, "--ep", "2"])
    assert text.exit_code == 0 and " ep " in text.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([*SEARCH, "--ep", "4"], "error: --ep 4: folded, the experts split over a replica's"),
        ([*SEARCH, "--ep", "2", "--ep_layout", "x"], "error: --ep_layout 'x' is not allowed"),
        (
            [
                "serve",
                "--model",
                "mixtral-8x7b",
                "--num_stacks",
                "2",
                "--ep",
                "2",
                "--ep_layout",
                "multiply",
                "--prefill-replicas",
                "1",
            ],
            "error: --ep 2 --ep_layout multiply: a replica of data-parallel attention ranks",
        ),
        (
            ["serve", "--model", "mixtral-8x7b", "--num_stacks", "2", "--ep_layout", "dp"],
            "error: --ep_layout 'dp': allowed values are fold, multiply",
        ),
        (
            ["serve", "--model", "mixtral-8x7b", "--num_stacks", "2", "--tp", "2", "--ep", "3"],
            "error: --ep 3: the experts split over the replica's tensor-parallel GPUs",
        ),
        (
            ["serve", "--model", "llama3-8b", "--num_stacks", "2", "--tp", "2", "--ep", "2"],
            "error: --ep 2: model 'llama' has no experts to split",
        ),
    ],
)
def test_cli_ep_errors_are_one_line(args, message, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, [*args, "--rate", "2", "--duration", "2"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(message), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_cli_serve_reports_ep() -> None:
    args = ["serve", "--model", "mixtral-8x7b", "--num_stacks", "2", "--tp", "2", "--ep", "2"]
    result = CliRunner().invoke(app, [*args, "--rate", "2", "--duration", "5", "--json"])
    assert result.exit_code == 0, result.output
    import json

    report = json.loads(result.stdout)
    assert (report["ep"], report["tp"], report["gpus"]) == (2, 2, 2)


def test_a_mixed_step_with_folded_experts_serves_one_prompt(registry, system) -> None:
    """Folded over tp, ep splits no batch: a mixed iteration of one prompt is valid (the check
    once asked dp·ep to divide its prompts, as if ep multiplied the replicas)."""
    from stg.core.pipeline import validate_options

    base = expert_parallel(replica(registry, "mixtral-8x7b", tp=2), 2, registry)
    mixed = replace(
        base, phase="mixed", batch=3, context=300, prefill_batch=1, chunk=128, prefill_context=0
    )
    validate_options(mixed, registry)
    assert step_time(registry, system, mixed) > 0
    multiplied = replace(mixed, ep_layout="multiply", etp=None, batch=4)
    with pytest.raises(UserError, match="dp·ep=2 must divide prefill_batch=1"):
        validate_options(multiplied, registry)


def test_a_pipeline_of_expert_parallel_stages_is_the_step_predictor(registry, system) -> None:
    """Each stage is tp GPUs (ep folds over them): the next stage starts tp ranks on, in
    the same 4-GPU NVLink domain (not 4 ranks on, across the network)."""
    from stg.explore.serve_cost import pipeline_pricer

    nvlink, *rest = system.network
    system = replace(system, network=(replace(nvlink, size=4), *rest))
    base = expert_parallel(replica(registry, "mixtral-8x7b", num_stacks=4, tp=2), 2, registry)
    staged = replace(base, pp=2)
    pricer = pipeline_pricer(staged, system, registry)
    assert pricer.stage_sends is not None and pricer.stage_sends[0] == 1
    prompt = 300
    want = step_time(registry, system, replace(staged, phase="prefill", batch=1, seq=prompt))
    assert pricer.price(Batch(((prompt, prompt),), ())) == pytest.approx(want, rel=1e-12)


# -- data-parallel attention (--ep_layout multiply) --------------------------------------------

MULTIPLIED = [("mixtral-8x7b", 1, 2), ("mixtral-8x7b", 2, 4), ("qwen3-30b-a3b", 2, 2)]


@pytest.mark.parametrize(("model", "tp", "ep"), MULTIPLIED)
def test_an_attention_rank_is_the_step_predictor_of_every_rank_alike(
    registry, system, model, tp, ep
) -> None:
    """An iteration of one data-parallel attention rank is priced as every one of the ep
    ranks running the same batch: stg predict of ep times its sequences, the experts'
    tokens moved by all-to-all."""
    base = expert_parallel(replica(registry, model, tp=tp), ep, registry, "multiply")
    assert (base.world_size, base.data_replicas) == (tp * ep, ep)
    workload = build_workload(replace(base, batch=ep), registry)
    kinds = {n.comm_type for n in workload.rank_classes[0].nodes}
    assert CollectiveType.ALL_TO_ALL in kinds
    pricer = replica_pricer(base, system, registry)
    assert pricer.attention_ranks == ep
    for batch, prompt in ((1, 300), (3, 77)):
        options = replace(base, phase="prefill", batch=batch * ep, seq=prompt)
        got = pricer.price(Batch(((prompt, prompt),) * batch, ()))
        assert got == pytest.approx(step_time(registry, system, options), rel=1e-12)
    for batch, context in ((1, 500), (5, 1234)):
        options = replace(base, phase="decode", batch=batch * ep, context=context, steps=1)
        got = pricer.price(Batch((), (context + 1,) * batch))
        assert got == pytest.approx(step_time(registry, system, options), rel=1e-12)


def test_attention_ranks_hold_all_the_attention_and_their_share_of_the_experts(
    registry, system
) -> None:
    """Multiplied, each GPU holds the attention and dense layers whole (at tp 1) and half
    the experts: more than tp 2 (which halves both), less than one GPU."""
    one = replica(registry, "mixtral-8x7b", tp=1)
    two = replica(registry, "mixtral-8x7b", tp=2)
    weights = [
        replica_pricer(o, system, registry).weight_bytes
        for o in (one, expert_parallel(one, 2, registry, "multiply"), two)
    ]
    assert weights[0] > weights[1] > weights[2]


def test_the_search_splits_the_experts_that_do_not_fit_one_gpu(registry, system) -> None:
    """Mixtral 8x7B's 46.7B bf16 parameters (93 GB) leave no KV cache on one 80 GB GPU at
    0.9 of its memory (72 GB); two attention ranks of one GPU each hold 1.6B parameters of
    attention, embeddings and routers and half of the 45.1B in experts (48 GB): the only
    plan is ep 2, two GPUs a replica, and it is the fewest replicas by direct simulation."""
    base = replica(registry, "mixtral-8x7b", num_stacks=None)
    stream = generate(
        arrival="poisson", rate=5, duration=10, prompt="fixed:512", output="fixed:32", seed=0
    )
    limits = Limits(tpot=(90, 0.05))
    result = serving_capacity(
        stream, base, system, registry, limits, max_gpus=4, tps=(1,), eps=(1, 2),
        ep_layouts=("multiply",), layouts=("aggregated",),
    )  # fmt: skip
    assert list(result.skipped) == ["tp 1, KV bf16, budget 2048"]
    [plan] = result.plans
    assert (plan.tp, plan.ep, plan.ep_layout, plan.gpus) == (1, 2, "multiply", 2 * plan.replicas)
    options = expert_parallel(base, 2, registry, "multiply")
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
            EngineConfig(replicas=2 * replicas, blocks=blocks),
            transfer_time=kv_transfer(pricer),
        )
        measured = limits.measure(sim)
        assert limits.met(measured) is meets, (plan, replicas)
        assert measured == plan.measured or not meets


def test_cli_serves_data_parallel_attention_ranks() -> None:
    args = [
        "serve", "--model", "mixtral-8x7b", "--num_stacks", "2", "--ep", "2", "--ep_layout",
        "multiply", "--replicas", "2", "--rate", "4", "--duration", "5",
    ]  # fmt: skip
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    import json

    report = json.loads(result.stdout)
    assert (report["gpus"], report["virtual_engines"], report["ep_layout"]) == (4, 4, "multiply")
    text = CliRunner().invoke(app, args)
    assert "ep 2 data-parallel attention: 4 virtual engines" in text.stdout
