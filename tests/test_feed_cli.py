"""``stg feed``: rank discovery, statistics, exit codes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stg.cli import main

LOCAL = Path(__file__).resolve().parent / "data" / "chakra"


def write_json_trace(path: Path, nodes: list[dict[str, Any]]) -> Path:
    """A Chakra feeder-JSON rank file; each node dict gives Id and deps, the rest defaults."""
    graph = []
    for n in nodes:
        entry = {"Name": f"n{n['Id']}", "NodeType": 4, "runtime": 1, "is_cpu_op": False}
        entry.update(n)
        graph.append(entry)
    path.write_text(json.dumps({"workload_graph": graph}))
    return path


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def diamond(rank_dir: Path, rank: int) -> Path:
    # 0 -> {1, 2, 3} -> 4, plus an independent 5 and a ctrl-ordered 6 after 4
    return write_json_trace(
        rank_dir / f"workload.{rank}.json",
        [
            {"Id": 0},
            {"Id": 1, "data_deps": [0]},
            {"Id": 2, "data_deps": [0]},
            {"Id": 3, "data_deps": [0], "NodeType": 7, "comm_type": 0, "comm_size": 64},
            {"Id": 4, "data_deps": [1, 2, 3]},
            {"Id": 5},
            {"Id": 6, "ctrl_deps": [4]},
        ],
    )


@pytest.fixture
def two_ranks(tmp_path: Path) -> Path:
    diamond(tmp_path, 0)
    diamond(tmp_path, 1)
    (tmp_path / "workload.json").write_text('{"1": [0, 1]}')  # the comm-group file: skipped
    return tmp_path


def test_feed_directory_reports_every_rank(capsys: pytest.CaptureFixture[str], two_ranks: Path):
    code, out, err = run(capsys, "feed", two_ranks, "--json")
    assert code == 0 and err == ""
    report = json.loads(out)
    assert [(r["name"], r["rank"]) for r in report["ranks"]] == [("workload", 0), ("workload", 1)]
    first = report["ranks"][0]
    assert first["nodes"] == 7
    assert first["rounds"] == 4  # {0, 5} {1, 2, 3} {4} {6}
    assert first["max_width"] == 3
    assert first["mean_width"] == pytest.approx(7 / 4)
    assert first["by_type"] == {"COMM_COLL": 1, "COMP": 6}
    assert first["error"] is None and report["invalid"] == 0


def test_feed_data_deps_only_ignores_ctrl_deps(capsys: pytest.CaptureFixture[str], two_ranks):
    code, out, _ = run(capsys, "feed", two_ranks, "--rank", "1", "--deps", "data", "--json")
    assert code == 0
    (only,) = json.loads(out)["ranks"]
    assert only["rank"] == 1 and only["rounds"] == 3  # 6 now starts in the first round


def test_feed_text_table(capsys: pytest.CaptureFixture[str], two_ranks: Path) -> None:
    code, out, _ = run(capsys, "feed", two_ranks / "workload")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["trace", "nodes", "rounds"]
    assert lines[1].split()[:5] == ["workload.0", "7", "4", "3", "1.75"]
    assert lines[2].startswith("workload.1 ")


@pytest.mark.parametrize("spec", ["workload", "workload.%d.json", "workload.1.json"])
def test_feed_prefix_and_pattern_and_file(capsys, two_ranks: Path, spec: str) -> None:
    code, out, _ = run(capsys, "feed", two_ranks / spec, "--json")
    assert code == 0
    ranks = [r["rank"] for r in json.loads(out)["ranks"]]
    assert ranks == ([1] if spec.endswith("1.json") else [0, 1])


def test_feed_invalid_trace_exits_1_and_reports_the_others(capsys, two_ranks: Path) -> None:
    write_json_trace(
        two_ranks / "workload.1.json",
        [{"Id": 0}, {"Id": 1, "data_deps": [2]}, {"Id": 2, "data_deps": [1]}],
    )
    code, out, err = run(capsys, "feed", two_ranks)
    assert code == 1
    assert err.count("\n") == 1
    assert err.startswith("error: ") and "dependency cycle 1 -> 2 -> 1" in err
    assert "workload.0" in out and "invalid" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--deps", "ctrl"], "--deps ctrl: not known; allowed: data, data+ctrl"),
        (["--window", "0"], "--window 0: must be a positive integer"),
        (["--format", "xml"], "--format xml: not known; allowed: v0.0.4, v0.0.1, json"),
        (["--rank", "7"], "--rank 7: no such rank; ranks present: 0-1"),
    ],
)
def test_feed_bad_options_exit_2(capsys, two_ranks: Path, args: list[str], message: str):
    code, out, err = run(capsys, "feed", two_ranks, *args)
    assert code == 2 and out == ""
    assert err == f"error: {message}\n"


def test_feed_missing_path_exits_2(capsys, tmp_path: Path) -> None:
    code, out, err = run(capsys, "feed", tmp_path / "nothing" / "here")
    assert code == 2 and out == ""
    assert "no trace files" in err and err.count("\n") == 1


def test_feed_chakra_trace(capsys: pytest.CaptureFixture[str]) -> None:
    trace = LOCAL / "chakra.0.et.gz"
    code, out, err = run(capsys, "feed", trace, "--deps", "data", "--json")
    assert code == 0
    (rank,) = json.loads(out)["ranks"]
    assert rank["nodes"] == 3664 and rank["by_type"] == {"COMM_COLL": 21, "COMP": 3643}
    assert rank["rounds"] == 1966
    code, out, err = run(capsys, "feed", trace)
    assert code == 1 and "--deps data" in err


def test_feed_output_is_deterministic(capsys, two_ranks: Path) -> None:
    first = run(capsys, "feed", two_ranks, "--json")
    assert run(capsys, "feed", two_ranks, "--json") == first
