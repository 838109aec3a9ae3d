"""Readers find a comm-group file that is not named after the trace.

``stg generate --comm_group_file comm_group.json`` (the original STG's option) writes the
comm-group file under that name. ``stg validate``, ``predict``, ``convert``, ``feed`` and
``inspect trace`` take ``--comm_group_file PATH``; without it they use ``<name>.json`` and, when
that is absent, the only other JSON file beside the rank files that parses as a comm-group
map, saying on stderr which one they used. Since stg records the comm-group file's name in
the trace's metadata (tests/test_trace_sets.py), these rules apply to traces without that
record: the fixture removes it, as from a trace written by an earlier stg.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.cli import app
from stg.trace import chakra_v004
from stg.trace.reader import read_metadata, read_nodes
from stg.trace.validate import find_comm_group_files, find_rank_files, locate_comm_groups

SMALL = ["--num_stacks", "2", "--dmodel", "64", "--dff", "256", "--head", "4", "--kvhead", "4",
         "--seq", "32", "--dvocal", "128"]  # fmt: skip


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def custom(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2x2x2 trace whose comm-group file is comm_group.json (the original STG's usage)."""
    out = tmp_path_factory.mktemp("cg") / "generated"
    code, _, err = invoke("generate", "--output_dir", str(out), "--output_name", "workload.%d.et",
                          "--comm_group_file", "comm_group.json", "--dp", "2", "--tp", "2",
                          "--pp", "2", "--weight_sharded", "0", *SMALL)  # fmt: skip
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir())[0] == "comm_group.json"
    assert not (out / "workload.json").exists()
    for path in out.glob("*.et"):
        meta = read_metadata(path)
        del meta["attrs"]["comm_group_file"]
        nodes = read_nodes(path)
        with open(path, "wb") as stream:
            chakra_v004.write_stream(stream, nodes, meta["attrs"], version=meta["version"])
    return out


@pytest.fixture
def trace(custom: Path, tmp_path: Path) -> Path:
    out = tmp_path / "generated"
    shutil.copytree(custom, out)
    return out


FOUND = "comm groups: workload.json is absent; using comm_group.json"


def test_validate_finds_the_only_comm_group_file(trace: Path) -> None:
    code, out, err = invoke("validate", str(trace))
    assert code == 0, out + err
    assert "valid: 8 ranks" in out
    assert FOUND in err
    code, out, err = invoke("validate", str(trace), "--json")
    report = json.loads(out)
    assert report["ok"] and report["comm_group_file"].endswith("comm_group.json")
    assert report["notes"][0].startswith(FOUND)


def test_explicit_comm_group_file(trace: Path, tmp_path: Path) -> None:
    moved = tmp_path / "elsewhere.json"
    (trace / "comm_group.json").rename(moved)
    code, out, _ = invoke("validate", str(trace), "--json")
    report = json.loads(out)
    assert code == 1 and "comm-group" in report["errors"]  # groups undefined without it
    code, out, err = invoke("validate", str(trace), "--comm_group_file", str(moved))
    assert code == 0, out + err
    assert "comm groups:" not in err
    code, _, err = invoke("validate", str(trace), "--comm_group_file", str(tmp_path / "nope"))
    assert code == 2 and "--comm_group_file" in err and "no such file" in err


def test_predict_convert_feed_inspect(trace: Path, tmp_path: Path) -> None:
    code, out, err = invoke("predict", str(trace), "--json")
    assert code == 0, err
    assert FOUND in err
    assert json.loads(out)["time"]["world_size"] == 8
    code, out, err = invoke("predict", str(trace), "--json", "--comm_group_file",
                            str(trace / "comm_group.json"))  # fmt: skip
    assert code == 0 and FOUND not in err
    dest = tmp_path / "as-json"
    code, _, err = invoke("convert", str(trace), str(dest), "--to", "json")
    assert code == 0, err
    assert FOUND in err
    groups = json.loads((dest / "workload.json").read_text())
    assert groups == json.loads((trace / "comm_group.json").read_text())
    code, out, err = invoke("validate", str(dest))
    assert code == 0 and "comm groups:" not in err
    for command in (["feed"], ["inspect", "trace"]):
        code, out, err = invoke(*command, str(trace), "--comm_group_file",
                                str(trace / "comm_group.json"))  # fmt: skip
        assert code == 0, err
        code, _, err = invoke(*command, str(trace), "--comm_group_file",
                              str(trace / "workload.0.et"))  # fmt: skip
        assert code == 2 and "not a readable JSON comm-group file" in err


def test_several_candidates_are_not_guessed(trace: Path) -> None:
    shutil.copy(trace / "comm_group.json", trace / "other.json")
    code, out, err = invoke("validate", str(trace), "--json")
    report = json.loads(out)
    assert code == 1 and "comm-group" in report["errors"]
    assert "comm_group.json, other.json" in err and "--comm_group_file" in err


def test_discovery_rules(trace: Path) -> None:
    (trace / "notes.json").write_text('{"title": "not groups"}')
    (trace / "broken.json").write_text("{")
    (trace / "empty.json").write_text("")
    files, default = find_rank_files(trace)
    assert default is not None and default.name == "workload.json"
    assert [p.name for p in find_comm_group_files(trace, files)] == ["comm_group.json"]
    path, note = locate_comm_groups(files, default)
    assert path == trace / "comm_group.json" and note is not None
    # the default name wins when it exists, with no note
    shutil.copy(trace / "comm_group.json", trace / "workload.json")
    assert locate_comm_groups(files, default) == (default, None)


def test_rank_files_of_a_json_trace_are_not_candidates(tmp_path: Path) -> None:
    root = tmp_path / "t"
    root.mkdir()
    (root / "w.0.json").write_text('{"workload_graph": [{"Id": 0, "Name": "a", "NodeType": 4}]}')
    (root / "w.1.json").write_text('{"1": [0, 1]}')  # named like a rank file: never taken
    assert find_comm_group_files(root) == []
