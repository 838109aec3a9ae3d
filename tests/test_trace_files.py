"""Trace files on disk: names with dots, empty and foreign files, `stg convert` into a
directory without silent overwrites, leftovers of killed runs (issue 8, items 3, 6, 7, 9)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from formats_samples import pipeline_workload

from stg.cli import main
from stg.core.options import GenerateOptions
from stg.core.pipeline import build_workload
from stg.emitters import chakra_v001 as v001_emitter
from stg.emitters import chakra_v004 as v004_emitter
from stg.emitters import json_trace as json_emitter
from stg.errors import TraceError, UserError
from stg.testing import make_registry
from stg.trace import chakra_v004
from stg.trace.convert import convert_file, convert_trace
from stg.trace.feeder import ETFeeder
from stg.trace.reader import detect_format, read_nodes
from stg.trace.stats import find_trace_files
from stg.trace.validate import find_rank_files, validate_trace
from stg.trace.writer import (
    comm_group_path,
    output_paths,
    write_file_atomically,
    write_workload,
)

TINY = dict(dvocal=128, dmodel=64, dff=128, head=4, kvhead=2, seq=32, batch=8, micro_batch=4)


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def one_line_error(err: str, *needles: str) -> None:
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


def tree(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


# -- item 3: output names with dots ------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("workload.%d.et", "workload.json"),
        ("workload", "workload.json"),
        ("workload.%d", "workload.json"),
        ("workload.%d.json", "workload.json"),
        ("rank%d.et", "rank.json"),
        ("w.v1.%d.et", "w.v1.json"),
        ("llama3.1-70b", "llama3.1-70b.json"),
        ("llama3.1-70b.%d.et", "llama3.1-70b.json"),
        ("gpt.3", "gpt.3.json"),
        ("a%%b.%d.et", "a%b.json"),
    ],
)
def test_comm_group_name_drops_only_the_rank_part(name: str, group: str) -> None:
    assert comm_group_path(name) == group


def test_generated_dotted_name_is_read_back_by_every_reader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = GenerateOptions(**TINY, num_stacks=2, tp=2, pp=2)  # type: ignore[arg-type]
    workload = build_workload(options, make_registry())
    out = tmp_path / "out"
    files = write_workload(workload, v004_emitter.EMITTER, out, "llama3.1-70b")
    assert [p.name for p in files] == [f"llama3.1-70b.{r}.et" for r in range(4)] + [
        "llama3.1-70b.json"
    ]
    for path in (out, out / "llama3.1-70b", out / "llama3.1-70b.%d.et"):
        ranks, group = find_rank_files(path)
        assert group == out / "llama3.1-70b.json" and len(ranks) == 4
        report = validate_trace(path)
        assert report.ok, report.errors[:3]
        assert report.comm_group_file == str(out / "llama3.1-70b.json")
    code, _, err = run(capsys, "validate", out)
    assert code == 0, err
    code, out_text, err = run(capsys, "predict", out)
    assert code == 0, err
    code, out_text, err = run(capsys, "feed", out)
    assert code == 0 and "llama3.1-70b.3" in out_text, err


@pytest.mark.parametrize("emitter", [v004_emitter, json_emitter], ids=["v0.0.4", "json"])
def test_group_file_that_looks_like_a_rank_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], emitter: object
) -> None:
    # "llama3.1.json" matches <name>.<rank>.json: it must not become rank 1 of "llama3"
    out = tmp_path / "out"
    written = write_workload(pipeline_workload(), emitter.EMITTER, out, "llama3.1")  # type: ignore[attr-defined]
    assert written[-1].name == "llama3.1.json"
    ranks, group = find_rank_files(out)
    assert group == out / "llama3.1.json" and len(ranks) == 4
    assert validate_trace(out).ok
    assert {t.name for t in find_trace_files(out)} == {"llama3.1"}
    with pytest.raises(UserError):
        find_trace_files(out / "llama3")
    for command in ("feed", "validate"):
        code, _, err = run(capsys, command, out)
        assert code == 0, err
    code, _, err = run(capsys, "inspect", "trace", out)
    assert code == 0, err


# -- item 6: empty and foreign files ------------------------------------------------------------


def _metadata_only(path: Path) -> Path:
    path.write_bytes(chakra_v004.encode_metadata({"generator": "test"}))
    return path


@pytest.mark.parametrize(
    ("name", "make", "message"),
    [
        ("w.0.et", _metadata_only, "GlobalMetadata but no nodes"),
        ("w.0.json", lambda p: p.write_text('{"workload_graph": []}'), "no nodes"),
    ],
)
def test_files_without_nodes_are_rejected_by_every_reader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, make: object, message: str
) -> None:
    path = tmp_path / name
    make(path)  # type: ignore[operator]
    for fmt in (None, "v0.0.4", "v0.0.1", "json"):
        with pytest.raises(TraceError, match=str(path)):
            read_nodes(path, format=fmt)
    with pytest.raises(TraceError, match=message):
        read_nodes(path)
    with pytest.raises(TraceError, match=message):
        with ETFeeder(path) as feeder:
            while feeder.has_nodes_to_issue():
                node = feeder.get_next_issuable_node()
                assert node is not None
                feeder.remove_node(node.id)
    report = validate_trace(path)
    assert not report.ok and message in report.errors[0].message
    for args in (("feed", path), ("inspect", "trace", path), ("validate", path, "--json")):
        code, out, err = run(capsys, *args)
        assert code == 2, (args, out, err)  # not a readable trace
        assert str(path) in out + err and message in out + err
        assert "Traceback" not in err
    with pytest.raises(UserError, match=message):
        convert_file(path, tmp_path / "c.0.json", "json")
    assert not (tmp_path / "c.0.json").exists()


@pytest.mark.parametrize("name", ["w.0.et", "w.0.json", "w.0"])
def test_a_zero_byte_rank_file_is_not_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    # a trace holds at least its metadata record: an empty file is bad input (exit 2)
    path = tmp_path / name
    path.write_bytes(b"")
    message = f"{path}: empty file, not a Chakra trace"
    with pytest.raises(TraceError, match=message):
        read_nodes(path)
    with pytest.raises(TraceError, match=message):
        ETFeeder(path)
    for args in (("feed", path), ("inspect", "trace", path), ("validate", path)):
        code, out, err = run(capsys, *args)
        assert (code, out) == (2, ""), (args, out, err)
        one_line_error(err, message)


def test_an_empty_rank_among_working_ranks_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    write_workload(pipeline_workload(), v004_emitter.EMITTER, out, "workload")
    (out / "workload.2.et").write_bytes(b"")
    for command in ("validate", "predict"):
        code, _, err = run(capsys, command, out)
        assert code == 2
        one_line_error(err, "workload.2.et: empty file, not a Chakra trace")


@pytest.mark.parametrize(
    ("emitter", "name", "allowed"),
    [
        (v004_emitter, "x.%d.json", "'.et'"),
        (v001_emitter, "x.%d.JSON", "'.et'"),
        (json_emitter, "x.%d.et", "'.json'"),
        (json_emitter, "x.%d.et.gz", "'.json'"),
    ],
)
def test_output_name_with_the_other_formats_extension_is_refused(
    tmp_path: Path, emitter: object, name: str, allowed: str
) -> None:
    with pytest.raises(UserError, match=f"allowed: a name ending in {allowed}"):
        write_workload(pipeline_workload(), emitter.EMITTER, tmp_path / "out", name)  # type: ignore[attr-defined]
    assert list(tmp_path.iterdir()) == []


def test_other_extensions_are_kept(tmp_path: Path) -> None:
    files = write_workload(pipeline_workload(), v004_emitter.EMITTER, tmp_path, "w.%d.pb")
    assert files[0].name == "w.0.pb" and files[-1].name == "w.json"
    assert detect_format(files[0]) == "v0.0.4"
    assert validate_trace(tmp_path / "w.%d.pb").ok


def test_generate_refuses_json_extension_for_protobuf(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = [f"--{k}={v}" for k, v in TINY.items()]
    code, _, err = run(
        capsys, "generate", *tiny, "--num_stacks", "1", "--output_dir", tmp_path / "o",
        "--output_name", "x.%d.json",
    )  # fmt: skip
    assert code == 2
    one_line_error(err, "x.%d.json", "allowed", "'.et'")
    assert list(tmp_path.iterdir()) == []


# -- item 7: stg convert into a directory -------------------------------------------------------


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    write_workload(pipeline_workload(), v004_emitter.EMITTER, tmp_path / "src", "workload")
    return tmp_path / "src"


def test_directory_source_converts_into_a_new_directory(
    tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "a" / "b" / "conv"  # missing, no trailing slash
    code, out, err = run(capsys, "convert", trace, dest, "--to", "json")
    assert code == 0, err
    assert sorted(tree(dest)) == sorted(
        [*output_paths("workload", 4, ".json"), "workload.json"]
    )
    assert validate_trace(dest).ok
    assert [p.parent for p in map(Path, out.split())] == [dest] * 5
    # a file where the directory should go
    (tmp_path / "file").write_text("x")
    code, _, err = run(capsys, "convert", trace, tmp_path / "file", "--to", "json")
    assert code == 2
    one_line_error(err, "not a directory")
    assert (tmp_path / "file").read_text() == "x"


def test_second_conversion_never_silently_overwrites(
    tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "conv"
    convert_trace(trace, dest, "json")
    before = tree(dest)
    # the same conversion again: same bytes, allowed
    assert convert_trace(trace, dest, "json")[0] == dest / "workload.0.json"
    assert tree(dest) == before
    # a different trace of the same name (more ranks): refused, nothing changed
    other = tmp_path / "other"
    write_workload(pipeline_workload(tp=2, pp=2, dp=2), v004_emitter.EMITTER, other, "workload")
    code, _, err = run(capsys, "convert", other, dest, "--to", "json")
    assert code == 2
    one_line_error(err, str(dest), "--force", "workload.0.json")
    assert tree(dest) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # fewer ranks than what is there: the extra ranks would be removed, refused too
    small = tmp_path / "small"
    write_workload(pipeline_workload(tp=2, pp=1), v004_emitter.EMITTER, small, "workload")
    with pytest.raises(UserError, match="already holds a different trace"):
        convert_trace(small, dest, "json")
    assert tree(dest) == before
    # --force replaces it
    code, _, err = run(capsys, "convert", other, dest, "--to", "json", "--force")
    assert code == 0, err
    assert len(find_rank_files(dest)[0]) == 8 and validate_trace(dest).ok


def test_directory_destination_must_not_hold_another_trace(
    tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # converting into the source directory would leave two traces side by side
    code, _, err = run(capsys, "convert", trace, trace, "--to", "json")
    assert code == 2
    one_line_error(err, "workload.0.et", "--force")
    assert sorted(tree(trace)) == sorted([*output_paths("workload", 4, ".et"), "workload.json"])
    # and --force converts into a directory that holds another trace, leaving it alone
    dest = tmp_path / "dest"
    write_workload(pipeline_workload(), json_emitter.EMITTER, dest, "other")
    code, _, err = run(capsys, "convert", trace, dest, "--to", "v0.0.1")
    assert code == 2 and "other.0.json" in err
    code, _, err = run(capsys, "convert", trace, dest, "--to", "v0.0.1", "--force")
    assert code == 0, err
    assert (dest / "other.0.json").exists()
    assert validate_trace(dest / "workload", consumer="chakra").ok  # v0.0.1: not ASTRA-sim's
    # a prefix source into dir/name may sit beside another trace: it overwrites nothing
    out = convert_trace(trace / "workload", trace / "copy", "json")
    assert out[-1] == trace / "copy.json" and validate_trace(trace / "copy").ok


def test_single_file_conversion_does_not_overwrite_a_different_file(tmp_path: Path) -> None:
    src = tmp_path / "w.0.et"
    write_workload(pipeline_workload(), v004_emitter.EMITTER, tmp_path, "w")
    dest = tmp_path / "d.0.json"
    dest.write_text("keep")
    with pytest.raises(UserError, match="--force"):
        convert_file(src, dest, "json")
    assert dest.read_text() == "keep"
    convert_file(src, dest, "json", force=True)
    convert_file(src, dest, "json")  # the same bytes again
    assert read_nodes(dest) == read_nodes(src)
    assert not [p for p in tmp_path.iterdir() if "stg-tmp" in p.name]


# -- item 9: leftovers of killed runs -----------------------------------------------------------


def _flock(fd: object) -> None:
    fcntl = pytest.importorskip("fcntl")  # the leftovers cleanup needs POSIX locks
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _past(path: Path) -> Path:
    then = time.time() - 60
    os.utime(path, (then, then))
    return path


def test_stale_tmp_dirs_are_removed_locked_ones_kept(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_workload(pipeline_workload(), v004_emitter.EMITTER, out, "workload")
    killed = tmp_path / ".out.stg-tmp-killed"
    killed.mkdir()
    (killed / "workload.0.et").write_bytes(b"partial")
    inside = out / ".out.stg-tmp-killed2"  # staged inside output_dir
    inside.mkdir()
    running = tmp_path / ".out.stg-tmp-running"
    running.mkdir()
    unrelated = tmp_path / ".other.stg-tmp-x"
    unrelated.mkdir()
    for p in (killed, inside, running, unrelated):
        _past(p)
    fd = os.open(running, os.O_RDONLY)
    try:
        _flock(fd)  # a run still in progress
        write_workload(pipeline_workload(), v004_emitter.EMITTER, out, "workload")
        assert not killed.exists() and not inside.exists()
        assert running.is_dir() and unrelated.is_dir()
    finally:
        os.close(fd)
    # once that run is gone (its lock free), the next run removes it
    write_workload(pipeline_workload(), v004_emitter.EMITTER, out, "workload")
    assert not running.exists() and unrelated.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.stg-tmp-x", "out"]


def test_new_tmp_dirs_of_other_runs_are_kept(tmp_path: Path) -> None:
    # not older than this run: may belong to a run that has not locked it yet
    young = tmp_path / ".out.stg-tmp-young"
    young.mkdir()
    future = time.time() + 60
    os.utime(young, (future, future))
    write_workload(pipeline_workload(), v004_emitter.EMITTER, tmp_path / "out", "workload")
    assert young.is_dir()


def test_killed_switch_gives_its_backups_back(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_workload(pipeline_workload(), v004_emitter.EMITTER, out, "keep")
    saved = (out / "keep.1.et").read_bytes()
    # a run killed after moving keep.1.et into its backup, before moving the new one in
    killed = tmp_path / ".out.stg-tmp-killed"
    (killed / ".old").mkdir(parents=True)
    os.rename(out / "keep.1.et", killed / ".old" / "keep.1.et")
    _past(killed)
    write_workload(pipeline_workload(), v004_emitter.EMITTER, out, "workload")
    assert (out / "keep.1.et").read_bytes() == saved and not killed.exists()
    assert validate_trace(out / "keep").ok


def test_stale_tmp_files_of_single_file_writes(tmp_path: Path) -> None:
    killed = tmp_path / ".plan.json.stg-tmp-abc"
    killed.write_text("partial")
    _past(killed)
    running = tmp_path / ".plan.json.stg-tmp-def"
    running.write_text("partial")
    _past(running)
    with open(running, "rb") as held:
        _flock(held)
        write_file_atomically(tmp_path / "plan.json", lambda out: out.write(b"{}"))
        assert not killed.exists() and running.exists()
    assert (tmp_path / "plan.json").read_bytes() == b"{}"


def test_a_run_holds_the_lock_of_its_tmp_dir(tmp_path: Path) -> None:
    seen: list[bool] = []

    def write(tmp: Path) -> list[Path]:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            _flock(fd)
            seen.append(False)
        except BlockingIOError:
            seen.append(True)
        finally:
            os.close(fd)
        return v004_emitter.EMITTER.write(pipeline_workload(), tmp, "workload")

    from stg.trace.writer import write_atomically

    write_atomically(tmp_path / "out", "workload", ".et", write)
    assert seen == [True]


def test_sizes_beyond_int64_are_one_line_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code, _, err = run(
        capsys, "generate", "--num_stacks", 1, "--seq", 10**15, "--output_dir", out
    )
    assert code == 2
    one_line_error(err, "does not fit Chakra's int64_val")
    assert not out.exists() and list(tmp_path.iterdir()) == []
