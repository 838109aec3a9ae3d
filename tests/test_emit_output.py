"""Output naming and atomic writing (stg.trace.writer)."""

from __future__ import annotations

from pathlib import Path

import pytest
from formats_samples import pipeline_workload

from stg.emitters.chakra_v004 import EMITTER
from stg.errors import OutputError, UserError
from stg.host.records import Emitter
from stg.trace import writer as output
from stg.trace.writer import comm_group_path, format_comm_groups, output_paths, write_workload


def test_naming() -> None:
    assert output_paths("workload", 2, ".et") == ["workload.0.et", "workload.1.et"]
    assert output_paths("workload.%d.et", 2, ".et") == ["workload.0.et", "workload.1.et"]
    assert output_paths("rank%d", 2, ".json") == ["rank0", "rank1"]
    assert output_paths("a%%b.%d.et", 1, ".et") == ["a%b.0.et"]
    assert comm_group_path("workload.%d.et") == "workload.json"
    assert comm_group_path("workload") == "workload.json"
    assert comm_group_path("rank%d.et") == "rank.json"
    assert comm_group_path("w.v1.%d.et") == "w.v1.json"


@pytest.mark.parametrize("name", ["a/b.%d.et", "w.%s.et", "w.%d.%d.et", "", "w%"])
def test_bad_names(name: str) -> None:
    with pytest.raises(UserError, match="output_name="):
        output_paths(name, 2, ".et")


def test_comm_group_text() -> None:
    text = format_comm_groups({10: (3, 2), 2: [1, 0], 5: (7,)})
    assert text == '{\n  "2": [0, 1],\n  "10": [2, 3]\n}\n'
    assert format_comm_groups({}) == "{}\n"


def test_new_directory_with_missing_parents(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "out"
    paths = write_workload(pipeline_workload(), EMITTER, out, "workload")
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in paths)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]


def test_existing_directory_replaces_only_this_runs_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_workload(pipeline_workload(tp=2, pp=2, dp=2), EMITTER, out, "workload")
    (out / "notes.txt").write_text("keep me")
    (out / "other.0.et").write_text("keep me too")
    paths = write_workload(pipeline_workload(tp=2, pp=2), EMITTER, out, "workload")
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([p.name for p in paths] + ["notes.txt", "other.0.et"])
    assert "workload.7.et" not in names  # stale ranks of the same name are removed
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_failure_leaves_old_state(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_workload(pipeline_workload(), EMITTER, out, "workload")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(workload: object, directory: Path, output_name: str) -> list[Path]:
        (directory / "workload.0.et").write_bytes(b"partial")
        raise RuntimeError("disk full")

    bad = Emitter(name="broken", write=broken, extension=".et")
    with pytest.raises(RuntimeError, match="disk full"):
        write_workload(pipeline_workload(tp=4, pp=2), bad, out, "workload")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(RuntimeError, match="disk full"):
        write_workload(pipeline_workload(), bad, tmp_path / "fresh", "workload")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_rollback_when_a_rename_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    write_workload(pipeline_workload(), EMITTER, out, "workload")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_rename = output.os.rename
    calls = {"n": 0}

    def flaky(src: object, dst: object) -> None:
        calls["n"] += 1
        if calls["n"] == 7:
            raise OSError(28, "No space left on device")
        real_rename(src, dst)

    monkeypatch.setattr(output.os, "rename", flaky)
    with pytest.raises(OutputError, match=rf"^cannot write output_dir={out}: No space"):
        write_workload(pipeline_workload(tp=4, pp=2), EMITTER, out, "workload")
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_unwritable_output_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(output.os, "access", lambda path, mode: False)
    with pytest.raises(UserError, match=rf"^cannot write output_dir={out}: permission denied$"):
        write_workload(pipeline_workload(), EMITTER, out, "workload")
    assert list(out.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_output_dir_under_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match=r"cannot write output_dir=.*is not a directory"):
        write_workload(pipeline_workload(), EMITTER, blocker / "out", "workload")
    with pytest.raises(UserError, match="exists and is not a directory"):
        write_workload(pipeline_workload(), EMITTER, blocker, "workload")
