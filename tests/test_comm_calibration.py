"""Measured collectives as a calibration: a ``stg bench comms`` result loads with
``--calibration`` and replaces the modelled curve of each collective and group size it
measured (stg.perf.calibration, stg.perf.comm_time.MeasuredCurve)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.core.workload import CollectiveType
from stg.perf import costs
from stg.perf.calibration import (
    CalibrationError,
    calibration_from_dict,
    load_calibration,
    with_measured_comms,
)
from stg.perf.comm_time import MeasuredCurve
from stg.perf.system import SystemDescriptionError, load_system, system_from_dict

MIB = 2**20


def comms_result(nprocs: int = 2, scale: float = 1.0) -> dict:
    """A ``stg bench comms`` result as the command writes it (only the fields it reads)."""
    rows = []
    for collective, per_mib in (("all_reduce", 50e-6), ("send_recv", 20e-6)):
        for size in (MIB, 4 * MIB, 16 * MIB):
            seconds = scale * (30e-6 + per_mib * size / MIB)
            rows.append({"collective": collective, "size": size, "count": size // 4,
                         "time": seconds, "time_max": seconds, "time_min": seconds,
                         "algbw": size / seconds, "busbw": size / seconds})  # fmt: skip
    return {"format": "stg-bench-comms", "network": [], "fits": {}, "device": "NVIDIA A100",
            "options": {"nprocs": nprocs, "backend": "nccl"}, "rows": rows}  # fmt: skip


def write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_a_bench_comms_result_loads_as_measured_curves(tmp_path: Path) -> None:
    table = load_calibration(write(tmp_path / "comms.json", comms_result()))
    assert table.device == "NVIDIA A100" and not table.entries
    assert [(c.collective, c.ranks, c.sizes) for c in table.comms] == [
        ("all_reduce", 2, (MIB, 4 * MIB, 16 * MIB)),
        ("send_recv", 2, (MIB, 4 * MIB, 16 * MIB)),
    ]
    system = with_measured_comms(load_system("a100-80g"), table)
    assert system.network[0].measured == tuple(table.comms)
    assert system.network[1:] == load_system("a100-80g").network[1:]
    # the measured group size takes the measurement, at and between the measured sizes
    pair = costs.group_shape([0, 1], system)
    for size in (MIB, 16 * MIB):
        assert costs.collective_time(CollectiveType.ALL_REDUCE, size, pair, system) == (
            pytest.approx(30e-6 + 50e-6 * size / MIB)
        )
    assert costs.send_time(4 * MIB, 0, system) == pytest.approx(30e-6 + 80e-6)
    # other sizes of group, other collectives and the other dimensions keep the model
    model = load_system("a100-80g")
    for kind, ranks in (
        (CollectiveType.ALL_REDUCE, range(8)),
        (CollectiveType.ALL_GATHER, [0, 1]),
        (CollectiveType.ALL_REDUCE, [0, 8]),
    ):
        shape = costs.group_shape(ranks, system)
        assert costs.collective_time(kind, MIB, shape, system) == costs.collective_time(
            kind, MIB, shape, model
        )


def test_the_table_keeps_its_curves_in_its_file() -> None:
    curve = MeasuredCurve("all_gather", 4, (MIB,), (1e-4,))
    raw = {"format": "stg-calibration", "version": 1, "entries": [],
           "comms": [curve.as_dict()]}  # fmt: skip
    table = calibration_from_dict(raw)
    assert table.comms == [curve]
    assert table.as_dict()["comms"] == [curve.as_dict()]
    # a table without curves writes no comms key (its bytes are as before)
    assert "comms" not in calibration_from_dict({**raw, "comms": []}).as_dict()


def test_a_system_file_carries_measured_curves() -> None:
    curve = MeasuredCurve("all_reduce", 8, (MIB, 2 * MIB), (1e-4, 1.5e-4))
    data = load_system("h100-80g").as_dict()
    data["network"][0]["measured"] = [curve.as_dict()]
    system = system_from_dict(data)
    assert system.network[0].measured == (curve,)
    assert system.as_dict()["network"][0]["measured"] == [curve.as_dict()]
    data["network"][0]["measured"] = [{**curve.as_dict(), "ranks": 1}]
    with pytest.raises(SystemDescriptionError, match=r"network\[0\]\.measured\[0\]: ranks"):
        system_from_dict(data)


def test_a_measurement_replaces_an_older_one_of_the_same_group(tmp_path: Path) -> None:
    first = load_calibration(write(tmp_path / "a.json", comms_result(scale=1.0)))
    second = load_calibration(write(tmp_path / "b.json", comms_result(scale=2.0)))
    system = with_measured_comms(with_measured_comms(load_system("a100-80g"), first), second)
    assert system.network[0].measured == tuple(second.comms)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"options": {"nprocs": 1}}, "options.nprocs must be"),
        ({"rows": []}, "needs its rows"),
        ({"rows": [{"collective": "gather", "size": 1, "time": 1.0}]}, "'gather' is not known"),
        ({"rows": [{"collective": "all_reduce", "size": 0, "time": 1.0}]}, "must be > 0"),
        ({"rows": [{"collective": "all_reduce", "time": 1.0}]}, "missing key 'size'"),
    ],
)
def test_a_bad_comms_result_is_one_line(tmp_path: Path, change: dict, message: str) -> None:
    with pytest.raises(CalibrationError, match=message):
        load_calibration(write(tmp_path / "bad.json", {**comms_result(), **change}))


def test_more_ranks_than_the_node_holds_are_refused(tmp_path: Path) -> None:
    table = load_calibration(write(tmp_path / "c.json", comms_result(nprocs=16)))
    with pytest.raises(CalibrationError, match=r"over 16 ranks.*holds 8"):
        with_measured_comms(load_system("a100-80g"), table)


PLAN = ["--model", "gpt", "--dmodel", "1024", "--dff", "4096", "--head", "16", "--kvhead", "16",
        "--seq", "1024", "--dvocal", "32000", "--num_stacks", "2", "--tp", "2", "--pp", "1",
        "--dp", "1", "--batch", "4", "--micro_batch", "4", "--system", "a100-80g",
        "--predictor", "time", "--json"]  # fmt: skip


def predicted_comm_seconds(args: list[str]) -> dict:
    result = CliRunner().invoke(app, ["predict", *PLAN, *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["time"]


def test_stg_predict_takes_a_bench_comms_result(tmp_path: Path) -> None:
    """The tensor-parallel all-reduces of a tp=2 plan run over two GPUs of a node: a slower
    measured all-reduce over two ranks makes the iteration slower, a faster one faster."""
    model = predicted_comm_seconds([])
    slow = predicted_comm_seconds(
        ["--calibration", str(write(tmp_path / "slow.json", comms_result(scale=20.0)))]
    )
    fast = predicted_comm_seconds(
        ["--calibration", str(write(tmp_path / "fast.json", comms_result(scale=0.05)))]
    )
    assert fast["iteration_time_s"] < model["iteration_time_s"] < slow["iteration_time_s"]


def test_stg_generate_refuses_measured_collectives_only(tmp_path: Path) -> None:
    path = write(tmp_path / "comms.json", comms_result())
    out = str(tmp_path / "out")
    args = ["generate", *PLAN[:-3], "--calibration", str(path), "--output_dir", out]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert result.stderr.strip().startswith("error: --calibration")
    assert "measured collectives only" in result.stderr
    assert not (tmp_path / "out").exists()
