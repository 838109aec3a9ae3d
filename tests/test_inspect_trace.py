"""``stg inspect trace`` and stg.trace.stats: counts, bytes, critical path, DOT output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_feed_cli import run, write_json_trace

from stg.trace.stats import TraceFile, analyze, find_trace_files

LOCAL = Path(__file__).resolve().parent / "data" / "chakra"


@pytest.fixture
def rank_files(tmp_path: Path) -> Path:
    # rank 0: two GEMMs, an all-reduce, an all-gather, a send; rank 1: a recv and a GEMM
    write_json_trace(
        tmp_path / "w.0.json",
        [
            {"Id": 1, "num_ops": 1000, "tensor_size": 64, "runtime": 5},
            {"Id": 2, "data_deps": [1], "num_ops": 500, "tensor_size": 32, "runtime": 7},
            {"Id": 3, "data_deps": [2], "NodeType": 7, "comm_type": 0, "comm_size": 4096,
             "pg_name": "1", "runtime": 20},
            {"Id": 4, "ctrl_deps": [3], "NodeType": 7, "comm_type": 2, "comm_size": 128,
             "pg_name": "1", "runtime": 3},
            {"Id": 5, "data_deps": [1], "NodeType": 5, "comm_size": 256, "comm_dst": 1,
             "comm_tag": 9, "runtime": 2},
        ],
    )  # fmt: skip
    write_json_trace(
        tmp_path / "w.1.json",
        [
            {"Id": 1, "NodeType": 6, "comm_size": 256, "comm_src": 0, "comm_tag": 9},
            {"Id": 2, "data_deps": [1], "num_ops": 10, "runtime": 4},
        ],
    )
    return tmp_path


def test_stats_of_one_rank(rank_files: Path) -> None:
    stats = analyze(TraceFile("w", 0, rank_files / "w.0.json"))
    assert stats.error is None
    assert stats.nodes == 5
    assert stats.by_type == {"COMM_COLL": 2, "COMM_SEND": 1, "COMP": 2}
    assert stats.flops == 1500
    assert stats.tensor_bytes == 96
    assert stats.collective_counts == {"ALL_GATHER": 1, "ALL_REDUCE": 1}
    assert stats.collective_bytes == {"ALL_GATHER": 128, "ALL_REDUCE": 4096}
    assert (stats.send_count, stats.send_bytes, stats.recv_count) == (1, 256, 0)
    assert stats.critical_path == 4  # 1 -> 2 -> 3 -> 4 (ctrl)
    assert stats.critical_path_us == 5 + 7 + 20 + 3
    data_only = analyze(TraceFile("w", 0, rank_files / "w.0.json"), deps="data")
    assert data_only.critical_path == 3 and data_only.critical_path_us == 32


def test_critical_path_of_a_long_chain_is_iterative(tmp_path: Path) -> None:
    n = 20000
    write_json_trace(
        tmp_path / "c.0.json",
        [{"Id": 0}] + [{"Id": i, "data_deps": [i - 1]} for i in range(1, n)],
    )
    stats = analyze(TraceFile("c", 0, tmp_path / "c.0.json"), window=100)
    assert stats.critical_path == n and stats.rounds == n and stats.max_width == 1


def test_critical_path_with_forward_references_and_sparse_ids(tmp_path: Path) -> None:
    big = 1 << 40
    write_json_trace(
        tmp_path / "s.0.json",
        [{"Id": 7, "data_deps": [big]}, {"Id": big}, {"Id": 3, "data_deps": [7, big]}],
    )
    stats = analyze(TraceFile("s", 0, tmp_path / "s.0.json"))
    assert stats.critical_path == 3 and stats.rounds == 3


def test_inspect_trace_json_totals(capsys: pytest.CaptureFixture[str], rank_files: Path):
    code, out, err = run(capsys, "inspect", "trace", rank_files, "--json")
    assert code == 0 and err == ""
    report = json.loads(out)
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert report["ranks"][1]["recv_bytes"] == 256
    total = report["total"]
    assert total["flops"] == 1510
    assert total["send_bytes"] == total["recv_bytes"] == 256
    assert total["collective_bytes"] == {"ALL_GATHER": 128, "ALL_REDUCE": 4096}
    assert total["critical_path"] == 4


def test_inspect_trace_text(capsys: pytest.CaptureFixture[str], rank_files: Path) -> None:
    code, out, _ = run(capsys, "inspect", "trace", rank_files / "w", "--rank", "0")
    assert code == 0
    assert "FLOPs          1,500" in out
    assert "ALL_REDUCE     1 ops, 4,096 bytes" in out
    assert "critical path  4 nodes, 35 us of runtime" in out


def test_inspect_trace_dot(capsys: pytest.CaptureFixture[str], rank_files: Path) -> None:
    target = rank_files / "g.dot"
    code, _, _ = run(capsys, "inspect", "trace", rank_files, "--rank", "0", "--dot", target)
    assert code == 0
    text = target.read_text()
    assert text.startswith('digraph "w.0" {\n') and text.endswith("}\n")
    assert "  n1 -> n2;\n" in text
    assert "  n3 -> n4 [style=dashed];\n" in text
    assert 'n3 [label="3 COMM_COLL\\nn3\\nALL_REDUCE 4096 B", fillcolor=orange];' in text
    assert text.count(" [label=") == 5
    code, _, _ = run(
        capsys, "inspect", "trace", rank_files, "--rank", "0", "--dot", target, "--deps", "data"
    )
    assert code == 0 and "dashed" not in target.read_text()


def test_inspect_dot_needs_one_rank_and_writes_nothing_otherwise(capsys, rank_files: Path):
    target = rank_files / "g.dot"
    code, out, err = run(capsys, "inspect", "trace", rank_files, "--dot", target)
    assert code == 2 and out == ""
    assert "choose one with --rank (w.0, w.1)" in err
    assert not target.exists()


def test_inspect_dot_of_an_invalid_trace_leaves_no_file(capsys, tmp_path: Path) -> None:
    write_json_trace(tmp_path / "b.0.json", [{"Id": 1, "data_deps": [9]}])
    target = tmp_path / "b.dot"
    code, _, err = run(capsys, "inspect", "trace", tmp_path / "b.0.json", "--dot", target)
    assert code == 1 and "node 1 has data dep 9, which never appears" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.0.json"]


def test_inspect_dot_into_a_missing_directory_exits_2(capsys, rank_files: Path) -> None:
    code, _, err = run(
        capsys, "inspect", "trace", rank_files / "w.0.json", "--dot", rank_files / "no" / "g.dot"
    )
    assert code == 2 and "does not exist" in err


def test_inspect_chakra_trace_matches_the_feeder_rounds(capsys) -> None:
    code, out, _ = run(capsys, "inspect", "trace", LOCAL / "chakra.0.et.gz", "--deps", "data",
                       "--json")  # fmt: skip
    assert code == 0
    (rank,) = json.loads(out)["ranks"]
    assert rank["critical_path"] == rank["rounds"] == 1966
    assert rank["collective_counts"] == {"ALL_REDUCE": 5, "BROADCAST": 2, "UNSET": 14}


def test_generated_traces_by_directory() -> None:
    files = find_trace_files(LOCAL / "generated")
    assert len(files) == 28
    assert files[0] == TraceFile("ALL_GATHER", 0, LOCAL / "generated" / "ALL_GATHER.0.et")
    for trace in files:
        stats = analyze(trace)
        assert stats.error is None and stats.nodes >= 1


def test_inspect_group_lists_trace(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", "--help")
    assert code == 0 and "trace" in out


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_critical_path_matches_a_longest_path_oracle(data: st.DataObject) -> None:
    import tempfile

    n = data.draw(st.integers(1, 25))
    edges = data.draw(
        st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=3 * n)
    )
    parents: dict[int, set[int]] = {i: set() for i in range(n)}
    for a, b in edges:
        if a < b:
            parents[b].add(a)
    runtime = {i: data.draw(st.integers(0, 9)) for i in range(n)}
    longest: dict[int, tuple[int, int]] = {}
    for i in range(n):  # ids are a topological order
        depth = max((longest[p][0] for p in parents[i]), default=0) + 1
        span = max((longest[p][1] for p in parents[i]), default=0) + runtime[i]
        longest[i] = (depth, span)
    order = list(range(n))
    data.draw(st.randoms()).shuffle(order)  # forward references
    with tempfile.TemporaryDirectory() as tmp:
        path = write_json_trace(
            Path(tmp) / "r.0.json",
            [{"Id": i, "data_deps": sorted(parents[i]), "runtime": runtime[i]} for i in order],
        )
        stats = analyze(TraceFile("r", 0, path))
    assert stats.error is None
    assert stats.critical_path == max(d for d, _ in longest.values()) == stats.rounds
    assert stats.critical_path_us == max(s for _, s in longest.values())
