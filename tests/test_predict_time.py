"""The time predictor on hand-built workloads with known answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stg.core.layout import Layout
from stg.core.workload import CollectiveType, NodeTemplate, NodeType, RankClass, RankGraph, Workload
from stg.errors import TraceError
from stg.perf.system import NetworkDim, System
from stg.predictors.time import (
    collective_time,
    group_shape,
    predict_problem,
    predict_time,
    problem_from_nodes,
    problem_from_workload,
    send_time,
)

TF = 1e12  # 1 TFLOP/s: 1e9 FLOPs take 1 ms
MS = 1e-3


def system(node_size: int = 8, bandwidth: float = 100e9, latency: float = 0.0) -> System:
    """An ideal system: 1 TFLOP/s in every dtype, unbounded memory bandwidth, no overheads."""
    return System(
        name="ideal",
        peak_flops=dict.fromkeys(("fp32", "tf32", "bf16", "fp16", "fp8", "int8"), TF),
        hbm_bandwidth=1e30,
        hbm_capacity=2**40,
        network=(
            NetworkDim("intra", node_size, bandwidth, latency, 1.0),
            NetworkDim("inter", 0, bandwidth / 10, 10 * latency, 1.0),
        ),
    )


def comp(i: int, ms: float, deps: tuple[int, ...] = (), ctrl: tuple[int, ...] = (),
         name: str = "gemm") -> NodeTemplate:
    return NodeTemplate(i, f"{name}{i}", NodeType.COMP, data_deps=deps, ctrl_deps=ctrl,
                        num_ops=int(ms * 1e9), tensor_size=1, dtype="bf16")


def coll(i: int, size: int, axes: tuple[str, ...], deps: tuple[int, ...] = (),
         kind: CollectiveType = CollectiveType.ALL_REDUCE) -> NodeTemplate:
    return NodeTemplate(i, f"coll{i}", NodeType.COMM_COLL, data_deps=deps, comm_type=kind,
                        comm_size=size, group_axes=axes)


def workload(layout: Layout, classes: dict[int, RankClass], class_of, metadata=None) -> Workload:
    ranks = tuple(RankGraph(r, classes[class_of(r)], layout) for r in range(layout.world_size))
    return Workload(ranks, layout.comm_groups, layout, metadata or {})


# --- closed forms ------------------------------------------------------------------------------


def test_ring_collective_closed_forms() -> None:
    s = system(bandwidth=50e9, latency=2e-6)
    size, n, b, a = 64 * 2**20, 4, 50e9, 2e-6
    assert collective_time(CollectiveType.ALL_REDUCE, size, (n, 1), s) == pytest.approx(
        2 * (n - 1) / n * size / b + 2 * (n - 1) * a
    )
    assert collective_time(CollectiveType.REDUCE_SCATTER, size, (n, 1), s) == pytest.approx(
        (n - 1) / n * size / b + (n - 1) * a
    )
    # all-gather: comm_size is this rank's shard
    assert collective_time(CollectiveType.ALL_GATHER, size // n, (n, 1), s) == pytest.approx(
        (n - 1) / n * size / b + (n - 1) * a
    )
    # all-to-all: concurrent sends to every peer, one step of latency
    assert collective_time(CollectiveType.ALL_TO_ALL, size, (n, 1), s) == pytest.approx(
        (n - 1) / n * size / b + a
    )
    assert send_time(size, 0, s) == pytest.approx(size / b + a)
    assert send_time(size, 1, s) == pytest.approx(size / (b / 10) + 10 * a)


def test_hierarchical_all_reduce_over_two_nodes() -> None:
    s = system(node_size=8, bandwidth=80e9, latency=1e-6)
    shape = group_shape(range(16), s)
    assert shape == (8, 2)
    size = 2**30
    intra = 2 * (7 / 8 * size / 80e9 + 7 * 1e-6)
    inter = 2 * (1 / 2 * (size / 8) / 8e9 + 1 * 10e-6)
    assert collective_time(CollectiveType.ALL_REDUCE, size, shape, s) == pytest.approx(
        intra + inter
    )
    # one GPU per node: only the inter-node dimension
    assert group_shape([0, 8, 16, 24], s) == (1, 4)
    # irregular placement: ranks 6..9 are two per node on two nodes
    assert group_shape([6, 7, 8, 9], s) == (2, 2)


def test_all_reduce_takes_a_tree_for_small_buffers_on_many_ranks() -> None:
    s = system(node_size=1, bandwidth=80e9, latency=1e-6)
    b, a, n = 8e9, 10e-6, 64  # the inter-node dimension of this test system
    small, large = 4096, 2**30
    ring = 2 * ((n - 1) / n * small / b + (n - 1) * a)
    tree = 2 * small / b + 2 * 6 * a  # ceil(log2 64) = 6 hops up and down
    assert tree < ring
    assert collective_time(CollectiveType.ALL_REDUCE, small, (1, n), s) == pytest.approx(tree)
    ring_large = 2 * ((n - 1) / n * large / b + (n - 1) * a)
    assert collective_time(CollectiveType.ALL_REDUCE, large, (1, n), s) == pytest.approx(ring_large)


# --- replay --------------------------------------------------------------------------------------


def test_compute_and_communication_overlap() -> None:
    # c0 (1 ms) -> all-reduce (2 ms) ; c0 -> c2 (1 ms): the collective hides c2
    layout = Layout({"dp": 2}, group_axes=(("dp",),))
    size = int(2 * MS * 100e9)  # 2(n-1)/n * S / B = 2 ms for n = 2
    rc = RankClass(0, 0, (comp(0, 1), coll(1, size, ("dp",), (0,)), comp(2, 1, (0,))))
    report = predict_time(workload(layout, {0: rc}, lambda r: 0), system())
    assert report["iteration_time_s"] == pytest.approx(3 * MS)
    assert report["simulated_ranks"] == 1
    (rank,) = report["ranks"]
    assert rank["ranks"] == 2
    assert rank["compute_s"] == pytest.approx(2 * MS)
    assert rank["communication_s"] == pytest.approx(2 * MS)
    assert rank["exposed_communication_s"] == pytest.approx(1 * MS)
    assert rank["bubble_s"] == pytest.approx(0)
    # MFU: 2 GFLOP per rank, 2 ranks, 3 ms, 1 TFLOP/s
    assert report["mfu"] == pytest.approx(4e9 / (3 * MS * 2 * TF))


def test_collective_waits_for_the_slowest_member() -> None:
    layout = Layout({"pp": 2}, group_axes=(("pp",),))
    size = int(1 * MS * 100e9)  # all-reduce over 2 ranks: 1 ms
    fast = RankClass(0, 0, (comp(0, 1), coll(1, size, ("pp",), (0,))))
    slow = RankClass(1, 1, (comp(0, 3), coll(1, size, ("pp",), (0,))))
    report = predict_time(workload(layout, {0: fast, 1: slow}, layout.stage), system())
    assert report["iteration_time_s"] == pytest.approx(4 * MS)
    first, second = report["ranks"]
    assert first["collective_wait_s"] == pytest.approx(2 * MS)
    assert first["bubble_s"] == pytest.approx(2 * MS)
    assert second["collective_wait_s"] == pytest.approx(0)
    path = report["critical_path"]
    assert [p["kind"] for p in path] == ["compute", "collective"]
    assert path[0]["rank"] == 1  # the slow rank's compute gates the collective


def test_send_receive_chain() -> None:
    layout = Layout({"pp": 2})
    size = 10**8  # 1 ms at 100 GB/s
    lat = 5e-6
    sender = RankClass(0, 0, (
        comp(0, 1),
        NodeTemplate(1, "send", NodeType.COMM_SEND, data_deps=(0,), comm_size=size,
                     peer_stage=1, comm_tag=7),
    ))
    receiver = RankClass(1, 1, (
        NodeTemplate(0, "recv", NodeType.COMM_RECV, comm_size=size, peer_stage=0, comm_tag=7),
        comp(1, 1, (0,)),
    ))
    report = predict_time(workload(layout, {0: sender, 1: receiver}, layout.stage),
                          system(latency=lat))
    assert report["iteration_time_s"] == pytest.approx(3 * MS + lat)
    assert [p["kind"] for p in report["critical_path"]] == ["compute", "send", "recv", "compute"]


def gpipe_classes(p: int, m: int, tf: float, tb: float) -> dict[int, RankClass]:
    """Stage i: F(0..m-1) then B(0..m-1), activations forward and gradients backward."""
    classes = {}
    for stage in range(p):
        nodes: list[NodeTemplate] = []
        prev = None
        for mb in range(m):
            deps: tuple[int, ...] = ()
            if stage > 0:
                nodes.append(NodeTemplate(len(nodes), f"recv_act{mb}", NodeType.COMM_RECV,
                                          comm_size=1, peer_stage=stage - 1, comm_tag=mb))
                deps = (len(nodes) - 1,)
            nodes.append(comp(len(nodes), tf, deps, () if prev is None else (prev,), "fwd"))
            prev = len(nodes) - 1
            if stage < p - 1:
                nodes.append(NodeTemplate(len(nodes), f"send_act{mb}", NodeType.COMM_SEND,
                                          data_deps=(prev,), comm_size=1, peer_stage=stage + 1,
                                          comm_tag=mb))
        for mb in range(m):
            deps = ()
            if stage < p - 1:
                nodes.append(NodeTemplate(len(nodes), f"recv_grad{mb}", NodeType.COMM_RECV,
                                          comm_size=1, peer_stage=stage + 1, comm_tag=1000 + mb))
                deps = (len(nodes) - 1,)
            nodes.append(comp(len(nodes), tb, deps, (prev,), "bwd"))
            prev = len(nodes) - 1
            if stage > 0:
                nodes.append(NodeTemplate(len(nodes), f"send_grad{mb}", NodeType.COMM_SEND,
                                          data_deps=(prev,), comm_size=1, peer_stage=stage - 1,
                                          comm_tag=1000 + mb))
        classes[stage] = RankClass(stage, stage, tuple(nodes))
    return classes


@pytest.mark.parametrize(("p", "m"), [(4, 8), (2, 1), (3, 5)])
def test_gpipe_bubble(p: int, m: int) -> None:
    tf, tb = 1.0, 2.0
    layout = Layout({"pp": p, "dp": 2})
    s = System(
        name="no-network",
        peak_flops=dict.fromkeys(("fp32", "tf32", "bf16", "fp16", "fp8", "int8"), TF),
        hbm_bandwidth=1e30,
        hbm_capacity=2**40,
        network=(NetworkDim("any", 0, 1e30, 0.0, 1.0),),
    )
    report = predict_time(workload(layout, gpipe_classes(p, m, tf, tb), layout.stage), s)
    step = (tf + tb) * MS
    assert report["iteration_time_s"] == pytest.approx((m + p - 1) * step)
    assert report["simulated_ranks"] == p
    for rank in report["ranks"]:
        assert rank["bubble_s"] / report["iteration_time_s"] == pytest.approx(
            (p - 1) / (m + p - 1)
        )
        assert rank["compute_s"] == pytest.approx(m * step)


def test_symmetry_matches_simulating_every_rank() -> None:
    # 4-GPU nodes: tp group {0,1,2} fits a node, {3,4,5} straddles two; dp group {0,3}
    # fits a node, {1,4} and {2,5} do not: four kinds of rank
    layout = Layout({"tp": 3, "dp": 2}, group_axes=(("tp",), ("dp",)))
    rc = RankClass(0, 0, (
        comp(0, 1),
        coll(1, 10**8, ("tp",), (0,)),
        comp(2, 1, (1,)),
        coll(3, 10**8, ("dp",), (2,)),
        comp(4, 0.5, (2,)),
    ))
    wl = workload(layout, {0: rc}, lambda r: 0)
    s = system(node_size=4, latency=1e-6)
    fast = predict_time(wl, s)
    assert fast["simulated_ranks"] == 4
    every = {g.rank: list(g.nodes()) for g in wl.ranks}
    slow = predict_problem(problem_from_nodes(every, wl.comm_groups), s)
    assert fast["iteration_time_s"] == pytest.approx(slow["iteration_time_s"])
    assert fast["hardware_flops"] == slow["hardware_flops"]
    units = problem_from_workload(wl, s).units
    assert [u.ranks for u in units] == [(0,), (1, 2), (3,), (4, 5)]


def test_timeline_is_a_chrome_trace(tmp_path: Path) -> None:
    layout = Layout({"dp": 2}, group_axes=(("dp",),))
    rc = RankClass(0, 0, (comp(0, 1), coll(1, 10**6, ("dp",), (0,)), comp(2, 1, (0,))))
    out = tmp_path / "trace.json"
    report = predict_time(workload(layout, {0: rc}, lambda r: 0), system(), timeline=out)
    assert report["timeline"] == str(out)
    trace = json.loads(out.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 3
    for e in spans:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e)
        assert e["dur"] >= 0
    assert {e["tid"] for e in spans} == {0, 1}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"compute", "communication"}
    # same input, same bytes
    again = tmp_path / "again.json"
    predict_time(workload(layout, {0: rc}, lambda r: 0), system(), timeline=again)
    assert again.read_bytes() == out.read_bytes()


def test_receive_without_send_is_reported() -> None:
    layout = Layout({"pp": 2})
    lonely = RankClass(0, 0, (comp(0, 1),))
    waiting = RankClass(1, 1, (
        NodeTemplate(0, "recv", NodeType.COMM_RECV, comm_size=8, peer_stage=0, comm_tag=3),
    ))
    with pytest.raises(TraceError, match=r"deadlocked: rank 1 node 0 .*waits for a send"):
        predict_time(workload(layout, {0: lonely, 1: waiting}, layout.stage), system())


def test_roofline_memory_bound_and_runtime_fallback() -> None:
    from stg.core.workload import Node
    from stg.predictors.time import compute_time

    s = System(
        name="s",
        peak_flops=dict.fromkeys(("fp32", "tf32", "bf16", "fp16", "fp8", "int8"), TF),
        hbm_bandwidth=1e12,
        hbm_capacity=2**40,
        network=(NetworkDim("any", 0, 1e9, 0.0, 1.0),),
        memory_efficiency=0.5,
        kernel_overhead=1e-6,
    )
    gemm = Node(0, "mm", NodeType.COMP, num_ops=10**9, tensor_size=10**6)
    assert compute_time(gemm, s) == pytest.approx(1e-3 + 1e-6)
    elementwise = Node(1, "add", NodeType.COMP, num_ops=10**6, tensor_size=10**9)
    assert compute_time(elementwise, s) == pytest.approx(2e-3 + 1e-6)
    measured = Node(2, "kernel", NodeType.COMP, runtime=250)
    assert compute_time(measured, s) == pytest.approx(250e-6)
