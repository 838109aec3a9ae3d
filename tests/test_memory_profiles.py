"""The memory predictor under the execution profiles (Megatron-LM with Transformer Engine, and
eager PyTorch) and with fp8 GEMMs that run natively (Transformer Engine on Hopper).

Each expected figure is a list of the tensors one rank keeps, derived by hand from what each
kernel saves for its backward (Korthikanti et al. 2022 for Megatron; for eager PyTorch, the
autograd formulas of tools/autograd/derivatives.yaml), never from the predictor's code.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.errors import UserError
from stg.host.registry import load_registry
from stg.predictors.memory import (
    activation_bytes_per_layer,
    analytic_memory,
    gemm_weights_per_rank,
    layer_parameters_per_rank,
    planned_activation_delta,
    predict_memory,
)

S, B, H, A, D, V = 128, 2, 64, 4, 16, 1000  # sequence, micro-batch, dmodel, heads, dhead, vocab
SB = S * B
SBH = S * B * H
BF16, FP32, BOOL = 2, 4, 1

GPT = GenerateOptions(
    model="gpt", dmodel=H, dff=4 * H, head=A, kvhead=A, seq=S, batch=B, num_stacks=2,
    dvocal=V, dropout=0.1, attention="unfused", tpsp=False,
)  # fmt: skip
F_LLAMA, KV = 176, 2
LLAMA = GenerateOptions(
    model="llama", dmodel=H, dff=F_LLAMA, head=A, kvhead=KV, seq=S, batch=B, num_stacks=2,
    dvocal=V, tpsp=False,
)  # fmt: skip
LLAMA_GEMMS = ("q", "k", "v", "attn_out", "gate", "up", "down")


def total(tensors: list[tuple[str, float, int]]) -> float:
    """Bytes of ``(name, elements, bytes per element)`` tensors."""
    return sum(elements * width for _, elements, width in tensors)


def gpt_layer(profile: str, attention: str) -> list[tuple[str, float, int]]:
    """What one GPT layer keeps (t = 1, dropout 0.1, no recompute)."""
    sbf, scores = SB * 4 * H, A * S * S * B
    kept = [
        ("ln1 input", SBH, BF16),
        ("QKV input (ln1 output)", SBH, BF16),
        ("Q", SBH, BF16),
        ("K", SBH, BF16),
        ("V", SBH, BF16),
        ("projection input", SBH, BF16),
        ("attention hidden dropout mask", SBH, BOOL),
        ("ln2 input", SBH, BF16),
        ("fc1 input (ln2 output)", SBH, BF16),
        ("GELU input", sbf, BF16),  # eager: the bias-add output; Megatron: fc1's output
        ("fc2 input (GELU output)", sbf, BF16),
        ("MLP hidden dropout mask", SBH, BOOL),
    ]
    if attention == "unfused":
        kept += [
            ("softmax output", scores, BF16),
            ("attention dropout mask", scores, BOOL),
            ("attention dropout output", scores, BF16),
        ]
    else:  # the kernel regenerates its dropout mask from the RNG state
        kept.append(("log-sum-exp per query row and head", A * SB, FP32))
    if profile == "eager":  # native_layer_norm's result1 and result2
        kept += [("ln1 mean", SB, FP32), ("ln1 rstd", SB, FP32)]
        kept += [("ln2 mean", SB, FP32), ("ln2 rstd", SB, FP32)]
    return kept


def llama_layer(profile: str, attention: str) -> list[tuple[str, float, int]]:
    """What one Llama layer keeps (t = 1, GQA, no recompute)."""
    sbf = SB * F_LLAMA
    kept = [
        ("attention norm input", SBH, BF16),
        ("QKV input (norm output)", SBH, BF16),
        ("Q (after RoPE)", SB * A * D, BF16),
        ("K (after RoPE)", SB * KV * D, BF16),
        ("V", SB * KV * D, BF16),
        ("projection input", SB * A * D, BF16),
        ("MLP norm input", SBH, BF16),
        ("gate/up input (norm output)", SBH, BF16),
        ("gate", sbf, BF16),
        ("up", sbf, BF16),
        ("down input (silu(gate) * up)", sbf, BF16),
    ]
    if attention == "unfused":
        kept.append(("softmax output", A * S * S * B, BF16))
    else:
        kept.append(("log-sum-exp per query row and head", A * SB, FP32))
    if profile == "eager":
        kept += [
            ("silu(gate), saved by the product", sbf, BF16),
            ("attention norm rstd", SB, FP32),  # _fused_rms_norm's result1
            ("MLP norm rstd", SB, FP32),
        ]
    return kept


@pytest.mark.parametrize("profile", ["megatron", "eager"])
@pytest.mark.parametrize("attention", ["unfused", "fused"])
def test_gpt_layer_closed_form(profile: str, attention: str) -> None:
    o = replace(GPT, profile=profile, attention=attention)
    assert activation_bytes_per_layer(o) == total(gpt_layer(profile, attention))


def test_gpt_closed_forms_in_numbers() -> None:
    # the lists above, summed: Korthikanti's 34·sbh + 5·a·s²·b, and 16 bytes per row more
    sbh, scores = SBH, A * S * S * B
    assert total(gpt_layer("megatron", "unfused")) == 34 * sbh + 5 * scores == 1_212_416
    assert total(gpt_layer("eager", "unfused")) == 1_212_416 + 16 * SB


@pytest.mark.parametrize("profile", ["megatron", "eager"])
@pytest.mark.parametrize("attention", ["unfused", "fused"])
def test_llama_layer_closed_form(profile: str, attention: str) -> None:
    o = replace(LLAMA, profile=profile, attention=attention)
    assert activation_bytes_per_layer(o) == total(llama_layer(profile, attention))


def test_eager_extras_follow_sequence_and_tensor_parallelism() -> None:
    # t = 2 with sequence parallelism: norms run on s/t rows, the SiLU output is split by F/t
    o = replace(LLAMA, tp=2, tpsp=True)
    extra = activation_bytes_per_layer(replace(o, profile="eager")) - activation_bytes_per_layer(o)
    assert extra == BF16 * SB * F_LLAMA / 2 + 2 * FP32 * SB / 2
    # full recompute keeps the layer input in both (torch.utils.checkpoint and Megatron)
    full = replace(o, activation_recompute="full")
    assert activation_bytes_per_layer(replace(full, profile="eager")) == BF16 * SBH / 2


def test_eager_head_keeps_the_norm_statistics_and_the_cross_entropy_transient() -> None:
    megatron, eager = analytic_memory(LLAMA)[0], analytic_memory(replace(LLAMA, profile="eager"))[0]
    layers = 2 * (total(llama_layer("eager", "fused")) - total(llama_layer("megatron", "fused")))
    # the final norm's rstd; the fp32 log-probabilities (4 bytes per logit) are in both
    assert eager.activations - megatron.activations == layers + FP32 * SB
    # at the start of the backward: nll_loss_backward's and _log_softmax_backward_data's fp32
    # gradients, 4 bytes per logit each; Megatron's loss computes its gradient in place, but
    # holds the 16-bit logits (or their 16-bit gradient) beside its fp32 copy
    assert megatron.buffers == BF16 * SB * V
    assert eager.buffers == 8 * SB * V
    # with full recompute a layer's recompute comes after the head: the larger of the two
    full = replace(LLAMA, profile="eager", activation_recompute="full")
    layer = total(llama_layer("eager", "fused"))
    assert analytic_memory(full)[0].buffers == max(layer, 8 * SB * V)


def test_unknown_profile_is_a_user_error() -> None:
    with pytest.raises(UserError, match="profile='jax'; allowed: megatron, eager"):
        activation_bytes_per_layer(replace(LLAMA, profile="jax"))


# --- one-GPU eager Llama steps: fused attention has no s² terms --------------------------------


def eager_step(seq: int, attention: str) -> dict:
    """predict_memory on a generated one-GPU eager Llama step (Llama 3 8B widths, 2 layers)."""
    o = GenerateOptions(
        model="llama", dmodel=4096, dff=14336, head=32, kvhead=8, seq=seq, batch=1,
        num_stacks=2, dvocal=128256, profile="eager", attention=attention,
    )  # fmt: skip
    (entry,) = predict_memory(build_workload(o, load_registry(autoload=False)), "h100-80g")[
        "classes"
    ]
    return entry


def test_fused_eager_llama_step_is_linear_in_the_sequence() -> None:
    # from 8k tokens the loss's transients at the start of the backward outgrow the
    # optimizer step's peak (memory.eager_peak), whose fields do not depend on the sequence
    one, two = eager_step(8192, "fused"), eager_step(16384, "fused")
    for key in ("activations", "buffers"):
        assert two[key] == 2 * one[key], key  # no s² term anywhere
    unfused = eager_step(8192, "unfused")
    # the unfused option restores the softmax output (2 bytes per score; no dropout in
    # Llama) and drops the fused kernel's 4-byte log-sum-exp, in each of the two layers
    s, a = 8192, 32
    assert unfused["activations"] - one["activations"] == 2 * (BF16 * a * s * s - FP32 * a * s)
    assert unfused["buffers"] == one["buffers"] == 8 * s * 128256


def test_eager_step_from_the_trace_matches_the_options() -> None:
    entry = eager_step(8192, "fused")
    o = GenerateOptions(
        model="llama", dmodel=4096, dff=14336, head=32, kvhead=8, seq=8192, batch=1,
        num_stacks=2, dvocal=128256, profile="eager",
    )  # fmt: skip
    (analytic,) = analytic_memory(o)
    assert entry["activations"] == round(analytic.activations)
    assert entry["buffers"] == round(analytic.buffers)


# --- fp8 GEMMs that run natively (Transformer Engine on Hopper) ---------------------------------


def fp8_plan(o: GenerateOptions, ops: tuple[str, ...] = LLAMA_GEMMS) -> GenerateOptions:
    return replace(o, precision=tuple((op, "fp8") for op in ops))


@pytest.mark.parametrize("profile", ["megatron", "eager"])
def test_fp8_saved_inputs_take_one_byte_on_hopper(profile: str) -> None:
    from stg.api import load_system

    o = fp8_plan(replace(LLAMA, profile=profile))
    h100, a100 = load_system("h100-80g"), load_system("a100-80g")
    sbf = SB * F_LLAMA
    # QKV input and gate/up input: 1 byte instead of 2; the down input (silu(gate) * up) too;
    # the projection input is the fused attention's output O, which the attention backward
    # keeps in 16 bits: its fp8 copy comes on top
    expected = -(BF16 - 1) * SBH * 2 - (BF16 - 1) * sbf + 1 * SB * A * D
    assert planned_activation_delta(o, system=h100) == expected
    assert activation_bytes_per_layer(o, system=h100) == total(llama_layer(profile, "fused")) + (
        expected
    )
    # no fp8 tensor cores: every GEMM computes in bf16 from the 16-bit input
    assert planned_activation_delta(o, system=a100) == 0
    assert planned_activation_delta(o) == 0
    # behind unfused attention the context is read by the projection alone: 1 byte
    unfused = replace(o, attention="unfused")
    assert planned_activation_delta(unfused, system=h100) == expected - 2 * SB * A * D


def test_fp8_copy_needed_beside_a_16_bit_reader_adds_a_byte() -> None:
    from stg.api import load_system

    # q alone in fp8: k and v still read the 16-bit QKV input, so the fp8 copy is extra
    o = fp8_plan(LLAMA, ("q",))
    assert planned_activation_delta(o, system=load_system("h100-80g")) == SBH


def test_fp8_weight_copies_are_counted_with_the_weights() -> None:
    from stg.api import load_system

    o = fp8_plan(replace(LLAMA, tp=2))
    per_layer = gemm_weights_per_rank(o)
    expected = (
        2 * H * A * D / 2 + 2 * H * KV * D / 2 + 3 * H * F_LLAMA / 2
    )  # q and attn_out, k and v, gate/up/down: split by t = 2
    assert sum(per_layer.values()) == expected
    assert sum(per_layer.values()) == layer_parameters_per_rank(o) - 2 * H  # less the norms
    h100 = analytic_memory(o, system=load_system("h100-80g"))[0]
    a100 = analytic_memory(o, system=load_system("a100-80g"))[0]
    plain = analytic_memory(replace(o, precision=()), system=load_system("h100-80g"))[0]
    # fp8 data and its transpose, 1 byte each, for every planned GEMM of the two layers
    assert h100.weights - plain.weights == 2 * 2 * expected
    assert a100.weights == plain.weights
    assert (h100.gradients, h100.optimizer) == (plain.gradients, plain.optimizer)


def test_fp8_plan_through_the_predictor_on_a_workload() -> None:
    o = fp8_plan(LLAMA)
    workload = build_workload(o, load_registry(autoload=False))
    (h100,) = predict_memory(workload, "h100-80g")["classes"]
    (a100,) = predict_memory(workload, "a100-80g")["classes"]
    layers = 2 * (total(llama_layer("megatron", "fused")))
    delta = -SBH * 2 - SB * F_LLAMA + SB * A * D
    assert a100["activations"] - layers == 2 * SBH * BF16 + FP32 * SB * V  # the head
    assert h100["activations"] - a100["activations"] == 2 * delta
    copies = 2 * 2 * sum(gemm_weights_per_rank(o).values())
    assert h100["weights"] - a100["weights"] == copies


def test_an_fp8_kernel_plugin_replaces_transformer_engine() -> None:
    from stg.api import Kernel, KernelTable, load_system

    # a plugin's fp8 GEMM on the H100: its record prices the saved input (here 1 byte) and
    # declares no weight copies
    kernel = Kernel(name="fp8-demo", op_class="einsum", dtype="fp8", bytes_per_element=1.0)
    table = KernelTable.build([kernel], "h100-80g")
    o = fp8_plan(LLAMA)
    h100 = load_system("h100-80g")
    with_plugin = analytic_memory(o, table, h100)[0]
    built_in = analytic_memory(o, None, h100)[0]
    assert with_plugin.activations == built_in.activations
    assert built_in.weights - with_plugin.weights == 2 * 2 * sum(gemm_weights_per_rank(o).values())
