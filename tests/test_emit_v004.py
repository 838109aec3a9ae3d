"""The chakra-v0.0.4 emitter: files, framing, attribute kinds, caching, round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from formats_samples import pipeline_workload

from stg.core.workload import NodeType
from stg.emitters.chakra_v004 import EMITTER
from stg.trace.chakra_v004 import encode_nodes
from stg.trace.reader import iter_records, read_metadata, read_nodes
from stg.trace.writer import frame, generator_metadata, varint, write_workload

SHARED = Path(__file__).parent.parent.parent / "shared" / "data" / "chakra"
DATA = Path(__file__).parent / "data"

et_def = pytest.importorskip("chakra.schema.protobuf.et_def_pb2")
protolib = pytest.importorskip("chakra.src.third_party.utils.protolib")

EXPECTED_KINDS = {
    "is_cpu_op": "bool_val",
    "num_ops": "int64_val",
    "tensor_size": "uint64_val",
    "comm_type": "int64_val",
    "comm_size": "int64_val",
    "pg_name": "string_val",
    "comm_src": "int32_val",
    "comm_dst": "int32_val",
    "comm_tag": "int32_val",
    "dtype": "string_val",
}


def official(path: Path) -> tuple[object, list[object]]:
    handle = protolib.openFileRd(str(path))
    meta = et_def.GlobalMetadata()
    assert protolib.decodeMessage(handle, meta)
    nodes = []
    while True:
        node = et_def.Node()
        if not protolib.decodeMessage(handle, node):
            break
        nodes.append(node)
    handle.close()
    return meta, nodes


@pytest.fixture
def written(tmp_path: Path) -> tuple[object, list[Path]]:
    workload = pipeline_workload(tp=2, pp=2, dp=2)
    return workload, write_workload(workload, EMITTER, tmp_path / "out", "workload")


def test_files_and_comm_groups(written: tuple[object, list[Path]]) -> None:
    workload, paths = written
    names = [p.name for p in paths]
    assert names == [f"workload.{r}.et" for r in range(8)] + ["workload.json"]
    groups = json.loads(paths[-1].read_text())
    assert groups == {str(g): list(m) for g, m in sorted(workload.comm_groups.items())}
    assert all(k.isdecimal() and int(k) >= 1 for k in groups)
    assert all(len(m) > 1 and m == sorted(m) for m in groups.values())
    assert list(groups) == sorted(groups, key=int)


def test_official_reader_sees_exact_kinds(written: tuple[object, list[Path]]) -> None:
    workload, paths = written
    for rank, path in enumerate(paths[:-1]):
        meta, nodes = official(path)
        assert meta.version == "0.0.4"
        attrs = {a.name: a for a in meta.attr}
        assert attrs["generator"].string_val == "stg"
        assert attrs["generator_version"].WhichOneof("value") == "string_val"
        assert attrs["rank"].int64_val == rank
        expected = list(workload.ranks[rank].nodes())
        assert [n.id for n in nodes] == sorted(n.id for n in expected)
        for msg, node in zip(nodes, expected, strict=True):
            kinds = {a.name: a.WhichOneof("value") for a in msg.attr}
            assert kinds["is_cpu_op"] == "bool_val"
            for name, kind in kinds.items():
                assert EXPECTED_KINDS[name] == kind, name
            by_name = {a.name: a for a in msg.attr}
            if node.type is NodeType.COMP:
                assert by_name["num_ops"].int64_val == node.num_ops
                assert by_name["tensor_size"].uint64_val == node.tensor_size
            if node.type is NodeType.COMM_COLL:
                assert by_name["comm_type"].int64_val == int(node.comm_type)
                assert by_name["pg_name"].string_val == str(node.comm_group)
                assert by_name["comm_size"].int64_val == node.comm_size
            if node.type is NodeType.COMM_SEND:
                assert by_name["comm_dst"].int32_val == node.comm_dst
                assert by_name["comm_tag"].int32_val == node.comm_tag
            if node.type is NodeType.COMM_RECV:
                assert by_name["comm_src"].int32_val == node.comm_src


def test_reads_back_equal_and_no_empty_record(written: tuple[object, list[Path]]) -> None:
    workload, paths = written
    for graph, path in zip(workload.ranks, paths, strict=False):
        assert read_nodes(path) == list(graph.nodes())
        with open(path, "rb") as stream:
            assert all(len(data) > 0 for _, _, data in iter_records(stream, path))


def test_cached_bytes_equal_direct_encoding(written: tuple[object, list[Path]]) -> None:
    workload, paths = written
    for graph, path in zip(workload.ranks, paths, strict=False):
        direct = encode_nodes(graph.nodes(), generator_metadata(workload, graph.rank, "workload"))
        assert path.read_bytes() == direct


def test_deterministic(tmp_path: Path) -> None:
    a = write_workload(pipeline_workload(), EMITTER, tmp_path / "a", "w.%d.et")
    b = write_workload(pipeline_workload(), EMITTER, tmp_path / "b", "w.%d.et")
    assert [p.name for p in a] == ["w.0.et", "w.1.et", "w.2.et", "w.3.et", "w.json"]
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]


@pytest.mark.parametrize(
    "path",
    [DATA / "one_metadata_node_all_types.0.et", SHARED / "chakra.0.et"],
    ids=lambda p: p.name,
)
def test_foreign_trace_round_trips(tmp_path: Path, path: Path) -> None:
    if not path.exists():
        pytest.skip("needs ../shared/data")
    nodes = read_nodes(path)
    meta = read_metadata(path)
    out = tmp_path / "copy.0.et"
    out.write_bytes(encode_nodes(nodes, meta["attrs"], version=meta["version"]))
    again = read_nodes(out)
    assert again == nodes
    for a, b in zip(again, nodes, strict=True):
        assert a.attrs.kinds == b.attrs.kinds
        assert a.attrs.docs == b.attrs.docs
        assert a.attrs.extras == b.attrs.extras
    meta2 = read_metadata(out)
    assert meta2["version"] == meta["version"] and meta2["attrs"] == meta["attrs"]
    assert meta2["attrs"].kinds == meta["attrs"].kinds
    # The official reader agrees on every node of the copy.
    _, theirs = official(out)
    _, original = official(path)
    assert len(theirs) == len(original)


def test_frame_refuses_empty_record() -> None:
    with pytest.raises(ValueError, match="empty record"):
        frame(b"")
    assert varint(300) == b"\xac\x02"
