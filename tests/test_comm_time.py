"""The communication sub-model (stg.perf.comm_time) against its closed forms and against
published nccl-tests measurements on the preset systems."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from stg.core.workload import CollectiveType
from stg.perf import comm_time, costs
from stg.perf.comm_time import LL, LL128, SIMPLE, Algorithm, Kind, Level, MeasuredCurve
from stg.perf.system import load_system
from stg.predictors.time import collective_time, group_shape

GB = 1e9
DATA = Path(__file__).parent / "data" / "nccl"


def levels(name: str) -> tuple[Level, ...]:
    return tuple(Level.of(d) for d in load_system(name).network)


def test_simple_ring_closed_form_for_large_buffers() -> None:
    nvlink = levels("a100-80g")[0]
    size, n = 2**30, 8
    a = 3.4e-6
    moved = 2 * (n - 1) / n * size  # what each GPU sends
    # the ramp's argument: each step moves one chunk per rank of the buffer, read at 8 chunks
    b = 300 * GB * 0.75 * comm_time.mid_size_efficiency(8 * size / n)
    ring = SIMPLE.ring_base_s + 2 * (n - 1) * a + moved / b
    assert comm_time.level_time(Kind.ALL_REDUCE, size, n, nvlink) == pytest.approx(ring)
    moved = (n - 1) / n * size
    rs = SIMPLE.ring_base_s + (n - 1) * a + moved / b
    assert comm_time.level_time(Kind.REDUCE_SCATTER, size, n, nvlink) == pytest.approx(rs)
    assert comm_time.level_time(Kind.ALL_GATHER, size, n, nvlink) == pytest.approx(rs)


def test_small_buffers_take_the_low_latency_protocol() -> None:
    nvlink = levels("a100-80g")[0]
    size, n = 8192, 8
    b, a = 300 * GB * 0.75, 3.4e-6
    # NCCL's tuner: the LL ring (a quarter of the bandwidth, 0.6 us steps) beats the chain
    ll = (
        LL.ring_base_s
        + 2 * (n - 1) * a * LL.step_ratio["nvlink"]
        + 2 * (n - 1) / n * size / (b * LL.bandwidth)
    )
    choice = comm_time.choose(Kind.ALL_REDUCE, size, n, nvlink)
    assert (choice.algorithm, choice.protocol) == (Algorithm.RING, LL)
    # LL flags every 8-byte line: no pipeline ramp, the tuner's time is the time
    assert comm_time.level_time(Kind.ALL_REDUCE, size, n, nvlink) == pytest.approx(ll)
    # the bus bandwidth rises with the size and saturates at B
    sizes = [2**k for k in range(10, 34)]
    bus = [comm_time.bus_bandwidth(Kind.ALL_REDUCE, s, n, nvlink) for s in sizes]
    assert all(x <= y * (1 + 1e-9) for x, y in itertools.pairwise(bus))
    assert bus[-1] == pytest.approx(300 * GB * 0.75, rel=0.01)
    assert bus[0] < 0.02 * 300 * GB * 0.75
    # the middle of the curve uses LL128 (0.92 of the bandwidth, shorter steps than Simple),
    # whose pipeline of buffer slots ramps up as Simple's does
    mid = 4 * 2**20
    b_mid = b * comm_time.mid_size_efficiency(mid)  # 8 GPUs: 8 shares of mid / 8
    ll128 = LL128.ring_base_s + 14 * a * LL128.step_ratio["nvlink"] + 1.75 * mid / (b_mid * 0.92)
    assert comm_time.choose(Kind.ALL_REDUCE, mid, n, nvlink).protocol is LL128
    assert comm_time.level_time(Kind.ALL_REDUCE, mid, n, nvlink) == pytest.approx(ll128)


def test_mid_size_efficiency_reproduces_its_calibration_curve() -> None:
    """MID_SIZE_EFFICIENCY is the ND H200 v5 NVLS curve of tests/data/nccl/published.jsonl,
    (S / B) / (t - NCCL's NVLS latency), with B the h200-141g preset's NVLS bandwidth."""
    sharp = 450 * GB * 0.61
    rows = [
        json.loads(line)
        for line in (DATA / "published.jsonl").read_text().splitlines()
        if line.strip()
    ]
    curve = [r for r in rows if r["system"] == "h200-141g" and r["collective"] == "all_reduce"]
    assert len(curve) == len(comm_time.MID_SIZE_EFFICIENCY)
    for row, (size, efficiency) in zip(curve, comm_time.MID_SIZE_EFFICIENCY, strict=True):
        assert row["size_bytes"] == size
        measured = (size / sharp) / (row["time_us"] * 1e-6 - comm_time.NVLS_LATENCY_S)
        assert efficiency == pytest.approx(min(measured, 1.0), abs=0.0015)
    # geometric interpolation between the tabulated sizes, clamped at both ends
    assert comm_time.mid_size_efficiency(1) == comm_time.MID_SIZE_EFFICIENCY[0][1]
    assert comm_time.mid_size_efficiency(2**40) == 1.0
    between = comm_time.mid_size_efficiency(2**20 * math.sqrt(2))
    assert between == pytest.approx((0.328 + 0.417) / 2)


def test_nvlink_sharp_and_oversubscription() -> None:
    nvlink = levels("h100-80g")[0]
    size, n = 8 * 2**30, 8
    sharp = comm_time.NVLS_LATENCY_S + size / (450 * GB * 0.61)
    assert comm_time.level_time(Kind.ALL_REDUCE, size, n, nvlink) == pytest.approx(sharp)
    # reduce-scatter has no in-network path in NCCL 2.18: the ring
    efficiency = comm_time.mid_size_efficiency(size)  # 8 chunks of size / 8
    assert comm_time.level_time(Kind.REDUCE_SCATTER, size, n, nvlink) == pytest.approx(
        SIMPLE.ring_base_s + 7 * 3.4e-6 + 7 / 8 * size / (450 * GB * 0.82 * efficiency)
    )
    spine = Level(bandwidth=45 * GB / 2, latency=9.6e-6, link="network")
    rail = Level(bandwidth=45 * GB, latency=9.6e-6, link="network")
    big = 2**32
    assert comm_time.level_time(Kind.REDUCE_SCATTER, big, 4, spine) == pytest.approx(
        2 * comm_time.level_time(Kind.REDUCE_SCATTER, big, 4, rail), rel=0.01
    )


def test_placement_decides_the_level() -> None:
    a100 = load_system("a100-80g")
    size = 2**30
    # tensor parallel inside a node: NVLink only
    tp = group_shape(range(8), a100)
    assert tp == (8, 1, 1)
    assert collective_time(CollectiveType.ALL_REDUCE, size, tp, a100) == pytest.approx(
        comm_time.level_time(Kind.ALL_REDUCE, size, 8, Level.of(a100.network[0]))
    )
    # data parallel, one GPU per node in one scalable unit: the GPU's rail at 0.9 x 25 GB/s
    dp = group_shape([8 * i for i in range(16)], a100)
    assert dp == (1, 16, 1)
    ring = SIMPLE.ring_base_s + 30 * 9.6e-6 + 2 * 15 / 16 * size / (25 * GB * 0.9)
    assert collective_time(CollectiveType.ALL_REDUCE, size, dp, a100) == pytest.approx(ring)
    # across scalable units: the rail, then the spine on the shard the rail leaves
    wide = group_shape([8 * i for i in range(40)], a100)
    assert wide == (1, 20, 2)
    rail, spine = Level.of(a100.network[1]), Level.of(a100.network[2])
    expected = comm_time.level_time(Kind.ALL_REDUCE, size, 20, rail) + comm_time.level_time(
        Kind.ALL_REDUCE, size / 20, 2, spine
    )
    assert collective_time(CollectiveType.ALL_REDUCE, size, wide, a100) == pytest.approx(expected)
    # whole nodes in a data-parallel group: one NCCL algorithm over all 32 GPUs, its NVLink and
    # NIC bytes pipelined, where running NVLink and then each GPU's NIC on 1/8 adds them up
    node = group_shape(range(32), a100)
    assert node == (8, 4, 1)
    spanning = comm_time.spanning_parts(Kind.ALL_REDUCE, size, node, levels("a100-80g"))
    assert spanning is not None
    assert collective_time(CollectiveType.ALL_REDUCE, size, node, a100) == pytest.approx(
        spanning[1] + spanning[2]
    )
    sequential = comm_time.level_time(Kind.ALL_REDUCE, size, 8, Level.of(a100.network[0]))
    sequential += comm_time.level_time(Kind.ALL_REDUCE, size / 8, 4, rail)
    assert collective_time(CollectiveType.ALL_REDUCE, size, node, a100) < 0.7 * sequential


def _spanning(kind: Kind, size: float, shape: tuple[int, ...], name: str, algorithm: Algorithm):
    return next(
        c
        for c in comm_time.spanning_candidates(kind, size, shape, levels(name))
        if c.algorithm is algorithm and c.protocol is SIMPLE
    )


def test_a_ring_across_nodes_shares_each_node_s_nics() -> None:
    """A ring over whole nodes: each GPU moves the bus bytes over NVLink, and a node's NICs
    (one per GPU, 0.9 x 50 GB/s on the h100-80g preset) carry the same bus bytes together;
    fewer GPUs per node leave fewer NICs for the ring's channels."""
    size = 2**30
    for local, nodes in ((8, 2), (4, 2), (8, 4)):
        n = local * nodes
        ring = _spanning(Kind.ALL_REDUCE, size, (local, nodes, 1), "h100-80g", Algorithm.RING)
        bus = 2 * (n - 1) / n * size
        assert dict(ring.seconds) == pytest.approx(
            {0: bus / (450 * GB * 0.82), 1: bus / (local * 50 * GB * 0.9)}
        )
        assert ring.bottleneck == 1  # 8 x 45 GB/s of NICs < 369 GB/s of NVLink
        # NCCL's latency: 2 nodes of network steps, the rest NVLink steps, x1.4 (plateau)
        steps = (2 * (n - 1) - 2 * nodes) * 3.4e-6 + 2 * nodes * 9.6e-6
        assert ring.latency == pytest.approx(1.4 * (SIMPLE.ring_base_s + steps))
    gather = _spanning(Kind.ALL_GATHER, size, (8, 2, 1), "h100-80g", Algorithm.RING)
    assert dict(gather.seconds)[1] == pytest.approx(15 / 16 * size / (8 * 45 * GB))


def test_tree_and_nvls_tree_bytes_between_nodes() -> None:
    """NCCL's tree sends ``S`` through each node's NICs between two nodes and about ``2 S``
    through the interior nodes of a large double binary tree (``2 (nodes-1)/nodes · S``), while
    each GPU's NVLink carries ``2 S`` (the chain); NVLSTree reduces inside the node through the
    switch (``S`` at its rate) and runs the same tree at 0.70 of the NICs (NCCL's tuner)."""
    size = 2**30
    two = _spanning(Kind.ALL_REDUCE, size, (8, 2, 1), "h100-80g", Algorithm.TREE)
    many = _spanning(Kind.ALL_REDUCE, size, (8, 16, 1), "h100-80g", Algorithm.TREE)
    nics = 8 * 45 * GB * 0.92
    assert dict(two.seconds)[1] == pytest.approx(size / nics)
    assert dict(many.seconds)[1] == pytest.approx(2 * 15 / 16 * size / nics)
    assert dict(two.seconds)[0] == pytest.approx(2 * size / (450 * GB * 0.82 * 0.92))
    nvls = _spanning(Kind.ALL_REDUCE, size, (8, 2, 1), "h100-80g", Algorithm.NVLS_TREE)
    assert dict(nvls.seconds) == pytest.approx(
        {0: size / (450 * GB * 0.61), 1: size / (8 * 45 * GB * 0.70)}
    )
    assert nvls.latency == pytest.approx(23e-6 + 2 * 9.6e-6 * 19 / 14)
    # what NCCL runs on two H100 nodes: NVLSTree; an A100 node has no NVLink SHARP
    parts = comm_time.spanning_parts(Kind.ALL_REDUCE, size, (8, 2, 1), levels("h100-80g"))
    assert parts == pytest.approx(
        (1, nvls.latency, nvls.saturated() / comm_time.mid_size_efficiency(size))
    )
    kinds = {
        c.algorithm
        for c in comm_time.spanning_candidates(Kind.ALL_REDUCE, size, (8, 2, 1), levels("a100-80g"))
    }
    assert kinds == {Algorithm.RING, Algorithm.TREE}
    # NVLS needs three GPUs of a node or more
    kinds = {
        c.algorithm
        for c in comm_time.spanning_candidates(Kind.ALL_REDUCE, size, (2, 4, 1), levels("h100-80g"))
    }
    assert Algorithm.NVLS_TREE not in kinds


def test_all_to_all_across_nodes_sends_over_both_links_at_once() -> None:
    size = 2**30
    h100 = load_system("h100-80g")
    shape = (8, 2, 1)
    # 7 of 16 peers over NVLink, 8 through the GPU's own NIC, all at once: the NIC sets the pace
    expected = 9.6e-6 + 8 / 16 * size / (45 * GB)
    assert collective_time(CollectiveType.ALL_TO_ALL, size, shape, h100) == pytest.approx(expected)
    phases = costs.collective_phases(CollectiveType.ALL_TO_ALL, size, shape, h100)
    assert [port for port, _, _ in phases] == ["nic"]
    assert phases[0][1:] == pytest.approx((9.6e-6, 8 / 16 * size / (45 * GB)))


def test_all_to_all_bus_bandwidth_across_nodes_is_one_nic_per_gpu() -> None:
    """An NCCL maintainer's rule (nccl-tests issue #130): an all-to-all's bus bandwidth is the
    network bandwidth per GPU with one GPU per node, and with several GPUs per node the traffic
    that leaves the node sets it, ``N/(N-1)`` times the per-GPU network bandwidth over ``N``
    nodes (the NVLink share is not the bottleneck); issue #267: an all-to-all cannot aggregate
    several NICs, it gets one NIC's bandwidth per GPU. Exactly, ``(n-1)/(n-local)`` of it, the
    ``1/n`` a GPU keeps for itself left out of both."""
    h100 = load_system("h100-80g")
    nic = 45 * GB  # the preset's 400 Gb/s NIC per GPU at its 0.9 efficiency
    size = 4 * 2**30

    def bus(shape: tuple[int, ...]) -> float:
        n = math.prod(shape)
        return (n - 1) / n * size / collective_time(CollectiveType.ALL_TO_ALL, size, shape, h100)

    for nodes in (2, 4, 8, 32):
        assert bus((1, nodes, 1)) == pytest.approx(nic, rel=0.01), nodes
        n = 8 * nodes
        exact = (n - 1) / (n - 8) * nic
        assert bus((8, nodes, 1)) == pytest.approx(exact, rel=0.01), nodes
        assert bus((8, nodes, 1)) == pytest.approx(nodes / (nodes - 1) * nic, rel=0.07), nodes


def test_all_to_all_over_rail_and_spine_crosses_the_nic_once() -> None:
    """One GPU in each of eight nodes over two rail groups of four (shape 1 x 4 x 2): NCCL sends
    to all seven peers at once, and the 7/8 of the buffer that leaves the GPU crosses its one
    NIC once (rail and spine peers alike), in one step of latency: not a rail all-to-all of the
    whole buffer followed by a spine one (3/4 + 1/2 of it, two latencies)."""
    h100 = load_system("h100-80g")
    size = 2**30
    shape = (1, 4, 2)
    expected = 9.6e-6 + 7 / 8 * size / (45 * GB)
    assert collective_time(CollectiveType.ALL_TO_ALL, size, shape, h100) == pytest.approx(expected)
    phases = costs.collective_phases(CollectiveType.ALL_TO_ALL, size, shape, h100)
    assert [port for port, _, _ in phases] == ["nic"]
    assert phases[0][1:] == pytest.approx((9.6e-6, 7 / 8 * size / (45 * GB)))
    # eight GPUs of each of those nodes: the same bytes leave through each GPU's NIC
    wide = collective_time(CollectiveType.ALL_TO_ALL, size, (8, 4, 2), h100)
    assert wide == pytest.approx(9.6e-6 + 56 / 64 * size / (45 * GB))


def test_all_to_all_with_fewer_nics_than_gpus() -> None:
    """NVIDIA/nccl issue #1138 (tests/data/nccl/published.jsonl): 2 nodes of 8 A100s with four
    200 Gb/s NICs per node, NCCL 2.18.6, a 4 GiB all-to-all at 19.83 GB/s of bus bandwidth. No
    preset has half a NIC per GPU: the a100-80g NVLink with a network of 12.5 GB/s per GPU (a
    node's 100 GB/s over its 8 GPUs) at the presets' 0.9 efficiency predicts it within 10 %."""
    row = next(
        json.loads(line)
        for line in (DATA / "published.jsonl").read_text().splitlines()
        if "nccl/issues/1138" in line
    )
    nvlink, rail, spine = levels("a100-80g")
    per_gpu = 4 * 25 * GB / 8
    network = replace(rail, bandwidth=per_gpu * 0.9, line_bandwidth=per_gpu)
    shape = (8, 2, 1)
    seconds = comm_time.collective_time(
        Kind.ALL_TO_ALL, row["size_bytes"], shape, (nvlink, network, spine)
    )
    assert seconds * 1e6 == pytest.approx(row["time_us"], rel=0.10)


def test_spanning_phases_add_up_to_the_collective_on_its_bottleneck_port() -> None:
    h100 = load_system("h100-80g")
    for kind in (CollectiveType.ALL_REDUCE, CollectiveType.REDUCE_SCATTER):
        for size in (2**16, 2**24, 2**32):
            phases = costs.collective_phases(kind, size, (8, 2, 1), h100)
            assert len(phases) == 1
            port, latency, transfer = phases[0]
            assert port in ("nvlink", "nic")
            total = collective_time(kind, size, (8, 2, 1), h100)
            assert latency + transfer == pytest.approx(total)


def test_dimensions_without_nccl_links_or_with_measured_curves_run_one_by_one() -> None:
    """Plain alpha-beta dimensions and dimensions with a measured curve keep the
    hierarchical decomposition (a curve measures its own dimension only)."""
    plain = (Level(bandwidth=100 * GB, latency=2e-6), Level(bandwidth=10 * GB, latency=5e-6))
    assert comm_time.spanning_candidates(Kind.ALL_REDUCE, 2**30, (4, 2), plain) == []
    curve = MeasuredCurve("all_reduce", 8, (2**20, 2**30), (1e-4, 5e-3))
    nvlink, rail, spine = levels("h100-80g")
    measured = (replace(nvlink, measured=(curve,)), rail, spine)
    assert comm_time.spanning_candidates(Kind.ALL_REDUCE, 2**30, (8, 2, 1), measured) == []
    assert comm_time.collective_time(Kind.ALL_REDUCE, 2**30, (8, 2, 1), measured) == (
        pytest.approx(5e-3 + comm_time.level_time(Kind.ALL_REDUCE, 2**27, 2, rail))
    )


# Published nccl-tests bus bandwidths (GB/s) for 8 GPUs of one node, large buffers.
PUBLISHED = [
    # (system, collective, size, published busBW, tolerance, source)
    ("a100-80g", Kind.ALL_REDUCE, 2**30, 208.0, 0.10, "nccl-tests #178 (8x A100 SXM, NVLink)"),
    ("a100-80g", Kind.ALL_REDUCE, 2**30, 235.0, 0.10, "NCCL tuning model cap for sm80"),
    ("h100-80g", Kind.ALL_GATHER, 8 * 2**30, 370.0, 0.05, "nccl-tests #212 (ring, NCCL maint.)"),
    ("h100-80g", Kind.ALL_GATHER, 16 * 2**30, 360.0, 0.05, "nccl-tests #326 (NCCL maint.)"),
    ("h100-80g", Kind.REDUCE_SCATTER, 8 * 2**30, 370.0, 0.05, "nccl-tests #212 (non-all-reduce)"),
    ("h100-80g", Kind.ALL_TO_ALL, 8 * 2**30, 370.0, 0.05, "nccl-tests #212 (non-all-reduce)"),
    ("h100-80g", Kind.ALL_REDUCE, 8 * 2**30, 480.0, 0.05, "nccl-tests #212 (NVLS, NCCL maint.)"),
    ("h800-80g", Kind.ALL_REDUCE, 8 * 2**30, 215.0, 0.05, "nccl #1374 (8x H800, NVLS)"),
]


def test_bus_bandwidth_matches_published_nccl_tests(report_table: Callable) -> None:
    lines = [
        f"{'system':<10} {'collective':<15} {'size':>8} {'published':>9} {'model':>7} "
        f"{'error':>7}  source"
    ]
    failures = []
    for name, kind, size, published, tol, source in PUBLISHED:
        nvlink = levels(name)[0]
        t = comm_time.level_time(kind, size, 8, nvlink)
        bus = comm_time.bus_factor(kind, 8) * size / t / GB
        error = bus / published - 1
        lines.append(
            f"{name:<10} {kind.value:<15} {size / 2**30:>6g}G {published:>9.0f} "
            f"{bus:>7.1f} {100 * error:>+6.1f}%  {source}"
        )
        if abs(error) > tol:
            failures.append((name, kind, error))
    report_table("communication sub-model vs published nccl-tests bus bandwidth", lines)
    assert not failures


def test_alpha_beta_link_without_nccl_protocols() -> None:
    plain = Level(bandwidth=10 * GB, latency=2e-6)
    n, size = 4, 2**20
    assert comm_time.level_time(Kind.ALL_REDUCE, size, n, plain) == pytest.approx(
        min(
            2 * (3 / 4 * size / (10 * GB) + 3 * 2e-6),
            2 * size / (10 * GB) + 2 * math.ceil(math.log2(n)) * 2e-6,
        )
    )
    assert comm_time.send_time(size, plain) == pytest.approx(size / (10 * GB) + 2e-6)


def test_nvls_only_where_nccl_would_run_it() -> None:
    """NCCL enables NVLink SHARP for more than two GPUs of a node (nvls.cc) and, in 2.18, for
    all-reduce only; its tuner then weighs NVLS (23 us, one channel per GPU at the fastest
    Hopper speed that fits) against the ring."""
    nvlink = levels("h100-80g")[0]
    # the tuner's NVLS bandwidth: 8 channels x 40 GB/s (8 x 60 exceeds 8/7 x 18 x 20 GB/s)
    assert comm_time.nccl_nvls_rate(8, nvlink) == pytest.approx(8 * 40e9 * 5 / 6)
    assert comm_time.nccl_nvls_rate(4, nvlink) == pytest.approx(4 * 60e9 * 5 / 6)
    size = 64 * 2**20
    algorithms = {
        n: comm_time.choose(Kind.ALL_REDUCE, size, n, nvlink).algorithm for n in (2, 4, 8)
    }
    assert algorithms == {2: Algorithm.RING, 4: Algorithm.RING, 8: Algorithm.NVLS}
    # two GPUs never get an NVLS candidate, whatever the size
    for n, s in itertools.product((2,), (2**10, 2**20, 2**30)):
        kinds = {c.algorithm for c in comm_time.candidates(Kind.ALL_REDUCE, s, n, nvlink)}
        assert Algorithm.NVLS not in kinds
    # four GPUs: NVLS's shorter latency wins the small buffers only
    assert comm_time.choose(Kind.ALL_REDUCE, 2**20, 4, nvlink).algorithm is not Algorithm.NVLS
    assert comm_time.choose(Kind.ALL_REDUCE, 2**16, 4, nvlink).algorithm in (
        Algorithm.NVLS,
        Algorithm.RING,
    )
    # no NVLS for reduce-scatter or all-gather, none on the A100's NVSwitch
    for kind in (Kind.REDUCE_SCATTER, Kind.ALL_GATHER):
        assert comm_time.choose(kind, size, 8, nvlink).algorithm is Algorithm.RING
    a100 = levels("a100-80g")[0]
    assert all(
        c.algorithm is not Algorithm.NVLS
        for c in comm_time.candidates(Kind.ALL_REDUCE, size, 8, a100)
    )


@pytest.mark.parametrize("name", ["a100-80g", "h100-80g"])
def test_smaller_rings_run_further_up_the_ramp(name: str) -> None:
    """A ring cuts the buffer into one chunk per rank and moves one chunk per step, so at a
    given buffer a smaller ring fills its pipeline with larger chunks: its bytes reach a larger
    fraction of the link's rate. On the H100 eight GPUs switch to NVLS, whose bus bandwidth
    tops both smaller rings once the buffer is large (nccl-tests: ~470 GB/s against ~360)."""
    nvlink = levels(name)[0]
    for size in (2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20):
        rates = []
        for n in (2, 4, 8):
            ring = next(
                c
                for c in comm_time.candidates(Kind.ALL_REDUCE, size, n, nvlink)
                if (c.algorithm, c.protocol) == (Algorithm.RING, SIMPLE)
            )
            assert ring.share == size / n
            rates.append(ring.moved / ring.transfer(comm_time.ramp(ring, nvlink)))
        assert rates[0] > rates[1] > rates[2], (size, rates)
    if name == "h100-80g":
        for size in (2**28, 2**30):
            bus = [comm_time.bus_bandwidth(Kind.ALL_REDUCE, size, n, nvlink) for n in (2, 4, 8)]
            assert bus[2] > 1.15 * max(bus[:2]), (size, bus)


def test_all_to_all_is_concurrent_sends() -> None:
    """NCCL's all-to-all is one group of sends and receives to every peer: one step of
    latency, (n-1)/n of the buffer leaves each GPU."""
    nvlink = levels("h100-80g")[0]
    n = 8
    for size in (2**20, 2**30):
        # point to point: no ring of dependent steps, so no ramp
        moved = 7 / 8 * size
        assert comm_time.level_parts(Kind.ALL_TO_ALL, size, n, nvlink) == pytest.approx(
            (3.4e-6, moved / (450 * GB * 0.82))
        )


def test_a_send_has_no_collective_base_latency() -> None:
    """A send is one step of the link (NCCL's tuner gives point-to-point no ``baseLat``): on
    NVLink 3.4 us, where the ring collective's 8.4 us base used to be added; its bytes at the
    link's bandwidth."""
    nvlink = levels("a100-80g")[0]
    for size in (2**20, 16 * 2**20):
        assert comm_time.send_parts(size, nvlink) == pytest.approx(
            (3.4e-6, size / (300 * GB * 0.75))
        )


def test_a_measured_curve_replaces_the_model() -> None:
    curve = MeasuredCurve("all_reduce", 4, (2**20, 2**24), (40e-6, 200e-6))
    base = levels("h100-80g")[0]
    nvlink = Level(
        base.bandwidth,
        base.latency,
        base.link,
        base.sharp_efficiency,
        base.line_bandwidth,
        measured=(curve,),
    )
    # at and between the measured sizes (log-log), below them the floor, above their rate
    assert comm_time.level_time(Kind.ALL_REDUCE, 2**20, 4, nvlink) == pytest.approx(40e-6)
    middle = comm_time.level_time(Kind.ALL_REDUCE, 2**22, 4, nvlink)
    assert middle == pytest.approx(math.sqrt(40e-6 * 200e-6))
    assert comm_time.level_time(Kind.ALL_REDUCE, 2**10, 4, nvlink) == pytest.approx(40e-6)
    assert comm_time.level_time(Kind.ALL_REDUCE, 2**26, 4, nvlink) == pytest.approx(800e-6)
    assert comm_time.level_parts(Kind.ALL_REDUCE, 2**22, 4, nvlink) == pytest.approx(
        (40e-6, middle - 40e-6)
    )
    # other group sizes and collectives keep the model
    for kind, n in ((Kind.ALL_REDUCE, 8), (Kind.ALL_GATHER, 4)):
        assert comm_time.level_time(kind, 2**22, n, nvlink) == comm_time.level_time(
            kind, 2**22, n, base
        )
    sends = MeasuredCurve("send_recv", 2, (2**20,), (10e-6,))
    linked = Level(base.bandwidth, base.latency, base.link, measured=(sends,))
    assert comm_time.send_time(2**21, linked) == pytest.approx(20e-6)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"collective": "gather", "ranks": 2, "sizes": [1], "seconds": [1.0]}, "not known"),
        ({"collective": "all_reduce", "ranks": 1, "sizes": [1], "seconds": [1.0]}, "at least 2"),
        ({"collective": "all_reduce", "ranks": 2, "sizes": [2, 1], "seconds": [1, 2]}, "increase"),
        ({"collective": "all_reduce", "ranks": 2, "sizes": [1], "seconds": [0]}, "> 0"),
        ({"collective": "all_reduce", "ranks": 2, "sizes": [1]}, "missing key 'seconds'"),
        ({"collective": "all_reduce", "ranks": 2, "sizes": [1], "seconds": [1], "x": 1}, "'x'"),
    ],
)
def test_measured_curve_json_mistakes(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MeasuredCurve.from_dict(raw)
    good = {"collective": "all_reduce", "ranks": 2, "sizes": [1, 2], "seconds": [1.0, 2.0]}
    assert MeasuredCurve.from_dict(good).as_dict() == good


# NVIDIA/nccl issue #1455 (description): 8x H100 SXM, all_reduce_perf -b 2G -e 4G -g <n>: the
# ring "about 365-370 GBps when gpus from 2 to 8"; NVLS like the ring for 2 to 4 GPUs, then
# "420, 440, 460, and 480 GBps when gpus increase from 4 to 5, 6, 7, and 8".
H100_GROUP_SIZES = [
    (2, Algorithm.RING, 367.5),
    (3, Algorithm.RING, 367.5),
    (4, Algorithm.RING, 367.5),
    (5, Algorithm.NVLS, 420.0),
    (6, Algorithm.NVLS, 440.0),
    (7, Algorithm.NVLS, 460.0),
    (8, Algorithm.NVLS, 480.0),
]


@pytest.mark.parametrize(("n", "algorithm", "published"), H100_GROUP_SIZES)
def test_h100_bus_bandwidth_by_group_size(n: int, algorithm: Algorithm, published: float) -> None:
    """NCCL's own choice on 2 to 8 GPUs of one H100 node at 2-4 GiB (the ring up to four GPUs,
    NVLS from five) and its bus bandwidth, within 4 % of nccl issue #1455's figures."""
    nvlink = levels("h100-80g")[0]
    for size in (2 * 2**30, 4 * 2**30):
        assert comm_time.choose(Kind.ALL_REDUCE, size, n, nvlink).algorithm is algorithm
        bus = comm_time.bus_bandwidth(Kind.ALL_REDUCE, size, n, nvlink) / GB
        assert bus == pytest.approx(published, rel=0.04), (n, size, bus)
