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


# --- FSDP2's buffers (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) ------------

FSDP = replace(
    LONG, seq=1024, batch=8, dp=8, weight_sharded=True, mixed_precision=True, profile="eager",
    activation_recompute="none", num_stacks=2,
)  # fmt: skip
LAYER = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
EMBEDDING = HEAD_WEIGHT = 128256 * 4096


def test_fsdp_gathers_the_embedding_and_head_units() -> None:
    """The LM head and the embedding are FSDP units of their own (torchtitan wraps them so);
    with a 128k vocabulary each is larger than a layer, so they are the two gathered units
    the buffer holds, not two layers."""
    (rank,) = analytic_memory(FSDP)
    gathered = 2 * (EMBEDDING + HEAD_WEIGHT + 4096)
    assert rank.buffers >= gathered
    assert gathered > 2 * 2 * LAYER


def test_fsdp_reduce_scatter_input_beside_the_unit_gradients() -> None:
    """foreach_reduce copies a unit's bf16 gradients into an fp32 reduce-scatter input before
    it frees them: 2 + 4 bytes per parameter of the largest unit, where the loss's transient is
    smaller (a short sequence)."""
    short = replace(FSDP, seq=128)
    (rank,) = analytic_memory(short)
    largest = HEAD_WEIGHT + 4096
    logits = 128 * 128256
    assert 6 * largest > 8 * logits  # the eager loss's transient: 8 bytes per logit
    assert rank.buffers == 6 * largest + 2 * (EMBEDDING + largest)
