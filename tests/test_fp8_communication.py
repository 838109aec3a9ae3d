"""What ranks of an fp8 training run send, byte by byte, in the files ``generate`` writes.

Transformer Engine quantizes only the inputs of its fp8 GEMMs; everything else that crosses
ranks is in the autocast dtype, bf16 (stg/core/lowering.py, ``_recipe_collectives`` and
``_boundary_bytes``, cite TE v2.9 and Megatron-LM core_v0.15.0):

- a row-parallel GEMM's output is reduce-scattered (sequence parallelism) or all-reduced in
  bf16, and so is a column-parallel GEMM's input gradient;
- the sequence-parallel all-gathers before a TE GEMM move the quantized rows, 1 byte each;
  the embedding's and the output layer's (no TE modules) move bf16;
- FSDP gathers bf16 weights, the distributed optimizer bf16 parameters, and gradients are
  reduced in fp32 (mixed precision) or bf16;
- pipeline stages send the hidden states and their gradients in ``pipeline_dtype``, bf16.

Before, delayed scaling (the default recipe) counted all of these but the MoE and context
exchanges at 1 byte per element, and every recipe its pipeline sends, its optimizer's
parameter gathers and (without mixed precision) its gradient reductions. The closed forms
below count tokens and bytes from those rules, not from stg's code.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from stg.api import Role
from stg.cli import main
from stg.trace.reader import read_nodes

S, D, F, HEADS, KV, V = 256, 256, 512, 4, 2, 512
M = 2  # micro-batches of one sequence
T, BF16 = S, 2  # tokens of a micro-batch; bytes per bf16 element
MODEL = ["--model", "llama", "--dmodel", str(D), "--dff", str(F), "--head", str(HEADS),
         "--kvhead", str(KV), "--seq", str(S), "--dvocal", str(V), "--num_stacks", "2",
         "--mixed_precision", "true", "--causal", "true", "--dtype", "fp8"]  # fmt: skip


def _rank0(tmp_path: Path, *given: str) -> Counter[str]:
    """Bytes that rank 0 moves, by collective kind (the amax reductions left out: fp32)."""
    out = tmp_path / "trace"
    with pytest.raises(SystemExit) as done:
        main(["generate", *MODEL, *given, "--output_dir", str(out)])
    assert done.value.code == 0
    moved: Counter[str] = Counter()
    for node in read_nodes(out / "workload.0.et"):
        if node.attrs.get("role") == Role.FP8_AMAX:
            continue
        if node.comm_type is not None:
            moved[node.comm_type.name] += node.comm_size
        elif node.comm_size:
            moved[node.type.name] += node.comm_size
    return moved


@pytest.mark.parametrize("recipe", ["delayed", "mxfp8"])
def test_sequence_parallel_and_pipeline_bytes(tmp_path: Path, recipe: str) -> None:
    # tp 2 with sequence parallelism, pp 2: rank 0 holds the embedding and layer 0
    moved = _rank0(tmp_path, "--tp", "2", "--pp", "2", "--batch", str(M), "--micro_batch", "1",
                   "--low_precision_recipe", recipe)  # fmt: skip
    local = T // 2  # this rank's tokens
    # reduce-scatters of the whole micro-batch's bf16 rows: the embedding's, and per layer the
    # attention and MLP outputs forward and the QKV and gate/up input gradients backward
    assert moved["REDUCE_SCATTER"] == M * (1 + 4) * T * D * BF16
    # all-gathers: per layer the two norms' outputs and the two row-parallel GEMMs' output
    # gradients, quantized (this rank's rows, 1 byte each, plus MXFP8's E8M0 scale per 32
    # elements), and the embedding's output gradient, bf16
    quantized = local * D * (1 if recipe == "delayed" else 1 + 1 / 32)
    assert moved["ALL_GATHER"] == M * (4 * quantized + local * D * BF16)
    # the hidden states to stage 1 and their gradients back, this rank's rows in bf16
    assert moved["COMM_SEND"] == moved["COMM_RECV"] == M * local * D * BF16


def test_tensor_parallel_all_reduces_move_bf16(tmp_path: Path) -> None:
    # tp 2 without sequence parallelism, one stage: the embedding's output, per layer the two
    # row-parallel outputs and the two column-parallel input gradients, and the output
    # layer's input gradient, each the whole micro-batch in bf16
    moved = _rank0(tmp_path, "--tp", "2", "--tpsp", "false", "--batch", str(M),
                   "--micro_batch", "1")  # fmt: skip
    assert moved["ALL_REDUCE"] == M * (1 + 2 * 4 + 1) * T * D * BF16


LAYER = 2 * D * D + 2 * KV * (D // HEADS) * D + 3 * F * D + 2 * D  # q, o; k, v; MLP; norms
WEIGHTS = V * D + 2 * LAYER + D + V * D  # embedding, two layers, final norm, output layer


@pytest.mark.parametrize(("mixed", "grad_bytes"), [("true", 4), ("false", BF16)])
def test_gradients_and_optimizer_gathers_are_never_fp8(
    tmp_path: Path, mixed: str, grad_bytes: int
) -> None:
    # ZeRO-1 over dp 2, one micro-batch: every gradient reduce-scattered once (fp32 main
    # gradients under mixed precision, else the parameters' bf16), every updated parameter
    # shard all-gathered once in the parameters' dtype, bf16
    moved = _rank0(tmp_path, "--dp", "2", "--zero", "1", "--batch", "2", "--micro_batch", "2",
                   "--mixed_precision", mixed)  # fmt: skip
    assert moved["REDUCE_SCATTER"] == WEIGHTS * grad_bytes
    assert moved["ALL_GATHER"] == WEIGHTS // 2 * BF16


def test_fsdp_gathers_bf16_weights(tmp_path: Path) -> None:
    # dp 2 with sharded weights, one micro-batch: the weights of each part (the embedding,
    # two layers, the head's norm and output layer) gathered forward and again backward,
    # the other rank's half, in bf16
    moved = _rank0(tmp_path, "--dp", "2", "--weight_sharded", "true", "--batch", "2",
                   "--micro_batch", "2")  # fmt: skip
    assert moved["ALL_GATHER"] == 2 * WEIGHTS // 2 * BF16
