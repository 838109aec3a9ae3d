"""``stg serve``: the iteration pricer against the step predictor, the request-level engine
against closed forms (one request, M/D/1, Little's law) and the command line."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions, resolve_model
from stg.core.pipeline import build_workload
from stg.errors import UserError
from stg.explore.serve import EngineConfig, Simulation, request_table, simulate, summary
from stg.explore.serve_cost import Batch, kv_transfer, replica_blocks, replica_pricer
from stg.explore.serve_requests import Stream, generate, read_trace
from stg.perf.costs import send_time
from stg.perf.system import load_system
from stg.testing import make_registry

SMALL = ["--model", "llama3-8b", "--num_stacks", "2"]


@pytest.fixture(scope="module")
def registry():
    return make_registry()


@pytest.fixture(scope="module")
def system():
    return load_system("h100-80g")


def replica(registry, model: str = "llama3-8b", **extra) -> GenerateOptions:
    values, _ = resolve_model({"model": model, "num_stacks": 2, "causal": True}, registry)
    return GenerateOptions(**{**values, "phase": "decode", "batch": 1, **extra})


@pytest.fixture(scope="module")
def pricer(registry, system):
    return replica_pricer(replica(registry), system, registry)


def step_time(registry, system, options: GenerateOptions) -> float:
    serving = registry.predictors.get("serving")
    return serving.predict(
        build_workload(options, registry), system, kernels=list(registry.kernels)
    )["time_s"]


def run(stream: Stream, pricer, draft=None, **config) -> Simulation:
    """A simulation, with Little's law checked: the replicas' queues integrated over time
    equal the arrival rate times the mean time in the system."""
    config = EngineConfig(**{"blocks": 4000, **config})
    sim = simulate(stream, pricer, config, transfer_time=kv_transfer(pricer), draft=draft)
    law = summary(sim)["littles_law"]
    assert law["mean_in_system"] == pytest.approx(law["rate_times_time"], rel=1e-9)
    assert not np.isnan(request_table(sim)["finish_s"]).any()
    return sim


def one(prompt: int, output: int) -> Stream:
    return Stream(np.array([0.0]), np.array([prompt]), np.array([output]))


# -- the pricer ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "tp"), [("llama3-8b", 1), ("llama3-8b", 2), ("mixtral-8x7b", 2), ("gpt", 1)]
)
def test_one_group_iterations_are_the_step_predictor(registry, system, model, tp: int) -> None:
    """Dense, MoE (expert slots of the fullest expert) and learned positions alike."""
    base = replica(registry, model, tp=tp)
    pricer = replica_pricer(base, system, registry)
    for batch, prompt in ((1, 300), (3, 77)):
        want = step_time(registry, system, replace(base, phase="prefill", batch=batch, seq=prompt))
        assert pricer.price(Batch(((prompt, prompt),) * batch, ())) == pytest.approx(
            want, rel=1e-12
        )
    for batch, context in ((1, 500), (5, 1234)):
        options = replace(base, phase="decode", batch=batch, context=context, steps=1)
        want = step_time(registry, system, options)
        got = pricer.price(Batch((), (context + 1,) * batch))
        assert got == pytest.approx(want, rel=1e-12)


def test_a_mixed_workload_is_the_priced_iteration(registry, system, pricer) -> None:
    """``--phase mixed`` reads every weight once (the embedding table and norm weights too,
    not once per group): its replay is the pricer's iteration of the same batch."""
    base = replica(registry)
    mixed = replace(
        base, phase="mixed", batch=6, context=300, prefill_batch=2, chunk=128, prefill_context=64
    )
    want = step_time(registry, system, mixed)
    assert pricer.price(Batch(((128, 192),) * 2, (301,) * 6)) == pytest.approx(want, rel=1e-9)


def test_a_chunk_after_cached_tokens_costs_more_attention(pricer) -> None:
    fresh = pricer.price(Batch(((256, 256),), ()))
    later = pricer.price(Batch(((256, 4096),), ()))
    assert later > fresh
    assert later - fresh == pytest.approx(
        pricer.attention_time(1, 256, 4096) - pricer.attention_time(1, 256, 256)
    )


def test_a_pipeline_or_mla_replica_is_refused(registry, system) -> None:
    with pytest.raises(UserError, match="priced on tensor and expert parallelism"):
        replica_pricer(replica(registry, pp=2), system, registry)
    with pytest.raises(UserError, match="decode step runs q_absorb where its prefill runs"):
        replica_pricer(replica(registry, "deepseek"), system, registry)


def test_positions_are_the_distinct_rows_an_iteration_reads() -> None:
    batch = Batch(((4, 10), (4, 10), (3, 6)), (10, 20), (30,), verify_tokens=3)
    assert batch.positions() == len(range(3, 10)) + 1 + 3


def test_an_moe_iteration_is_shaped_by_its_fullest_expert(registry, system) -> None:
    """Expert kernels are shaped by the slots of the fullest expert over all the tokens of
    the iteration (stg's routing model), not affine in the tokens."""
    pricer = replica_pricer(replica(registry, "mixtral-8x7b"), system, registry)
    assert pricer.expert_slots(1) == 1
    assert pricer.expert_slots(4096) < 4096 * 2 / 8 * 1.5
    per_token = [pricer.body_time(n) / n for n in (1, 64, 4096)]
    assert per_token[0] > per_token[1] > per_token[2]


def test_kv_blocks_follow_the_memory_left(pricer, registry) -> None:
    base = replica(registry)
    full = replica_blocks(pricer, base, registry, tokens=2048, block_size=16, memory_fraction=0.9)
    half = replica_blocks(pricer, base, registry, tokens=2048, block_size=16, memory_fraction=0.45)
    per_block = pricer.kv_bytes_per_token * 16
    assert (full - half) == pytest.approx(0.45 * pricer.system.hbm_capacity / per_block, abs=2)


# -- one request ------------------------------------------------------------------------------


@pytest.mark.parametrize("scheduler", ["sarathi", "vllm", "static"])
def test_a_single_request_is_the_step_predictor(registry, system, pricer, scheduler) -> None:
    prompt, output = 700, 5
    sim = run(one(prompt, output), pricer, scheduler=scheduler, max_num_batched_tokens=2048)
    row = {k: v[0] for k, v in request_table(sim).items()}
    base = replica(registry)
    prefill = step_time(registry, system, replace(base, phase="prefill", batch=1, seq=prompt))
    assert row["ttft_s"] == pytest.approx(prefill, rel=1e-12)
    decode = [
        step_time(registry, system, replace(base, phase="decode", context=prompt + i, steps=1))
        for i in range(output - 1)
    ]
    assert row["e2e_s"] - row["ttft_s"] == pytest.approx(sum(decode), rel=1e-12)
    assert row["tpot_s"] == pytest.approx(sum(decode) / (output - 1), rel=1e-12)


def test_a_disaggregated_request_pays_the_kv_transfer(registry, system, pricer) -> None:
    prompt, output = 700, 4
    sim = run(one(prompt, output), pricer, prefill_replicas=1, replicas=1)
    row = {k: v[0] for k, v in request_table(sim).items()}
    base = replica(registry)
    prefill = step_time(registry, system, replace(base, phase="prefill", batch=1, seq=prompt))
    assert row["ttft_s"] == pytest.approx(prefill, rel=1e-12)
    transfer = send_time(pricer.kv_bytes_per_token * prompt, len(system.network) - 1, system)
    assert transfer > 0 and kv_transfer(pricer)(prompt) == transfer
    decode = sum(
        step_time(registry, system, replace(base, phase="decode", context=prompt + i, steps=1))
        for i in range(output - 1)
    )
    assert row["e2e_s"] - row["ttft_s"] == pytest.approx(transfer + decode, rel=1e-12)
    assert row["replica"] == 0  # the prefill replica it arrived at


@pytest.fixture(scope="module")
def draft(registry, system):
    values, _ = resolve_model({"model": "llama3-8b", "num_stacks": 1, "causal": True}, registry)
    options = GenerateOptions(**{**values, "phase": "decode", "batch": 1})
    return replica_pricer(options, system, registry)


def test_speculative_decoding_with_every_draft_accepted(pricer, draft) -> None:
    prompt, k = 600, 3
    sim = run(one(prompt, 9), pricer, draft, speculative_tokens=k, acceptance_rate=1.0)
    row = {key: v[0] for key, v in request_table(sim).items()}
    prefill = Batch(((prompt, prompt),), ())
    assert row["ttft_s"] == pytest.approx(pricer.price(prefill) + draft.price(prefill))
    steps = 0.0
    for cached in (prompt, prompt + k + 1):  # tokens 2-5, then 6-9
        verify = pricer.price(Batch((), (), (cached + 1 + k,), k + 1))
        proposals = sum(draft.decode_time(1, cached + i) for i in range(1, k + 1))
        steps += verify + proposals
    assert row["e2e_s"] - row["ttft_s"] == pytest.approx(steps, rel=1e-12)
    assert summary(sim)["speculative"]["accepted_per_verification"] == k


def test_speculative_acceptance_follows_its_rate(pricer, draft) -> None:
    stream = generate(
        arrival="poisson", rate=20, duration=10, prompt="fixed:200", output="fixed:100", seed=1
    )
    rate, k = 0.6, 4
    sim = run(stream, pricer, draft, speculative_tokens=k, acceptance_rate=rate, replicas=2)
    accepted = summary(sim)["speculative"]["accepted_per_verification"]
    assert accepted == pytest.approx(sum(rate**j for j in range(1, k + 1)), rel=0.03)
    plain = summary(run(stream, pricer, replicas=2))
    assert summary(sim)["tpot_s"]["mean"] != plain["tpot_s"]["mean"]
    none = run(one(300, 5), pricer, draft, speculative_tokens=2, acceptance_rate=0.0)
    assert summary(none)["speculative"]["accepted_per_verification"] == 0


def test_a_chunked_prompt_takes_several_iterations(pricer) -> None:
    sim = run(one(5000, 2), pricer, max_num_batched_tokens=2048)
    expected = (
        pricer.price(Batch(((2048, 2048),), ()))
        + pricer.price(Batch(((2048, 4096),), ()))
        + pricer.price(Batch(((904, 5000),), ()))
    )
    assert request_table(sim)["ttft_s"][0] == pytest.approx(expected, rel=1e-12)


# -- closed forms --------------------------------------------------------------------------------


def test_md1_mean_wait_is_pollaczek_khinchine(pricer) -> None:
    """Batch 1, constant service S (a prompt and its one token), Poisson arrivals at rate L:
    the mean wait is rho·S / (2(1 - rho)) with rho = L·S."""
    service = pricer.price(Batch(((512, 512),), ()))
    rho = 0.7
    rate = rho / service
    stream = generate(
        arrival="poisson",
        rate=rate,
        duration=40_000 * service,
        prompt="fixed:512",
        output="fixed:1",
        seed=3,
    )
    sim = run(stream, pricer, max_num_seqs=1, scheduler="vllm", max_num_batched_tokens=512)
    wait = request_table(sim)["ttft_s"] - service
    expected = rho * service / (2 * (1 - rho))
    # ~28,000 requests; the waits are correlated over busy periods (their standard error at
    # rho = 0.7 is about 2.5 % of the mean on this many): 3 standard errors
    assert wait.mean() == pytest.approx(expected, rel=0.075)
    assert wait.min() == pytest.approx(0.0, abs=1e-12)


def test_littles_law_under_load_preemption_and_every_routing(pricer) -> None:
    stream = generate(
        arrival="bursty",
        rate=40,
        duration=20,
        prompt="lognormal:800:0.8",
        output="uniform:50:400",
        seed=5,
        burst=4,
    )
    preempted = 0
    for scheduler in ("sarathi", "vllm", "static"):
        for routing in ("round-robin", "least-outstanding", "kv-aware"):
            sim = run(
                stream,
                pricer,
                scheduler=scheduler,
                routing=routing,
                preemption="swap" if routing == "kv-aware" else "recompute",
                swap_bandwidth=32e9,
                replicas=2,
                blocks=600,
                max_num_batched_tokens=4096 if scheduler == "vllm" else 1024,
                prefix_hit_rate=0.25,
                tokenize_rate=450_000,
            )
            preempted += summary(sim)["preemptions"]
    assert preempted > 0
    for scheduler in ("sarathi", "vllm"):
        run(stream, pricer, scheduler=scheduler, prefill_replicas=2, replicas=1, blocks=600)


def test_swap_preemption_keeps_the_tokens_and_pays_the_copies(pricer) -> None:
    two = Stream(np.array([0.0, 0.0]), np.array([64, 64]), np.array([40, 40]))
    bandwidth = 64e9
    swap = run(two, pricer, blocks=10, preemption="swap", swap_bandwidth=bandwidth)
    again = run(two, pricer, blocks=10)
    assert summary(swap)["preemptions"] == summary(again)["preemptions"] == 1
    # B (the newest) goes out with 5 blocks (80 tokens) and comes back with them
    assert swap.trace.swapped_blocks == 10
    block_bytes = pricer.kv_bytes_per_token * 16
    assert swap.trace.swap_s == pytest.approx(10 * block_bytes / bandwidth)
    finish_swap, finish_again = request_table(swap)["e2e_s"], request_table(again)["e2e_s"]
    assert finish_swap[0] == pytest.approx(finish_again[0], rel=0.01)  # A runs alike
    assert finish_swap[1] < finish_again[1]  # B needs no second prefill


def test_a_request_larger_than_the_cache_is_refused(pricer) -> None:
    """It would be admitted, fill the cache and preempt itself forever."""
    with pytest.raises(UserError, match=r"200 tokens .* needs 13 KV blocks; a replica has 10"):
        simulate(one(100, 100), pricer, EngineConfig(blocks=10))


def test_continuous_batching_beats_static_batching(pricer) -> None:
    stream = generate(
        arrival="poisson", rate=30, duration=20, prompt="fixed:256", output="uniform:10:400", seed=2
    )
    static = summary(run(stream, pricer, scheduler="static", max_num_seqs=16))
    sarathi = summary(run(stream, pricer, scheduler="sarathi", max_num_seqs=16))
    assert sarathi["e2e_s"]["mean"] < static["e2e_s"]["mean"]


def test_prefix_hits_shorten_the_first_token(pricer) -> None:
    cold = run(one(2000, 2), pricer)
    warm = run(one(2000, 2), pricer, prefix_hit_rate=0.5)
    assert request_table(warm)["cached_tokens"][0] == 992
    assert request_table(warm)["ttft_s"][0] < request_table(cold)["ttft_s"][0]


# -- request streams -----------------------------------------------------------------------------


def test_streams_are_seeded_and_have_their_rate() -> None:
    a = generate(
        arrival="gamma", rate=50, duration=200, prompt="uniform:1:9", output="fixed:3", seed=1, cv=2
    )
    b = generate(
        arrival="gamma", rate=50, duration=200, prompt="uniform:1:9", output="fixed:3", seed=1, cv=2
    )
    assert np.array_equal(a.arrival, b.arrival) and np.array_equal(a.prompt, b.prompt)
    assert len(a) / 200 == pytest.approx(50, rel=0.1)
    gaps = np.diff(a.arrival)
    assert gaps.std() / gaps.mean() == pytest.approx(2, rel=0.15)
    mean = generate(
        arrival="poisson",
        rate=100,
        duration=100,
        prompt="lognormal:500:1",
        output="fixed:1",
        seed=0,
    ).prompt.mean()
    assert mean == pytest.approx(500, rel=0.05)


def test_trace_files(tmp_path) -> None:
    (tmp_path / "t.csv").write_text("arrival,prompt,output\n0.5,10,3\n0.1,20,4\n")
    stream = read_trace(str(tmp_path / "t.csv"))
    assert stream.arrival.tolist() == [0.1, 0.5] and stream.prompt.tolist() == [20, 10]
    (tmp_path / "t.jsonl").write_text('{"arrival": 0, "prompt": 5, "output": 2}\n')
    assert read_trace(str(tmp_path / "t.jsonl")).output.tolist() == [2]
    (tmp_path / "bad.csv").write_text("arrival,prompt\n0,5\n")
    with pytest.raises(UserError, match="no field 'output'"):
        read_trace(str(tmp_path / "bad.csv"))


# -- the command line ----------------------------------------------------------------------------


def invoke(*args: str):
    return CliRunner().invoke(app, ["serve", *SMALL, *args])


def test_cli_json_is_the_same_bytes_for_the_same_seed(tmp_path) -> None:
    args = ["--rate", "5", "--duration", "5", "--replicas", "2", "--json", "--slo-ttft", "1s"]
    first, again = invoke(*args, "--seed", "4"), invoke(*args, "--seed", "4")
    assert first.exit_code == 0, first.output
    assert first.stdout == again.stdout
    other = invoke(*args, "--seed", "5")
    assert other.stdout != first.stdout
    report = json.loads(first.stdout)
    assert report["goodput"]["slo_ttft_s"] == 1.0 and report["gpus"] == 2


def test_cli_writes_the_tables(tmp_path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    table, times = tmp_path / "requests.parquet", tmp_path / "timeline.csv"
    result = invoke(
        "--rate", "5", "--duration", "5", "--requests-table", str(table), "--timeline", str(times)
    )
    assert result.exit_code == 0, result.output
    rows = pq.read_table(table).to_pydict()
    assert len(rows["ttft_s"]) == int(result.stdout.split()[0])
    assert all(t > 0 for t in rows["ttft_s"])
    assert times.read_text().startswith("time_s,replica,kv_blocks_used,kv_occupancy")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requests.parquet", "timeline.csv"]


def test_cli_plots_the_same_bytes(tmp_path) -> None:
    pytest.importorskip("plotly")
    pages = []
    for name in ("a.html", "b.html"):
        result = invoke(
            "--rate", "5", "--duration", "5", "--replicas", "2", "--plot", str(tmp_path / name)
        )
        assert result.exit_code == 0, result.output
        pages.append((tmp_path / name).read_bytes())
    assert pages[0] == pages[1]
    assert b"latency CDF" in pages[0] and b"replica 1" in pages[0]


def test_cli_without_pyarrow_says_so(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    table = str(tmp_path / "r.parquet")
    result = invoke("--rate", "5", "--duration", "2", "--requests-table", table)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: the Parquet table needs pyarrow")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--scheduler", "fifo"],
            "error: --scheduler 'fifo': allowed values are vllm, sarathi, static",
        ),
        (["--routing", "random"], "error: --routing 'random': allowed values are"),
        (["--prompt", "normal:5"], "error: --prompt 'normal:5': expected fixed:N"),
        (["--arrival", "weibull"], "error: --arrival 'weibull': allowed values are poisson"),
        (["--tp", "1", "--trace", "missing.csv"], "error: missing.csv: no such file"),
        (["--requests-table", "r.txt"], "error: r.txt: a table is written as .parquet or .csv"),
        (["--slo-tpot", "50"], "error: --slo-tpot '50' is not a positive duration"),
        (["--speculative", "2"], "error: --speculative needs a draft model: --draft NAME"),
        (["--preemption", "evict"], "error: --preemption 'evict': allowed values are recompute"),
        (["--plot", "p.png"], "error: p.png: --plot writes an .html file"),
        (
            ["--prefill-replicas", "1", "--scheduler", "static"],
            "error: --prefill-replicas: disaggregated serving needs --scheduler sarathi or vllm",
        ),
    ],
)
def test_cli_errors_are_one_line(args, message, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke("--rate", "5", "--duration", "2", *args)
    assert result.exit_code == 2
    assert result.stderr.startswith(message), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_progress_lines_on_a_long_run(monkeypatch) -> None:
    import stg.cli._shared as shared

    monkeypatch.setattr(shared, "PROGRESS_INTERVAL_S", 0.0)
    result = invoke("--rate", "5", "--duration", "4")
    assert result.exit_code == 0
    assert "requests" in result.stderr
