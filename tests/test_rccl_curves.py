"""The communication sub-model on AMD Infinity Fabric against a published rccl-tests curve
(tests/data/rccl/mi300x_all_reduce.jsonl: 8 MI300X of one node, RCCL 2.22.3, ROCm 6.3, every
size from 8 B to 16 GiB, launched eagerly and as HIP graphs; tests/data/rccl/README.md).

Each eager row is predicted on the ``mi300x-192g`` preset the way the replay prices an
all-reduce (stg.perf.costs) and compared by size band: the tensor-parallel all-reduces of a
decode step (1 KiB-256 KiB), the middle (512 KiB-32 MiB) and the plateau (64 MiB up). Acceptance:
the median signed error of the decode band within 25 % and of the plateau within 8 % (the
plateau tolerance of tests/test_nccl_curves.py). The middle band is a known gap (strict xfail).
The graph-launched rows are printed beside the eager ones, not compared: the replay prices
an eagerly launched collective."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

from stg.core.workload import CollectiveType
from stg.perf import costs
from stg.perf.system import load_system

DATA = Path(__file__).parent / "data" / "rccl" / "mi300x_all_reduce.jsonl"
KIB, MIB = 2**10, 2**20
DECODE = (KIB, 256 * KIB)
MIDDLE = (512 * KIB, 32 * MIB)
PLATEAU = (64 * MIB, 2**62)
DECODE_TOLERANCE = 0.25
PLATEAU_TOLERANCE = 0.08
MIDDLE_GAP = (
    "NCCL's LL128 ring latencies and the NVLink ramp measured on an H200 NVLS all-reduce "
    "(stg.perf.comm_time.MID_SIZE_EFFICIENCY), applied to RCCL on xGMI, are slower than RCCL "
    "measures between 512 KiB and 32 MiB (+6 % to +86 %); RCCL's own tuning table for gfx942 is "
    "not modelled"
)


def rows() -> list[dict]:
    return [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]


def predicted_us(size: int) -> float:
    """The model's time of an 8-rank all-reduce of ``size`` bytes on the mi300x-192g preset."""
    system = load_system("mi300x-192g")
    shape = costs.group_shape(range(8), system)
    return 1e6 * costs.collective_time(CollectiveType.ALL_REDUCE, size, shape, system)


def errors_in(band: tuple[int, int]) -> list[float]:
    return [
        predicted_us(r["size_bytes"]) / r["time_us"] - 1
        for r in rows()
        if r["launch"] == "eager" and band[0] <= r["size_bytes"] <= band[1]
    ]


def test_rows_are_cited_and_consistent() -> None:
    data = rows()
    assert {r["launch"] for r in data} == {"eager", "graph"}
    for launch in ("eager", "graph"):
        sizes = [r["size_bytes"] for r in data if r["launch"] == launch]
        assert sizes == [8 * 2**i for i in range(32)], launch  # -b 8 -e 16G -f 2
    for row in data:
        assert row["source"].startswith("https://github.com/ROCm/rocm-blogs/blob/"), row
        assert row["system"] == "mi300x-192g" and row["n_gpus"] == 8 and row["time_us"] > 0
        # rccl-tests' definitions: algbw = size / time, busbw = algbw x 2(n-1)/n
        algbw = row["size_bytes"] / (row["time_us"] * 1e-6) / 1e9
        assert algbw == pytest.approx(row["algbw_gbps"], rel=0.02, abs=1e-3), row
        assert row["busbw_gbps"] == pytest.approx(algbw * 2 * 7 / 8, rel=0.02, abs=1e-3), row


def test_all_reduce_on_xgmi(report_table: Callable[[str, list[str]], None]) -> None:
    graph = {r["size_bytes"]: r["time_us"] for r in rows() if r["launch"] == "graph"}
    lines = [f"{'size B':>12} {'eager us':>9} {'graph us':>9} {'model us':>9} {'vs eager':>8}"]
    for row in rows():
        if row["launch"] != "eager":
            continue
        size, measured = row["size_bytes"], row["time_us"]
        model = predicted_us(size)
        lines.append(
            f"{size:>12} {measured:>9.2f} {graph[size]:>9.2f} {model:>9.2f} "
            f"{100 * (model / measured - 1):>+7.1f}%"
        )
    for label, band in (("decode", DECODE), ("middle", MIDDLE), ("plateau", PLATEAU)):
        median = statistics.median(errors_in(band))
        lines.append(f"median error, {label} band: {100 * median:+.1f}%")
    lines.append(f"known gap, middle band: {MIDDLE_GAP}")
    report_table("all-reduce of 8 MI300X: model vs rccl-tests (tests/data/rccl)", lines)
    assert abs(statistics.median(errors_in(DECODE))) <= DECODE_TOLERANCE
    assert abs(statistics.median(errors_in(PLATEAU))) <= PLATEAU_TOLERANCE


@pytest.mark.xfail(strict=True, reason=MIDDLE_GAP)
def test_middle_band_gap() -> None:
    assert abs(statistics.median(errors_in(MIDDLE))) <= PLATEAU_TOLERANCE
