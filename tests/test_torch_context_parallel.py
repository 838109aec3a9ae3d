"""PyTorch's own context parallelism as torchtitan runs it (``--profile compiled`` or
``torchtitan`` with ``--cp_comm_type all_gather``): :mod:`stg.core.torch_context_parallel`.

Closed forms of one layer, from ``torch/distributed/tensor/experimental/_attention.py`` at
pytorch/pytorch 1963fc8: per attention pass one all-gather of K and V at the queries' heads
(torchtitan's ``repeat_kv`` runs before SDPA), ``cp`` SDPA calls of fixed shapes, a merge
after each call but the first; the backward gathers again, accumulates the K/V gradients in
fp32 and passes them round the ring (an all-to-all per call) instead of reduce-scattering
them. Megatron's profile keeps Transformer Engine's all-gather variant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.torchtitan import EAGER_KERNEL_BYTES_ATTR, EAGER_KERNELS_ATTR
from stg.core.workload import CollectiveType, NodeType
from stg.host.registry import load_registry
from stg.perf.costs import compute_time
from stg.perf.system import load_system
from stg.predictors.time import predict_time
from stg.trace.reader import read_nodes

# one layer: 8 query heads of 32 on 2 key/value heads, 4 ranks of 512 tokens
B, S, D, HEADS, KV, HD, CP = 1, 2048, 256, 8, 2, 32, 4
SMALL = {
    "model": "llama", "dvocal": 1000, "dmodel": D, "dff": 512, "head": HEADS, "kvhead": KV,
    "num_stacks": 1, "batch": B, "micro_batch": B, "seq": S, "sp": CP, "causal": True,
    "mixed_precision": True, "cp_comm_type": "all_gather",
}  # fmt: skip
S_Q = S // CP  # the rank's two chunks
E = B * HEADS * S_Q * HD  # elements of its queries, output, or one K/V at the queries' heads
LSE = B * HEADS * S_Q
BF16, FP32 = 2, 4


def _layer0(profile: str) -> dict[str, Any]:
    options = GenerateOptions(**SMALL, profile=profile)
    workload = build_workload(options, load_registry(autoload=False))
    sp_group = workload.layout.group_id(0, ("sp",))
    return {
        n.name: n
        for n in workload.ranks[0].nodes()
        if n.name.startswith("mb0/layer0/") and n.comm_group in (None, sp_group)
    }


def _sp(nodes: dict[str, Any], phase: str, kind: CollectiveType) -> list[Any]:
    return [
        n
        for name, n in nodes.items()
        if f"/{phase}/" in name and n.type is NodeType.COMM_COLL and n.comm_type is kind
    ]


def _kernels(node: Any) -> list[tuple[str, int]]:
    return list(
        zip(node.attrs[EAGER_KERNELS_ATTR], node.attrs[EAGER_KERNEL_BYTES_ATTR], strict=True)
    )


@pytest.mark.parametrize("profile", ["compiled", "torchtitan"])
def test_forward_gathers_once_and_merges_after_each_call(profile: str) -> None:
    """Forward: one all-gather of the K/V buffer (2 tensors at 8 heads, bf16) that SDPA call 0
    does not wait for; call 0 causal over the rank's 512 tokens, calls 1-3 non-causal over
    512 x 256, together the FLOPs of the rank's causal share; a merge after each of calls
    1-3 reading the fp32 running output and log-sum-exp and the call's bf16 output and lse,
    the first also casting call 0's output to fp32, the last the result back to bf16."""
    nodes = _layer0(profile)
    (gather,) = _sp(nodes, "fwd", CollectiveType.ALL_GATHER)
    assert gather.comm_size == 2 * E * BF16
    assert not _sp(nodes, "fwd", CollectiveType.REDUCE_SCATTER)
    steps = [nodes[f"mb0/layer0/fwd/core_attention.step{i}"] for i in range(CP)]
    assert steps[0].attrs["attention"] == (B, HEADS, S_Q, S_Q, HD, 1, 0)
    for step in steps[1:]:
        assert step.attrs["attention"] == (B, HEADS, S_Q, S_Q // 2, HD, 0, 0)
    whole = _layer0("megatron")["mb0/layer0/fwd/core_attention"]  # one kernel, causal share
    assert sum(s.num_ops for s in steps) == whole.num_ops
    assert gather.id not in steps[0].data_deps and gather.id in steps[1].data_deps
    merges = [nodes[f"mb0/layer0/fwd/core_attention.merge{i}"] for i in range(1, CP)]
    merge = ("stream:fp32", E * (FP32 + BF16 + FP32) + LSE * 3 * FP32)
    assert _kernels(merges[0]) == [("convert:fp32", E * (BF16 + FP32)), merge]
    assert _kernels(merges[1]) == [merge]
    assert _kernels(merges[2]) == [merge, ("convert:fp32", E * (FP32 + BF16))]
    written = [2 * E + LSE, E + LSE, 2 * E + LSE]  # one op per element written
    for i, node in enumerate(merges, start=1):
        assert node.tensor_size == sum(b for _, b in _kernels(node))
        assert node.num_ops == written[i - 1]
        assert steps[i].id in node.data_deps


def test_backward_passes_fp32_kv_gradients_round_the_ring() -> None:
    """Backward: the K/V buffer gathered again; calls 0-3 as in the forward; after each an
    accumulation (call 0's dQ, dK, dV into fp32; later calls' half-key dK, dV into the fp32
    K/V gradient received, written as the buffer sent on, and dQ into fp32) and an all-to-all
    that sends the 2 x E fp32 buffer to the next rank (comm_size spread over 4 ranks: x 4/3),
    which the next accumulation waits for; the last one's buffer cast to bf16 is the K/V
    gradient. No reduce-scatter of K/V gradients."""
    nodes = _layer0("compiled")
    (gather,) = _sp(nodes, "bwd", CollectiveType.ALL_GATHER)
    assert gather.comm_size == 2 * E * BF16
    assert not _sp(nodes, "bwd", CollectiveType.REDUCE_SCATTER)
    sends = _sp(nodes, "bwd", CollectiveType.ALL_TO_ALL)
    assert len(sends) == CP
    assert {n.comm_size for n in sends} == {-(-2 * E * FP32 * CP // (CP - 1))}
    assert {n.dtype for n in sends} == {"fp32"}
    base = "mb0/layer0/bwd/core_attention.grad"
    steps = [nodes[f"{base}.step{i}"] for i in range(CP)]
    assert [s.attrs["attention"][5:] for s in steps] == [(1, 1), *[(0, 1)] * (CP - 1)]
    accumulations = [nodes[f"{base}.accumulate{i}"] for i in range(CP)]
    assert _kernels(accumulations[0]) == [("stream:fp32", 3 * E * (BF16 + FP32))]
    later = ("stream:fp32", 2 * (2 * FP32 * E + BF16 * E // 2) + E * (2 * FP32 + BF16))
    assert _kernels(accumulations[1]) == [later]
    assert _kernels(accumulations[-1]) == [later, ("convert:fp32", E * (FP32 + BF16))]
    for i in range(1, CP):
        assert sends[i - 1].id in accumulations[i].data_deps
        assert steps[i].id in accumulations[i].data_deps
    cast = nodes[f"{base}.dkv"]
    assert _kernels(cast) == [("convert:fp32", 2 * E * (FP32 + BF16))]
    assert cast.data_deps == (sends[-1].id,)


def test_megatron_keeps_transformer_engines_all_gather_variant() -> None:
    """``--profile megatron``: K and V gathered at their own heads before one kernel, their
    gradients reduce-scattered (Transformer Engine's ``AttnFuncWithCPAndKVAllGather``)."""
    nodes = _layer0("megatron")
    gathers = _sp(nodes, "fwd", CollectiveType.ALL_GATHER)
    assert sorted(n.comm_size for n in gathers) == [B * KV * S_Q * HD * BF16] * 2
    assert len(_sp(nodes, "bwd", CollectiveType.REDUCE_SCATTER)) == 2
    assert "mb0/layer0/fwd/core_attention" in nodes
    assert not any(".merge" in name for name in nodes)


def test_the_trace_validates(tmp_path: Path) -> None:
    """The written trace meets ASTRA-sim's rules (``stg validate``) and keeps the merges'
    kernels."""
    out = tmp_path / "cp"
    args = ["generate", "--output_dir", str(out), "--profile", "compiled",
            *(f"--{k}={v}" for k, v in SMALL.items())]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    checked = CliRunner().invoke(app, ["validate", "--consumer", "astra-sim", str(out)])
    assert checked.exit_code == 0, checked.output
    read = {n.name: n for n in read_nodes(out / "workload.0.et")}
    merge = read["mb0/layer0/fwd/core_attention.merge2"]
    assert tuple(merge.attrs[EAGER_KERNEL_BYTES_ATTR]) == (
        E * (FP32 + BF16 + FP32) + LSE * 3 * FP32,
    )


def test_explain_counts_merges_as_memory_bound() -> None:
    """``--explain`` puts the merges and accumulations (nodes of memory-bound kernels, named
    after the attention) under ``compute: memory-bound``, not under ``attention``: that part
    holds at least their time (they are all on the critical path, which has no other
    stream to hide them on)."""
    registry = load_registry(autoload=False)
    system = load_system("h100-80g")
    workload = build_workload(GenerateOptions(**SMALL, profile="compiled"), registry)
    breakdown = predict_time(workload, system, explain=True)["explain"]["breakdown_s"]
    merges = [n for n in workload.ranks[0].nodes() if EAGER_KERNELS_ATTR in n.attrs]
    assert len(merges) == 2 * CP  # cp - 1 merges; cp accumulations and the K/V cast
    merge_s = sum(compute_time(n, system, profile="compiled") for n in merges)
    assert breakdown["compute: memory-bound"] >= merge_s
