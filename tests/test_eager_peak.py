"""Eager PyTorch's two memory peaks (predictors/memory.py ``eager_peak``): the start of the
backward, where a step of one micro-batch holds no gradients yet (``zero_grad`` sets them to
None; AccumulateGrad allocates each when the backward produces it), and the optimizer step,
where PyTorch's default foreach AdamW holds the square roots of the second moments beside
the states (``torch._foreach_sqrt(device_exp_avg_sqs)``) and autocast's 16-bit weight casts
are gone. Each test fails on the accounting that kept the gradients and had no step peak."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stg.core.options import GenerateOptions
from stg.predictors.memory import analytic_memory, count_parameters

# Llama 3.2 1B widths, as benchmarks/eager_step.py measures them: bf16 autocast over fp32
# weights (mixed precision), one sequence per step
EAGER = GenerateOptions(
    model="llama", dmodel=2048, num_stacks=16, head=32, kvhead=8, dff=8192, dvocal=128256,
    seq=1024, batch=1, mixed_precision=True, dtype="bf16", profile="eager", causal=True,
)  # fmt: skip
PSI = count_parameters(EAGER)[0].total


def test_a_short_step_peaks_in_the_optimizer_step() -> None:
    """fp32 weights, gradients, both moments and the moments' square roots: 20 bytes per
    parameter; no activations, no 16-bit casts."""
    (rank,) = analytic_memory(EAGER)
    assert (rank.weights, rank.activations) == (0, 0)
    assert (rank.gradients, rank.optimizer, rank.buffers) == (4 * PSI, 12 * PSI, 4 * PSI)
    assert rank.peak == 20 * PSI


def test_a_long_step_peaks_at_the_loss_without_gradients() -> None:
    """At 8k tokens the loss's transients win: the 16-bit casts, the fp32 weights and
    moments, the activations and the loss's 8 bytes per logit, and no gradient yet."""
    long = replace(EAGER, seq=8192)
    (rank,) = analytic_memory(long)
    assert rank.gradients == 0
    assert (rank.weights, rank.optimizer) == (2 * PSI, 12 * PSI)
    assert rank.buffers == 8 * 8192 * 128256
    assert rank.peak == 14 * PSI + rank.activations + rank.buffers > 20 * PSI


def test_micro_batches_accumulate_into_gradients_that_stay() -> None:
    (rank,) = analytic_memory(replace(EAGER, seq=8192, batch=2, micro_batch=1))
    assert rank.gradients == 4 * PSI
    assert rank.peak == 18 * PSI + rank.activations + rank.buffers


def test_with_recompute_the_gradients_of_later_layers_count() -> None:
    """A layer's recompute runs once the layers after it have their gradients: all count."""
    (rank,) = analytic_memory(replace(EAGER, seq=32768, activation_recompute="full"))
    assert rank.gradients == 4 * PSI
    assert rank.peak == 18 * PSI + rank.activations + rank.buffers


def test_without_mixed_precision_the_square_roots_take_the_weights_dtype() -> None:
    """bf16 weights, gradients and moments (2 + 2 + 4 bytes) and 2-byte square roots; the
    weights are the parameters themselves and stay."""
    (rank,) = analytic_memory(replace(EAGER, mixed_precision=False))
    assert (rank.weights, rank.gradients, rank.optimizer, rank.buffers) == (
        2 * PSI, 2 * PSI, 4 * PSI, 2 * PSI,
    )  # fmt: skip


def test_fsdp_frees_its_sharded_gradients_too() -> None:
    """FSDP2 over 8 ranks: the states are shards, the gathered units dominate, and the
    sharded gradients (set to None too) are not yet there when the backward starts."""
    o = replace(EAGER, dp=8, batch=8, weight_sharded=True)
    (rank,) = analytic_memory(o)
    assert rank.optimizer / 12 == pytest.approx(PSI / 8, rel=1e-6)
    assert rank.gradients == 0
    assert rank.peak == rank.weights + rank.optimizer + rank.activations + rank.buffers


def test_megatron_keeps_its_gradient_buffers_and_fuses_adam() -> None:
    (rank,) = analytic_memory(replace(EAGER, profile="megatron"))
    assert (rank.weights, rank.gradients, rank.optimizer) == (2 * PSI, 4 * PSI, 12 * PSI)
    assert rank.peak == 18 * PSI + rank.activations + rank.buffers
