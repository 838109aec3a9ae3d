"""An fp8 recipe quantizes the GEMMs; attention stays in 16 bits.

Transformer Engine's DotProductAttention runs in bf16 unless ``fp8_dpa`` is set, and
Megatron's fp8 recipes leave it off: so the attention of an fp8 workload is priced at the
bf16 rate of the attention model, while its GEMMs take the fp8 rate. (It was priced at the
fp8 peak: a 16k-token Llama step's attention at half its time.)
"""

from __future__ import annotations

from typing import Any

import pytest

from stg.core.fp8 import QUANTIZE_ATTR
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.host.registry import load_registry
from stg.perf.costs import compute_time
from stg.perf.system import load_system

TINY = {"dmodel": 256, "dff": 1024, "head": 4, "kvhead": 4, "seq": 2048, "dvocal": 512,
        "num_stacks": 1, "batch": 2, "micro_batch": 2}  # fmt: skip


def _nodes(dtype: str) -> dict[str, Any]:
    options = GenerateOptions(model="llama", dtype=dtype, mixed_precision=True, **TINY)
    workload = build_workload(options, load_registry(autoload=False))
    return {n.name: n for n in workload.ranks[0].nodes()}


@pytest.mark.parametrize("system_name", ["h100-80g", "h200-141g"])
def test_attention_of_an_fp8_recipe_is_priced_in_bf16(system_name: str) -> None:
    system = load_system(system_name)
    fp8, bf16 = _nodes("fp8"), _nodes("bf16")
    attention = [k for k, n in fp8.items() if "attention" in (getattr(n, "attrs", None) or {})]
    # the GEMM kernels alone: those that also pay a quantization of their own, and the output
    # layer (bf16 in the recipe), are left out
    gemms = [
        k
        for k, n in fp8.items()
        if "gemm" in n.attrs and QUANTIZE_ATTR not in n.attrs and n.dtype == "fp8"
    ]
    assert attention and gemms
    for name in attention:
        assert compute_time(fp8[name], system, "fp8") == pytest.approx(
            compute_time(bf16[name], system, "bf16")
        ), name
    # the GEMMs keep the fp8 rate: faster than bf16 on Hopper (small ones, not by 2x)
    fp8_gemm = sum(compute_time(fp8[k], system, "fp8") for k in gemms if k in bf16)
    bf16_gemm = sum(compute_time(bf16[k], system, "bf16") for k in gemms if k in bf16)
    assert fp8_gemm < bf16_gemm
