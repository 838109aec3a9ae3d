"""``stg predict`` end to end: generated workloads, traces on disk, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stg.cli import main

SMALL = [
    "--model", "gpt", "--dmodel", "256", "--dff", "1024", "--head", "8", "--kvhead", "8",
    "--num_stacks", "4", "--seq", "128", "--dvocal", "1000", "--batch", "8",
    "--micro_batch", "2", "--dp", "2", "--tp", "2", "--pp", "2",
]


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def test_generated_json_report(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    timeline = tmp_path / "timeline.json"
    code, out, err = run(capsys, "predict", *SMALL, "--json", "--timeline", str(timeline))
    assert code == 0, err
    reports = json.loads(out)
    assert set(reports) == {"time", "memory"}
    time = reports["time"]
    assert time["world_size"] == 8
    assert time["simulated_ranks"] == 2  # one per pipeline stage
    assert 0 < time["mfu"] <= time["hfu"] <= 1
    assert time["tokens_per_s"] == pytest.approx(8 * 128 / time["iteration_time_s"])
    assert [c["stage"] for c in reports["memory"]["classes"]] == [0, 1]
    events = json.loads(timeline.read_text())["traceEvents"]
    assert any(e["ph"] == "X" for e in events)


def test_trace_on_disk_matches_generated(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    out_dir = tmp_path / "trace"
    code, _, err = run(capsys, "generate", *SMALL, "--output_dir", str(out_dir))
    assert code == 0, err
    code, out, err = run(capsys, "predict", str(out_dir), "--json")
    assert code == 0, err
    from_trace = json.loads(out)
    code, out, err = run(capsys, "predict", *SMALL, "--json")
    generated = json.loads(out)
    # identical ranks are recognised in the files: one replay per pipeline stage, as generated
    assert from_trace["time"]["simulated_ranks"] == generated["time"]["simulated_ranks"] == 2
    assert from_trace["time"]["iteration_time_s"] == pytest.approx(
        generated["time"]["iteration_time_s"], rel=1e-9
    )
    assert from_trace["memory"]["peak_bytes"] == generated["memory"]["peak_bytes"]


def test_rich_report(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "predict", *SMALL, "--system", "h100-80g")
    assert code == 0, err
    assert "iteration time" in out and "MFU" in out and "h100-80g" in out
    assert "memory per rank" in out


def test_memory_only(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "predict", *SMALL, "--predictor", "memory", "--json")
    assert code == 0
    assert set(json.loads(out)) == {"memory"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--system", "z80"],
            "unknown system 'z80'; allowed: a10-24g, a100-40g, a100-80g, b200-180g",
        ),
        (["--predictor", "oracle"], "unknown predictor 'oracle'; allowed:"),
        (["somewhere", "--dp", "2"], "give either a trace PATH or generation options"),
    ],
)
def test_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], args: list[str],
                               message: str) -> None:
    code, out, err = run(capsys, "predict", *args)
    assert code == 2
    assert out == ""
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_malformed_system_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "sys.json"
    bad.write_text('{"peak_tflops": {"bf16": 1}}')
    code, _, err = run(capsys, "predict", *SMALL, "--system", str(bad))
    assert code == 2
    assert "missing key 'hbm_gbps'" in err
    assert len(err.strip().splitlines()) == 1


def test_timeline_directory_must_exist(capsys: pytest.CaptureFixture[str],
                                       tmp_path: Path) -> None:
    code, _, err = run(capsys, "predict", *SMALL, "--timeline", str(tmp_path / "no" / "t.json"))
    assert code == 2
    assert "does not exist" in err
