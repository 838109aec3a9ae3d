"""tests/data/kernels/h200-host-sync.jsonl (``benchmarks/measure_host_sync.py`` on an H200):
the measurements the script names, and docs/notes/moe-host-sync.md quoting them as they are."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "kernels" / "h200-host-sync.jsonl"
NOTES = ROOT / "docs" / "notes" / "moe-host-sync.md"
LINES = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "measure_host_sync", ROOT / "benchmarks" / "measure_host_sync.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _key(line: dict[str, object]) -> tuple[str, str]:
    return str(line["measurement"]), str(line.get("op") or line.get("when") or "")


def test_the_file_holds_each_measurement_of_the_script_once() -> None:
    script = _script()
    assert LINES[0]["device"] == "NVIDIA H200"
    keys = [_key(line) for line in LINES[1:]]
    assert sorted(keys) == sorted(
        [
            ("sync_gap", ""),
            ("launch_host", "add"),
            ("launch_host", "add_autograd"),
            ("launch_host", "scaled_mm_fp8_2048x2048x1536"),
            ("post_sync_sequence", "synced"),
            ("post_sync_sequence", "queued"),
        ]
    )
    for line in LINES[1:]:
        assert line["repeats"] == script.REPEATS
        assert line["min_us"] <= line["median_us"] <= line["max_us"]
    sequences = [line for line in LINES[1:] if line["measurement"] == "post_sync_sequence"]
    for line in sequences:
        assert line["experts"] == script.EXPERTS
        assert line["shape"] == [script.ROWS, script.DMODEL, script.FC1]


def test_a_sync_exposes_the_host_time_of_a_host_bound_sequence() -> None:
    """The finding the notes draw: the sync alone is tens of microseconds, the sequence after
    it runs at the host's pace (over twice its GPU time)."""
    by_key = {_key(line): line["median_us"] for line in LINES[1:]}
    synced = by_key[("post_sync_sequence", "synced")]
    queued = by_key[("post_sync_sequence", "queued")]
    assert by_key[("sync_gap", "")] < 0.1 * (synced - queued)
    assert synced > 2 * queued


def test_the_notes_quote_every_median() -> None:
    text = NOTES.read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    for line in LINES[1:]:
        measurement, detail = _key(line)
        names = [f"`{measurement}`"] + ([f"`{detail}`"] if detail else [])
        quoted = [row for row in rows if all(name in row for name in names)]
        assert quoted, (measurement, detail)
        assert f"| {line['median_us']:.2f} |" in quoted[0], (measurement, detail, quoted[0])


def test_without_a_gpu_the_script_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert _script().main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == "error: measure_host_sync.py needs a CUDA GPU; none is visible\n"
    assert not list(tmp_path.iterdir())
