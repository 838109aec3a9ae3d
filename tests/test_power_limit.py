"""A system's ``power_limit_w``: a GPU capped below its TDP sustains a lower clock (cube law),
which lowers compute-bound rates and leaves HBM bandwidth alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.errors import UserError
from stg.host.registry import load_registry
from stg.perf.kernel_time import gemm_time
from stg.perf.system import load_system, system_from_dict
from stg.predictors.time import predict_time


def capped(preset: str, watts: float | None) -> dict:
    data = load_system(preset).as_dict()
    if watts is not None:
        data["power_limit_w"] = watts
    return data


def test_presets_carry_their_data_sheet_tdp() -> None:
    assert load_system("h100-80g").tdp_w == 700
    assert load_system("h200-141g").tdp_w == 700
    assert load_system("a100-80g").tdp_w == 400
    assert load_system("t4-16g").tdp_w == 70


def test_clock_follows_the_cube_root_of_the_power_limit() -> None:
    h100 = system_from_dict(capped("h100-80g", 500))
    assert h100.clock_ghz == pytest.approx(1.38 * (500 / 700) ** (1 / 3))
    assert h100.clock_ghz == pytest.approx(1.2336, abs=1e-4)
    at_tdp = system_from_dict(capped("h100-80g", 700))
    assert at_tdp.clock_ghz == load_system("h100-80g").clock_ghz == 1.38


def test_a_cap_slows_gemms_but_not_memory_bandwidth() -> None:
    full, low = load_system("h100-80g"), system_from_dict(capped("h100-80g", 500))
    big = [gemm_time(s.gpu, 8192, 8192, 8192, "bf16") for s in (full, low)]
    assert big[1] / big[0] == pytest.approx(full.clock_ghz / low.clock_ghz, rel=0.02)
    assert low.gpu.stream_time(2**30) == full.gpu.stream_time(2**30)
    assert low.hbm_bandwidth == full.hbm_bandwidth


def test_a_capped_system_predicts_a_slower_iteration() -> None:
    options = GenerateOptions(
        model="llama", dvocal=4096, dmodel=2048, dff=5632, head=16, kvhead=8, num_stacks=2,
        seq=2048, batch=4, dp=2,
    )  # fmt: skip
    workload = build_workload(options, load_registry(autoload=False))
    times = [
        predict_time(workload, system_from_dict(capped("h100-80g", w)))["iteration_time_s"]
        for w in (None, 500)
    ]
    assert times[1] > 1.05 * times[0]


def test_the_limit_round_trips_through_the_json_form() -> None:
    system = system_from_dict(capped("a100-80g", 300))
    assert system.as_dict()["power_limit_w"] == 300
    assert system_from_dict(system.as_dict()) == system
    assert "power_limit_w" not in load_system("a100-80g").as_dict()


@pytest.mark.parametrize(
    ("watts", "message"),
    [
        (150, "power_limit_w=150 is outside the GPU's power-limit range; allowed: 200 to 700 W"),
        (701, "power_limit_w=701 is outside the GPU's power-limit range; allowed: 200 to 700 W"),
        (0, "power_limit_w must be > 0, got 0"),
        ("500", "power_limit_w must be a number, got '500'"),
    ],
)
def test_limits_outside_the_range_are_rejected(watts: object, message: str) -> None:
    with pytest.raises(UserError, match=message):
        system_from_dict(capped("h100-80g", watts), "h100-capped.json")  # type: ignore[arg-type]


def test_cli_names_the_allowed_range_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "h100-capped.json"
    path.write_text(json.dumps(capped("h100-80g", 800)), encoding="utf-8")
    result = CliRunner().invoke(app, ["inspect", "system", str(path)])
    assert result.exit_code == 2
    assert "power_limit_w=800 is outside the GPU's power-limit range" in result.stderr
    assert "allowed: 200 to 700 W" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
