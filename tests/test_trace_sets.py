"""A trace is the set of rank files its metadata declares, and the comm-group file it names.

Every reader (validate, feed, inspect trace, predict, convert) refuses a partial rank set with
one line naming the missing ranks; readers take the comm-group file that the trace's metadata
names over a stale one of the default name; and the exit codes follow one rule: 2 for bad
input (a file that is not a readable trace, a partial set), 1 for a readable trace found
invalid.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.trace.reader import read_metadata

SMALL = ["--num_stacks", "1", "--dmodel", "64", "--dff", "256", "--head", "4", "--kvhead", "4",
         "--seq", "32", "--dvocal", "128"]  # fmt: skip
PARALLEL = ["--dp", "4", "--tp", "2"]
EXTENSIONS = {"chakra-v0.0.4": ".et", "json": ".json"}


def invoke(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def generate(out: Path, *args: str) -> Path:
    code, _, err = invoke("generate", "--output_dir", out, *PARALLEL, *SMALL, *args)
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One 8-rank trace per format, and a v0.0.4 one whose comm-group file is comm_group.json."""
    root = tmp_path_factory.mktemp("sets")
    made = {fmt: generate(root / fmt, "--format", fmt) for fmt in EXTENSIONS}
    made["named"] = generate(root / "named", "--comm_group_file", "comm_group.json")
    return made


def copy(traces: dict[str, Path], which: str, tmp_path: Path) -> Path:
    out = tmp_path / which
    shutil.copytree(traces[which], out)
    return out


def reader_commands(trace: Path, tmp_path: Path) -> list[list[object]]:
    return [
        ["validate", trace],
        ["feed", trace],
        ["inspect", "trace", trace],
        ["predict", trace, "--predictor", "time"],
        ["convert", trace, tmp_path / "converted", "--to", "json"],
    ]


def refused(args: list[object], message: str) -> None:
    """The command exits 2 with exactly ``error: <message>`` and no output."""
    code, out, err = invoke(*args)
    assert (code, out, err) == (2, "", f"error: {message}\n"), (args, code, out, err)


# -- A: the rank set ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(EXTENSIONS))
def test_every_reader_refuses_a_partial_rank_set(
    traces: dict[str, Path], tmp_path: Path, fmt: str
) -> None:
    # what a run killed while moving its files into place leaves: the first ranks only
    trace = copy(traces, fmt, tmp_path)
    for rank in range(3, 8):
        (trace / f"workload.{rank}{EXTENSIONS[fmt]}").unlink()
    message = f"trace {trace}/workload: 3 of 8 rank files present; missing ranks 3..7"
    for args in reader_commands(trace, tmp_path):
        refused(args, message)
    refused(["feed", trace / "workload"], message)  # a prefix names the same set
    assert not (tmp_path / "converted").exists()
    # one rank file named alone is no rank set: the other ranks are not looked for
    for command in (["validate"], ["feed"], ["inspect", "trace"]):
        code, _, err = invoke(*command, trace / f"workload.0{EXTENSIONS[fmt]}")
        assert code == 0, (command, err)


def test_a_missing_rank_in_the_middle_is_named(traces: dict[str, Path], tmp_path: Path) -> None:
    trace = copy(traces, "chakra-v0.0.4", tmp_path)
    (trace / "workload.5.et").unlink()
    (trace / "workload.2.et").unlink()
    message = f"trace {trace}/workload: 6 of 8 rank files present; missing ranks 2, 5"
    for args in reader_commands(trace, tmp_path):
        refused(args, message)


def test_an_empty_rank_file_in_a_set_is_not_a_trace(
    traces: dict[str, Path], tmp_path: Path
) -> None:
    trace = copy(traces, "chakra-v0.0.4", tmp_path)
    (trace / "workload.3.et").write_bytes(b"")
    message = f"{trace}/workload.3.et: empty file, not a Chakra trace"
    for args in reader_commands(trace, tmp_path):
        refused(args, message)


# -- B: the comm-group file the trace names ---------------------------------------------------


def test_the_writer_records_the_comm_group_file_name(traces: dict[str, Path]) -> None:
    for which, name in (("chakra-v0.0.4", "workload.json"), ("json", "workload.json"),
                        ("named", "comm_group.json")):  # fmt: skip
        for path in sorted(traces[which].glob("workload.*.*")):
            if path.name != "workload.json":
                assert read_metadata(path)["attrs"]["comm_group_file"] == name, path
    code, out, err = invoke("validate", traces["named"])
    assert code == 0, out + err


def test_the_official_reader_decodes_the_metadata(traces: dict[str, Path]) -> None:
    protolib = pytest.importorskip("chakra.src.third_party.utils.protolib")
    et_def = pytest.importorskip("chakra.schema.protobuf.et_def_pb2")
    stream = protolib.openFileRd(str(traces["named"] / "workload.3.et"))
    meta = et_def.GlobalMetadata()
    assert protolib.decodeMessage(stream, meta)
    attrs = {a.name: a for a in meta.attr}
    assert attrs["comm_group_file"].string_val == "comm_group.json"
    assert attrs["world_size"].int64_val == 8
    node = et_def.Node()
    assert protolib.decodeMessage(stream, node) and node.name
    stream.close()


STALE = {"1": [0, 1, 2, 3, 4, 5, 6, 7]}
"""A comm-group file of an earlier run: groups that the trace's collectives do not match."""


def test_readers_prefer_the_named_file_over_a_stale_default(
    traces: dict[str, Path], tmp_path: Path
) -> None:
    trace = copy(traces, "named", tmp_path)
    (trace / "workload.json").write_text(json.dumps(STALE))
    code, out, err = invoke("validate", trace, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"], err
    assert report["comm_group_file"] == str(trace / "comm_group.json")
    assert err == ""
    code, out, err = invoke("predict", trace, "--predictor", "time", "--json")
    assert code == 0, err
    assert json.loads(out)["time"]["world_size"] == 8
    dest = tmp_path / "as-json"
    code, _, err = invoke("convert", trace, dest, "--to", "json")
    assert code == 0, err
    named = json.loads((trace / "comm_group.json").read_text())
    assert json.loads((dest / "workload.json").read_text()) == named
    # the output names the comm-group file it was given, under the output's name
    assert read_metadata(dest / "workload.0.json")["attrs"]["comm_group_file"] == "workload.json"
    code, out, err = invoke("validate", dest)
    assert code == 0, out + err


def test_an_explicit_file_wins_and_a_named_file_must_exist(
    traces: dict[str, Path], tmp_path: Path
) -> None:
    trace = copy(traces, "named", tmp_path)
    stale = trace / "workload.json"
    stale.write_text(json.dumps(STALE))
    code, out, _ = invoke("validate", trace, "--json", "--comm_group_file", stale)
    report = json.loads(out)
    assert code == 1 and report["comm_group_file"] == str(stale)
    assert "collective-mismatch" in report["errors"] or "comm-group" in report["errors"]
    (trace / "comm_group.json").unlink()
    message = (
        f"comm-group file {trace}/comm_group.json is missing (the trace's metadata names it); "
        "restore it or choose one with --comm_group_file"
    )
    for args in reader_commands(trace, tmp_path):
        if args[0] in ("validate", "predict", "convert"):  # the readers of comm groups
            refused(args, message)


# -- C1: one exit-code rule --------------------------------------------------------------------


def test_unreadable_exits_2_everywhere_and_invalid_exits_1(
    traces: dict[str, Path], tmp_path: Path
) -> None:
    trace = copy(traces, "chakra-v0.0.4", tmp_path)
    path = trace / "workload.1.et"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # cut inside a record
    for args in reader_commands(trace, tmp_path):
        code, out, err = invoke(*args)
        assert code == 2, (args, code, out, err)
        assert err.startswith(f"error: {path}: truncated record ") and err.count("\n") == 1
        assert out == "", (args, out)
    # a trace that reads but cannot run: a dependency cycle
    cycle = tmp_path / "cycle"
    cycle.mkdir()
    nodes = [
        {"Id": 0, "Name": "a", "NodeType": 4, "num_ops": 1, "tensor_size": 1},
        {"Id": 1, "Name": "b", "NodeType": 4, "num_ops": 1, "tensor_size": 1, "data_deps": [2]},
        {"Id": 2, "Name": "c", "NodeType": 4, "num_ops": 1, "tensor_size": 1, "data_deps": [1]},
    ]
    (cycle / "w.0.json").write_text(json.dumps({"workload_graph": nodes}))
    for args in (["validate", cycle], ["feed", cycle], ["inspect", "trace", cycle]):
        code, out, err = invoke(*args)
        assert code == 1, (args, code, out, err)
        assert "cycle" in out + err
