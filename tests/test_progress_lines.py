"""Long commands off a terminal (a pipe, a log) print progress lines to stderr, at most one
every PROGRESS_INTERVAL_S seconds plus a final one; stdout is unchanged."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import stg.cli._shared as shared
from stg.cli import main
from stg.cli._shared import ProgressLines, format_elapsed

TINY = [
    "--dvocal", "128", "--dmodel", "64", "--dff", "128", "--head", "4", "--kvhead", "2",
    "--seq", "32", "--batch", "8", "--micro_batch", "2", "--num_stacks", "2", "--pp", "2",
]  # fmt: skip
LINE = re.compile(r"^[^:]+(: [^:]+)?: [\d,]+ of [\d,]+ \(\d+%\), \d+s elapsed$")


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def test_lines_come_at_most_once_per_interval_and_a_final_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    now = [0.0]
    lines = ProgressLines(10.0, clock=lambda: now[0])
    for second in range(26):
        now[0] = float(second)
        lines.update("closed forms", second * 100, 2_600)
    lines.finish()
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "search: plans checked by closed forms: 1,000 of 2,600 (38%), 10s elapsed",
        "search: plans checked by closed forms: 2,000 of 2,600 (76%), 20s elapsed",
        "search: plans checked by closed forms: 2,500 of 2,600 (96%), 25s elapsed",
    ]


def test_lines_fit_the_width(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log is read at the terminal's width too: a long phase name wraps, nothing is cut."""
    monkeypatch.setenv("COLUMNS", "60")
    now = [0.0]
    lines = ProgressLines(10.0, clock=lambda: now[0])
    now[0] = 70.0
    lines.update("analytical", 573, 573)
    err = capsys.readouterr().err
    assert max(len(line) for line in err.splitlines()) <= 60
    assert " ".join(err.split()) == (
        "search: plans considered for analytical pricing: 573 of 573 (100%), 1m10s elapsed"
    )


def test_a_short_run_prints_no_line(capsys: pytest.CaptureFixture[str]) -> None:
    lines = ProgressLines(10.0, clock=lambda: 3.0)
    lines.update("lowering", 1, 4)
    lines.update("lowering", 4, 4)
    lines.finish()
    assert capsys.readouterr().err == ""


def test_elapsed_times() -> None:
    assert [format_elapsed(s) for s in (0.4, 59.9, 70, 3599, 7500)] == [
        "0s", "59s", "1m10s", "59m59s", "2h05m",
    ]  # fmt: skip


def test_generate_prints_lines_on_stderr_and_the_same_stdout(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    args = ["generate", *TINY, "--output_dir", tmp_path / "out", "--json"]
    code, quiet_out, quiet_err = run(capsys, *args)
    assert code == 0, quiet_err
    assert "elapsed" not in quiet_err  # done within the default interval: no line
    monkeypatch.setattr(shared, "PROGRESS_INTERVAL_S", 0.0)
    code, out, err = run(capsys, *args)
    assert code == 0, err
    assert out == quiet_out
    progress = [line for line in err.splitlines() if line.endswith("elapsed")]
    assert all(LINE.match(line) for line in progress), progress
    assert any(line.startswith("building: ") for line in progress)
    assert "writing rank files: 2 of 2 (100%)" in err
    assert "elapsed" not in out


def test_search_and_sweep_print_lines(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    search = ["search", "--model", "debug", "--batch", "16", "--gpus", "4", "--refine", "1",
              "--json"]  # fmt: skip
    code, quiet_out, _ = run(capsys, *search)
    assert code == 0
    monkeypatch.setattr(shared, "PROGRESS_INTERVAL_S", 0.0)
    code, out, err = run(capsys, *search)
    assert code == 0, err
    assert out == quiet_out
    considered = r"^search: plans considered for analytical pricing: ([\d,]+) of \1 \(100%\)"
    assert re.search(considered, err, re.M)
    assert "search: best plans re-priced by the DAG predictor: 1 of 1 (100%)" in err
    code, out, err = run(
        capsys, "sweep", "--model", "debug", "--batch", "16", "--dp", "1,2", "-o",
        tmp_path / "sweep", "-j", "1", "--json",
    )  # fmt: skip
    assert code == 0, err
    assert "sweep: configurations evaluated: 2 of 2 (100%)" in err
