"""The communication sub-model (stg.perf.comm_time) against its closed forms and against
published nccl-tests measurements on the preset systems."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from stg.core.workload import CollectiveType
from stg.perf import comm_time
from stg.perf.comm_time import LL, LL128, SIMPLE, Kind, Level
from stg.perf.system import load_system
from stg.predictors.time import collective_time, group_shape

GB = 1e9
DATA = Path(__file__).parent / "data" / "nccl"


def levels(name: str) -> tuple[Level, ...]:
    return tuple(Level.of(d) for d in load_system(name).network)


def test_simple_ring_closed_form_for_large_buffers() -> None:
    nvlink = levels("a100-80g")[0]
    size, n = 2**30, 8
    b, a = 300 * GB * 0.75 * comm_time.mid_size_efficiency(size), 3.4e-6
    ring = SIMPLE.ring_base_s + 2 * (n - 1) * a + 2 * (n - 1) / n * size / b
    assert comm_time.level_time(Kind.ALL_REDUCE, size, n, nvlink) == pytest.approx(ring)
    rs = SIMPLE.ring_base_s + (n - 1) * a + (n - 1) / n * size / b
    assert comm_time.level_time(Kind.REDUCE_SCATTER, size, n, nvlink) == pytest.approx(rs)
    assert comm_time.level_time(Kind.ALL_GATHER, size, n, nvlink) == pytest.approx(rs)


def test_small_buffers_take_the_low_latency_protocol() -> None:
    nvlink = levels("a100-80g")[0]
    size, n = 8192, 8
    b, a = 300 * GB * 0.75 * comm_time.mid_size_efficiency(size), 3.4e-6
    ll = (
        LL.ring_base_s
        + 2 * (n - 1) * a * LL.step_ratio["nvlink"]
        + 2 * (n - 1) / n * size / (b * LL.bandwidth)
    )
    # NCCL's chain: 2(n-1) tree steps, the tree's LL bandwidth and its correction at 8 KiB
    tree_bw = b * LL.tree_bandwidth["nvlink"] * comm_time.tree_correction(LL, size)
    tree = LL.tree_base_s + 14 * a * LL.tree_step_ratio["nvlink"] + 2 * size / tree_bw
    assert comm_time.level_time(Kind.ALL_REDUCE, size, n, nvlink) == pytest.approx(min(ll, tree))
    # the bus bandwidth rises with the size and saturates at B (a latency-plus-saturation curve)
    sizes = [2**k for k in range(10, 34)]
    bus = [comm_time.bus_bandwidth(Kind.ALL_REDUCE, s, n, nvlink) for s in sizes]
    assert all(x <= y * (1 + 1e-9) for x, y in itertools.pairwise(bus))
    assert bus[-1] == pytest.approx(300 * GB * 0.75, rel=0.01)
    assert bus[0] < 0.02 * 300 * GB * 0.75
    # the middle of the curve uses LL128 (0.92 of the bandwidth, shorter steps than Simple)
    mid = 4 * 2**20
    b_mid = 300 * GB * 0.75 * comm_time.mid_size_efficiency(mid)
    ll128 = LL128.ring_base_s + 14 * a * LL128.step_ratio["nvlink"] + 1.75 * mid / (b_mid * 0.92)
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
    # reduce-scatter has no in-network path: the ring
    assert comm_time.level_time(Kind.REDUCE_SCATTER, size, n, nvlink) == pytest.approx(
        SIMPLE.ring_base_s + 7 * 3.4e-6 + 7 / 8 * size / (450 * GB * 0.82)
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
    # a whole node in a data-parallel group: NVLink first, then each GPU's NIC on 1/8
    node = group_shape(range(32), a100)
    assert node == (8, 4, 1)
    expected = comm_time.level_time(Kind.ALL_REDUCE, size, 8, Level.of(a100.network[0]))
    expected += comm_time.level_time(Kind.ALL_REDUCE, size / 8, 4, rail)
    assert collective_time(CollectiveType.ALL_REDUCE, size, node, a100) == pytest.approx(expected)


# Published nccl-tests bus bandwidths (GB/s) for 8 GPUs of one node, large buffers.
PUBLISHED = [
    # (system, collective, size, published busBW, tolerance, source)
    ("a100-80g", Kind.ALL_REDUCE, 2**30, 208.0, 0.10, "nccl-tests #178 (8x A100 SXM, NVLink)"),
    ("a100-80g", Kind.ALL_REDUCE, 2**30, 235.0, 0.10, "NCCL tuning model cap for sm80"),
    ("h100-80g", Kind.ALL_GATHER, 8 * 2**30, 370.0, 0.05, "nccl-tests #212 (ring, NCCL maint.)"),
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
