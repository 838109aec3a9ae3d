"""Layers kept in bf16 under a low-precision recipe (``--first_last_layers_bf16``, Megatron-LM's
``--first-last-layers-bf16`` with ``--num-layers-at-start-in-bf16`` and
``--num-layers-at-end-in-bf16``; the NVFP4 paper's bf16 layers, arXiv 2509.25149).

A layer of global index i of L runs in bf16 when i < start or i >= L - end: its GEMMs in
bf16, no quantize node, no quantized weight copy. The closed forms of the recipes' kernels
are tests/test_low_precision_recipes.py's, written from the recipes' definitions.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from consumers import assert_ranks_decode_and_feed
from test_low_precision_recipes import (
    CLI,
    CLOSED_FORMS,
    HD,
    HEADS,
    KV,
    LLAMA,
    SITES,
    TP,
    B,
    D,
    F,
    S,
    rowwise_expected,
)

from stg.cli import main
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.perf.costs import compute_time
from stg.perf.kernel_time import gemm_time
from stg.perf.system import load_system
from stg.trace.reader import read_metadata, read_nodes

GEMM_DTYPE = {"tensorwise": "fp8", "rowwise": "fp8", "blockwise": "fp8", "mxfp8": "fp8",
              "nvfp4": "fp4"}  # fmt: skip
LAYERS, START, END = 5, 1, 2
BF16 = {0, 3, 4}  # i < START or i >= LAYERS - END
BF16_CLI = ["--first_last_layers_bf16", "true", "--num_layers_at_start_in_bf16", str(START),
            "--num_layers_at_end_in_bf16", str(END)]  # fmt: skip


def _generate(tmp_path: Path, recipe: str, *extra: str) -> Path:
    out = tmp_path / recipe
    cli = [*CLI[: CLI.index("--num_stacks")], "--num_stacks", str(LAYERS),
           *CLI[CLI.index("--num_stacks") + 2 :]]  # fmt: skip
    with pytest.raises(SystemExit) as done:
        main(["generate", *cli, "--low_precision_recipe", recipe, *extra, "--output_dir", str(out)])
    assert done.value.code == 0
    return out


def _layer(name: str) -> int | None:
    part = name.split("/")[1] if name.count("/") >= 2 else ""
    return int(part[5:]) if part.startswith("layer") and part[5:].isdigit() else None


def _weight_copies(recipe: str) -> int:
    """Bytes of one layer's quantized weight copies and scales: what the recipe's weight casts
    write (their bf16 reads aside)."""
    reads = 2 if recipe == "rowwise" else 1  # torchao rowwise: a cast per copy
    return sum(
        sum(v for k, v in CLOSED_FORMS[recipe](operand, r, c).items() if k.endswith("cast"))
        - reads * 2 * r * c
        for (operand, _), (r, c) in SITES.items()
        if operand == "weight"
    )


@pytest.mark.parametrize("recipe", list(CLOSED_FORMS))
def test_bf16_layers_have_no_quantize_nodes_and_bf16_gemms(tmp_path: Path, recipe: str) -> None:
    out = _generate(tmp_path, recipe, *BF16_CLI)
    found: dict[int, Counter[tuple[str, str, str]]] = {i: Counter() for i in range(LAYERS)}
    for n in read_nodes(out / "workload.0.et"):
        layer = _layer(n.name)
        if layer is None or not n.name.startswith("mb0/"):
            continue
        if "quantize_kernel" in n.attrs:
            op = n.name.rsplit("/", 1)[1].split(".", 1)[0]
            found[layer][n.attrs["quantize_operand"], op, n.attrs["quantize_kernel"]] += (
                n.tensor_size
            )
        if "gemm" in n.attrs:
            bf16 = layer in BF16
            assert n.dtype == ("bf16" if bf16 else GEMM_DTYPE[recipe]), (n.name, n.dtype)
            assert ("low_precision_recipe" in n.attrs) is not bf16, n.name
    per_layer: Counter[tuple[str, str, str]] = Counter()
    for (operand, op), (r, c) in SITES.items():
        for kind, nbytes in CLOSED_FORMS[recipe](operand, r, c).items():
            per_layer[operand, op, kind] += nbytes
    if recipe == "rowwise":  # gathered bf16 rows, the backward's casts and rescales
        per_layer = rowwise_expected()
    for layer in range(LAYERS):
        assert found[layer] == (Counter() if layer in BF16 else per_layer), layer
    options = json.loads(read_metadata(out / "workload.0.et")["attrs"]["options"])
    assert options["first_last_layers_bf16"] is True
    assert (options["num_layers_at_start_in_bf16"], options["num_layers_at_end_in_bf16"]) == (
        START,
        END,
    )


def test_the_written_ranks_decode_and_feed(tmp_path: Path) -> None:
    assert_ranks_decode_and_feed(_generate(tmp_path, "nvfp4", *BF16_CLI))


def _workload(**given: Any) -> Any:
    options = GenerateOptions(**{**LLAMA, "num_stacks": LAYERS, **given})
    return build_workload(options, load_registry(autoload=False))


def test_a_bf16_layer_prices_its_gemms_in_bf16() -> None:
    workload = _workload(
        low_precision_recipe="nvfp4",
        first_last_layers_bf16=True,
        num_layers_at_start_in_bf16=START,
        num_layers_at_end_in_bf16=END,
    )
    nodes = {n.name: n for n in workload.ranks[0].nodes()}
    b200 = load_system("b200-180g")
    for layer, dtype in ((0, "bf16"), (1, "fp4"), (4, "bf16")):
        gate = nodes[f"mb0/layer{layer}/fwd/gate"]
        batch, m, n, k = gate.attrs["gemm"]
        assert compute_time(gate, b200, "fp8") == pytest.approx(
            gemm_time(b200.gpu, m, n, k, dtype, batch) + b200.kernel_overhead
        )


@pytest.mark.parametrize("recipe", list(CLOSED_FORMS))
def test_memory_counts_the_copies_of_quantized_layers_only(recipe: str) -> None:
    from stg.predictors.memory import predict_analytic, predict_memory

    given = {"low_precision_recipe": recipe, "first_last_layers_bf16": True,
             "num_layers_at_start_in_bf16": START, "num_layers_at_end_in_bf16": END}  # fmt: skip
    workload = _workload(**given)
    facts = workload.rank_classes[0].facts
    quantized = LAYERS - len(BF16)
    assert facts["low_precision_weight_bytes"] == quantized * _weight_copies(recipe)
    built = predict_memory(workload, "b200-180g")["classes"][0]
    # Blackwell keeps one per-tensor scaled fp8 copy for both usages (Transformer Engine v2.9
    # pytorch/csrc/quantizer.cpp: no transpose where nvte_is_non_tn_fp8_gemm_supported())
    # (its one fp32 scale_inv per weight whole)
    gemms = [rc for (operand, _), rc in SITES.items() if operand == "weight"]
    kept = _weight_copies(recipe)
    if recipe == "tensorwise":
        kept = (kept - 4 * len(gemms)) // 2 + 4 * len(gemms)
    assert built["weights"] == 2 * built["parameters"] + quantized * kept
    # from options alone: the same copies and scales (tests/test_memory_paths.py), for the
    # quantized layers only
    options = GenerateOptions(**{**LLAMA, "num_stacks": LAYERS, **given})
    alone = predict_analytic(options, "b200-180g")["classes"][0]
    assert built["weights"] == alone["weights"]
    assert alone["parameters"] == built["parameters"]
    assert alone["activations"] == built["activations"]


def test_memory_per_pipeline_stage_from_options_and_workload() -> None:
    from stg.predictors.memory import predict_analytic, predict_memory

    # 4 layers on 2 stages: layer 0 (stage 0) and layer 3 (stage 1) in bf16
    given = {**LLAMA, "num_stacks": 4, "pp": 2, "batch": 4, "micro_batch": 2,
             "low_precision_recipe": "mxfp8", "first_last_layers_bf16": True}  # fmt: skip
    options = GenerateOptions(**given)  # type: ignore[arg-type]
    workload = build_workload(options, load_registry(autoload=False))
    copies = _weight_copies("mxfp8")  # mxfp8 leaves no scale out: exact from options
    built = {c["class"]: c for c in predict_memory(workload, "b200-180g")["classes"]}
    alone = {c["class"]: c for c in predict_analytic(options, "b200-180g")["classes"]}
    for rank_class in workload.rank_classes:
        assert rank_class.facts["low_precision_weight_bytes"] == copies
        assert rank_class.facts["layer_kinds"] == {"block_bf16": 1, "block": 1}
        stage = rank_class.stage
        assert (
            built[rank_class.index]["weights"] == 2 * built[rank_class.index]["parameters"] + copies
        )
        assert alone[stage]["weights"] == built[rank_class.index]["weights"]
        assert alone[stage]["peak"] == built[rank_class.index]["peak"]


def test_without_the_option_nothing_changes() -> None:
    plain = GenerateOptions(**LLAMA, low_precision_recipe="nvfp4")
    assert plain.bf16_layers == (0, 0)
    recorded = plain.recorded()
    assert not {"first_last_layers_bf16", *GenerateOptions.BF16_LAYER_COUNTS} & set(recorded)
    # Megatron's defaults: one layer at each end
    assert GenerateOptions(**LLAMA, first_last_layers_bf16=True).bf16_layers == (1, 1)


def test_the_analytical_predictor_prices_bf16_layers_as_they_are() -> None:
    from stg.predictors.analytical import predict_options, unlike_layers
    from stg.predictors.time import predict_time

    registry = load_registry()
    given = {**LLAMA, "num_stacks": 4, "pp": 2, "dp": 2, "batch": 8, "micro_batch": 4,
             "low_precision_recipe": "nvfp4", "first_last_layers_bf16": True}  # fmt: skip
    options = GenerateOptions(**given)  # type: ignore[arg-type]
    assert unlike_layers(options, registry)
    dag = predict_time(build_workload(options, registry), "b200-180g")
    fast = predict_options(options, "b200-180g", registry=registry)
    assert fast["iteration_time_s"] == pytest.approx(dag["iteration_time_s"], rel=0.03)
    quantized = GenerateOptions(**{**given, "first_last_layers_bf16": False})  # type: ignore[arg-type]
    assert not unlike_layers(quantized, registry)
    # at these small sizes the quantize kernels outweigh the fp4 GEMMs' gain: faster in bf16
    plain = predict_options(quantized, "b200-180g", registry=registry)
    assert fast["iteration_time_s"] < plain["iteration_time_s"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--low_precision_recipe", "delayed", "--first_last_layers_bf16", "true"],
         "first_last_layers_bf16 keeps layers out of a low-precision recipe: it needs "
         "low_precision_recipe one of tensorwise"),
        (["--low_precision_recipe", "nvfp4", "--first_last_layers_bf16", "true",
          "--num_layers_at_start_in_bf16", "-1"],
         "num_layers_at_start_in_bf16=-1 must be between 0 and the layers per pipeline "
         "stage, num_stacks // pp = 4"),
        (["--low_precision_recipe", "nvfp4", "--first_last_layers_bf16", "true", "--pp", "2",
          "--num_layers_at_end_in_bf16", "3"],
         "num_layers_at_end_in_bf16=3 must be between 0 and the layers per pipeline stage, "
         "num_stacks // pp = 2"),
        (["--low_precision_recipe", "nvfp4", "--num_layers_at_end_in_bf16", "2"],
         "num_layers_at_end_in_bf16=2 counts the layers that first_last_layers_bf16 keeps in "
         "bf16: give first_last_layers_bf16=true"),
        (["--low_precision_recipe", "mxfp8", "--first_last_layers_bf16", "true",
          "--fp8_param_gather", "true", "--weight_sharded", "true", "--tp", "1", "--dp", "2"],
         "first_last_layers_bf16 with fp8_param_gather"),
    ],
)  # fmt: skip
def test_bad_values_get_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    cli = [*CLI[: CLI.index("--num_stacks")], "--num_stacks", "4",
           *CLI[CLI.index("--num_stacks") + 2 :]]  # fmt: skip
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as done:
        main(["generate", *cli, *extra, "--output_dir", str(out)])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_a_serving_phase_refuses_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["generate", "--model", "llama", "--num_stacks", "2", "--phase", "decode",
              "--first_last_layers_bf16", "true", "--output_dir", str(tmp_path / "o")])  # fmt: skip
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "first_last_layers_bf16=true is a training option" in err and err.count("\n") == 1


# Saved activations under Transformer Engine (--dtype fp8, megatron profile): everything
# outside the GEMMs in bf16; a linear layer keeps one quantized copy of its input (TE 2.9
# module/linear.py, layernorm_linear.py), not the bf16 one; torchao's rowwise keeps bf16.
SAVED_INPUT = {"delayed": 1.0, "tensorwise": 1.0, "rowwise": 2.0, "blockwise": 1 + 4 / 128,
               "mxfp8": 1 + 1 / 32, "nvfp4": 0.5 + 1 / 16}  # fmt: skip


def _llama_layer_bytes(recipe: str | None, tpsp: bool = True) -> float:
    """One layer's saved bytes (one rank, one micro-batch) of LLAMA with fused attention."""
    sb = B * S
    rows = sb / TP if tpsp else sb  # sequence-parallel tensors: this rank's rows
    attn = sb * HEADS * HD / TP  # the attention output, the projection's input
    bf16 = 2 * 2 * rows * D  # the two norms' inputs
    bf16 += 2 * sb * HD * (HEADS + 2 * KV) / TP  # Q, K, V
    bf16 += 2 * attn  # the fused kernel's output, kept for its backward
    bf16 += 2 * 2 * sb * F / TP  # gate and up, the SwiGLU's inputs
    lse = 4 * HEADS * sb / TP
    if recipe is None:  # a layer kept in bf16
        return bf16 + 2 * (2 * rows * D + sb * F / TP) + lse
    q = SAVED_INPUT[recipe]
    # NVFP4 keeps both copies of a norm output that sequence parallelism gathers
    norm_output = 2 * q if recipe == "nvfp4" and tpsp else q
    return bf16 + norm_output * 2 * rows * D + q * (attn + sb * F / TP) + lse


@pytest.mark.parametrize("tpsp", [True, False])
@pytest.mark.parametrize("recipe", list(SAVED_INPUT))
def test_saved_activations_hold_the_recipes_quantized_inputs(recipe: str, tpsp: bool) -> None:
    from stg.predictors.memory import activation_bytes_per_layer

    given = {**LLAMA, "num_stacks": LAYERS, "low_precision_recipe": recipe, "tpsp": tpsp}
    if recipe != "delayed":
        given |= {"first_last_layers_bf16": True, "num_layers_at_start_in_bf16": START,
                  "num_layers_at_end_in_bf16": END}  # fmt: skip
    options = GenerateOptions(**given)  # type: ignore[arg-type]
    assert activation_bytes_per_layer(options, kind="block") == pytest.approx(
        _llama_layer_bytes(recipe, tpsp)
    )
    assert activation_bytes_per_layer(options, kind="block_bf16") == pytest.approx(
        _llama_layer_bytes(None, tpsp)
    )
    # full recompute keeps the bf16 layer input alone
    rows = B * S / TP if tpsp else B * S
    assert activation_bytes_per_layer(options, kind="block", recompute="full") == 2 * rows * D


def test_stage_activations_from_the_workload_and_options_count_each_layer_as_it_runs() -> None:
    from stg.predictors.memory import predict_analytic, predict_memory

    given = {**LLAMA, "num_stacks": LAYERS, "low_precision_recipe": "nvfp4"}
    kept = {**given, "first_last_layers_bf16": True, "num_layers_at_start_in_bf16": START,
            "num_layers_at_end_in_bf16": END}  # fmt: skip
    registry = load_registry(autoload=False)
    reports = {}
    for name, options in (("quantized", given), ("bf16 ends", kept)):
        o = GenerateOptions(**options)  # type: ignore[arg-type]
        built = predict_memory(build_workload(o, registry), "b200-180g")["classes"][0]
        assert predict_analytic(o, "b200-180g")["classes"][0]["activations"] == pytest.approx(
            built["activations"]
        )
        reports[name] = built["activations"]
    # one micro-batch in flight (pp 1): the bf16 layers keep their bf16 GEMM inputs
    change = len(BF16) * (_llama_layer_bytes(None) - _llama_layer_bytes("nvfp4"))
    assert reports["bf16 ends"] - reports["quantized"] == pytest.approx(change, abs=1)


def test_an_moe_layer_keeps_its_router_input_in_bf16_and_its_experts_inputs_quantized() -> None:
    from stg.api import expert_capacity
    from stg.predictors.memory import activation_bytes_per_layer

    h, f, s, tp, experts, k = 512, 1024, 1024, 2, 8, 2
    o = GenerateOptions(model="moe", dmodel=h, dff=f, head=8, kvhead=4, seq=s, dvocal=1024,
                        num_stacks=4, batch=4, micro_batch=4, experts=experts, kexperts=k,
                        shared_experts=1, tp=tp, ep=2, dp=2, dtype="fp8",
                        mixed_precision=True, low_precision_recipe="mxfp8",
                        first_last_layers_bf16=True)  # fmt: skip
    q = 1 + 1 / 32  # an E4M3 copy with one E8M0 scale per 32 elements
    sb = s * 4 / o.data_replicas
    capacity = expert_capacity(o, 4 * s)
    assert capacity == k * 4 * s // experts  # balanced, capacity factor 1
    slots = experts * capacity / (o.ep * o.expert_dp)  # this rank's routed token slots
    change = (
        (q - 2) * sb * h / tp  # the QKV input (the norm output of a fused norm-and-linear)
        + q * sb * h / tp  # the projection's copy beside the attention's bf16 output
        + q * sb * h / tp  # the shared expert's copy beside the router's bf16 input
        + (q - 2) * slots * h  # the dispatched tokens (the grouped linear's input)
        + (q - 2) * slots * f / o.expert_tp  # the experts' SwiGLU products
        + (q - 2) * sb * f / tp  # the shared expert's SwiGLU product
    )
    quantized = activation_bytes_per_layer(o, kind="block")
    assert quantized - activation_bytes_per_layer(o, kind="block_bf16") == pytest.approx(change)


def test_a_model_without_a_layer_stack_refuses_the_option() -> None:
    from stg.core.recipes import split_bf16_layers
    from stg.errors import UserError

    assert split_bf16_layers((), 0, 0) == ()
    with pytest.raises(UserError, match="the model has no layer stack whose first and last"):
        split_bf16_layers((), 1, 1)
    # runs of two kinds: the first layer and the last two of a 1 + 4 stack
    runs = (("dense", "d", 1), ("moe", "m", 4))
    assert split_bf16_layers(runs, 1, 2) == (
        ("dense_bf16", "d", 1),
        ("moe", "m", 2),
        ("moe_bf16", "m", 2),
    )
    # the whole stack (Megatron allows each count up to num_layers // pp)
    assert split_bf16_layers(runs, 2, 4) == (("dense_bf16", "d", 1), ("moe_bf16", "m", 4))
