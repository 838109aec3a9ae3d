"""The quantized weight copies a low-precision recipe keeps, by GPU architecture.

Transformer Engine caches each GEMM weight's quantized copies across the micro-batches of an
iteration (``_fp8_workspaces``; Megatron-LM passes ``is_first_microbatch``). Per-tensor scaled
fp8 (delayed and tensorwise) keeps the rowwise fp8 data and its transpose for the
input-gradient GEMM on Hopper, but on Blackwell, whose fp8 GEMMs read either layout, the data
alone serves both usages: ``Float8Quantizer`` and ``Float8CurrentScalingQuantizer``
``create_tensor`` write no transpose where ``nvte_is_non_tn_fp8_gemm_supported()``
(``pytorch/csrc/quantizer.cpp``) and ``Float8TensorStorage.update_usage`` drops it, at TE v2.9
(70f5366) and v2.18 (27486e0). Block scales run along one dimension, so blockwise, MXFP8 and
NVFP4 keep both copies with their scales on either GPU (blockwise on Blackwell converts only
its scales to MXFP8's, per GEMM: ``convert_block_scaling_to_mxfp8_tensor``). The closed forms
below count, per weight of ``r x c`` elements on this rank, the copies' bytes and scales.
"""

from __future__ import annotations

from typing import Any

import pytest

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.predictors.memory import predict_analytic, predict_memory

D, F, HEADS, KV, TP = 512, 1536, 8, 4, 2
HD = D // HEADS
LLAMA: dict[str, Any] = {"model": "llama", "dmodel": D, "dff": F, "head": HEADS, "kvhead": KV,
                         "seq": 1024, "dvocal": 1024, "num_stacks": 1, "batch": 2,
                         "micro_batch": 2, "mixed_precision": True, "causal": True,
                         "dtype": "fp8", "tp": TP}  # fmt: skip
WEIGHTS = [  # (rows, cols) of one TP rank's GEMM weights, cols along the forward's reduction
    (D // TP, D),  # q
    (KV * HD // TP, D),  # k
    (KV * HD // TP, D),  # v
    (D, D // TP),  # attn_out
    (F // TP, D),  # gate
    (F // TP, D),  # up
    (D, F // TP),  # down
]
ELEMENTS = sum(r * c for r, c in WEIGHTS)
HOPPER, BLACKWELL = "h100-80g", "b200-180g"


def per_weight(recipe: str, arch_system: str, r: int, c: int) -> int:
    """Bytes a rank caches for one weight of ``r x c``: elements of each copy, and scales."""
    n = r * c
    if recipe in ("delayed", "tensorwise"):  # fp8 data (+ transpose on Hopper), one fp32 scale
        return (2 * n if arch_system == HOPPER else n) + 4
    if recipe == "blockwise":  # two fp8 copies, one fp32 scale per 128x128 block of each
        return 2 * n + 2 * 4 * (r // 128) * (c // 128)
    if recipe == "mxfp8":  # two fp8 copies, one E8M0 byte per 32 elements of each
        return 2 * n + 2 * n // 32
    assert recipe == "nvfp4"  # two E2M1 copies, an E4M3 byte per 16, an fp32 scale each
    return 2 * (n // 2 + n // 16 + 4)


def closed_form(recipe: str, system: str) -> int:
    return sum(per_weight(recipe, system, r, c) for r, c in WEIGHTS)


CASES = [
    ("delayed", HOPPER),
    ("delayed", BLACKWELL),
    ("tensorwise", HOPPER),
    ("tensorwise", BLACKWELL),
    ("blockwise", HOPPER),
    ("blockwise", BLACKWELL),
    ("mxfp8", BLACKWELL),  # block-scaled tensor cores: Blackwell only
    ("nvfp4", BLACKWELL),
]


def _copies(report: dict[str, Any]) -> float:
    (rank,) = report["classes"]
    return rank["weights"] - 2 * rank["parameters"]  # bf16 weights beside the copies


@pytest.mark.parametrize(("recipe", "system"), CASES)
def test_copies_from_the_options(recipe: str, system: str) -> None:
    # every scale counted, as the workload states them (tests/test_memory_paths.py)
    options = GenerateOptions(**LLAMA, low_precision_recipe=recipe)
    assert _copies(predict_analytic(options, system)) == closed_form(recipe, system)


@pytest.mark.parametrize(("recipe", "system"), CASES)
def test_copies_from_a_generated_workload(recipe: str, system: str) -> None:
    options = GenerateOptions(**LLAMA, low_precision_recipe=recipe)
    workload = build_workload(options, load_registry(autoload=False))
    # the workload states both usages' copies (any GPU) and their scales apart: Blackwell's
    # tensorwise copies are half of them, its one fp32 scale per weight whole
    # (stated_weight_copy_bytes)
    assert _copies(predict_memory(workload, system)) == closed_form(recipe, system)


def test_the_workload_states_both_usages_whatever_the_gpu() -> None:
    options = GenerateOptions(**LLAMA, low_precision_recipe="tensorwise")
    workload = build_workload(options, load_registry(autoload=False))
    stated = workload.rank_classes[0].facts["low_precision_weight_bytes"]
    assert stated == closed_form("tensorwise", HOPPER)


def test_fp8_weights_need_no_copy_on_blackwell() -> None:
    # --fp8_param_gather: the stored fp8 weight is the rowwise copy; Hopper adds its transpose
    # (1 byte per element) and Blackwell nothing (one fp32 scale per weight on both, counted
    # by the workload and the options alike)
    given = {**LLAMA, "low_precision_recipe": "tensorwise", "fp8_param_gather": True,
             "weight_sharded": True, "dp": 2}  # fmt: skip
    options = GenerateOptions(**given)
    workload = build_workload(options, load_registry(autoload=False))
    for report in (
        lambda system: predict_memory(workload, system),
        lambda system: predict_analytic(options, system),
    ):
        (hopper,) = report(HOPPER)["classes"]
        (blackwell,) = report(BLACKWELL)["classes"]
        assert hopper["parameters"] == blackwell["parameters"]
        assert hopper["weights"] - blackwell["weights"] == ELEMENTS


def test_a_precision_plans_fp8_copies_halve_on_blackwell() -> None:
    # a bf16 run whose plan puts the MLP in fp8: Transformer Engine's delayed-scaling copies
    plan = (("gate", "fp8"), ("up", "fp8"), ("down", "fp8"))
    options = GenerateOptions(**{**LLAMA, "dtype": "bf16"}, precision=plan)
    mlp = sum(r * c for r, c in WEIGHTS[4:])
    assert _copies(predict_analytic(options, HOPPER)) == 2 * mlp
    assert _copies(predict_analytic(options, BLACKWELL)) == mlp


def _quantize_nodes(recipe: str) -> list[Any]:
    options = GenerateOptions(**LLAMA, low_precision_recipe=recipe)
    workload = build_workload(options, load_registry(autoload=False))
    return list(workload.ranks[0].nodes())


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8"])
def test_cast_writes_one_copy_in_time_where_one_serves_both(recipe: str) -> None:
    """The time of a recipe's cast follows the copies it writes: on Blackwell a per-tensor
    fp8 cast writes the data alone (no transpose), so its input's bf16 read and one fp8 copy
    (3 bytes per element, not the trace's 4); block-scaled casts write both copies on either
    GPU. The trace states both usages' copies whatever the GPU."""
    from stg.core.recipes import QUANTIZE_KERNEL_ATTR
    from stg.perf.costs import recipe_quantize_time
    from stg.perf.kernel_time import memory_bound_time
    from stg.perf.system import load_system

    casts = [
        n
        for n in _quantize_nodes(recipe)
        if n.attrs.get(QUANTIZE_KERNEL_ATTR) == "cast"
        and recipe_quantize_time(n, load_system(BLACKWELL)) > 0
    ]
    assert casts
    for system in (HOPPER, BLACKWELL) if recipe != "mxfp8" else (BLACKWELL,):
        gpu = load_system(system)
        for node in casts:
            written = node.tensor_size
            if recipe == "tensorwise" and system == BLACKWELL:
                written -= node.num_ops  # one fp8 byte per element not written
            expected = memory_bound_time(gpu.gpu, written, "quantize") + gpu.kernel_overhead
            assert recipe_quantize_time(node, gpu) == pytest.approx(expected)


def test_delayed_cast_transpose_writes_no_transpose_on_blackwell() -> None:
    """Delayed scaling's cast before an fp8 GEMM (``fp8_quantize`` elements): 2 + 1 + 1 bytes
    per element on Hopper (bf16 read, fp8 data and its transpose), 2 + 1 on Blackwell."""
    from stg.core.fp8 import QUANTIZE_ATTR
    from stg.perf.costs import fp8_quantize_time
    from stg.perf.kernel_time import memory_bound_time
    from stg.perf.system import load_system

    nodes = [n for n in _quantize_nodes("delayed") if QUANTIZE_ATTR in n.attrs]
    assert nodes
    for system, per_element in ((HOPPER, 4), (BLACKWELL, 3)):
        gpu = load_system(system)
        for node in nodes:
            expected = (
                memory_bound_time(gpu.gpu, node.attrs[QUANTIZE_ATTR] * per_element, "quantize")
                + gpu.kernel_overhead
            )
            assert fp8_quantize_time(node, gpu) == pytest.approx(expected)
