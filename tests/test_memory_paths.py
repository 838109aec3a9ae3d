"""The three ways to ask the memory predictor about one plan agree exactly: ``stg predict
OPTIONS`` (the closed forms, predictors/memory.py ``predict_analytic``), ``stg generate OPTIONS
--predict`` (the built workload's rank-class facts, ``predict_memory``) and ``stg predict
DIR`` (the trace written, read back). Two fuzzed disagreements:

- Muon beside ``--full_attention_every``: the closed forms named every layer ``block`` where
  the stack names them ``local`` and ``global``, so no Muon matrix was found for them and the
  options and the trace reported Adam's state; the built workload priced a ``dense_global``
  layer's activations as an MoE layer's (``closed_form_kind``).
- low-precision recipes other than ``delayed``: the options counted the weight copies per
  element and left out their scales (one fp32 per tensor, one per row under ``rowwise``,
  blocks rounded up), which the workload states; on Blackwell the workload's one fp32
  ``scale_inv`` per ``tensorwise`` weight was halved with the copies. Both now count what
  Transformer Engine and torchao keep (``stg.core.recipes.cached_weight_bytes``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions
from stg.host.registry import load_registry
from stg.predictors.memory import (
    gemm_weight_shapes_per_rank,
    gemm_weights_per_rank,
    layer_kinds,
)

REGISTRY = load_registry(autoload=False)
SMALL = ["--dmodel", "256", "--dff", "512", "--head", "8", "--kvhead", "4", "--seq", "256",
         "--dvocal", "1024", "--num_stacks", "4", "--batch", "8", "--micro_batch", "2"]  # fmt: skip
HYBRID = ["--causal", "true", "--attention_window", "64", "--full_attention_every", "2"]
CAUSAL = ["--model", "llama", "--causal", "true"]
MOE = ["--model", "moe", "--experts", "4", "--dense_dff", "768"]

BF16_ENDS = dict(first_last_layers_bf16=True, dtype="fp8", low_precision_recipe="tensorwise")
FIELDS = ("parameters", "weights", "gradients", "optimizer", "activations", "peak")


def three_paths(args: list[str], system: str, tmp_path: Path) -> list[dict[str, Any]]:
    """The memory reports of the options, of generate --predict and of the trace written."""
    runner = CliRunner()
    out = tmp_path / "trace"
    options = [*args, "--system", system]
    reports = []
    result = runner.invoke(app, ["predict", *options, "--predictor", "memory", "--json"])
    assert result.exit_code == 0, result.output
    reports.append(json.loads(result.output)["memory"])
    gen = ["generate", *options, "--output_dir", str(out), "--predict", "--json"]
    result = runner.invoke(app, gen)
    assert result.exit_code == 0, result.output
    reports.append(json.loads(result.output)["predictions"]["memory"])
    trace = ["predict", str(out), "--system", system, "--predictor", "memory", "--json"]
    result = runner.invoke(app, trace)
    assert result.exit_code == 0, result.output
    reports.append(json.loads(result.output)["memory"])
    return reports


def figures(report: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [tuple(c[k] for k in FIELDS) for c in report["classes"]]


def assert_agree(args: list[str], system: str, tmp_path: Path) -> list[dict[str, Any]]:
    options, generated, trace = three_paths(args, system, tmp_path)
    assert options["peak_bytes"] == generated["peak_bytes"] == trace["peak_bytes"]
    assert figures(options) == figures(generated) == figures(trace)
    return [options, generated, trace]


def test_adam_bf16_control(tmp_path: Path) -> None:
    assert_agree(["--model", "llama", *SMALL], "a100-80g", tmp_path)


MUON_PLANS = {
    "window": ["--model", "llama", "--causal", "true", "--attention_window", "64"],
    "hybrid-window": ["--model", "llama", *HYBRID],
    "hybrid-chunk": [*CAUSAL, "--attention_chunk", "64", "--full_attention_every", "2"],
    "hybrid-pp": [*CAUSAL, "--attention_window", "64", "--full_attention_every", "3", "--pp", "2"],
    "moe-hybrid": [*MOE, *HYBRID],
    "moe-hybrid-dense": [*MOE, *HYBRID, "--dense_layers", "2"],
    "moe-hybrid-zero": [*MOE, *HYBRID, "--dense_layers", "1", "--dp", "2", "--zero", "1"],
}


@pytest.mark.parametrize("plan", sorted(MUON_PLANS))
def test_muon_with_attention_spans(plan: str, tmp_path: Path) -> None:
    args = [*MUON_PLANS[plan], *SMALL, "--optimizer", "muon"]
    options, _, _ = assert_agree(args, "a100-80g", tmp_path)
    # Muon's one moment a matrix element: less optimizer state than Adam's on every stage
    (tmp_path / "adam").mkdir()
    adam, _, _ = three_paths([*MUON_PLANS[plan], *SMALL], "a100-80g", tmp_path / "adam")
    for muon_class, adam_class in zip(options["classes"], adam["classes"], strict=True):
        assert muon_class["optimizer"] < adam_class["optimizer"]


def test_a_dense_global_layer_is_priced_as_a_dense_one(tmp_path: Path) -> None:
    # Adam: the built workload priced the dense_global layer's activations as an MoE one's
    assert_agree([*MOE, *HYBRID, *SMALL, "--dense_layers", "2"], "a100-80g", tmp_path)


@pytest.mark.parametrize(
    ("recipe", "system"),
    [
        ("tensorwise", "h100-80g"),
        ("tensorwise", "b200-180g"),
        ("rowwise", "h100-80g"),
        ("blockwise", "h100-80g"),
        ("mxfp8", "b200-180g"),
        ("nvfp4", "b200-180g"),
        ("delayed", "b200-180g"),
    ],
)
def test_low_precision_recipes(recipe: str, system: str, tmp_path: Path) -> None:
    # dff 500, dmodel 200: weights whose dimensions do not divide the scale blocks
    args = ["--model", "llama", *SMALL, "--dtype", "fp8", "--low_precision_recipe", recipe]
    args += ["--dmodel", "200", "--head", "5", "--kvhead", "5", "--dff", "500"]
    assert_agree(args, system, tmp_path)


@pytest.mark.parametrize("system", ["h100-80g", "b200-180g"])
def test_low_precision_recipes_on_sharded_moe(system: str, tmp_path: Path) -> None:
    args = [*MOE, *SMALL, "--dtype", "fp8", "--low_precision_recipe", "tensorwise",
            "--tp", "2", "--dense_layers", "1", "--shared_experts", "1"]  # fmt: skip
    assert_agree(args, system, tmp_path)


def test_fp8_param_gather_on_blackwell_keeps_the_scales(tmp_path: Path) -> None:
    args = ["--model", "llama", *SMALL, "--dtype", "fp8", "--low_precision_recipe",
            "tensorwise", "--dp", "2", "--weight_sharded", "true", "--fp8_param_gather",
            "true"]  # fmt: skip
    assert_agree(args, "b200-180g", tmp_path)


@pytest.mark.parametrize(
    "overrides",
    [
        {"model": "llama", "tp": 2},
        {"model": "moe", "experts": 4, "tp": 2, "etp": 2, "shared_experts": 1},
        dict(model="deepseek", experts=4, dense_layers=1, head=4, kvhead=4, q_lora_rank=64),
        {"model": "gpt", "kvhead": 8, "tp": 2},
    ],
)
def test_gemm_weight_shapes_multiply_to_the_elements(overrides: dict[str, Any]) -> None:
    o = GenerateOptions(**{**dict(dmodel=256, dff=512, head=8, kvhead=4, seq=256, dvocal=1024,
                                  num_stacks=2, batch=8), **overrides})  # fmt: skip
    for kind in set(layer_kinds(o)):
        shapes = gemm_weight_shapes_per_rank(o, kind)
        elements = gemm_weights_per_rank(o, kind)
        assert {op: r * c for op, (r, c) in shapes.items()} == elements


@pytest.mark.parametrize(
    "overrides",
    [
        {"model": "llama", "full_attention_every": 2},
        {**BF16_ENDS, "model": "llama", "full_attention_every": 3},
        {"model": "moe", "experts": 4, "full_attention_every": 2, "dense_layers": 3},
        {"model": "moe", "experts": 4, "full_attention_every": 4, "dense_layers": 1},
        {"model": "llama"},
    ],
)
def test_layer_kinds_are_the_stacks(overrides: dict[str, Any]) -> None:
    from stg.core.pipeline import build_parts, validate_options

    o = GenerateOptions(**{**dict(dmodel=256, dff=512, head=8, kvhead=4, seq=256, dvocal=1024,
                                  num_stacks=6, batch=8, causal=True, attention_window=64),
                           **overrides})  # fmt: skip
    parts = build_parts(REGISTRY.models.get(o.model), validate_options(o, REGISTRY))
    assert layer_kinds(o) == list(parts.layer_kinds)
