"""Engine profiles and vLLM's multi-step scheduling in ``stg serve``: a round's closed form,
requests that wait for a round's end, streaming at the round's end, and one-line refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions, resolve_model
from stg.errors import UserError
from stg.explore.serve import EngineConfig, Simulation, request_table, simulate, summary
from stg.explore.serve_cost import Batch, replica_pricer
from stg.explore.serve_profiles import PROFILES, engine_profile
from stg.explore.serve_requests import Stream
from stg.perf.system import load_system
from stg.testing import make_registry

SMALL = ["--model", "llama3-8b", "--num_stacks", "2"]


@pytest.fixture(scope="module")
def pricer():
    registry = make_registry()
    values, _ = resolve_model({"model": "llama3-8b", "num_stacks": 2, "causal": True}, registry)
    base = GenerateOptions(**{**values, "phase": "decode", "batch": 1})
    return replica_pricer(base, load_system("h100-80g"), registry)


def run(stream: Stream, pricer, **config) -> Simulation:
    """A simulation with ``vllm`` scheduling, Little's law checked."""
    config = EngineConfig(**{"blocks": 4000, "scheduler": "vllm", **config})
    sim = simulate(stream, pricer, config)
    law = summary(sim)["littles_law"]
    assert law["mean_in_system"] == pytest.approx(law["rate_times_time"], rel=1e-9)
    return sim


def test_a_round_is_one_scheduler_call_then_its_steps(pricer) -> None:
    """One request of 21 tokens out, 10 steps a round and 4 ms a scheduler call: a prefill
    step, then two rounds of ten decode steps at contexts 101..120 (the second round's last
    nine tokens dropped): TTFT, finish and iterations in closed form."""
    overhead = 4e-3
    stream = Stream(np.array([0.0]), np.array([100]), np.array([12]))
    sim = run(stream, pricer, num_scheduler_steps=10, iteration_overhead_s=overhead)
    prefill = overhead + pricer.price(Batch(((100, 100),), ()))
    steps = [pricer.decode_time(1, 100 + i) for i in range(1, 21)]
    r = sim.requests[0]
    assert r.first_token == pytest.approx(prefill, rel=1e-12)
    # tokens 2..11 in the first round, token 12 at the first step of the second
    assert r.finish == pytest.approx(prefill + 2 * overhead + sum(steps[:11]), rel=1e-12)
    assert sim.trace.iterations == 1 + 20


def test_a_request_waits_for_the_round_in_flight(pricer) -> None:
    """B arrives just after A's prefill: one step per call admits it after one decode step;
    ten steps per call after the whole round of ten."""
    stream = Stream(np.array([0.0, 0.0]), np.array([64, 64]), np.array([40, 8]))
    prefill = pricer.price(Batch(((64, 64),), ()))
    stream.arrival[1] = prefill * 1.001
    single = request_table(run(stream, pricer))
    multi = request_table(run(stream, pricer, num_scheduler_steps=10))
    b_prefill = pricer.price(Batch(((64, 64),), ()))
    assert single["first_token_s"][1] == pytest.approx(
        prefill + pricer.decode_time(1, 65) + b_prefill, rel=1e-12
    )
    round_ = sum(pricer.decode_time(1, 64 + i) for i in range(1, 11))
    assert multi["first_token_s"][1] == pytest.approx(prefill + round_ + b_prefill, rel=1e-12)
    assert multi["ttft_s"][1] > single["ttft_s"][1]


def test_a_round_streams_at_its_end_or_per_step(pricer) -> None:
    """vLLM v0.6.0 returns a round's ten tokens together (inter-token gaps of 0 within a
    chunk); per-step streaming gives every gap a step."""
    stream = Stream(np.array([0.0]), np.array([64]), np.array([11]))
    chunked = run(stream, pricer, num_scheduler_steps=10, stream_round_end=True)
    per_step = run(stream, pricer, num_scheduler_steps=10)
    gaps = np.frombuffer(chunked.trace.itl_values, dtype=np.float64)
    assert (gaps == 0).sum() == 9 and (gaps > 0).sum() == 1
    assert (np.frombuffer(per_step.trace.itl_values, dtype=np.float64) > 0).all()
    # the same steps: the last token arrives at the round's end either way
    assert chunked.requests[0].finish == pytest.approx(per_step.requests[0].finish, rel=1e-12)


def test_a_random_stream_under_multi_step_keeps_littles_law(pricer) -> None:
    rng = np.random.default_rng(3)
    n = 60
    stream = Stream(
        np.cumsum(rng.exponential(0.02, n)),
        rng.integers(16, 400, n),
        rng.integers(1, 120, n),
    )
    for lag in (False, True):  # vLLM v0.6: outputs processed during the next execution
        sim = run(
            stream, pricer, num_scheduler_steps=8, stream_round_end=True, blocks=300, output_lag=lag
        )
        table = request_table(sim)
        assert not np.isnan(table["finish_s"]).any()
        assert (table["ttft_s"] > 0).all()


def test_overlap_scheduling_delivers_outputs_one_iteration_late(pricer) -> None:
    """SGLang's and TensorRT-LLM's overlap scheduler: the prefill's token reaches the client
    at the end of the first decode step; the last token, with no iteration after it, at
    once. A request finishing while another decodes leaves one step later."""
    stream = Stream(np.array([0.0]), np.array([100]), np.array([3]))
    for scheduler in ("sarathi", "vllm"):
        sim = run(stream, pricer, scheduler=scheduler, output_lag=True)
        prefill = pricer.price(Batch(((100, 100),), ()))
        first, second = (pricer.decode_time(1, 100 + i) for i in (1, 2))
        r = sim.requests[0]
        assert r.first_token == pytest.approx(prefill + first, rel=1e-12)
        assert r.finish == pytest.approx(prefill + first + second, rel=1e-12)
    both = Stream(np.array([0.0, 0.0]), np.array([64, 64]), np.array([2, 9]))
    plain = request_table(run(both, pricer, scheduler="sarathi"))
    late = request_table(run(both, pricer, scheduler="sarathi", output_lag=True))
    step = pricer.decode_time(1, 66)  # B decodes alone after A's last token
    assert late["finish_s"][0] == pytest.approx(plain["finish_s"][0] + step, rel=1e-12)
    assert late["finish_s"][1] == pytest.approx(plain["finish_s"][1], rel=1e-12)
    assert (late["ttft_s"] > plain["ttft_s"]).all()


def test_a_random_stream_under_overlap_scheduling_keeps_littles_law(pricer) -> None:
    rng = np.random.default_rng(5)
    n = 80
    stream = Stream(
        np.cumsum(rng.exponential(0.01, n)), rng.integers(16, 600, n), rng.integers(1, 90, n)
    )
    for scheduler in ("sarathi", "vllm"):
        table = request_table(run(stream, pricer, scheduler=scheduler, output_lag=True))
        assert (table["finish_s"] >= table["first_token_s"]).all()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"num_scheduler_steps": 0}, "--num-scheduler-steps 0: must be a positive integer"),
        ({"num_scheduler_steps": 4, "scheduler": "sarathi"}, "modelled for --scheduler vllm"),
        ({"num_scheduler_steps": 4, "prefill_replicas": 1}, "neither --speculative nor"),
    ],
)
def test_multi_step_refusals(config: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        EngineConfig(**{"scheduler": "vllm", "blocks": 10, **config}).check()


def test_profiles_name_their_source() -> None:
    assert engine_profile("vllm-0.6").scheduler_overhead_s == 4e-3
    assert all(p.source for p in PROFILES.values())
    with pytest.raises(UserError, match=r"allowed values are none, vllm-0\.6, sglang, trtllm"):
        engine_profile("vllm-9")


def test_cli_engine_profile_and_steps() -> None:
    runner = CliRunner()
    common = [
        "serve",
        *SMALL,
        "--scheduler",
        "vllm",
        "--rate",
        "4",
        "--duration",
        "5",
        "--prompt",
        "fixed:200",
        "--output",
        "fixed:50",
        "--json",
    ]
    plain = json.loads(runner.invoke(app, common).stdout)
    result = runner.invoke(
        app, [*common, "--engine-profile", "vllm-0.6", "--num-scheduler-steps", "8"]
    )
    assert result.exit_code == 0, result.output
    tuned = json.loads(result.stdout)
    assert (tuned["engine_profile"], tuned["num_scheduler_steps"]) == ("vllm-0.6", 8)
    assert tuned["iteration_overhead_s"] == 4e-3
    assert tuned["tpot_s"]["p50"] != plain["tpot_s"]["p50"]
    # an explicit --iteration-overhead wins over the profile's
    result = runner.invoke(
        app, [*common, "--engine-profile", "vllm-0.6", "--iteration-overhead", "0s"]
    )
    assert json.loads(result.stdout)["iteration_overhead_s"] == 0.0
    overlapped = json.loads(runner.invoke(app, [*common, "--engine-profile", "sglang"]).stdout)
    assert overlapped["ttft_s"]["p50"] > plain["ttft_s"]["p50"]
    bad = runner.invoke(app, [*common, "--engine-profile", "trt"])
    assert bad.exit_code == 2
    assert bad.output.strip().splitlines()[-1].startswith("error: --engine-profile 'trt'")
