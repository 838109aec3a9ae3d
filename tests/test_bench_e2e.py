"""The calibration loop on the CPU: ``stg bench model`` -> ``stg bench compute`` -> ``stg bench
calibrate`` -> ``stg predict --calibration``.

The workload is a small GPT on one rank (no communication), so its iteration time is the sum
of its compute nodes, each on the one compute stream: with the calibration table, that sum
must be exactly the measured medians of the kernels the nodes run, and so differ from the
analytical prediction for an A100 (a CPU is far slower).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch  # noqa: F401 (the bench extra: stg bench compute runs it)
from typer.testing import CliRunner

from stg.api import GenerateOptions, build_workload, load_calibration
from stg.cli import app
from stg.core.workload import NodeType
from stg.host.registry import load_registry

SMALL = {"num_stacks": 1, "dmodel": 64, "dff": 256, "head": 4, "kvhead": 4, "seq": 32,
         "dvocal": 128, "batch": 2}  # fmt: skip
ARGS = [token for k, v in SMALL.items() for token in (f"--{k}", str(v))]


def _ok(args: list[str]) -> Any:
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result


def test_model_compute_calibrate_predict(tmp_path: Path) -> None:
    config, results, table_file = tmp_path / "m.json", tmp_path / "r.jsonl", tmp_path / "c.json"
    _ok(["bench", "model", *ARGS, "-o", str(config)])
    workload = build_workload(GenerateOptions(**SMALL), load_registry(autoload=False))
    compute = [n for rc in workload.rank_classes for n in rc.nodes if n.type is NodeType.COMP]
    # exactly the workload's GEMM and attention shapes, each once
    written = json.loads(config.read_text())
    gemms = {tuple(n.attrs["gemm"]) for n in compute if "gemm" in n.attrs}
    mm = written["torch.mm"]["config"][0]["input"]
    assert len(mm) == len(gemms)
    assert {
        (1, a["shape"][0], b["shape"][1], a["shape"][1]) for a, b in (x["args"] for x in mm)
    } == gemms
    attention = {tuple(n.attrs["attention"][:6]) for n in compute if "attention" in n.attrs}
    sdpa = written["torch.nn.functional.scaled_dot_product_attention"]["config"][0]["input"]
    assert len(sdpa) == len(attention) == 1

    _ok(["bench", "compute", str(config), "-b", "-w", "1", "-i", "3", "-o", str(results)])
    _ok(["bench", "calibrate", str(results), "-o", str(table_file)])
    table = load_calibration(table_file)

    plain = json.loads(_ok(["predict", *ARGS, "--json"]).stdout)["time"]
    calibrated = json.loads(
        _ok(["predict", *ARGS, "--calibration", str(table_file), "--json"]).stdout
    )["time"]
    report = calibrated["calibration"]
    assert (report["nodes"], report["measured"], report["analytical"]) == (
        len(compute),
        len(compute),
        0,
    )
    # one rank, no communication: the iteration is its compute nodes, each a measured kernel
    measured = [table.node_time(n, "bf16") for n in compute]
    assert all(t is not None for t in measured)
    assert calibrated["iteration_time_s"] == pytest.approx(sum(measured), rel=1e-9)  # type: ignore[arg-type]
    assert calibrated["iteration_time_s"] > 3 * plain["iteration_time_s"]
    # and a GEMM node's time is its shape's measured median
    lines = [json.loads(x) for x in results.read_text().splitlines() if '"op_name"' in x]
    medians = {
        tuple(x["extra"]["gemm"]): x["extra"]["median_ms"] for x in lines if "gemm" in x["extra"]
    }
    fc1 = next(n for n in compute if n.name.endswith("/fwd/fc1"))
    assert table.node_time(fc1, "bf16") == pytest.approx(medians[tuple(fc1.attrs["gemm"])] * 1e-3)

    # the text report says what the table covered
    text = _ok(["predict", *ARGS, "--calibration", str(table_file)]).stdout
    assert text.splitlines()[-1] == (
        f"calibration {table_file} (cpu): of {len(compute)} compute nodes, {len(compute)} "
        "measured (100% of FLOPs), 0 fitted (0%), 0 analytical (0%)"
    )

    # a trace on disk carries the kernel shapes too: the same prediction from its files
    _ok(["generate", *ARGS, "--output_dir", str(tmp_path / "trace")])
    from_files = json.loads(
        _ok(["predict", str(tmp_path / "trace"), "--calibration", str(table_file), "--json"]).stdout
    )["time"]
    assert from_files["iteration_time_s"] == pytest.approx(calibrated["iteration_time_s"])


def test_a_bad_calibration_file_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "c.json"
    bad.write_text('{"format": "stg-calibration", "version": 1, "entries": 3}')
    result = CliRunner().invoke(app, ["predict", *ARGS, "--calibration", str(bad)])
    assert result.exit_code == 2
    assert result.stderr == f"error: {bad}: entries has the wrong type (int)\n"
    missing = CliRunner().invoke(app, ["predict", *ARGS, "--calibration", str(tmp_path / "no")])
    assert missing.exit_code == 2
    assert missing.stderr.startswith(f"error: cannot read calibration '{tmp_path / 'no'}': ")
