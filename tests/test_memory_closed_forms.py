"""The memory predictor answers from options through its closed forms only for the models they
describe (predictors/memory.py, CLOSED_FORM_MODELS): there its parameters and peaks are those
read from the built workload; every other model (BERT's and RoBERTa's heads, Mamba-2, gated
DeltaNet, hybrid stacks), whose layers the closed forms would price as GPT's, is read from its
built workload."""

from __future__ import annotations

from typing import Any

import pytest

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.predictors.memory import (
    CLOSED_FORM_MODELS,
    predict_analytic,
    predict_memory,
    predict_memory_options,
)

REGISTRY = load_registry(autoload=False)
SMALL = dict(dmodel=128, head=4, kvhead=4, dff=256, num_stacks=4, seq=128, dvocal=1024, batch=8,
             micro_batch=4, pp=2)  # fmt: skip
EXTRA: dict[str, dict[str, Any]] = {
    "mamba2": {"ssm_chunk": 64},
    "hybrid": {"ssm_chunk": 64, "layer_pattern": "M*-G", "num_stacks": 4},
}


def figures(report: dict[str, Any]) -> list[tuple[Any, ...]]:
    keys = ("parameters", "weights", "gradients", "optimizer", "activations", "peak")
    return [tuple(c[k] for k in keys) for c in report["classes"]]


@pytest.mark.parametrize("model", sorted(CLOSED_FORM_MODELS))
def test_the_closed_forms_are_the_built_workloads(model: str) -> None:
    o = GenerateOptions(model=model, **SMALL)
    built = predict_memory(build_workload(o, REGISTRY), "h100-80g")
    assert figures(predict_analytic(o, "h100-80g", registry=REGISTRY)) == figures(built)


@pytest.mark.parametrize("model", ["bert", "bert-qa", "roberta-mc", "mamba2", "gated-deltanet",
                                   "hybrid"])  # fmt: skip
@pytest.mark.parametrize("optimizer", ["adam", "muon"])
def test_other_models_are_read_from_their_workload(model: str, optimizer: str) -> None:
    if optimizer == "muon" and model.startswith(("bert", "roberta")):
        pytest.skip("encoders: Muon's recipes are decoders'")
    o = GenerateOptions(model=model, **{**SMALL, **EXTRA.get(model, {}), "optimizer": optimizer})
    built = predict_memory(build_workload(o, REGISTRY), "h100-80g")
    report = predict_memory_options(o, "h100-80g", registry=REGISTRY)
    assert figures(report) == figures(built)
    assert all(row[3] > 0 for row in figures(report))  # Muon's state: never negative


def test_a_trace_of_another_model_reports_its_workloads_memory(tmp_path: Any) -> None:
    # from a trace directory the memory predictor rebuilds the workload of the options the
    # trace records (the closed forms priced a gated DeltaNet's layers as GPT's, and its Muon
    # state came out negative)
    import json

    from typer.testing import CliRunner

    from stg.cli import app

    args = ["--model", "gated-deltanet", "--dmodel", "128", "--head", "4", "--kvhead", "4",
            "--dff", "256", "--num_stacks", "2", "--seq", "128", "--dvocal", "1024", "--batch",
            "4", "--optimizer", "muon"]  # fmt: skip
    runner = CliRunner()
    out = tmp_path / "trace"
    assert runner.invoke(app, ["generate", *args, "--output_dir", str(out)]).exit_code == 0
    reports = []
    for given in ([str(out)], args):
        result = runner.invoke(app, ["predict", *given, "--predictor", "memory", "--json"])
        assert result.exit_code == 0, result.output
        reports.append(json.loads(result.output)["memory"])
    assert figures(reports[0]) == figures(reports[1])
    assert all(row[3] > 0 for row in figures(reports[0]))
