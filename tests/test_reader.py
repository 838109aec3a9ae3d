"""The trace reader against mlc-chakra's official decoding, and its strictness."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from stg.core.workload import CollectiveType, NodeType
from stg.errors import TraceError
from stg.trace import reader
from stg.trace.proto import chakra_v004_pb2 as pb4
from stg.trace.reader import TraceAttrs, detect_format, iter_nodes, read_metadata, read_nodes

HERE = Path(__file__).parent
DATA = HERE / "data"
SHARED = HERE.parent.parent / "shared" / "data" / "chakra"
SHARED_ET = sorted(SHARED.glob("**/*.et")) if SHARED.is_dir() else []
LOCAL_ET = sorted(DATA.glob("*.et")) + sorted(DATA.glob("chakra/chakra.0.et.gz"))

et_def = pytest.importorskip("chakra.schema.protobuf.et_def_pb2")
protolib = pytest.importorskip("chakra.src.third_party.utils.protolib")

KNOWN_INT = {"num_ops", "tensor_size", "comm_size", "comm_src", "comm_dst", "comm_tag"}


def official_decode(path: Path) -> tuple[object, list[object]]:
    """GlobalMetadata and Nodes as mlc-chakra's own reader decodes them."""
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


def official_value(attr: object) -> object:
    kind = attr.WhichOneof("value")  # type: ignore[attr-defined]
    value = getattr(attr, kind)
    return tuple(value.values) if kind.endswith("_list") else value


def check_same(ours: object, theirs: object) -> None:
    assert ours.id == theirs.id
    assert ours.name == theirs.name
    assert int(ours.type) == theirs.type
    assert ours.data_deps == tuple(theirs.data_deps)
    assert ours.ctrl_deps == tuple(theirs.ctrl_deps)
    assert ours.runtime == theirs.duration_micros
    seen = set()
    for attr in theirs.attr:
        name, value = attr.name, official_value(attr)
        seen.add(name)
        if name == "is_cpu_op":
            assert ours.is_cpu_op is bool(value)
        elif name in KNOWN_INT:
            assert getattr(ours, name) == value
        elif name == "comm_type":
            assert ours.comm_type == CollectiveType(value)
        elif name == "pg_name" and str(value).isdecimal():
            assert ours.comm_group == int(value)
        else:
            assert ours.attrs[name] == value
            assert ours.attrs.kinds[name] == attr.WhichOneof("value")
    assert set(ours.attrs) <= seen
    extras = ours.attrs.extras
    assert extras.get("start_time_micros", 0) == theirs.start_time_micros
    for io_name in ("inputs", "outputs"):
        if theirs.HasField(io_name):
            io_info = getattr(theirs, io_name)
            assert extras[io_name] == (io_info.values, io_info.shapes, io_info.types)
        else:
            assert io_name not in extras


@pytest.mark.parametrize("path", SHARED_ET + LOCAL_ET, ids=lambda p: p.name)
def test_matches_official_decoding(path: Path) -> None:
    meta, theirs = official_decode(path)
    ours = read_nodes(path)
    assert detect_format(path) == "v0.0.4"
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        check_same(a, b)
    md = read_metadata(path)
    assert md["format"] == "v0.0.4"
    assert md["version"] == meta.version
    assert dict(md["attrs"]) == {a.name: official_value(a) for a in meta.attr}


@pytest.mark.skipif(not (SHARED / "chakra.0.et").exists(), reason="needs ../shared/data")
def test_chakra_pytorch_trace_facts() -> None:
    path = SHARED / "chakra.0.et"
    nodes = read_nodes(path)
    assert len(nodes) == 3664
    first = {n.id: n for n in nodes}[216]
    assert first.type is NodeType.COMP and first.is_cpu_op is True
    assert first.attrs["rf_id"] == 2 and first.attrs.kinds["rf_id"] == "int64_val"
    md = read_metadata(path)
    assert md["version"] == "" and list(md["attrs"]) == [
        "schema", "pid", "time", "start_ts", "finish_ts"
    ]


def test_metadata_node_keeps_all_thirty_kinds() -> None:
    (node,) = read_nodes(DATA / "one_metadata_node_all_types.0.et")
    assert node.type is NodeType.METADATA
    assert len(node.attrs) == 30
    assert set(node.attrs.kinds.values()) == set(reader.SCALAR_KINDS) | set(reader.LIST_KINDS)
    assert node.attrs["sint64"] == -9876543210
    assert node.attrs["bytes_list"][0] == b"12345"
    assert node.attrs["bool_list"][:2] == (True, False)
    assert node.attrs.docs["double"] == "double"


def test_feeder_json() -> None:
    path = DATA / "small_chakra.0.json"
    assert detect_format(path) == "json"
    nodes = read_nodes(path)
    raw = json.loads(path.read_text())["workload_graph"]
    assert [n.id for n in nodes] == [e["Id"] for e in raw]
    assert [n.data_deps for n in nodes] == [tuple(e["data_deps"]) for e in raw]
    assert [n.ctrl_deps for n in nodes] == [tuple(e["ctrlDeps"]) for e in raw]
    assert [n.runtime for n in nodes] == [e["runtime"] for e in raw]
    assert nodes[3].type is NodeType.COMM_COLL and nodes[2].is_cpu_op is False
    assert read_metadata(path)["attrs"]["ngpus"] == 8


def test_small_chunks_read_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    path = DATA / "one_metadata_node_all_types.0.et"
    expected = read_nodes(path)
    monkeypatch.setattr(reader, "_CHUNK", 3)
    assert read_nodes(path) == expected


def test_gzip_by_magic(tmp_path: Path) -> None:
    src = DATA / "one_metadata_node_all_types.0.et"
    for name in ("t.0.et.gz", "t.0.et"):
        dst = tmp_path / name
        dst.write_bytes(gzip.compress(src.read_bytes(), mtime=0))
        assert read_nodes(dst) == read_nodes(src)
    js = tmp_path / "s.json.gz"
    js.write_bytes(gzip.compress((DATA / "small_chakra.0.json").read_bytes()))
    assert read_nodes(js) == read_nodes(DATA / "small_chakra.0.json")


# --- strictness -------------------------------------------------------------------------------


def _records(*payloads: bytes) -> bytes:
    from stg.trace.writer import frame

    return b"".join(frame(p) for p in payloads)


def _meta() -> bytes:
    meta = pb4.GlobalMetadata(version="0.0.4")
    return meta.SerializeToString()


def _node(node_id: int, **kw: object) -> bytes:
    node = pb4.Node(id=node_id, name=f"n{node_id}", type=pb4.COMP_NODE, **kw)
    attr = node.attr.add()
    attr.name = "is_cpu_op"
    attr.bool_val = False
    return node.SerializeToString()


def _write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "bad.0.et"
    path.write_bytes(data)
    return path


def test_truncated_record_names_offset_and_index(tmp_path: Path) -> None:
    good = _records(_meta(), _node(1), _node(2))
    path = _write(tmp_path, good[:-3])
    nodes = iter_nodes(path)
    assert next(nodes).id == 1  # streaming: earlier nodes arrive before the error
    with pytest.raises(TraceError, match=r"bad\.0\.et: truncated record 2 at byte \d+"):
        next(nodes)


def test_truncated_varint(tmp_path: Path) -> None:
    path = _write(tmp_path, _records(_meta(), _node(1)) + b"\x85")
    with pytest.raises(TraceError, match=r"truncated length varint .* \(record 2\)"):
        read_nodes(path)


def test_zero_length_record(tmp_path: Path) -> None:
    data = _records(_meta(), _node(1))
    path = _write(tmp_path, data + b"\x00" + _records(_node(2)))
    with pytest.raises(TraceError, match=rf"empty \(zero-length\) record at byte {len(data)}"):
        read_nodes(path)


def test_unparseable_record(tmp_path: Path) -> None:
    path = _write(tmp_path, _records(_meta(), _node(1), b"\x0a\x05ab"))
    with pytest.raises(TraceError, match=r"record 2 at byte .* does not parse as a v0\.0\.4 Node"):
        read_nodes(path)


def test_missing_global_metadata(tmp_path: Path) -> None:
    path = _write(tmp_path, _records(_node(1), _node(2)))
    with pytest.raises(TraceError, match="does not start with GlobalMetadata"):
        read_nodes(path)
    with pytest.raises(TraceError, match="not a GlobalMetadata"):
        read_nodes(path, format="v0.0.4")


def test_unknown_types_and_wrong_attribute_kind(tmp_path: Path) -> None:
    bad_type = pb4.Node(id=1, name="x", type=9).SerializeToString()
    with pytest.raises(TraceError, match="unknown type 9"):
        read_nodes(_write(tmp_path, _records(_meta(), bad_type)))
    node = pb4.Node(id=1, name="x", type=pb4.COMP_NODE)
    attr = node.attr.add()
    attr.name, attr.double_val = "num_ops", 1.5
    with pytest.raises(TraceError, match="stores attribute num_ops as double_val"):
        read_nodes(_write(tmp_path, _records(_meta(), node.SerializeToString())))


def test_empty_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        read_nodes(tmp_path / "nope.0.et")
    with pytest.raises(TraceError, match="empty file, not a Chakra trace"):
        read_nodes(_write(tmp_path, b""), format="v0.0.4")  # a trace holds its metadata
    with pytest.raises(TraceError, match=r"format=.v9. is not known; allowed: v0\.0\.4, v0\.0\.1"):
        read_nodes(DATA / "one_comm_send_node.0.et", format="v9")


def test_bad_json(tmp_path: Path) -> None:
    path = tmp_path / "t.0.json"
    path.write_text('{"workload_graph": [{"Id": 1, "Name": "a"}]}')
    with pytest.raises(TraceError, match=r"workload_graph\[0\] lacks 'NodeType'"):
        read_nodes(path)
    path.write_text('{"workload_graph": [')
    with pytest.raises(TraceError, match="not valid JSON"):
        read_nodes(path)


def test_trace_attrs_is_a_dict() -> None:
    attrs = TraceAttrs({"a": 1})
    attrs.kinds["a"] = "uint32_val"
    assert attrs == {"a": 1} and reader.attr_kind(attrs, "a") == "uint32_val"
    assert reader.attr_kind({"b": (True, False)}, "b") == "bool_list"
    assert reader.infer_kind(2.5) == "double_val"


def test_detection_without_extension(tmp_path: Path) -> None:
    meta = pb4.GlobalMetadata(version="0.0.4")
    meta.attr.add(name="generator", string_val="x" * 100)
    data = meta.SerializeToString()
    assert len(data) == 123  # its length prefix is the byte "{"
    path = tmp_path / "trace"
    path.write_bytes(_records(data, _node(1)))
    assert detect_format(path) == "v0.0.4"
    assert [n.id for n in read_nodes(path)] == [1]
    js = tmp_path / "trace2"
    js.write_text('  {"workload_graph": []}')
    assert detect_format(js) == "json"
    with pytest.raises(TraceError, match="no nodes"):
        read_nodes(js)  # a rank file without nodes is not a trace


def test_v001_detection_reads_past_ambiguous_records(tmp_path: Path) -> None:
    from stg.trace.proto import chakra_v001_pb2 as pb1

    plain = pb1.Node(id=1, name="a", node_type=pb1.COMP_NODE).SerializeToString()
    typed = pb1.Node(id=2, name="b", node_type=pb1.COMP_NODE, parent=[1], num_ops=7)
    path = tmp_path / "old.0.et"
    path.write_bytes(_records(plain, typed.SerializeToString()))
    assert detect_format(path) == "v0.0.1"
    nodes = read_nodes(path)
    assert [(n.id, n.type, n.data_deps, n.num_ops) for n in nodes] == [
        (1, NodeType.COMP, (), 0), (2, NodeType.COMP, (1,), 7)
    ]


def test_reads_through_the_fast_decoder() -> None:
    """These tests exercise the compiled decoder (stg.trace.decode) when it is built; the
    reference decoder is compared with it in tests/test_decode.py."""
    from stg.trace import decode

    if not decode.enabled():
        pytest.skip(decode.status())
    assert reader.iter_nodes(DATA / "one_comm_send_node.0.et").__qualname__.startswith(
        "_iter_protobuf"
    )
