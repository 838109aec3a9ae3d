"""A training run computing in fp8 (``--dtype fp8``) as Transformer Engine's recipe runs it.

Only the GEMMs of the transformer layers run in fp8: TE quantizes their operands with
kernels of its own (a module's input once forward, each GEMM's output gradient backward, each
cast with its transpose and amax), everything else moves bf16 activations, and Megatron's
output layer is a plain bf16 linear (stg/core/fp8.py cites the sources). Before, an fp8
workload moved 1-byte activations through every norm and residual, ran the logits in fp8
and quantized nothing: a Llama step came out about 1.9x faster than bf16, where the
published recipes measure about 1.3x.
"""

from __future__ import annotations

from typing import Any

import pytest

from stg.core.fp8 import QUANTIZE_ATTR, QUANTIZE_BYTES_PER_ELEMENT
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.perf.costs import compute_time
from stg.perf.kernel_time import memory_bound_time
from stg.perf.system import load_system
from stg.predictors.time import predict_time

LLAMA = {"model": "llama", "dmodel": 512, "dff": 1536, "head": 8, "kvhead": 2, "seq": 1024,
         "dvocal": 1024, "num_stacks": 1, "batch": 2, "micro_batch": 2,
         "mixed_precision": True, "causal": True}  # fmt: skip


def _nodes(**given: Any) -> dict[str, Any]:
    options = GenerateOptions(**{**LLAMA, **given})
    workload = build_workload(options, load_registry(autoload=False))
    return {n.name: n for n in workload.ranks[0].nodes()}


def _quantized(nodes: dict[str, Any]) -> dict[str, int]:
    """Quantized elements by (pass, forward op)."""
    return {
        (n.name.split("/")[2], n.attrs["op"].split(".grad_")[0]): n.attrs[QUANTIZE_ATTR]
        for n in nodes.values()
        if QUANTIZE_ATTR in n.attrs
    }


@pytest.mark.parametrize("tp", [1, 2])
def test_each_module_input_and_output_gradient_is_quantized_once(tp: int) -> None:
    # sequence parallelism: TE casts this rank's rows, then gathers them in fp8
    rows = LLAMA["batch"] * LLAMA["seq"] // tp
    d, f, kv = LLAMA["dmodel"], LLAMA["dff"], LLAMA["dmodel"] // LLAMA["head"] * LLAMA["kvhead"]
    assert _quantized(_nodes(dtype="fp8", tp=tp)) == {
        # forward: the fused QKV's and gate/up's input once, not once per GEMM
        ("fwd", "q"): rows * d,
        ("fwd", "attn_out"): rows * tp * d // tp,
        ("fwd", "gate"): rows * d,
        ("fwd", "down"): rows * tp * f // tp,
        # backward: every GEMM's output gradient, before its first backward GEMM
        ("bwd", "q"): rows * tp * d // tp,
        ("bwd", "k"): rows * tp * kv // tp,
        ("bwd", "v"): rows * tp * kv // tp,
        ("bwd", "attn_out"): rows * d,
        ("bwd", "gate"): rows * tp * f // tp,
        ("bwd", "up"): rows * tp * f // tp,
        ("bwd", "down"): rows * d,
    }


def test_kernels_outside_the_gemms_move_bf16_and_the_output_layer_is_bf16() -> None:
    fp8, bf16 = _nodes(dtype="fp8"), _nodes(dtype="bf16")
    for name in ("mb0/layer0/fwd/attention_norm", "mb0/layer0/fwd/swiglu",
                 "mb0/layer0/bwd/swiglu.grad_gate", "mb0/layer0/fwd/residual2"):  # fmt: skip
        assert fp8[name].tensor_size == bf16[name].tensor_size, name
    for name in ("mb0/head/fwd/logits", "mb0/head/bwd/logits.grad_lm_head"):
        assert fp8[name].dtype == "bf16", name
    assert fp8["mb0/layer0/fwd/gate"].dtype == "fp8"


def test_a_precision_plan_keeps_its_own_casts() -> None:
    plan = tuple((op, "fp8") for op in ("q", "k", "v", "attn_out", "gate", "up", "down"))
    nodes = _nodes(dtype="bf16", precision=plan)
    assert not _quantized(nodes)
    assert any(".cast_" in name for name in nodes)


def test_serving_quantizes_nothing() -> None:
    assert not _quantized(_nodes(dtype="fp8", phase="prefill", mixed_precision=False))


def test_quantization_is_priced_where_fp8_runs_natively() -> None:
    node = _nodes(dtype="fp8")["mb0/layer0/fwd/down"]
    bare = type(node)(**{**{s: getattr(node, s) for s in node.__slots__}, "attrs": {
        k: v for k, v in node.attrs.items() if k != QUANTIZE_ATTR}})  # fmt: skip
    h100 = load_system("h100-80g")
    cast = memory_bound_time(h100.gpu, node.attrs[QUANTIZE_ATTR] * QUANTIZE_BYTES_PER_ELEMENT,
                             "quantize")  # fmt: skip
    assert compute_time(node, h100) == pytest.approx(
        compute_time(bare, h100) + cast + h100.kernel_overhead
    )
    a100 = load_system("a100-80g")  # no fp8 tensor cores: bf16 GEMMs, nothing quantized
    assert compute_time(node, a100) == compute_time(bare, a100)


@pytest.mark.parametrize("system", ["h100-80g", "a100-80g"])
def test_explain_names_the_quantization_and_the_amax_bookkeeping(system: str) -> None:
    options = GenerateOptions(**{**LLAMA, "dtype": "fp8", "tp": 2, "dp": 2, "batch": 4})
    workload = build_workload(options, load_registry(autoload=False))
    report = predict_time(workload, system, explain=True)
    parts = report["explain"]["breakdown_s"]
    assert sum(parts.values()) == pytest.approx(report["iteration_time_s"], rel=1e-9)
    assert "compute: fp8 amax" in parts
    assert any(k.startswith("communication: tp ") for k in parts)
    # quantized only where the GEMMs run in fp8 (Hopper); an A100 runs them in bf16
    assert ("compute: fp8 quantize" in parts) == (system == "h100-80g")
