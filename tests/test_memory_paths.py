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

A third: ``--attention_output_gate`` (Qwen3-Next's gated attention) adds a gate projection
``w_gate`` as large as the query's, which the built workload counts and the closed forms
left out (2.1 MB of Adam state on the small Llama below); ``--attention_sinks`` likewise
its logit per head. The closed forms now count the gate's weight (with its gradient,
optimizer state and a recipe's quantized copies) and the two tensors its product keeps for
the backward, the attention's output and the gate projection's output, which
:func:`test_the_gates_saved_tensors_are_the_graphs` checks against the graph's saved ones.
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
GATE = ["--attention_output_gate", "true"]
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


GATE_PLANS = {
    "none": [],
    "selective": ["--activation_recompute", "selective"],
    "full": ["--activation_recompute", "full"],
    "tp2": ["--tp", "2", "--tpsp", "true"],
    "tp2-selective": ["--tp", "2", "--tpsp", "true", "--activation_recompute", "selective"],
    "pp2-zero3": ["--pp", "2", "--dp", "2", "--zero", "3"],
    "unfused": ["--attention", "unfused"],
    "eager": ["--profile", "eager"],
    "selective_op": ["--profile", "torchtitan", "--activation_recompute", "selective_op"],
    "hybrid-window": [*HYBRID],
    "sinks": ["--causal", "true", "--attention_sinks", "true", "--tp", "2"],
}


@pytest.mark.parametrize("plan", sorted(GATE_PLANS))
def test_output_gate(plan: str, tmp_path: Path) -> None:
    assert_agree(["--model", "llama", *SMALL, *GATE, *GATE_PLANS[plan]], "a100-80g", tmp_path)


def test_output_gate_of_moe_layers(tmp_path: Path) -> None:
    args = [*MOE, *HYBRID, *SMALL, *GATE, "--dense_layers", "1", "--tp", "2"]
    assert_agree(args, "a100-80g", tmp_path)


def test_attention_sinks_alone(tmp_path: Path) -> None:
    assert_agree([*CAUSAL, *SMALL, "--attention_sinks", "true"], "a100-80g", tmp_path)


@pytest.mark.parametrize(
    ("recipe", "system", "extra"),
    [
        ("tensorwise", "h100-80g", []),
        ("delayed", "h100-80g", ["--tp", "2"]),
        ("mxfp8", "b200-180g", ["--tp", "2", "--tpsp", "true"]),
    ],
)
def test_output_gate_under_a_recipe(
    recipe: str, system: str, extra: list[str], tmp_path: Path
) -> None:
    # the gate projection's weight gets its quantized copies (and their scales) like wq's
    args = ["--model", "llama", *SMALL, *GATE, "--dtype", "fp8", "--low_precision_recipe",
            recipe, *extra]  # fmt: skip
    assert_agree(args, system, tmp_path)


@pytest.mark.parametrize("plan", ["plain", "hybrid-window", "pp2"])
def test_output_gate_with_muon(plan: str, tmp_path: Path) -> None:
    extra = {"plain": [], "hybrid-window": HYBRID, "pp2": ["--pp", "2"]}[plan]
    args = ["--model", "llama", *SMALL, *GATE, *extra, "--optimizer", "muon"]
    muon, _, _ = assert_agree(args, "a100-80g", tmp_path)
    # w_gate is a matrix Muon updates: one moment an element, less state than Adam's
    (tmp_path / "adam").mkdir()
    adam, _, _ = three_paths(args[:-2], "a100-80g", tmp_path / "adam")
    for muon_class, adam_class in zip(muon["classes"], adam["classes"], strict=True):
        assert muon_class["optimizer"] < adam_class["optimizer"]


def test_output_gate_adds_a_query_sized_weight_and_two_saved_tensors() -> None:
    from stg.predictors.memory import activation_bytes_per_layer, layer_parameters_per_rank

    base = dict(model="llama", dmodel=256, dff=512, head=8, kvhead=4, seq=256, dvocal=1024,
                num_stacks=4, batch=8, micro_batch=2, tp=2)  # fmt: skip
    plain = GenerateOptions(**base)  # type: ignore[arg-type]
    gated = GenerateOptions(**base, attention_output_gate=True)  # type: ignore[arg-type]
    h, a, d, t, sb, e = 256, 8, 32, 2, 2 * 256, 2
    assert layer_parameters_per_rank(gated) - layer_parameters_per_rank(plain) == h * a * d // t
    for recompute in ("none", "selective"):
        added = activation_bytes_per_layer(gated, recompute=recompute)
        added -= activation_bytes_per_layer(plain, recompute=recompute)
        assert added == 2 * e * sb * a * d / t  # output_gate's inputs: context, gate_proj
    # full recompute keeps the layer input alone; the recomputed layer holds the gate's too
    full = [activation_bytes_per_layer(o, recompute="full") for o in (plain, gated)]
    assert full[0] == full[1]


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tp": 2, "tpsp": True}, {"attention": "unfused"},
     {"causal": True, "attention_window": 64, "full_attention_every": 2}],
)  # fmt: skip
def test_the_gates_saved_tensors_are_the_graphs(overrides: dict[str, Any]) -> None:
    """The closed form of a gated layer's activations (no recompute, the megatron profile:
    the graph has no eager norm statistics or SiLU outputs) is what the built layer's graph
    keeps for its backward (stg.core.pipeline.layer_saved_bytes)."""
    from stg.core.pipeline import Binder, build_parts, layer_saved_bytes, symbol_values
    from stg.core.pipeline import validate_options as validate
    from stg.predictors.memory import activation_bytes_per_layer

    o = GenerateOptions(**{**dict(model="llama", dmodel=256, dff=512, head=8, kvhead=4,
                                  seq=256, dvocal=1024, num_stacks=4, batch=8, micro_batch=2,
                                  attention_output_gate=True), **overrides})  # fmt: skip
    plan = validate(o, REGISTRY)
    parts = build_parts(REGISTRY.models.get(o.model), plan)
    binder = Binder(symbol_values(plan.options), plan.degrees, plan.axis_parts)
    for kind in set(layer_kinds(o)):
        graph = layer_saved_bytes(parts.blocks[kind].part, binder, fused=o.attention == "fused")
        assert activation_bytes_per_layer(o, kind=kind) == graph


def test_output_gate_under_an_fp8_plan(tmp_path: Path) -> None:
    # Transformer Engine's fp8 copy of w_gate on Hopper, and the saved inputs: gate_proj's is
    # the QKV input (one fp8 copy for the four GEMMs); the projection's is the gated product,
    # whose 16-bit copy no other backward reads, so only its fp8 copy stays
    from stg.perf.system import load_system
    from stg.predictors.memory import planned_activation_delta

    plan = tmp_path / "plan.json"
    ops = ("q", "k", "v", "gate_proj", "attn_out", "gate", "up", "down")
    plan.write_text(json.dumps({"ops": dict.fromkeys(ops, "fp8")}))
    assert_agree(["--model", "llama", *SMALL, *GATE, "--precision", str(plan)], "h100-80g",
                 tmp_path)  # fmt: skip
    base = dict(model="llama", dmodel=256, dff=512, head=8, kvhead=4, seq=256, dvocal=1024,
                num_stacks=4, batch=8, micro_batch=2, precision=(("attn_out", "fp8"),))  # fmt: skip
    h100 = load_system("h100-80g")
    sbw = 2 * 256 * 8 * 32
    plain = planned_activation_delta(GenerateOptions(**base), system=h100)  # type: ignore[arg-type]
    gated = GenerateOptions(**base, attention_output_gate=True)  # type: ignore[arg-type]
    assert plain == 1 * sbw  # the fused kernel keeps its 16-bit output beside the fp8 copy
    assert planned_activation_delta(gated, system=h100) == -(2 - 1) * sbw
