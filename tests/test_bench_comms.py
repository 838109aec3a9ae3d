"""``stg bench comms``: collectives over 2 gloo processes on loopback, nccl-tests' table, and
the fitted network section that a --system file takes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.bench.comms import (
    CommsOptions,
    CommsResult,
    Row,
    bus_factor,
    fit_network,
    size_sweep,
)
from stg.cli import app
from stg.core.quantities import parse_size
from stg.errors import UserError
from stg.perf.system import PRESETS, load_system, system_from_dict


def test_two_gloo_processes_on_loopback(tmp_path: Path) -> None:
    out = tmp_path / "net.json"
    plot = tmp_path / "busbw.png"
    args = ["bench", "comms", "-n", "2", "-b", "4KiB", "-e", "1MiB", "-f", "16", "-w", "1",
            "-i", "3", "--timeout", "120", "-o", str(out), "--plot", str(plot)]  # fmt: skip
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    rows = data["rows"]
    names = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
    assert [(r["collective"], r["size"]) for r in rows] == [
        (c, s) for c in names for s in (4096, 65536, 1048576)
    ]
    for r in rows:
        assert r["time_min"] <= r["time"] <= r["time_max"]
        assert r["algbw"] == pytest.approx(r["size"] / r["time"])
        assert r["busbw"] == pytest.approx(r["algbw"] * bus_factor(r["collective"], 2))
        assert r["count"] * 4 == r["size"]
    # the network section goes into a system file as it is
    (dim,) = data["network"]
    assert dim["size"] == 2 and dim["bandwidth_gbps"] > 0 and dim["latency_us"] >= 0
    system = dict(PRESETS["a100-80g"], network=data["network"])
    assert system_from_dict(system).network[0].bandwidth == pytest.approx(
        dim["bandwidth_gbps"] * 1e9
    )
    assert set(data["fits"]) == {*names, "joint"}
    for name in names:
        assert f"{name} " in result.stdout
    assert "busBW (GB/s)" in result.stdout
    assert plot.read_bytes()[:4] == b"\x89PNG"
    # the closing line wraps at the console's width (rich), so compare its words
    assert result.stderr.split() == f"network section written to {out}, plot in {plot}".split()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busbw.png", "net.json"]


def test_a_whole_system_file(tmp_path: Path) -> None:
    out = tmp_path / "mine.json"
    # five sizes up to 16 MiB: a bandwidth shows through a loaded machine's noise (three
    # sizes up to 4 MiB once fitted none on a busy 2-core machine)
    args = ["bench", "comms", "-c", "all_reduce", "-b", "64KiB", "-e", "16MiB", "-f", "4",
            "-w", "1", "-i", "5", "--system", "h100-80g", "-o", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    mine = load_system(str(out))
    base = load_system("h100-80g")
    assert mine.network[0].size == base.network[0].size
    assert mine.network[0].efficiency == 1.0
    # the measured all-reduce curve rides along and replaces the fit for its group size
    (curve,) = mine.network[0].measured
    assert (curve.collective, curve.ranks) == ("all_reduce", 2)
    assert curve.sizes == (2**16, 2**18, 2**20, 2**22, 2**24)
    assert all(t > 0 for t in curve.seconds)
    assert mine.network[1:] == base.network[1:]
    assert mine.peak_flops == base.peak_flops


def test_fit_recovers_latency_and_bandwidth() -> None:
    """Rows made by stg's own collective model with 3 µs steps over 50 GB/s are fitted back
    exactly, per collective and jointly."""
    n, latency, bandwidth = 4, 3e-6, 50e9
    rows = []
    for collective, steps in (("all_reduce", 2 * (n - 1)), ("all_gather", n - 1), ("send_recv", 1)):
        for size in (1 << 10, 1 << 16, 1 << 22):
            t = steps * latency + bus_factor(collective, n) * size / bandwidth
            rows.append(Row(collective, size, size // 4, t, t, t, size / t, 0.0))
    result = CommsResult(rows, CommsOptions(nprocs=n, collectives=("all_reduce", "all_gather",
                                                                    "send_recv")))  # fmt: skip
    fit_network(result)
    for fit in result.fits.values():
        assert fit["latency_us"] == pytest.approx(3.0, rel=1e-6)
        assert fit["bandwidth_gbps"] == pytest.approx(50.0, rel=1e-6)
    assert result.network == {
        "name": "local-gloo",
        "size": 4,
        "bandwidth_gbps": pytest.approx(50.0),
        "latency_us": pytest.approx(3.0),
        "efficiency": 1.0,
    }


def test_sizes_and_factors() -> None:
    assert size_sweep(1024, 65536, 4) == [1024, 4096, 16384, 65536]
    assert parse_size("1KiB", "--begin-size", whole=True) == 1024
    assert parse_size("1e6", "-b", whole=True) == 1_000_000
    assert parse_size("4 MB", "-b", whole=True) == 4_000_000
    assert [bus_factor(c, 8) for c in ("all_reduce", "all_gather", "send_recv")] == [
        1.75,
        0.875,
        1.0,
    ]
    with pytest.raises(UserError, match=r"^-b 'lots' is not a size; give e\.g\. 1KiB"):
        parse_size("lots", "-b", whole=True)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "1"], "--nprocs 1: collectives need at least 2 processes"),
        (["-c", "all_reduce,broadcast"],
         "--collectives: 'broadcast' is not known; allowed: all_reduce, all_gather, "
         "reduce_scatter, all_to_all, send_recv"),
        (["--backend", "nccl"], "--backend nccl needs --device cuda"),
        (["-b", "1MiB", "-e", "1KiB"], "--end-size 1024 is smaller than --begin-size 1048576"),
        (["--system", "nope-80g"], None),
    ],
)  # fmt: skip
def test_bad_options_are_one_line(tmp_path: Path, args: list[str], message: str | None) -> None:
    out = tmp_path / "net.json"
    result = CliRunner().invoke(app, ["bench", "comms", *args, "-o", str(out)])
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    if message is not None:
        assert lines[0] == f"error: {message}"
    assert not out.exists()
