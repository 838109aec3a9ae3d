"""Bandwidth sharing between concurrent transfers in the time replay: collectives and sends
in flight at once on one GPU through the same port (its NVLink ports, its NIC) share its
bandwidth equally; latencies are not shared, and transfers on different ports do not slow
each other. Each case against its closed form."""

from __future__ import annotations

import dataclasses
import math

import pytest

from stg.core.layout import Layout
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.core.workload import CollectiveType, NodeTemplate, NodeType, RankClass, RankGraph, Workload
from stg.host.registry import load_registry
from stg.perf import comm_time
from stg.perf.system import NetworkDim, System, load_system
from stg.predictors.time import (
    collective_phases,
    collective_time,
    group_shape,
    predict_problem,
    predict_time,
    problem_from_nodes,
    problem_from_workload,
    replay,
)

MS = 1e-3
TF = 1e12
B = 100e9  # bytes/s of the test network
H100 = load_system("h100-80g")


def network(bandwidth: float = B, latency: float = 0.0, node_size: int = 1) -> System:
    """1 TFLOP/s, unbounded memory, ``node_size`` GPUs per node on a plain alpha-beta link
    (dimension 0) and a plain link between nodes (dimension 1) of the same bandwidth."""
    return System(
        name="ideal",
        peak_flops=dict.fromkeys(("fp32", "tf32", "bf16", "fp16", "fp8", "int8"), TF),
        hbm_bandwidth=1e30,
        hbm_capacity=2**40,
        network=(
            NetworkDim("intra", node_size, bandwidth, latency, 1.0),
            NetworkDim("inter", 0, bandwidth, latency, 1.0),
        ),
    )


def comp(i: int, ms: float, deps: tuple[int, ...] = ()) -> NodeTemplate:
    return NodeTemplate(i, f"gemm{i}", NodeType.COMP, data_deps=deps, num_ops=int(ms * 1e9),
                        tensor_size=1, dtype="bf16")


def all_reduce(i: int, size: int, axes: tuple[str, ...], deps: tuple[int, ...] = ()):
    return NodeTemplate(i, f"all_reduce{i}", NodeType.COMM_COLL, data_deps=deps,
                        comm_type=CollectiveType.ALL_REDUCE, comm_size=size, group_axes=axes)


def send(i: int, size: int, stage: int, deps: tuple[int, ...] = ()) -> NodeTemplate:
    return NodeTemplate(i, f"send{i}", NodeType.COMM_SEND, data_deps=deps, comm_size=size,
                        peer_stage=stage, comm_tag=0)


def recv(i: int, size: int, stage: int) -> NodeTemplate:
    return NodeTemplate(i, f"recv{i}", NodeType.COMM_RECV, comm_size=size, peer_stage=stage,
                        comm_tag=0)


def workload(layout: Layout, classes: dict[int, RankClass], class_of=lambda r: 0) -> Workload:
    ranks = tuple(RankGraph(r, classes[class_of(r)], layout) for r in range(layout.world_size))
    return Workload(ranks, layout.comm_groups, layout, {})


def ends(wl: Workload, system: System, **kwargs) -> dict[str, float]:
    """When each node of the first simulated rank of each class ends."""
    result = replay(problem_from_workload(wl, system), system, **kwargs)
    out: dict[str, float] = {}
    for res in result.units:
        for i, node in enumerate(res.unit.nodes):
            out.setdefault(f"{res.unit.rank_class}:{node.name}", res.end[i])
    return out


# --- the phases of a transfer ------------------------------------------------------------------


@pytest.mark.parametrize("kind", [CollectiveType.ALL_REDUCE, CollectiveType.REDUCE_SCATTER,
                                  CollectiveType.ALL_GATHER, CollectiveType.ALL_TO_ALL])
@pytest.mark.parametrize("ranks", [range(8), range(0, 64, 8), range(16), range(0, 512, 8)])
def test_phases_add_up_to_the_collective_time(kind: CollectiveType, ranks: range) -> None:
    shape = group_shape(ranks, H100)
    size = 256 * 2**20
    phases = collective_phases(kind, size, shape, H100)
    total = sum(latency + transfer for _, latency, transfer in phases)
    assert total == pytest.approx(collective_time(kind, size, shape, H100), rel=1e-12)
    ports = [port for port, _, _ in phases]
    over_rail_and_spine = sum(n > 1 for n in shape[1:]) > 1
    if (shape[0] > 1 and math.prod(shape[1:]) > 1) or (
        kind is CollectiveType.ALL_TO_ALL and over_rail_and_spine
    ):
        # one NCCL algorithm over whole nodes: one phase, on the port that sets its pace (each
        # node's 8 NICs at 45 GB/s against 369 GB/s of NVLink per GPU); an all-to-all's sends
        # to rail and spine peers leave through the GPU's NIC at once
        assert ports == ["nic"]
        return
    # NVLink inside the node; the rail and the spine both go through the GPU's NIC
    expected = [p for n, p in zip(shape, ("nvlink", "nic", "nic"), strict=True) if n > 1]
    if kind is CollectiveType.ALL_GATHER:
        expected.reverse()  # outermost first: the gathered shards grow inwards
    if kind is CollectiveType.ALL_REDUCE and len(expected) > 1:
        expected = [*expected[:-1], expected[-1], *reversed(expected[:-1])]
    assert ports == expected


def test_ports_by_link_kind() -> None:
    levels = [comm_time.Level.of(d) for d in H100.network]
    assert [comm_time.port(lv, i) for i, lv in enumerate(levels)] == ["nvlink", "nic", "nic"]
    plain = network()
    assert [comm_time.port(comm_time.Level.of(d), i) for i, d in enumerate(plain.network)] == [
        "dim0",
        "dim1",
    ]


def test_hierarchical_all_reduce_splits_its_inner_dimension_around_the_outer() -> None:
    s = network(node_size=8)
    size = 2**30
    phases = collective_phases(CollectiveType.ALL_REDUCE, size, (8, 2), s)
    inner = 2 * 7 / 8 * size / B  # ring all-reduce over 8 on the full buffer
    outer = 2 * 1 / 2 * (size / 8) / B  # over 2 on the node's shard
    assert [p for p, _, _ in phases] == ["dim0", "dim1", "dim0"]
    assert [t for _, _, t in phases] == pytest.approx([inner / 2, outer, inner / 2])


# --- sharing in the replay ---------------------------------------------------------------------


def two_communicators(size: int, together: bool = True) -> Workload:
    """Every rank all-reduces ``size`` bytes over its tp group and, if ``together``, over its
    dp group at the same time (four ranks, one per node: both cross the same NIC)."""
    layout = Layout({"tp": 2, "dp": 2}, group_axes=(("tp",), ("dp",)))
    nodes = [all_reduce(0, size, ("tp",))]
    if together:
        nodes.append(all_reduce(1, size, ("dp",)))
    return workload(layout, {0: RankClass(0, 0, tuple(nodes))})


@pytest.mark.parametrize("latency", [0.0, 20e-6])
def test_two_equal_transfers_on_one_port_take_twice_as_long(latency: float) -> None:
    s = network(latency=latency)
    size = int(1 * MS * B)  # all-reduce over 2: 2(n-1)/n · S / B = 1 ms
    alone = predict_time(two_communicators(size, together=False), s)["iteration_time_s"]
    both = predict_time(two_communicators(size), s)["iteration_time_s"]
    ring_latency = 2 * (2 - 1) * latency
    assert alone == pytest.approx(ring_latency + 1 * MS)
    # the bytes share the NIC; the latencies run side by side, not shared
    assert both == pytest.approx(ring_latency + 2 * MS)
    if latency == 0:
        assert both == pytest.approx(2 * alone)
    # without sharing (the model before): both at full bandwidth
    off = replay(problem_from_workload(two_communicators(size), s), s, share_links=False)
    assert off.iteration_time == pytest.approx(alone)


def test_nvlink_and_nic_transfers_do_not_slow_each_other() -> None:
    # h100-80g: tp 8 inside the node on NVLink, dp 2 across two nodes on the NICs
    layout = Layout({"tp": 8, "dp": 2}, group_axes=(("tp",), ("dp",)))
    size = 512 * 2**20
    nodes = (all_reduce(0, size, ("tp",)), all_reduce(1, size, ("dp",)))
    got = ends(workload(layout, {0: RankClass(0, 0, nodes)}), H100)
    tp = collective_time(CollectiveType.ALL_REDUCE, size, group_shape(range(8), H100), H100)
    dp = collective_time(CollectiveType.ALL_REDUCE, size, group_shape([0, 8], H100), H100)
    assert group_shape([0, 8], H100) == (1, 2, 1)
    assert got["0:all_reduce0"] == pytest.approx(tp, rel=1e-9)
    assert got["0:all_reduce1"] == pytest.approx(dp, rel=1e-9)


def test_two_nic_collectives_share_on_a_preset() -> None:
    # h100-80g, one GPU of each node in use per group: tp and dp groups both cross nodes
    layout = Layout({"tp": 2, "dp": 2}, group_axes=(("tp",), ("dp",)), rank_order=(
        "sp", "ep", "pp", "tp", "dp"))
    s = dataclasses.replace(H100, network=(dataclasses.replace(H100.network[0], size=1),
                                           *H100.network[1:]))
    size = 512 * 2**20
    ((_, latency, transfer),) = collective_phases(CollectiveType.ALL_REDUCE, size, (1, 2, 1), s)
    nodes = (all_reduce(0, size, ("tp",)), all_reduce(1, size, ("dp",)))
    got = ends(workload(layout, {0: RankClass(0, 0, nodes)}), s)
    assert got["0:all_reduce0"] == pytest.approx(latency + 2 * transfer, rel=1e-9)
    assert got["0:all_reduce1"] == pytest.approx(latency + 2 * transfer, rel=1e-9)


def dp_and_pipeline(t_all_reduce: float, t_send: float) -> Workload:
    """Two stages of two data-parallel ranks, one per node. Stage 0 all-reduces over dp while
    it sends the activations to stage 1, which all-reduces over its own dp group while it
    receives them, and then computes 1 ms on them."""
    layout = Layout({"dp": 2, "pp": 2}, group_axes=(("dp",),))
    s_ar = int(t_all_reduce * B)  # all-reduce over 2: S / B
    s_p = int(t_send * B)
    stage0 = RankClass(0, 0, (all_reduce(0, s_ar, ("dp",)), send(1, s_p, 1)))
    stage1 = RankClass(1, 1, (recv(0, s_p, 0), all_reduce(1, s_ar, ("dp",)), comp(2, 1, (0,))))
    return workload(layout, {0: stage0, 1: stage1}, layout.stage)


@pytest.mark.parametrize(("t_ar", "t_p"), [(2 * MS, 1 * MS), (1 * MS, 3 * MS), (2 * MS, 2 * MS)])
def test_dp_all_reduce_beside_a_pipeline_send_closed_form(t_ar: float, t_p: float) -> None:
    s = network()
    wl = dp_and_pipeline(t_ar, t_p)
    got = ends(wl, s)
    # stage 0's NIC sends the all-reduce's bytes and the activations, stage 1's receives
    # both: each drains at half the bandwidth until the shorter is done, the other then at
    # full bandwidth
    short, long_ = min(t_ar, t_p), max(t_ar, t_p)
    first, second = 2 * short, short + long_
    send_end = first if t_p <= t_ar else second
    ar_end = first if t_ar < t_p else second
    assert got["0:send1"] == pytest.approx(send_end)
    assert got["1:recv0"] == pytest.approx(send_end)
    assert got["0:all_reduce0"] == pytest.approx(ar_end)
    assert got["1:all_reduce1"] == pytest.approx(ar_end)
    assert got["1:gemm2"] == pytest.approx(send_end + 1 * MS)
    report = predict_time(wl, s)
    assert report["iteration_time_s"] == pytest.approx(max(ar_end, send_end + 1 * MS))
    # without sharing each at full bandwidth
    off = ends(wl, s, share_links=False)
    assert off["0:send1"] == pytest.approx(t_p)
    assert off["0:all_reduce0"] == pytest.approx(t_ar)


def test_opposite_sends_do_not_share_a_full_duplex_link() -> None:
    # stage 0 sends to stage 1 while stage 1 sends to stage 0: each NIC sends one and
    # receives one, at full bandwidth both ways
    layout = Layout({"pp": 2})
    size = int(1 * MS * B)
    nodes0 = (send(0, size, 1), recv(1, size, 1))
    nodes1 = (send(0, size, 0), recv(1, size, 0))
    wl = workload(layout, {0: RankClass(0, 0, nodes0), 1: RankClass(1, 1, nodes1)}, layout.stage)
    assert predict_time(wl, network())["iteration_time_s"] == pytest.approx(1 * MS)


def test_symmetric_units_share_as_every_rank_does() -> None:
    s = network()
    wl = dp_and_pipeline(2 * MS, 1 * MS)
    fast = predict_time(wl, s)
    every = {g.rank: list(g.nodes()) for g in wl.ranks}
    slow = predict_problem(problem_from_nodes(every, wl.comm_groups), s)
    assert fast["simulated_ranks"] == 2
    assert slow["iteration_time_s"] == pytest.approx(fast["iteration_time_s"])


# --- a whole prediction ------------------------------------------------------------------------


def test_a_generated_run_slows_where_gathers_meet_pipeline_traffic() -> None:
    """GPT on two stages of four data-parallel ranks, ZeRO-1 with the parameter gathers beside
    the forward: four ranks per node (on a system with 4-GPU nodes), so the data-parallel
    gathers and reductions and the pipeline's sends all cross the NICs, concurrently."""
    options = GenerateOptions(num_stacks=4, dmodel=2048, dff=8192, head=16, seq=2048,
                              dvocal=32000, batch=32, micro_batch=8, dp=4, pp=2, tp=4,
                              zero=1, overlap_param_gather=True)
    wl = build_workload(options, load_registry(autoload=False))
    s = dataclasses.replace(H100, network=(dataclasses.replace(H100.network[0], size=4),
                                           *H100.network[1:]))
    problem = problem_from_workload(wl, s)
    shared = replay(problem, s, overlap_param_gather=True)
    alone = replay(problem, s, overlap_param_gather=True, share_links=False)
    assert shared.iteration_time > alone.iteration_time * 1.001
    # every transfer takes at least as long as at full bandwidth, some longer
    longer = 0
    for res_s, res_a in zip(shared.units, alone.units, strict=True):
        for i, kind in enumerate(res_s.kind):
            if kind in (1, 2):  # collectives and sends
                took = res_s.end[i] - res_s.transfer_start[i]
                free = res_a.end[i] - res_a.transfer_start[i]
                assert took >= free * (1 - 1e-9)
                longer += took > free * (1 + 1e-6)
    assert longer > 0
    # the same report through the public entry point, deterministic
    first = predict_time(wl, s)["iteration_time_s"]
    assert first == predict_time(wl, s)["iteration_time_s"] == shared.iteration_time
