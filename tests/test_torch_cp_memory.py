"""The memory predictor counts the buffers of PyTorch's own context parallelism
(torch/distributed/tensor/experimental/_attention.py: the all-gathered K/V, the forward's fp32
merges, the backward's fp32 dQ and the K/V gradient around the ring) where stg generate runs
it (torchtitan's profiles with cp_comm_type all_gather), and nowhere else."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stg.core.options import GenerateOptions
from stg.predictors.memory import TorchCPBuffers, stage_memory, torch_cp_buffers

# per rank: b 2 sequences of 64/4 = 16 tokens, 8/2 = 4 query heads of 32: N = 4096 elements
# of one K (or V, Q, output) at the queries' heads, R = 128 log-sum-exp rows; bf16 (2 bytes)
SMALL = GenerateOptions(
    model="llama", dmodel=256, dff=512, head=8, kvhead=2, seq=64, batch=2, num_stacks=2,
    dvocal=1000, tp=2, sp=4, causal=True, profile="compiled", cp_comm_type="all_gather",
    activation_recompute="full",
)  # fmt: skip
N, R = 4096, 128


def test_closed_form_of_a_small_plan() -> None:
    buffers = torch_cp_buffers(SMALL)
    assert buffers == TorchCPBuffers(
        gathered_kv=4 * 2 * N * 2,  # cp x (K + V) x bf16
        merged_output=2 * 4 * N + 2 * N + 3 * 4 * R,  # old and new fp32 pair, the call's
        query_grad=4 * N,  # fp32 dQ
        kv_grad=2 * 4 * 2 * N,  # fp32 K/V gradient sent and received
    )
    assert buffers.backward == 147456 and buffers.forward == 108032
    assert buffers.peak == buffers.backward


def test_it_follows_the_micro_batch_heads_and_dtype() -> None:
    base = torch_cp_buffers(SMALL)
    assert torch_cp_buffers(replace(SMALL, batch=4)).peak == 2 * base.peak
    assert torch_cp_buffers(replace(SMALL, tp=1)).peak == 2 * base.peak
    fp32 = torch_cp_buffers(replace(SMALL, dtype="fp32"))
    assert fp32.gathered_kv == 2 * base.gathered_kv and fp32.kv_grad == base.kv_grad


@pytest.mark.parametrize(
    "change",
    [
        {"profile": "megatron"},  # Megatron / Transformer Engine's all-gather CP
        {"cp_comm_type": "p2p"},  # Transformer Engine's ring under every profile
        {"sp": 1, "tp": 2},  # no context parallelism
        {"causal": False},  # torch's load balancing needs causal attention
        {"attention_window": 8},  # masked layers: not torch's ring
    ],
)
def test_zero_where_torch_does_not_run_it(change: dict) -> None:
    assert torch_cp_buffers(replace(SMALL, **change)).peak == 0


def _middle_stage(o: GenerateOptions) -> float:
    return stage_memory(
        o, stage=0, parameters=10**6, layers=2, has_embedding=False, has_head=False
    ).buffers


def test_the_stage_holds_them_beside_the_recomputed_layer() -> None:
    ring = replace(SMALL, cp_comm_type="p2p")
    added = _middle_stage(SMALL) - _middle_stage(ring)
    assert added == torch_cp_buffers(SMALL).peak > 0
    megatron = replace(SMALL, profile="megatron")
    assert _middle_stage(megatron) == _middle_stage(replace(megatron, cp_comm_type="p2p"))
