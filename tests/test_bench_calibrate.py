"""``stg bench calibrate`` and the calibration table (stg.perf.calibration); no torch needed.

Calibrated from PARAM's own result files and from the H100 kernel measurements (both in
../shared/data), the table must return the measured medians for measured shapes, interpolate
between measured work only, and refuse what it does not cover.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from stg.api import Calibration, calibrated_time, load_calibration
from stg.bench.calibrate import calibrate
from stg.bench.results import read_results
from stg.cli import app
from stg.perf.calibration import (
    CalibrationError,
    calibration_from_dict,
    coverage,
    fit_model,
    fit_relative,
    node_kernel,
)

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
PARAM = SHARED / "param"
KERNELS = SHARED / "kernels"


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def h100() -> Calibration:
    files = [
        read_results(KERNELS / f"h100-{n}.jsonl") for n in ("gemm", "attention", "elementwise")
    ]
    table, report = calibrate(files)
    assert report.used == report.cases == 2305 + 172 + 163
    return table


def test_calibrate_param_files_on_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "cal.json"
    files = sorted(str(p) for p in PARAM.glob("*.jsonl"))
    # wide enough that the closing line (with its long path) is not wrapped
    args = ["bench", "calibrate", *files, "-o", str(out)]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == (
        f"warning: {PARAM / 'h100-param_aten_ops.jsonl'} is incomplete (no finish line: the "
        "run stopped early); using its 4 cases"
    )
    assert result.stderr.splitlines()[-1] == (
        f"{len(load_calibration(out).entries)} kernels and 3 fitted models of NVIDIA H100 80GB "
        f"HBM3 written to {out} (from 113 of 114 cases; skipped: 1 op class other)"
    )
    table = load_calibration(out)
    # a llama2 GEMM measured by PARAM: the fastest median of its shape
    llama = [c for c in _lines(PARAM / "h100-param_llama2.jsonl") if "op_name" in c]
    first = llama[0]
    (m, k), (_, n) = (a["shape"] for a in first["config"]["input"]["args"])
    fastest = min(
        statistics.median(c["metric"]["forward"]["measure.time"])
        for c in llama
        if [a["shape"] for a in c["config"]["input"]["args"]] == [[m, k], [k, n]]
    )
    got = calibrated_time(table, "bf16", gemm=(1, m, n, k))
    assert got == pytest.approx(fastest * 1e-3)
    assert "gemm" in result.stdout and "fp32" in result.stdout  # mm_range ran in float


def test_measured_shapes_return_their_medians(h100: Calibration) -> None:
    reference = next(
        c
        for c in _lines(KERNELS / "h100-gemm.jsonl")
        if c.get("extra", {}).get("family") == "reference"
    )
    seconds = calibrated_time(h100, "bf16", gemm=(1, 8192, 8192, 8192))
    assert seconds == pytest.approx(reference["extra"]["median_ms"] * 1e-3)
    # attention: the fastest backend's median, forward and backward
    cases = [c for c in _lines(KERNELS / "h100-attention.jsonl") if "extra" in c]
    key = ("b", "heads", "seq", "head_dim", "causal")
    same = [c for c in cases if tuple(c["extra"][k] for k in key) == (4, 16, 4096, 128, False)]
    assert len(same) >= 2
    forward = calibrated_time(h100, "bf16", attention=(4, 16, 4096, 4096, 128, 0))
    backward = calibrated_time(h100, "bf16", attention=(4, 16, 4096, 4096, 128, 0, 1))
    assert forward == pytest.approx(min(c["extra"]["median_fwd_ms"] for c in same) * 1e-3)
    assert backward is not None and backward > forward


def test_fitted_models_interpolate_and_never_extrapolate(h100: Calibration) -> None:
    gemm = h100.models[("gemm", "bf16", "forward")]
    assert 500 < gemm.as_dict()["tflops"] < 900  # the data's bf16 GEMMs: 471-752 TFLOP/s
    # an unmeasured shape inside the measured range: the model's time
    shape = (1, 3000, 5000, 7000)
    fitted = calibrated_time(h100, "bf16", gemm=shape)
    assert fitted == pytest.approx(gemm.predict(2 * 3000 * 5000 * 7000, 0))
    assert fitted == pytest.approx(2 * 3000 * 5000 * 7000 / 690e12 + 10e-6, rel=0.1)
    # outside the measured FLOPs: no answer (the analytical model prices it)
    assert calibrated_time(h100, "bf16", gemm=(64, 65536, 65536, 65536)) is None
    # a dtype never measured
    assert calibrated_time(h100, "int8", gemm=shape) is None
    stream = h100.models[("stream", "bf16", "forward")]
    assert 2500 < stream.as_dict()["gbps"] < 3500  # add/mul/gelu/copy: up to 3.0 TB/s
    assert calibrated_time(h100, "bf16", op_class="stream", nbytes=10**8) == pytest.approx(
        stream.predict(0, 10**8)
    )


def test_fit_recovers_a_known_model() -> None:
    """Exact data of t = 5 µs + F / 100 TFLOP/s + B / 1 TB/s is fitted exactly, and a model
    that would need a negative rate drops that term instead."""
    samples = [(f, b, 5e-6 + f / 1e14 + b / 1e12) for f, b in
               [(1e9, 1e6), (1e10, 4e6), (1e11, 1e7), (1e12, 1e9), (3e12, 2e7)]]  # fmt: skip
    model = fit_model("gemm", "bf16", "forward", samples)
    assert model is not None
    assert model.latency == pytest.approx(5e-6, rel=1e-6)
    assert model.per_flop == pytest.approx(1e-14, rel=1e-6)
    assert model.per_byte == pytest.approx(1e-12, rel=1e-6)
    assert model.median_rel_error < 1e-9
    coef = fit_relative([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]], [3.0, 2.0, 1.0])
    assert coef is not None and coef[1] == 0.0 and coef[0] > 0
    assert fit_model("gemm", "bf16", "forward", samples[:2]) is None  # too few to fit


def _node(name: str, num_ops: int, size: int, dtype: str | None = "bf16", **attrs: Any) -> Any:
    return SimpleNamespace(name=name, num_ops=num_ops, tensor_size=size, dtype=dtype, attrs=attrs)


def test_nodes_are_keyed_as_the_predictor_prices_them(h100: Calibration) -> None:
    gemm = _node("mb0/layer0/fwd/fc1", 2 * 8192**3, 3 * 2 * 8192**2, gemm=(1, 8192, 8192, 8192))
    assert h100.node_time(gemm) == calibrated_time(h100, "bf16", gemm=(1, 8192, 8192, 8192))
    # a weight gradient written in fp32 runs in the workload's dtype
    wgrad = _node("mb0/layer0/bwd/fc1.grad_w1", 1, 1, "fp32", gemm=(1, 8192, 8192, 8192))
    assert h100.node_time(wgrad) == h100.node_time(gemm)
    attention = _node(
        "mb0/layer0/bwd/core_attention.grad", 1, 1, attention=(4, 16, 4096, 4096, 128, 0, 1)
    )
    assert node_kernel(attention).pass_ == "backward"  # type: ignore[union-attr]
    assert h100.node_time(attention) == calibrated_time(
        h100, "bf16", attention=(4, 16, 4096, 4096, 128, 0), backward=True
    )
    # an fp8 recipe's attention node computes in 16 bits unless it is fp8 attention
    shape = (4, 16, 4096, 4096, 128, 0, 0)
    recipe = _node("mb0/layer0/fwd/core_attention", 1, 1, "fp8", attention=shape)
    assert node_kernel(recipe).dtype == "bf16"  # type: ignore[union-attr]
    dpa = _node(
        "mb0/layer0/fwd/core_attention", 1, 1, "fp8", attention=shape, attention_dtype="fp8"
    )
    assert node_kernel(dpa).dtype == "fp8"  # type: ignore[union-attr]
    norm = _node("mb0/layer0/fwd/ln1", 7 * 2**20, 4 * 2**20)
    assert node_kernel(norm).op_class == "norm"  # type: ignore[union-attr]
    assert h100.node_time(_node("x", 0, 0)) is None
    report = coverage(
        h100, [gemm, wgrad, attention, norm, _node("y", 5, 0, "int8", gemm=(1, 1, 1, 1))]
    )
    assert (report["measured"], report["fitted"], report["analytical"]) == (3, 1, 1)
    assert report["by_class"]["gemm"] == {"measured": 2, "fitted": 0, "analytical": 1}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"format": "x"}, "c.json is not a calibration table (format 'stg-calibration'; "
                          "stg bench calibrate writes one) or a stg bench comms result (format "
                          "'stg-bench-comms')"),
        ({"format": "stg-calibration", "version": 2}, "c.json: version 2 is not 1"),
        ({"format": "stg-calibration", "version": 1, "entries": [{"op_class": "gemm"}]},
         "c.json: entries[0]: missing key 'dtype'"),
        ({"format": "stg-calibration", "version": 1, "entries": [
            {"op_class": "gemm", "dtype": "bf16", "shape": [1, 2, 3], "seconds": 1}]},
         "c.json: entries[0]: a gemm shape is 4 integers >= 0"),
        ({"format": "stg-calibration", "version": 1, "entries": [
            {"op_class": "conv", "dtype": "bf16"}]},
         "c.json: entries[0]: op_class 'conv' is not known; allowed: gemm, attention, stream, "
         "norm, softmax"),
    ],
)  # fmt: skip
def test_a_bad_table_is_one_line(data: Any, message: str) -> None:
    with pytest.raises(CalibrationError) as info:
        calibration_from_dict(data, "c.json")
    assert str(info.value) == message


def test_calibrate_refuses_results_without_kernels(tmp_path: Path) -> None:
    out = tmp_path / "cal.json"
    result = CliRunner().invoke(
        app, ["bench", "calibrate", str(PARAM / "h100-param_resnet.jsonl"), "-o", str(out)]
    )
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: no case of {PARAM / 'h100-param_resnet.jsonl'} calibrates a GEMM, attention "
        "or memory-bound kernel (skipped: 1 op class other)\n"
    )
    assert not out.exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    result = CliRunner().invoke(app, ["bench", "calibrate", str(bad), "-o", str(out)])
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: results {str(bad)!r}: line 1 is not JSON (expected PARAM's JSON lines)\n"
    )
