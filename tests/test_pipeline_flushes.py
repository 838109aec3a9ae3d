"""``--pipeline_flushes N``: an iteration's micro-batches as N pipeline schedules in turn.

torchtitan's trainer (``torchtitan/trainer.py``: one ``pp_schedule.step`` per gradient
accumulation step) and NeMo AutoModel (``recipes/llm/benchmark.py``: one forward-backward of
the schedule per GA step) fill and drain the pipeline once per accumulation step, where
Megatron-LM runs every micro-batch in one schedule. Each extra flush costs one more fill and
drain: with 1F1B over ``p`` stages of equal cost, ``(p - 1)`` micro-batch steps of a stage.
"""

from __future__ import annotations

import pytest
from consumers import assert_trace_checks_out_and_predicts_as_options
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload, flushed_order
from stg.core.workload import CollectiveType, NodeType
from stg.host.registry import load_registry
from stg.predictors.analytical import predict_options as predict_analytical
from stg.predictors.memory import predict_memory_options
from stg.predictors.time import predict_time_options

GPT = dict(
    model="gpt", dmodel=1024, dff=4096, head=16, kvhead=16, num_stacks=8, seq=1024,
    dvocal=256, pp=4, dp=1, micro_batch=1, mixed_precision=True, dtype="bf16",
)  # fmt: skip
REGISTRY = load_registry(autoload=False)


def test_each_flush_runs_the_schedule_of_its_micro_batches() -> None:
    schedule = REGISTRY.schedules.get("1f1b")
    for stage in range(4):
        one = schedule.order(stage, 4, 4, 1)
        flushed = flushed_order(schedule, stage, 4, 8, 1, 2)
        assert flushed == [*one, *[(d, mb + 4, c) for d, mb, c in one]]
    interleaved = REGISTRY.schedules.get("interleaved")
    assert flushed_order(interleaved, 1, 2, 4, 2, 2)[:8] == interleaved.order(1, 2, 2, 2)


def _time(**extra: object) -> float:
    options = GenerateOptions(**{**GPT, **extra})
    return predict_time_options(options, "h100-80g", registry=REGISTRY)["iteration_time_s"]


def test_a_flush_costs_one_more_fill_and_drain() -> None:
    # a stage's time per micro-batch, from the slope of one schedule in micro-batches
    step = (_time(batch=16) - _time(batch=8)) / 8
    for flushes in (2, 4):
        extra = _time(batch=8, pipeline_flushes=flushes) - _time(batch=8)
        assert extra == pytest.approx((flushes - 1) * (4 - 1) * step, rel=0.05)


def test_the_analytical_predictor_and_the_replay_agree_on_flushes() -> None:
    def both(flushes: int) -> tuple[float, float]:
        options = GenerateOptions(**GPT, batch=8, pipeline_flushes=flushes)
        analytical = predict_analytical(options, "h100-80g", registry=REGISTRY)
        return analytical["iteration_time_s"], _time(batch=8, pipeline_flushes=flushes)

    (a1, t1), (a2, t2) = both(1), both(2)
    assert a2 - a1 == pytest.approx(t2 - t1, rel=0.05)


def test_gpipe_holds_one_schedules_micro_batches() -> None:
    def activations(flushes: int) -> float:
        options = GenerateOptions(
            **GPT, batch=8, pipeline_schedule="gpipe", pipeline_flushes=flushes
        )
        report = predict_memory_options(options, "h100-80g", registry=REGISTRY)
        return report["classes"][1]["activations"]

    assert activations(2) == pytest.approx(activations(1) / 2)


def test_the_written_trace_replays_as_the_options_predict(tmp_path) -> None:
    flags = [f"--{k}={v}" for k, v in {**GPT, "batch": 8, "pipeline_flushes": 2}.items()]
    runner = CliRunner()
    result = runner.invoke(app, ["generate", *flags, "--output_dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert_trace_checks_out_and_predicts_as_options(
        tmp_path, {**GPT, "batch": 8, "pipeline_flushes": 2}
    )
    workload = build_workload(GenerateOptions(**GPT, batch=8, pipeline_flushes=2), REGISTRY)
    assert workload.metadata["options"]["pipeline_flushes"] == 2


@pytest.mark.parametrize(
    "args,message",
    [
        (["--pipeline_flushes", "3"],
         "pipeline_flushes=3 runs an iteration's micro-batches as that many pipeline "
         "schedules: allowed: 1, or with pp > 1 a divisor of the 8 micro-batches"),
        (["--pipeline_flushes", "2", "--pp", "1", "--num_stacks", "2"],
         "pipeline_flushes=2 runs an iteration's micro-batches as that many pipeline "
         "schedules: allowed: 1, or with pp > 1 a divisor of the 8 micro-batches"),
        (["--pipeline_flushes", "4", "--pipeline_schedule", "interleaved",
          "--virtual_stages", "2"],
         "pipeline_schedule=interleaved needs the number of micro-batches (2 a schedule) "
         "divisible by pp=4"),
    ],
)  # fmt: skip
def test_refused_flushes_get_one_line(args: list[str], message: str) -> None:
    base = ["--model", "gpt", "--num_stacks", "8", "--dmodel", "256", "--dff", "1024",
            "--head", "4", "--kvhead", "4", "--seq", "64", "--dvocal", "512", "--pp", "4",
            "--batch", "8", "--micro_batch", "1"]  # fmt: skip
    result = CliRunner().invoke(app, ["predict", "--json", *base, *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"error: {message}"


def test_each_schedule_reduces_and_fsdp_gathers_again() -> None:
    # FSDP under pipeline parallelism keeps the weights gathered through a schedule and
    # reduce-scatters the gradients after its last backward; the next schedule gathers again
    def collectives(flushes: int) -> tuple[int, int]:
        options = GenerateOptions(
            **{**GPT, "dp": 2, "batch": 16, "micro_batch": 2},
            weight_sharded=True,
            pipeline_flushes=flushes,
        )
        nodes = build_workload(options, REGISTRY).ranks[1].nodes()
        kinds = [n.comm_type for n in nodes if n.type is NodeType.COMM_COLL]
        return kinds.count(CollectiveType.ALL_GATHER), kinds.count(CollectiveType.REDUCE_SCATTER)

    (g1, r1), (g2, r2) = collectives(1), collectives(2)
    assert g1 > 0 and r1 > 0
    assert (g2, r2) == (2 * g1, 2 * r1)
