"""Compute beside a collective that runs one NCCL algorithm over several GPUs of several nodes:
the collective moves bytes through each GPU at the node's NIC rate, not one NIC's."""

from __future__ import annotations

import pytest

from stg.core.layout import Layout
from stg.core.workload import CollectiveType, NodeTemplate, NodeType, RankClass, RankGraph, Workload
from stg.perf.comm_time import Kind, Level, spanning_byte_rate
from stg.perf.replay import (
    HBM_BYTES_PER_WIRE_BYTE,
    NCCL_CHANNELS,
    contended_systems,
    contention_link,
    spanning_contended_system,
)
from stg.perf.system import load_system
from stg.predictors.time import collective_time, compute_time, group_shape, predict_time

A100 = load_system("a100-80g")
LEVELS = tuple(Level.of(d) for d in A100.network)
NVLINK, NIC = LEVELS[0].bandwidth, LEVELS[1].bandwidth


def test_a_ring_over_whole_nodes_moves_the_nodes_nic_rate_through_each_gpu() -> None:
    # 8 GPUs of each of 2 nodes: every GPU forwards the bus bytes at the pace of 8 NICs
    assert spanning_byte_rate(Kind.REDUCE_SCATTER, (8, 2, 1), LEVELS) == min(NVLINK, 8 * NIC)
    assert spanning_byte_rate(Kind.ALL_GATHER, (2, 4, 1), LEVELS) == min(NVLINK, 2 * NIC)
    # one GPU per node (the dimension-by-dimension path) and all-to-all are not such rings
    assert spanning_byte_rate(Kind.ALL_REDUCE, (1, 2, 1), LEVELS) is None
    assert spanning_byte_rate(Kind.ALL_TO_ALL, (8, 2, 1), LEVELS) is None
    assert spanning_byte_rate(Kind.ALL_REDUCE, (8, 1, 1), LEVELS) is None


def test_contention_key_names_the_spanning_rate() -> None:
    link, rate = contention_link(CollectiveType.REDUCE_SCATTER, (8, 2, 1), A100)
    assert rate == min(NVLINK, 8 * NIC)
    assert link is not None and link.startswith("network")
    assert contention_link(CollectiveType.ALL_REDUCE, (1, 2, 1), A100) == ("network", None)
    gpu = spanning_contended_system(A100, "network", rate)
    assert gpu.sm_count == A100.sm_count - NCCL_CHANNELS["network"]
    assert gpu.hbm_bandwidth == pytest.approx(
        A100.hbm_bandwidth - HBM_BYTES_PER_WIRE_BYTE * min(NVLINK, 8 * NIC)
    )


def test_memory_bound_kernel_beside_a_reduce_scatter_over_two_whole_nodes() -> None:
    # c0 -> reduce-scatter over 16 GPUs (8 of each of two nodes); c0 -> c2 (memory-bound) runs
    # while the reduce-scatter does
    layout = Layout({"dp": 16}, group_axes=(("dp",),))
    size = 2**32
    c0 = NodeTemplate(0, "c0", NodeType.COMP, num_ops=10**9, tensor_size=10**6, dtype="bf16")
    nodes = (
        c0,
        NodeTemplate(
            1,
            "grad_reduce",
            NodeType.COMM_COLL,
            data_deps=(0,),
            comm_type=CollectiveType.REDUCE_SCATTER,
            comm_size=size,
            group_axes=("dp",),
        ),
        NodeTemplate(
            2, "c2", NodeType.COMP, data_deps=(0,), num_ops=10**6, tensor_size=2**31, dtype="bf16"
        ),
    )
    rc = RankClass(0, 0, nodes)
    ranks = tuple(RankGraph(r, rc, layout) for r in range(16))
    report = predict_time(Workload(ranks, layout.comm_groups, layout, {}), A100)
    shape = group_shape(range(16), A100)
    assert shape[:2] == (8, 2)
    comm = collective_time(CollectiveType.REDUCE_SCATTER, size, shape, A100)
    _, rate = contention_link(CollectiveType.REDUCE_SCATTER, shape, A100)
    slow = compute_time(nodes[2], spanning_contended_system(A100, "network", rate), "bf16")
    assert comm > slow  # c2 runs entirely under the reduce-scatter
    # one NIC's traffic (the model for a group with one GPU per node) slows it less
    assert slow > compute_time(nodes[2], contended_systems(A100)["network"], "bf16")
    (rank,) = report["ranks"]
    assert rank["compute_s"] == pytest.approx(compute_time(c0, A100, "bf16") + slow)
