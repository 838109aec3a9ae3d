"""What a predictor needs (``Predictor.needs``): ``stg predict`` builds the workload only for
predictors that need it; options-only ones (analytical, plugins) answer without it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.core import pipeline
from stg.core.options import GenerateOptions
from stg.host.records import Predictor, RecordError

runner = CliRunner()

GPT3_1024 = [
    "--model", "gpt3-175b", "--tp", "8", "--pp", "16", "--dp", "8",
    "--batch", "1536", "--micro_batch", "8",
]  # fmt: skip
"""GPT-3 175B on 1,024 GPUs, 192 micro-batches: 1.4 M nodes when built."""


@pytest.fixture
def no_full_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the whole 1,024-rank workload fails (smaller ones, as the analytical
    predictor builds, still work)."""
    build = pipeline.build_workload

    def refuse_full(options: Any, *args: Any, **kwargs: Any) -> Any:
        if options.world_size == 1024:
            raise AssertionError("the whole workload was built")
        return build(options, *args, **kwargs)

    monkeypatch.setattr(pipeline, "build_workload", refuse_full)


def _report(args: list[str]) -> dict[str, Any]:
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_needs_is_checked_when_registered() -> None:
    with pytest.raises(RecordError, match="needs 'trace' must be one of options, workload"):
        Predictor(name="p", predict=dict, predict_options=dict, needs="trace")  # type: ignore[arg-type]
    with pytest.raises(RecordError, match="needs='options' requires predict_options"):
        Predictor(name="p", predict=dict, needs="options")
    assert Predictor(name="p", predict=dict).needs == "workload"


def test_analytical_predicts_the_175b_case_without_building_it(no_full_build: None) -> None:
    # no_full_build makes building the 1,024-rank workload fail; its cost is measured by
    # benchmarks/startup.py, not timed here
    report = _report(["predict", "--predictor", "analytical", "--json", *GPT3_1024])
    assert report["analytical"]["world_size"] == 1024
    assert report["analytical"]["iteration_time_s"] > 0


def test_plugin_predictor_of_options_is_never_handed_a_workload(
    fake_dists: Path, no_full_build: None
) -> None:
    args = ["-p", "fake_options_predictor", "predict", "--predictor", "fake-layers", "--json"]
    report = _report([*args, *GPT3_1024])
    assert report == {"fake-layers": {"predictor": "fake-layers", "layers": 96, "ranks": 1024}}


def test_a_predictor_that_needs_the_workload_still_gets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory predictor answers a training plan from its options and builds the workload
    where it needs the per-rank facts (a serving phase)."""
    built: list[int] = []
    build = pipeline.build_workload

    def counting(options: Any, *args: Any, **kwargs: Any) -> Any:
        built.append(options.world_size)
        return build(options, *args, **kwargs)

    monkeypatch.setattr(pipeline, "build_workload", counting)
    small = ["--model", "gpt", "--num_stacks", "2", "--dp", "4", "--predictor"]
    report = _report(["predict", "--json", *small, "memory"])
    assert built == [] and report["memory"]["peak_bytes"] > 0
    decode = ["--phase", "decode", "--context", "128", "--batch", "4"]
    report = _report(["predict", "--json", *decode, *small, "memory"])
    # the serving memory report of the built workload: its KV cache per rank class
    assert report["memory"]["peak_bytes"] > 0 and "kv_cache" in report["memory"]["classes"][0]
    built.clear()
    _report(["predict", "--json", *small, "analytical"])
    assert 4 not in built  # the analytical predictor builds only its reduced workloads


def test_memory_from_options_is_the_built_workloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory report from options has the peaks of the built workload's, class by class:
    pipeline stages, an uneven split, recompute of some layers, ZeRO-3."""
    from stg.host.registry import load_registry
    from stg.predictors.memory import predict_memory, predict_memory_options

    registry = load_registry()
    llama = dict(
        model="llama", dmodel=1024, dff=3584, head=16, kvhead=4, num_stacks=8, seq=1024,
        dvocal=32000,
    )  # fmt: skip
    plans = [
        dict(llama, tp=2, pp=2, batch=16, micro_batch=2),
        dict(llama, tp=2, pp=4, batch=16, micro_batch=4, decoder_first_pipeline_num_layers=3,
             decoder_last_pipeline_num_layers=1),
        dict(llama, pp=2, batch=8, micro_batch=2, activation_recompute="full",
             recompute_method="block", recompute_num_layers=2),
        dict(llama, dp=4, batch=8, micro_batch=4, zero=3),
    ]  # fmt: skip
    for plan in plans:
        options = GenerateOptions(**plan)
        built = predict_memory(pipeline.build_workload(options, registry), "h100-80g")
        answered = predict_memory_options(options, "h100-80g", registry=registry)
        assert sorted(c["peak"] for c in answered["classes"]) == sorted(
            c["peak"] for c in built["classes"]
        ), plan
        assert answered["peak_bytes"] == built["peak_bytes"]
