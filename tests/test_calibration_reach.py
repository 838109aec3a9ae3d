"""``--calibration`` beyond ``stg predict``: ``generate --predict``, ``plan precision``,
``search`` (its refined plans) and ``sweep`` price kernels with a measured table first.

The tables are made up so that their effect cannot be missed: a slow bf16 GEMM model (1 ms
per GEMM at least), and a fast fp8 one that makes lowering GEMMs to fp8 pay on a system whose
registered kernels do not run fp8 (the a100-80g).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.perf.calibration import load_calibration


def _model(dtype: str, latency_us: float, tflops: float) -> dict[str, Any]:
    return {"op_class": "gemm", "dtype": dtype, "pass": "forward", "latency_us": latency_us,
            "tflops": tflops, "gbps": None, "flops_range": [0, 1e30], "samples": 3,
            "median_rel_error": 0.0}  # fmt: skip


def _table(path: Path, *models: dict[str, Any]) -> str:
    path.write_text(json.dumps({"format": "stg-calibration", "version": 1, "device": "test",
                                "sources": [], "entries": [], "models": list(models)}))  # fmt: skip
    return str(path)


SMALL = ["--num_stacks", "1", "--dmodel", "64", "--dff", "256", "--head", "4", "--kvhead", "4",
         "--seq", "32", "--dvocal", "128", "--batch", "8"]  # fmt: skip


def _run(args: list[str]) -> Any:
    return CliRunner().invoke(app, args, env={"COLUMNS": "240"})


def _json(args: list[str]) -> Any:
    result = _run(args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture
def slow(tmp_path: Path) -> str:
    return _table(tmp_path / "slow.json", _model("bf16", 1000.0, 1.0))


def test_generate_predict_takes_the_calibration(tmp_path: Path, slow: str) -> None:
    def time(*extra: str) -> float:
        summary = _json(["generate", *SMALL, "--predict", "--json", "--output_dir",
                         str(tmp_path / "out"), *extra])  # fmt: skip
        return summary["predictions"]["time"]["iteration_time_s"]

    predicted = _json(["predict", *SMALL, "--calibration", slow, "--json"])["time"]
    assert time("--calibration", slow) == predicted["iteration_time_s"]
    assert time("--calibration", slow) > 10 * time()


def test_plan_precision_times_plans_and_lowers_to_measured_dtypes(tmp_path: Path) -> None:
    table = _table(tmp_path / "t.json", _model("bf16", 100.0, 10.0), _model("fp8", 10.0, 100.0))
    assert load_calibration(table).covers("gemm", "fp8")
    args = ["plan", "precision", "--num_stacks", "1", "--dmodel", "512", "--dff", "2048",
            "--head", "8", "--kvhead", "8", "--seq", "256", "--dvocal", "1024", "--batch", "2",
            "--system", "a100-80g", "--dtypes", "bf16,fp8", "--json", "-o"]  # fmt: skip
    plain = _json([*args, str(tmp_path / "p.json")])
    assert plain["plan"] == {"ops": {}}  # the a100's kernels run no fp8
    measured = _json([*args, str(tmp_path / "q.json"), "--calibration", table])
    assert set(measured["plan"]["ops"].values()) == {"fp8"}
    assert {"fc1", "fc2", "q", "k", "v"} <= set(measured["plan"]["ops"])
    assert measured["best"]["iteration_time_s"] < measured["baseline"]["iteration_time_s"] / 2
    baseline = _json(["predict", "--num_stacks", "1", "--dmodel", "512", "--dff", "2048",
                      "--head", "8", "--kvhead", "8", "--seq", "256", "--dvocal", "1024",
                      "--batch", "2", "--system", "a100-80g", "--calibration", table,
                      "--predictor", "time", "--json"])["time"]  # fmt: skip
    assert measured["baseline"]["iteration_time_s"] == pytest.approx(baseline["iteration_time_s"])


def test_search_refines_with_the_calibration(slow: str) -> None:
    args = ["search", *SMALL, "--num_stacks", "2", "--gpus", "4", "--system", "a100-80g",
            "--top", "2", "--refine", "2", "-j", "1", "--json"]  # fmt: skip
    plain, measured = _json(args), _json([*args, "--calibration", slow])
    assert measured["refined"] == 2
    assert [b["plan"] for b in measured["best"]] == [b["plan"] for b in plain["best"]]
    for before, after in zip(plain["best"], measured["best"], strict=True):
        assert after["analytical"] == before["analytical"]  # the closed form takes none
        assert after["time"]["iteration_time_s"] > 10 * before["time"]["iteration_time_s"]
    nothing = _run([*args, "--refine", "0", "--calibration", slow])
    assert nothing.exit_code == 2
    assert nothing.stderr == (
        "error: --calibration prices the refined plans; give --refine 1 or more\n"
    )


def test_sweep_takes_the_calibration(tmp_path: Path, slow: str) -> None:
    args = ["sweep", *SMALL, "--dp", "1,2", "--predictor", "time", "-j", "1", "--json"]
    plain = _json([*args, "-o", str(tmp_path / "a")])
    measured = _json([*args, "-o", str(tmp_path / "b"), "--calibration", slow])
    assert measured["best"]["iteration_time_s"] > 10 * plain["best"]["iteration_time_s"]
    rows = [json.loads(x) for x in (tmp_path / "b" / "rows.jsonl").read_text().splitlines()]
    assert all(r["explain: compute: gemm"] > 0.01 for r in rows)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--predictor", "analytical"], "error: --calibration: predictor 'analytical' does not "
         "take a calibration table; allowed: --predictor time\n"),
        (["--predictor", "time", "--system", "a100-80g,h100-80g"], "error: --calibration holds "
         "one device's measured kernels; the sweep has 2 systems: sweep one --system with it\n"),
    ],
)  # fmt: skip
def test_sweep_refuses_a_calibration_it_cannot_use(
    tmp_path: Path, slow: str, extra: list[str], message: str
) -> None:
    out = tmp_path / "o"
    result = _run(["sweep", *SMALL, "--dp", "1,2", "-j", "1", "-o", str(out),
                   "--calibration", slow, *extra])  # fmt: skip
    assert result.exit_code == 2
    assert result.stderr == message
    assert not out.exists()
