"""Memory of a ``--dtype fp8`` training run under delayed scaling, the default recipe.

Transformer Engine's ``Linear`` quantizes its bf16 weight with the delayed-scaling
``Float8Quantizer`` in the first micro-batch and keeps the result (``_fp8_workspaces``) for the
others (Megatron-LM passes ``is_first_microbatch``): a ``Float8Tensor`` of the rowwise fp8 data,
its transpose for the input-gradient GEMM (Hopper: ``nvte_is_non_tn_fp8_gemm_supported`` is
false below sm100) and one fp32 ``scale_inv`` (TE 2.9, ``module/base.py``
``get_weight_workspace``, ``tensor/float8_tensor.py`` ``Float8Quantizer.make_empty``). The
parameters stay bf16 (Megatron-LM's ``Float16Module``). So a rank keeps, per GEMM weight of
``w`` elements, ``2w`` bytes of weight, ``2w`` of copies and 4 of scale: the closed forms below.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from stg.core.options import GenerateOptions, resolve_model
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.predictors.memory import predict_analytic, predict_memory

D, F, HEADS, KV, TP, LAYERS = 512, 1536, 8, 4, 2, 2
HD = D // HEADS
LLAMA: dict[str, Any] = {"model": "llama", "dmodel": D, "dff": F, "head": HEADS, "kvhead": KV,
                         "seq": 1024, "dvocal": 1024, "num_stacks": LAYERS, "batch": 2,
                         "micro_batch": 2, "mixed_precision": True, "causal": True,
                         "dtype": "fp8", "tp": TP}  # fmt: skip
GEMM_WEIGHTS = [  # one TP rank's elements of each GEMM weight of a layer
    D * D // TP,  # q
    KV * HD * D // TP,  # k
    KV * HD * D // TP,  # v
    D * D // TP,  # attn_out
    F * D // TP,  # gate
    F * D // TP,  # up
    D * F // TP,  # down
]
FP8_COPIES = 2  # the rowwise fp8 data and its transpose, one byte each
SCALE = 4  # one fp32 scale_inv per quantized weight, shared by both
COPIES_PER_LAYER = sum(FP8_COPIES * w + SCALE for w in GEMM_WEIGHTS)
SYSTEM = "h100-80g"


def _options(**given: Any) -> GenerateOptions:
    return GenerateOptions(**{**LLAMA, **given})


def _built(options: GenerateOptions) -> list[dict[str, Any]]:
    workload = build_workload(options, load_registry(autoload=False))
    return predict_memory(workload, SYSTEM)["classes"]


def test_delayed_scaling_keeps_bf16_weights_and_their_fp8_copies_from_options() -> None:
    (memory,) = predict_analytic(_options(), SYSTEM)["classes"]
    assert memory["weights"] == 2 * memory["parameters"] + LAYERS * COPIES_PER_LAYER
    (bf16,) = predict_analytic(_options(dtype="bf16"), SYSTEM)["classes"]
    assert memory["parameters"] == bf16["parameters"]
    assert memory["weights"] - bf16["weights"] == LAYERS * COPIES_PER_LAYER


def test_delayed_scaling_keeps_bf16_weights_and_their_fp8_copies_from_a_workload() -> None:
    (memory,) = _built(_options())
    assert memory["weights"] == 2 * memory["parameters"] + LAYERS * COPIES_PER_LAYER
    (alone,) = predict_analytic(_options(), SYSTEM)["classes"]
    assert memory["peak"] == alone["peak"]


def test_delayed_and_current_scaling_keep_the_same_weight_bytes() -> None:
    # both scale per tensor: the same copies (a tensorwise workload states its own figure)
    for given in ({}, {"pp": 2, "num_stacks": 4, "batch": 4}):
        delayed = _built(_options(**given))
        tensorwise = _built(_options(low_precision_recipe="tensorwise", **given))
        assert [c["weights"] for c in delayed] == [c["weights"] for c in tensorwise]
        assert [c["optimizer"] for c in delayed] == [c["optimizer"] for c in tensorwise]


def test_a_mixture_of_experts_keeps_the_copies_that_current_scaling_keeps() -> None:
    registry = load_registry(autoload=False)
    values, _ = resolve_model(
        {"model": "qwen3-30b-a3b", "num_stacks": 1, "seq": 128, "batch": 4, "micro_batch": 4,
         "dp": 2, "ep": 2, "zero": 1, "dtype": "fp8", "mixed_precision": True},
        registry,
    )  # fmt: skip
    options = GenerateOptions(**values)
    delayed = predict_memory(build_workload(options, registry), SYSTEM)["classes"]
    current = replace(options, low_precision_recipe="tensorwise")
    tensorwise = predict_memory(build_workload(current, registry), SYSTEM)["classes"]
    assert [c["weights"] for c in delayed] == [c["weights"] for c in tensorwise]
    assert predict_analytic(options, SYSTEM)["peak_bytes"] == max(c["peak"] for c in delayed)


def test_a_pipeline_stage_counts_the_copies_of_its_own_layers() -> None:
    options = _options(pp=2, num_stacks=4, batch=4)
    built = {c["class"]: c for c in _built(options)}
    alone = {c["class"]: c for c in predict_analytic(options, SYSTEM)["classes"]}
    assert len(built) == 2
    for stage, memory in built.items():
        assert memory["weights"] == 2 * memory["parameters"] + 2 * COPIES_PER_LAYER
        assert alone[stage]["weights"] == memory["weights"]
        assert alone[stage]["peak"] == memory["peak"]


def test_a_precision_plan_keeps_its_own_fp8_copies_and_no_recipe_copies() -> None:
    # a bf16 run whose plan puts the MLP in fp8: Transformer Engine's copies of those weights
    # (FP8_WEIGHT_COPY_BYTES each), counted once
    plan = (("gate", "fp8"), ("up", "fp8"), ("down", "fp8"))
    (planned,) = predict_analytic(_options(dtype="bf16", precision=plan), SYSTEM)["classes"]
    mlp = sum(GEMM_WEIGHTS[4:])
    assert planned["weights"] == 2 * planned["parameters"] + LAYERS * FP8_COPIES * mlp


def test_eager_fp8_and_bf16_runs_keep_no_copies() -> None:
    # no Transformer Engine: the eager profile stores fp8 weights as the graph does
    (eager,) = predict_analytic(_options(profile="eager"), SYSTEM)["classes"]
    assert eager["weights"] == eager["parameters"]
    (bf16,) = predict_analytic(_options(dtype="bf16"), SYSTEM)["classes"]
    assert bf16["weights"] == 2 * bf16["parameters"]
