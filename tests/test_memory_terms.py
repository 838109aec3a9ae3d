"""Memory terms of the last stage's loss under Megatron-LM: its vocabulary-parallel cross
entropy upcasts the 16-bit logits with ``.float()`` (calculate_logits_max in
megatron/core/tensor_parallel/cross_entropy.py), so 2 bytes per logit sit beside the 4 of the
fp32 copy at the head; fp32 training needs no copy."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stg.core.options import GenerateOptions
from stg.predictors.memory import analytic_memory

# Llama 3 8B widths at 32k tokens: the 128k vocabulary's logits dwarf one layer's input
LONG = GenerateOptions(
    model="llama", dmodel=4096, dff=14336, head=32, kvhead=8, seq=32768, batch=1,
    num_stacks=4, dvocal=128256, causal=True, activation_recompute="full",
)  # fmt: skip
LOGITS = 32768 * 128256


def test_megatron_head_holds_the_16_bit_logits_beside_the_fp32_copy() -> None:
    (rank,) = analytic_memory(LONG)
    # full recompute: the recomputed layer comes after the head; the 2-byte logits are larger
    assert rank.buffers == 2 * LOGITS
    assert rank.buffers > 8e9


def test_the_transient_follows_tensor_parallelism_and_pipeline_stages() -> None:
    split = analytic_memory(replace(LONG, tp=4))
    assert split[0].buffers == 2 * LOGITS / 4
    first, last = analytic_memory(replace(LONG, pp=2))
    assert last.buffers == 2 * LOGITS
    assert first.buffers < last.buffers  # no head on the first stage: its recomputed layer


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp8"])
def test_16_bit_and_fp8_runs_hold_it_and_fp32_runs_need_no_copy(dtype: str) -> None:
    (rank,) = analytic_memory(replace(LONG, dtype=dtype, activation_recompute="none"))
    assert rank.buffers == 2 * LOGITS
    (fp32,) = analytic_memory(replace(LONG, dtype="fp32", activation_recompute="none"))
    assert fp32.buffers == 0
