"""The communication sub-model against measured nccl-tests curves (tests/data/nccl/).

Each row of ``published.jsonl`` is one size of a published nccl-tests run, cited by its
``source``; ``tests/data/nccl/README.md`` says which runs they are. A row whose machine a
preset describes (``system``) is predicted the way the replay prices it (stg.perf.costs) and
compared with its measured time. Acceptance, per (machine, collective, GPUs): the median
signed error of the sizes above 1 MiB within 8 %; and the mean absolute error over every
compared row within 10 %. The ND H200 v5 curve is the one
:data:`stg.perf.comm_time.MID_SIZE_EFFICIENCY` was measured from, so it is shown but not
counted."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from stg.core.workload import CollectiveType
from stg.perf import costs
from stg.perf.system import load_system

DATA = Path(__file__).parent / "data" / "nccl" / "published.jsonl"
MIB = 2**20
CALIBRATION = {("h200-141g", "all_reduce", 8)}
"""Groups a model constant was measured from: reported, not counted."""
KNOWN_GAPS = {("a100-80g", "sendrecv", 8)}
"""Groups the model does not meet yet (see test_point_to_point_bandwidth_gap)."""
MEDIAN_TOLERANCE = 0.08
MEAN_TOLERANCE = 0.10


@dataclass(frozen=True)
class Point:
    group: tuple[str, str, int]
    size: int
    measured_us: float
    predicted_us: float

    @property
    def error(self) -> float:
        return self.predicted_us / self.measured_us - 1


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
    if kind is CollectiveType.ALL_GATHER:
        size //= row["n_gpus"]  # the Chakra convention: this rank's shard
    return 1e6 * costs.collective_time(kind, size, costs.group_shape(ranks, system), system)


def points() -> list[Point]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return [
        Point(
            (row["system"], row["collective"], row["n_gpus"]),
            row["size_bytes"],
            row["time_us"],
            predicted_us(row),
        )
        for row in rows
        if row["system"] is not None
    ]


def by_group(selected: list[Point]) -> dict[tuple[str, str, int], list[Point]]:
    groups: dict[tuple[str, str, int], list[Point]] = {}
    for point in selected:
        groups.setdefault(point.group, []).append(point)
    return groups


def summary(groups: dict[tuple[str, str, int], list[Point]]) -> list[str]:
    lines = [
        f"{'system':<10} {'collective':<11} {'GPUs':>4} {'rows':>4} {'median >1MiB':>12} "
        f"{'mean |err|':>10}  role"
    ]
    for group, group_points in sorted(groups.items()):
        above = [p.error for p in group_points if p.size > MIB]
        role = (
            "calibration"
            if group in CALIBRATION
            else "known gap"
            if group in KNOWN_GAPS
            else "acceptance"
        )
        lines.append(
            f"{group[0]:<10} {group[1]:<11} {group[2]:>4} {len(group_points):>4} "
            f"{100 * statistics.median(above):>+11.1f}% "
            f"{100 * statistics.mean(abs(p.error) for p in group_points):>9.1f}%  {role}"
        )
    return lines


def test_data_rows_are_cited_and_consistent() -> None:
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    assert rows
    for row in rows:
        assert row["source"].startswith("https://github.com/"), row
        assert row["size_bytes"] > 0 and row["time_us"] > 0
        # nccl-tests' own definitions: algbw = size / time, busbw = algbw x the bus factor
        algbw = row["size_bytes"] / (row["time_us"] * 1e-6) / 1e9
        assert algbw == pytest.approx(row["algbw_gbps"], rel=0.02), row
        assert row["busbw_gbps"] >= row["algbw_gbps"] * 0.999


def test_measured_curves(report_table: Callable[[str, list[str]], None]) -> None:
    groups = by_group(points())
    lines = summary(groups)
    lines.append("")
    lines.append(
        f"{'system':<10} {'collective':<11} {'size':>7} {'measured':>10} {'model':>10} err"
    )
    for group, group_points in sorted(groups.items()):
        for p in group_points:
            lines.append(
                f"{group[0]:<10} {group[1]:<11} {p.size / MIB:>6g}M {p.measured_us:>9.1f}u "
                f"{p.predicted_us:>9.1f}u {100 * p.error:+.1f}%"
            )
    report_table("communication sub-model vs measured nccl-tests curves", lines)
    counted = {g: ps for g, ps in groups.items() if g not in CALIBRATION | KNOWN_GAPS}
    assert counted
    for group, group_points in counted.items():
        median = statistics.median(p.error for p in group_points if p.size > MIB)
        assert abs(median) <= MEDIAN_TOLERANCE, (group, median)
    every = [p for ps in counted.values() for p in ps]
    assert statistics.mean(abs(p.error) for p in every) <= MEAN_TOLERANCE


@pytest.mark.xfail(
    strict=True,
    reason="point-to-point over NVLink: nccl-tests' sendrecv reaches about 195 GB/s on 8 A100s "
    "where the send model uses the collective ring's 225 GB/s; no NCCL or data-sheet figure "
    "for the p2p path is at hand",
)
def test_point_to_point_bandwidth_gap() -> None:
    for group, group_points in by_group(points()).items():
        if group in KNOWN_GAPS:
            median = statistics.median(p.error for p in group_points if p.size > MIB)
            assert abs(median) <= MEDIAN_TOLERANCE, (group, median)
