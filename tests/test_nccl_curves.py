"""The communication sub-model against measured nccl-tests curves (tests/data/nccl/).

Each row of ``published.jsonl`` is one size of a published nccl-tests run, cited by its
``source``; ``tests/data/nccl/README.md`` says which runs they are. A row whose machine a
preset describes (``system``) is predicted the way the replay prices it (stg.perf.costs) and
compared with its measured time. Acceptance, per (machine, collective, GPUs): the median
signed error of the sizes above 1 MiB within 8 %; and the mean absolute error over every
compared row within 10 %. Groups that a model constant was measured from (:data:`CALIBRATION`)
and groups the model does not meet yet (:data:`KNOWN_GAPS`, each with its reason) are
printed in the same table but not counted; nothing is left out of the table."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from stg.core.workload import CollectiveType
from stg.perf import comm_time, costs
from stg.perf.system import load_system

DATA = Path(__file__).parent / "data" / "nccl" / "published.jsonl"
MIB = 2**20
Group = tuple[str, str, int]
CALIBRATION: dict[Group, str] = {
    ("h200-141g", "all_reduce", 8): "stg.perf.comm_time.MID_SIZE_EFFICIENCY was measured on it",
}
"""Groups a model constant was measured from: reported, not counted."""
KNOWN_GAPS: dict[Group, str] = {
    ("a100-80g", "sendrecv", 8): "NCCL's point-to-point path reaches ~195 GB/s on A100 NVLink, "
    "the model the collective ring's 225 GB/s (no source for the p2p figure)",
    ("a100-40g", "all_gather", 8): "microsoft/superbenchmark's run of an older NCCL (nccl-tests "
    "without a root column): a collective of 0 bytes takes 34 us there, where NCCL's latency "
    "model gives an 8-GPU ring about 11 us; the model is 8-63 % faster up to 128 MiB and within "
    "3 % above (the same run's reduce-scatter and all-reduce groups are counted)",
    ("h100-80g", "alltoall", 4): "the same point-to-point gap: 335 GB/s of bus bandwidth where "
    "the model's sends run at the ring's 369 GB/s",
    ("h100-80g", "all_reduce", 16): "nccl-tests issue #290's cluster (its reporter suspected a "
    "degraded fabric): 155 GB/s of bus bandwidth where the model's NVLSTree over 8 NICs a node "
    "gives ~470 and the healthy 2-node run of issue #294 measured 444",
    ("h100-80g", "all_reduce/ring", 16): "the same cluster with NCCL_ALGO=RING: 90 GB/s of bus "
    "bandwidth, two NICs' worth, where a ring over 8 NICs a node runs at ~360",
    ("h100-80g", "all_reduce/ring+ll128", 1024): "1024 GPUs, NICs per node not stated: the "
    "plateau (367 GB/s of bus bandwidth) is above the preset's 8 x 45 GB/s x LL128's 0.92; "
    "the 1-2 GiB rows are latency the model does not reach (~15 ms at 1024 ranks)",
    ("h800-80g", "alltoall", 64): "NVIDIA/nccl issue #1531's 8 nodes (NICs per node and NCCL "
    "version not stated), one 8 MiB row: 128 KiB to each peer, one P2P_NET_CHUNKSIZE step per "
    "remote peer, takes 338 us where the model's 56/64 of the buffer through the GPU's NIC at "
    "45 GB/s gives 173 (with four NICs a node, as issue #1138's nodes have, 336). Not NCCL's "
    "p2p schedule: at v2.27.7-1 every peer is in flight at once (enqueue.cc "
    "scheduleP2pTasksToPlan fills one plan with every round its work budget holds; channel.h "
    "ncclP2pChannelBaseForRound gives each destination node's 8 GPUs one channel; device.h "
    "NCCL_MAX_DEV_WORK_P2P_PER_BATCH runs 8 of them at once). An NCCL maintainer on the issue "
    "(2025-03-25) put its unstable bandwidth, in-place and out-of-place disagreeing, on the "
    "fabric ('a fabric shenanigan, rather than something coming from NCCL'); this row's two "
    "columns disagree too (296 against 338 us)",
}
"""Groups the model does not meet, and why: reported, not counted."""
MEDIAN_TOLERANCE = 0.08
MEAN_TOLERANCE = 0.10
BANDS = ((0, 16 * MIB, "<=16M"), (16 * MIB, 256 * MIB, "16M-256M"), (256 * MIB, 2**62, ">256M"))
"""Size bands the table reports the median error of."""


@dataclass(frozen=True)
class Point:
    group: Group
    size: int
    measured_us: float
    predicted_us: float

    @property
    def error(self) -> float:
        return self.predicted_us / self.measured_us - 1


def rows() -> list[dict]:
    return [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]


def predicted_us(row: dict) -> float:
    """The model's time of one measured row, on the row's preset, in microseconds."""
    system = load_system(row["system"])
    ranks = range(row["n_gpus"])
    if row["collective"] == "sendrecv":
        # nccl-tests' sendrecv: every rank sends its buffer to the next one
        return 1e6 * costs.send_time(row["size_bytes"], costs.link_dimension(0, 1, system), system)
    kind = {
        "all_reduce": CollectiveType.ALL_REDUCE,
        "all_gather": CollectiveType.ALL_GATHER,
        "reduce_scatter": CollectiveType.REDUCE_SCATTER,
        "alltoall": CollectiveType.ALL_TO_ALL,
    }[row["collective"]]
    size = row["size_bytes"]
    shape = costs.group_shape(ranks, system)
    if row.get("forced_algorithm"):
        return 1e6 * forced_seconds(row, shape, system)
    if kind is CollectiveType.ALL_GATHER:
        size //= row["n_gpus"]  # the Chakra convention: this rank's shard
    return 1e6 * costs.collective_time(kind, size, shape, system)


def forced_seconds(row: dict, shape: tuple[int, ...], system) -> float:
    """A run that set ``NCCL_ALGO`` (and ``NCCL_PROTO``): the model's time of that algorithm
    (and protocol), over nodes (:func:`stg.perf.comm_time.spanning_parts`)."""
    levels = tuple(comm_time.Level.of(d) for d in system.network)
    protocol = next((p for p in comm_time.PROTOCOLS if p.name == row.get("forced_protocol")), None)
    parts = comm_time.spanning_parts(
        comm_time.Kind(row["collective"]),
        row["size_bytes"],
        shape,
        levels,
        comm_time.Algorithm(row["forced_algorithm"]),
        protocol,
    )
    assert parts is not None, row
    return parts[1] + parts[2]


def group_of(row: dict) -> Group:
    """(preset, collective, GPUs); a run that forced an algorithm is a group of its own."""
    forced = "+".join(row[key] for key in ("forced_algorithm", "forced_protocol") if row.get(key))
    collective = row["collective"] + (f"/{forced}" if forced else "")
    return (row["system"], collective, row["n_gpus"])


def points() -> list[Point]:
    return [
        Point(group_of(row), row["size_bytes"], row["time_us"], predicted_us(row))
        for row in rows()
        if row["system"] is not None
    ]


def by_group(selected: list[Point]) -> dict[Group, list[Point]]:
    groups: dict[Group, list[Point]] = {}
    for point in selected:
        groups.setdefault(point.group, []).append(point)
    return groups


def role(group: Group) -> str:
    if group in CALIBRATION:
        return "calibration"
    return "known gap" if group in KNOWN_GAPS else "acceptance"


def _median(errors: list[float]) -> str:
    return f"{100 * statistics.median(errors):+.1f}%" if errors else "-"


def summary(groups: dict[Group, list[Point]]) -> list[str]:
    bands = " ".join(f"{label:>8}" for _, _, label in BANDS)
    lines = [
        f"{'system':<10} {'collective':<21} {'GPUs':>4} {'rows':>4} {'median>1M':>9} {bands} "
        f"{'mean|err|':>9}  role"
    ]
    for group, group_points in sorted(groups.items()):
        above = [p.error for p in group_points if p.size > MIB]
        per_band = " ".join(
            f"{_median([p.error for p in group_points if lo < p.size <= hi]):>8}"
            for lo, hi, _ in BANDS
        )
        lines.append(
            f"{group[0]:<10} {group[1]:<21} {group[2]:>4} {len(group_points):>4} "
            f"{_median(above):>9} {per_band} "
            f"{100 * statistics.mean(abs(p.error) for p in group_points):>8.1f}%  {role(group)}"
        )
    for group, why in {**CALIBRATION, **KNOWN_GAPS}.items():
        lines.append(f"  {role(group)} {'/'.join(map(str, group))}: {why}")
    return lines


def test_data_rows_are_cited_and_consistent() -> None:
    assert rows()
    for row in rows():
        assert row["source"].startswith("https://github.com/"), row
        assert row["size_bytes"] > 0 and row["time_us"] > 0
        # nccl-tests' own definitions: algbw = size / time, busbw = algbw x the bus factor
        algbw = row["size_bytes"] / (row["time_us"] * 1e-6) / 1e9
        assert algbw == pytest.approx(row["algbw_gbps"], rel=0.02), row
        n = row["n_gpus"]
        factor = {"all_reduce": 2 * (n - 1) / n, "sendrecv": 1.0}.get(
            row["collective"], (n - 1) / n
        )
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factor, rel=0.02), row


def test_every_gap_and_calibration_group_has_rows() -> None:
    groups = set(by_group(points()))
    assert set(CALIBRATION) | set(KNOWN_GAPS) <= groups


def test_groups_smaller_than_a_node_are_counted() -> None:
    """The 4-GPU H100 curve (a ring's chunks are a quarter of the buffer: it ramps faster than
    eight GPUs) is an acceptance group, not a gap: it is predicted, nothing is fitted to it."""
    groups = by_group(points())
    group = ("h100-80g", "all_reduce", 4)
    assert len(groups[group]) >= 10
    assert role(group) == "acceptance"


def test_measured_curves(report_table: Callable[[str, list[str]], None]) -> None:
    everything = points()
    groups = by_group(everything)
    counted = {g: ps for g, ps in groups.items() if role(g) == "acceptance"}
    every = [p for ps in counted.values() for p in ps]
    lines = summary(groups)
    lines.append(
        f"mean |error|: {100 * statistics.mean(abs(p.error) for p in every):.1f}% over the "
        f"{len(every)} counted rows, "
        f"{100 * statistics.mean(abs(p.error) for p in everything):.1f}% over all "
        f"{len(everything)} rows"
    )
    lines.append("")
    lines.append(
        f"{'system':<10} {'collective':<21} {'GPUs':>4} {'size':>7} {'measured':>10} "
        f"{'model':>10} err"
    )
    for group, group_points in sorted(groups.items()):
        for p in group_points:
            lines.append(
                f"{group[0]:<10} {group[1]:<21} {group[2]:>4} {p.size / MIB:>6g}M "
                f"{p.measured_us:>9.1f}u {p.predicted_us:>9.1f}u {100 * p.error:+.1f}%"
            )
    report_table("communication sub-model vs measured nccl-tests curves", lines)
    assert counted
    for group, group_points in counted.items():
        median = statistics.median(p.error for p in group_points if p.size > MIB)
        assert abs(median) <= MEDIAN_TOLERANCE, (group, median)
    assert statistics.mean(abs(p.error) for p in every) <= MEAN_TOLERANCE


@pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[("a100-80g", "sendrecv", 8)])
def test_point_to_point_bandwidth_gap() -> None:
    group_points = by_group(points())[("a100-80g", "sendrecv", 8)]
    median = statistics.median(p.error for p in group_points if p.size > MIB)
    assert abs(median) <= MEDIAN_TOLERANCE, median
