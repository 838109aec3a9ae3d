"""torchtitan's op-level selective activation checkpointing (``activation_recompute=
selective_op``): the ops each layer re-runs, what the memory predictor keeps, and the CLI."""

from __future__ import annotations

from collections import Counter

import pytest

from stg.cli._shared import parse_recompute
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import Phase, node_op, node_phase
from stg.errors import UserError
from stg.host.registry import load_registry
from stg.predictors.memory import activation_bytes_per_layer, op_checkpoint_layer_bytes
from stg.predictors.time import predict_time

SMALL = dict(
    model="llama", dvocal=1024, dmodel=256, dff=688, head=8, kvhead=4, seq=128, batch=8,
    micro_batch=4, num_stacks=2,
)  # fmt: skip


def options(**kw: object) -> GenerateOptions:
    return GenerateOptions(**{**SMALL, **kw})  # type: ignore[arg-type]


def recomputed_ops(o: GenerateOptions) -> Counter[str]:
    workload = build_workload(o, load_registry(autoload=False))
    nodes = workload.ranks[0].nodes()
    return Counter(node_op(n) for n in nodes if node_phase(n) is Phase.RECOMPUTE)


def test_each_layer_reruns_every_op_but_attention_and_the_odd_matmuls() -> None:
    ops = recomputed_ops(options(activation_recompute="selective_op"))
    # the layer's matmuls in forward order: q (1), k (2), v (3), attn_out (4), gate (5),
    # up (6), down (7); torchtitan keeps the odd ones' outputs and recomputes the even ones
    for kept in ("q", "v", "gate", "down", "core_attention"):
        assert ops[kept] == 0, kept
    for rerun in ("k", "attn_out", "up", "attention_norm", "ffn_norm", "rope_k", "swiglu"):
        assert ops[rerun] == 2 * 2, rerun  # two layers, two micro-batches
    # Megatron's selective recompute re-runs the attention core only
    assert set(recomputed_ops(options(activation_recompute="selective"))) == {"core_attention"}


def test_tensor_parallel_gathers_are_recomputed_and_reduce_scatters_kept() -> None:
    """torchtitan's save list keeps ``reduce_scatter_tensor``'s outputs, not the sequence-parallel
    all-gathers': the weight gradients of the column-parallel GEMMs read the gathered input,
    so each layer gathers it again before its backward."""
    ops = recomputed_ops(options(activation_recompute="selective_op", tp=2))
    for gather in ("all_gather_tp:attention_norm", "all_gather_tp:ffn_norm"):
        assert ops[gather] == 2 * 2, gather
    assert not any(op.startswith("reduce_scatter") for op in ops)


def test_the_recompute_costs_time() -> None:
    registry = load_registry(autoload=False)
    times = {
        mode: predict_time(
            build_workload(options(activation_recompute=mode), registry), "a100-80g"
        )["iteration_time_s"]
        for mode in ("selective", "selective_op", "full")
    }
    assert times["selective"] < times["selective_op"] < times["full"]


def test_memory_keeps_the_input_and_the_saved_outputs() -> None:
    o = options(activation_recompute="selective_op")
    sb, h, d = 128 * 4, 256, 256 // 8
    # input and down projection (2sbh), q and attention output (2·a·d), v (kv·d), gate (F),
    # 2 bytes each; the attention's fp32 log-sum-exp per query and head
    expected = 2 * sb * (2 * h + d * (2 * 8 + 4) + 688) + 4 * 8 * sb
    assert op_checkpoint_layer_bytes(o) == expected
    assert activation_bytes_per_layer(o) == expected
    none = activation_bytes_per_layer(o, recompute="none")
    full = activation_bytes_per_layer(o, recompute="full")
    assert full < expected < none


def test_memory_of_other_families_is_refused_in_one_line() -> None:
    o = GenerateOptions(
        model="gpt", dvocal=1024, dmodel=256, dff=1024, head=8, kvhead=8, seq=128, batch=8,
        micro_batch=4, num_stacks=2, activation_recompute="selective_op",
    )  # fmt: skip
    with pytest.raises(UserError, match=r"selective_op.*not modelled"):
        activation_bytes_per_layer(o)


def test_cli_takes_the_mode() -> None:
    assert parse_recompute("selective_op") == "selective_op"
