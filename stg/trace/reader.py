"""Streaming readers of Chakra execution traces into :class:`stg.core.workload.Node`.

Three formats are read, one rank file at a time:

``v0.0.4``
    Current Chakra protobuf: a ``GlobalMetadata`` record, then ``Node`` records.
``v0.0.1``
    Legacy proto2 protobuf: ``Node`` records only, with typed fields.
``json``
    Chakra's feeder JSON ``{"workload_graph": [...]}``. The compiled decoder
    (:mod:`stg.trace.decode`) streams it one entry at a time through its bounded buffer; this
    module's reference decoder loads the document whole (``json.load``).

Protobuf files are a sequence of records, each preceded by its length as a varint. They are
read through a bounded buffer, so memory stays constant whatever the file size; gzip files
(recognised by their magic bytes, whatever their name) are decompressed on the fly.

Format detection (``format=None``)
    A name ending in ``.json`` or ``.json.gz`` is JSON, one ending in ``.et`` or ``.et.gz`` is
    protobuf; any other name is JSON when it starts with ``{"`` (whitespace allowed). A
    protobuf file's records are inspected at the wire level, without a schema. A first
    record that holds only
    length-delimited fields 1 and 2, parses as ``GlobalMetadata``, has a valid UTF-8 version
    and only named attributes carrying a value is v0.0.4 metadata. Otherwise the records are
    Nodes, and each is classified by its wire layout: fields above 10, or varints in fields
    4, 5, 8, 9 or 10, exist only in v0.0.1; length-delimited fields 5, 8, 9 or 10 exist only
    in v0.0.4. The first decisive record (of at most 64) wins; a v0.0.4 verdict means the
    file lacks its ``GlobalMetadata`` and is rejected. A file whose first 64 records are all
    ambiguous (only id, name, type, times) is read as v0.0.1.

Strictness: a truncated varint or record, an empty (zero-length) record, a record that does
not parse, an unknown node or collective type, a well-known attribute of the wrong kind, or a
v0.0.4 file without ``GlobalMetadata`` raises :class:`stg.errors.TraceError` naming the file,
the byte offset and the record index (0 = the first record of the file). So does a file that
holds something but no nodes: a v0.0.4 file holding only its ``GlobalMetadata``, a JSON file
with an empty ``workload_graph``, and a 0-byte file (a trace holds at least its metadata
record): ``<path>: empty file, not a Chakra trace``. A file whose first record cannot be framed
or is not a protobuf message (an image, a text file named ``.et``), or a ``.json`` file that
is not JSON, raises ``<path>: not a Chakra trace (<why>)``.

Attribute mapping (v0.0.4): ``is_cpu_op``, ``num_ops``, ``tensor_size``, ``comm_type``,
``comm_size``, ``comm_src``, ``comm_dst``, ``comm_tag`` and ``dtype`` become Node fields;
``pg_name`` becomes ``comm_group`` when it is a decimal string. Every other attribute lands in
``Node.attrs`` (a :class:`TraceAttrs`) with its Python value (lists as tuples); the attrs also
remember each attribute's value kind and doc string, and the node's fields that Node has no
slot for (``start_time_micros``, ``inputs``, ``outputs``), so that writers lose nothing.

Presence: ``is_cpu_op``, ``num_ops``, ``tensor_size`` and ``comm_size`` (:data:`DEFAULTED`)
read as False or 0 where a file leaves them out. Which ones a v0.0.4 node gives is in its
``attrs.field_kinds``; for a JSON node only with ``iter_nodes(presence=True)``, which parses
the file a second time for the keys of each entry (a key listed in the entry's ``stg_unset``
is not given). Writers told so (``presence=True``, as ``stg convert`` does) write these
attributes where the source gave them, not by their default rule.
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
import re
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from google.protobuf.message import DecodeError

from stg.core.workload import OP_ATTR, CollectiveType, Node, NodeType, has_implied_op, implied_op
from stg.errors import TraceError
from stg.trace.proto import chakra_v004_pb2 as pb4

FORMATS: tuple[str, ...] = ("v0.0.4", "v0.0.1", "json")
_CHUNK = 1 << 20
_MAX_RECORD = 1 << 30
_DETECT_RECORDS = 64

# Attribute value kinds of AttributeProto (the oneof field names).
SCALAR_KINDS: tuple[str, ...] = (
    "double_val", "float_val", "int32_val", "int64_val", "uint32_val", "uint64_val",
    "sint32_val", "sint64_val", "fixed32_val", "fixed64_val", "sfixed32_val", "sfixed64_val",
    "bool_val", "string_val", "bytes_val",
)  # fmt: skip
LIST_KINDS: tuple[str, ...] = tuple(k[:-4] + "_list" for k in SCALAR_KINDS)
INT_KINDS: frozenset[str] = frozenset(k for k in SCALAR_KINDS if "int" in k or "fixed" in k)

# Attributes that map onto Node fields.
WELL_KNOWN: frozenset[str] = frozenset(
    {"is_cpu_op", "num_ops", "tensor_size", "comm_type", "comm_size", "comm_src", "comm_dst",
     "comm_tag", "dtype"}
)  # fmt: skip
# Well-known attributes whose Node field reads as False or 0 where a file leaves them out, with
# their kinds of TRACES.md (see "Presence" in the module doc).
DEFAULTED: dict[str, str] = {
    "is_cpu_op": "bool_val", "num_ops": "int64_val", "tensor_size": "uint64_val",
    "comm_size": "int64_val",
}  # fmt: skip


class TraceAttrs(dict[str, Any]):
    """``Node.attrs`` as read from a trace: a plain dict of attribute values that also
    remembers how each was stored.

    ``kinds`` maps an attribute name to its AttributeProto value kind (``"int64_val"``,
    ``"bool_list"``, ...); ``docs`` holds non-empty doc strings; ``extras`` holds node fields
    that :class:`Node` has no slot for (``start_time_micros``; ``inputs`` and ``outputs`` as
    ``(values, shapes, types)``). ``field_kinds`` records, for the validator, the kinds the
    file used for attributes that became Node fields (``num_ops``, ``pg_name``, ...); writers
    use the kinds of TRACES.md, and with ``presence`` only its names (see module doc).
    Equality is that of the dict.
    """

    __slots__ = ("docs", "extras", "field_kinds", "kinds")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kinds: dict[str, str] = {}
        self.docs: dict[str, str] = {}
        self.extras: dict[str, Any] = {}
        self.field_kinds: dict[str, str] = {}


def _imply_op(attrs: TraceAttrs, name: str) -> None:
    """Put back the ``op`` a writer left out (:func:`stg.core.workload.implied_op`)."""
    if OP_ATTR not in attrs and has_implied_op(attrs):
        attrs[OP_ATTR] = implied_op(name)
        attrs.kinds[OP_ATTR] = "string_val"


def attr_kind(attrs: Mapping[str, Any], name: str) -> str:
    """The value kind to store attribute ``name`` with: the remembered one, else inferred."""
    kinds = getattr(attrs, "kinds", None)
    if kinds and name in kinds:
        return kinds[name]
    return infer_kind(attrs[name])


def infer_kind(value: Any) -> str:
    """The natural AttributeProto kind of a Python value."""
    if isinstance(value, bool):
        return "bool_val"
    if isinstance(value, int):
        return "int64_val"
    if isinstance(value, float):
        return "double_val"
    if isinstance(value, str):
        return "string_val"
    if isinstance(value, bytes):
        return "bytes_val"
    if isinstance(value, (tuple, list)):
        kinds = {infer_kind(v) for v in value}
        if not kinds:
            return "int64_list"
        if len(kinds) == 1:
            return kinds.pop()[:-4] + "_list"
        if kinds <= {"int64_val", "double_val"}:
            return "double_list"
    raise TypeError(f"attribute value {value!r} has no Chakra attribute kind")


# ---------------------------------------------------------------------------------------------
# Record framing


def _open_binary(path: Path) -> IO[bytes]:
    try:
        raw = open(path, "rb")
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory, not a trace file") from None
    except PermissionError:
        raise TraceError(f"{path}: permission denied") from None
    if raw.peek(2)[:2] == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    return raw


def iter_records(
    stream: IO[bytes], name: str | Path, state: dict[str, Any] | None = None
) -> Iterator[tuple[int, int, bytes]]:
    """Yield ``(index, offset, payload)`` for each varint-length-prefixed record of a stream.

    ``offset`` is the byte offset of the record's length prefix in the (decompressed) stream.
    Raises :class:`TraceError` on a truncated varint or record and on an empty record.
    With ``state``, each yield first stores there what a reader taking over the stream after
    this record needs: ``rest`` (the bytes read but not consumed), ``base`` (their stream
    offset) and ``index`` (the next record's index).
    """
    buf = b""
    pos = 0
    base = 0  # stream offset of buf[0]
    index = 0
    eof = False

    def fill(need: int) -> bool:
        nonlocal buf, pos, base, eof
        while len(buf) - pos < need and not eof:
            try:
                chunk = stream.read(max(_CHUNK, need - (len(buf) - pos)))
            except (EOFError, OSError, zlib.error) as exc:  # corrupt or cut-off gzip stream
                raise TraceError(
                    f"{name}: unreadable compressed data near byte {base + len(buf)}: {exc}"
                ) from None
            if not chunk:
                eof = True
                break
            base += pos
            buf = buf[pos:] + chunk
            pos = 0
        return len(buf) - pos >= need

    while True:
        if not fill(1):
            return
        offset = base + pos
        length = 0
        shift = 0
        p = pos
        while True:
            if p >= len(buf):
                consumed = p - pos
                if not fill(consumed + 1):
                    raise TraceError(
                        f"{name}: truncated length varint at byte {offset} (record {index})"
                    )
                p = pos + consumed
            byte = buf[p]
            p += 1
            length |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
            if shift > 63:
                raise TraceError(
                    f"{name}: malformed length varint at byte {offset} (record {index})"
                )
        header = p - pos
        if length == 0:
            raise TraceError(
                f"{name}: empty (zero-length) record at byte {offset} (record {index})"
            )
        if length > _MAX_RECORD:
            raise TraceError(
                f"{name}: record {index} at byte {offset} claims {length} bytes; not a trace file"
            )
        if not fill(header + length):
            have = len(buf) - pos - header
            raise TraceError(
                f"{name}: truncated record {index} at byte {offset}: "
                f"{length} bytes announced, {have} present"
            )
        start = pos + header
        if state is not None:
            state.update(rest=buf[start + length :], base=base + start + length, index=index + 1)
        yield index, offset, buf[start : start + length]
        pos = start + length
        index += 1


# ---------------------------------------------------------------------------------------------
# Wire-level inspection (format detection)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = 0
    shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def wire_fields(data: bytes) -> list[tuple[int, int]]:
    """The ``(field number, wire type)`` pairs of a serialized message, in order."""
    out: list[tuple[int, int]] = []
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ValueError("field number 0")
        if wire == 0:
            _, pos = _read_varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 2:
            size, pos = _read_varint(data, pos)
            pos += size
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if pos > len(data):
            raise ValueError("field runs past the end")
        out.append((number, wire))
    return out


def _is_global_metadata(data: bytes) -> bool:
    try:
        fields = wire_fields(data)
    except ValueError:
        return False
    if not fields or any(wire != 2 or number not in (1, 2) for number, wire in fields):
        return False
    meta = pb4.GlobalMetadata()
    try:
        meta.ParseFromString(data)
    except DecodeError:
        return False
    if not meta.version.isprintable():
        return False
    return all(a.name and a.WhichOneof("value") for a in meta.attr)


def _node_version(data: bytes) -> str | None:
    """ "v0.0.1", "v0.0.4" or None (ambiguous) for a record that should be a Node."""
    try:
        fields = wire_fields(data)
    except ValueError:
        return None
    for number, wire in fields:
        if number > 10 or (wire == 0 and number in (4, 5, 8, 9, 10)):
            return "v0.0.1"
        if wire == 2 and number in (5, 8, 9, 10):
            return "v0.0.4"
    return None


_JSON_HEAD = re.compile(rb'^\s*\{\s*["}]')


def _sniff_json(path: Path) -> bool:
    name = path.name.lower().removesuffix(".gz")
    if name.endswith(".json"):
        return True
    if name.endswith(".et"):
        return False
    with _open_binary(path) as stream:
        head = stream.read(64)
    return bool(_JSON_HEAD.match(head))


def _empty(path: Path) -> TraceError:
    return TraceError(f"{path}: empty file, not a Chakra trace")


def _not_a_trace(path: Path, reason: str | Exception) -> TraceError:
    """``<path>: not a Chakra trace (<reason>)``; a reason naming the path already loses it."""
    text = str(reason).removeprefix(f"{path}: ")
    return TraceError(f"{path}: not a Chakra trace ({text})")


def _is_message(data: bytes) -> bool:
    try:
        wire_fields(data)
    except ValueError:
        return False
    return True


def _first_record(path: Path, records: Iterator[tuple[int, int, bytes]]) -> tuple[int, int, bytes]:
    """The first record of a protobuf file; a file that is empty or whose first record cannot
    be framed or is not a protobuf message is not a Chakra trace (see module doc)."""
    try:
        first = next(records, None)
    except TraceError as exc:
        raise _not_a_trace(path, exc) from None
    if first is None:
        raise _empty(path)
    if not _is_message(first[2]):
        raise _not_a_trace(path, "record 0 at byte 0 is not a protobuf message")
    return first


def _check_head(path: Path, fmt: str) -> None:
    """Refuse a file read as ``fmt`` that is not a Chakra trace (see :func:`_first_record`)."""
    if fmt == "json":
        return
    with _open_binary(path) as stream:
        _first_record(path, iter_records(stream, path))


def _no_nodes(path: Path, what: str) -> TraceError:
    return TraceError(f"{path}: {what} but no nodes; not a trace: a rank file holds nodes")


def detect_format(path: str | Path) -> str:
    """The format of one rank file: ``"v0.0.4"``, ``"v0.0.1"`` or ``"json"`` (see module doc)."""
    path = Path(path)
    if _sniff_json(path):
        return "json"
    with _open_binary(path) as stream:
        records = iter_records(stream, path)
        first = _first_record(path, records)
        for index, offset, data in itertools.chain([first], records):
            if index == 0 and _is_global_metadata(data):
                return "v0.0.4"
            version = _node_version(data)
            if version == "v0.0.4":
                raise TraceError(
                    f"{path}: v0.0.4 Node at byte {offset} (record {index}) but the file does "
                    "not start with GlobalMetadata"
                )
            if version == "v0.0.1" or index + 1 >= _DETECT_RECORDS:
                return "v0.0.1"
    return "v0.0.1"


# ---------------------------------------------------------------------------------------------
# v0.0.4


def _attr_value(attr: Any, kind: str) -> Any:
    value = getattr(attr, kind)
    if kind.endswith("_list"):
        return tuple(value.values)
    return value


_INT_FIELDS = frozenset({"num_ops", "tensor_size", "comm_size", "comm_src", "comm_dst", "comm_tag"})
_NODE_TYPES = {int(t): t for t in NodeType}
_COLLECTIVES = {int(c): c for c in CollectiveType}


def _node_from_v004(msg: Any, path: Path, index: int, offset: int) -> Node:
    def fail(message: str) -> TraceError:
        return TraceError(f"{path}: record {index} at byte {offset}: node {msg.id} {message}")

    node_type = _NODE_TYPES.get(msg.type)
    if node_type is None:
        raise fail(f"has unknown type {msg.type}")
    fields: dict[str, Any] = {}
    attrs = TraceAttrs()
    field_kinds = attrs.field_kinds
    for attr in msg.attr:
        name = attr.name
        kind = attr.WhichOneof("value")
        if kind is None:
            raise fail(f"has attribute {name!r} without a value")
        if name in field_kinds or name in attrs:
            raise fail(f"repeats attribute {name!r}")
        if name in _INT_FIELDS or name == "is_cpu_op" or name == "comm_type":
            if kind not in INT_KINDS and kind != "bool_val":
                raise fail(f"stores attribute {name} as {kind}; expected an integer")
            value = getattr(attr, kind)
            if name == "is_cpu_op":
                value = bool(value)
            elif name == "comm_type":
                collective = _COLLECTIVES.get(value)
                if collective is None:
                    raise fail(f"has unknown comm_type {value}")
                value = collective
            fields[name] = value
            field_kinds[name] = kind
            continue
        value = _attr_value(attr, kind)
        if name == "dtype" and kind == "string_val":
            fields["dtype"] = value
            field_kinds[name] = kind
        elif name == "pg_name" and kind == "string_val" and value.isdecimal() and value.isascii():
            fields["comm_group"] = int(value)
            field_kinds[name] = kind
        else:
            attrs[name] = value
            attrs.kinds[name] = kind
            if attr.doc_string:
                attrs.docs[name] = attr.doc_string
    if msg.start_time_micros:
        attrs.extras["start_time_micros"] = msg.start_time_micros
    if msg.HasField("inputs"):
        io_info = msg.inputs
        attrs.extras["inputs"] = (io_info.values, io_info.shapes, io_info.types)
    if msg.HasField("outputs"):
        io_info = msg.outputs
        attrs.extras["outputs"] = (io_info.values, io_info.shapes, io_info.types)
    _imply_op(attrs, msg.name)
    return Node(
        id=msg.id,
        name=msg.name,
        type=node_type,
        data_deps=tuple(msg.data_deps),
        ctrl_deps=tuple(msg.ctrl_deps),
        runtime=msg.duration_micros,
        attrs=attrs,
        **fields,
    )


def _parse(message: Any, data: bytes, path: Path, index: int, offset: int, what: str) -> None:
    try:
        message.ParseFromString(data)
    except DecodeError as exc:
        raise TraceError(
            f"{path}: record {index} at byte {offset} does not parse as {what}: {exc}"
        ) from None


def _iter_v004(path: Path) -> Iterator[Node]:
    with _open_binary(path) as stream:
        records = iter_records(stream, path)
        first = next(records, None)
        if first is None:
            raise _empty(path)
        _, offset, data = first
        if not _is_global_metadata(data):
            raise TraceError(
                f"{path}: record 0 at byte {offset} is not a GlobalMetadata; a v0.0.4 trace "
                "must start with one"
            )
        index = 0
        for index, offset, data in records:
            msg = pb4.Node()  # a fresh message: Clear() on a reused one keeps growing memory
            _parse(msg, data, path, index, offset, "a v0.0.4 Node")
            yield _node_from_v004(msg, path, index, offset)
        if index == 0:
            raise _no_nodes(path, "GlobalMetadata")


def _metadata_v004(path: Path) -> dict[str, Any]:
    with _open_binary(path) as stream:
        first = next(iter_records(stream, path), None)
    if first is None:
        raise _empty(path)
    if not _is_global_metadata(first[2]):
        raise TraceError(f"{path}: record 0 at byte 0 is not a GlobalMetadata")
    meta = pb4.GlobalMetadata()
    meta.ParseFromString(first[2])
    attrs = TraceAttrs()
    for attr in meta.attr:
        kind = attr.WhichOneof("value")
        attrs[attr.name] = _attr_value(attr, kind)
        attrs.kinds[attr.name] = kind
        if attr.doc_string:
            attrs.docs[attr.name] = attr.doc_string
    return {"format": "v0.0.4", "version": meta.version, "attrs": attrs}


# ---------------------------------------------------------------------------------------------
# v0.0.1

# v0.0.1 enum numbers -> v0.0.4 ones.
V001_NODE_TYPES: dict[int, NodeType] = {
    0: NodeType.INVALID,
    1: NodeType.MEM_LOAD,
    2: NodeType.MEM_STORE,
    3: NodeType.COMP,
    4: NodeType.COMM_SEND,
    5: NodeType.COMM_RECV,
    6: NodeType.COMM_COLL,
}
V001_COLLECTIVES: dict[int, CollectiveType | None] = {
    0: None,
    1: CollectiveType.ALL_REDUCE,
    2: CollectiveType.ALL_TO_ALL,
    3: CollectiveType.ALL_GATHER,
    4: CollectiveType.REDUCE_SCATTER,
}
# Typed v0.0.1 fields without a Node slot, kept in attrs under their schema names.
V001_EXTRA_FIELDS: tuple[str, ...] = (
    "tensor_loc", "input_tensor_loc", "input_tensor_size", "output_tensor_loc",
    "output_tensor_size", "comm_priority",
)  # fmt: skip


def _node_from_v001(msg: Any, path: Path, index: int, offset: int) -> Node:
    where = f"{path}: record {index} at byte {offset}"
    if not msg.HasField("id") or not msg.HasField("name"):
        raise TraceError(f"{where}: v0.0.1 Node lacks its required id or name")
    node_type = V001_NODE_TYPES.get(msg.node_type)
    if node_type is None:
        raise TraceError(f"{where}: node {msg.id} has unknown v0.0.1 node_type {msg.node_type}")
    comm_type = None
    if msg.HasField("comm_type"):
        if msg.comm_type not in V001_COLLECTIVES:
            raise TraceError(f"{where}: node {msg.id} has unknown comm_type {msg.comm_type}")
        comm_type = V001_COLLECTIVES[msg.comm_type]
    attrs = TraceAttrs()
    for name in V001_EXTRA_FIELDS:
        if msg.HasField(name):
            attrs[name] = int(getattr(msg, name))
            attrs.kinds[name] = "uint64_val" if name.endswith("size") else "int32_val"
    if msg.involved_dim:
        attrs["involved_dim"] = tuple(msg.involved_dim)
        attrs.kinds["involved_dim"] = "bool_list"
    if msg.HasField("comm_type") and comm_type is None:
        attrs.extras["v001_comm_type_invalid"] = True
    return Node(
        id=msg.id,
        name=msg.name,
        type=node_type,
        data_deps=tuple(msg.parent),
        num_ops=msg.num_ops,
        tensor_size=msg.tensor_size,
        comm_type=comm_type,
        comm_size=msg.comm_size,
        comm_group=msg.communicator_id if msg.HasField("communicator_id") else None,
        comm_src=msg.comm_src if msg.HasField("comm_src") else None,
        comm_dst=msg.comm_dst if msg.HasField("comm_dst") else None,
        comm_tag=msg.comm_tag if msg.HasField("comm_tag") else None,
        runtime=msg.simulated_run_time,
        attrs=attrs,
    )


def _iter_v001(path: Path) -> Iterator[Node]:
    from stg.trace.proto import chakra_v001_pb2 as pb1  # only v0.0.1 traces need its schema

    with _open_binary(path) as stream:
        empty = True
        for index, offset, data in iter_records(stream, path):
            msg = pb1.Node()
            _parse(msg, data, path, index, offset, "a v0.0.1 Node")
            empty = False
            yield _node_from_v001(msg, path, index, offset)
        if empty:
            raise _empty(path)


# ---------------------------------------------------------------------------------------------
# JSON

JSON_NODE_KEYS: frozenset[str] = frozenset(
    {"Id", "Name", "NodeType", "is_cpu_op", "runtime", "data_deps", "ctrl_deps", "ctrlDeps",
     "num_ops", "tensor_size", "comm_type", "comm_priority", "comm_size", "comm_src", "comm_dst",
     "comm_tag", "pg_name", "dtype", "attr", "start_time_micros", "inputs", "outputs",
     "stg_unset"}
)  # fmt: skip


def _load_json(path: Path) -> dict[str, Any]:
    try:
        with _open_binary(path) as stream:
            data = json.load(io.TextIOWrapper(stream, encoding="utf-8"))
    except json.JSONDecodeError as exc:
        if not exc.doc.strip():
            raise _empty(path) from None
        raise _not_a_trace(path, f"not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise _not_a_trace(path, f"not valid JSON: {exc}") from None
    except (EOFError, OSError) as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("workload_graph"), list):
        raise _not_a_trace(path, 'a JSON trace is an object with a "workload_graph" list')
    return data


def _json_int(where: str, entry: Mapping[str, Any], key: str, default: int | None = 0) -> Any:
    value = entry.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"{where}: {key}={value!r} must be an integer")
    return value


def _json_list(where: str, entry: Mapping[str, Any], key: str) -> tuple[int, ...]:
    value = entry.get(key, [])
    if not isinstance(value, list) or any(
        isinstance(v, bool) or not isinstance(v, int) for v in value
    ):
        raise TraceError(f"{where}: {key} must be a list of integers")
    return tuple(value)


def _json_attr_value(where: str, kind: str, value: Any) -> Any:
    import base64

    if kind not in SCALAR_KINDS and kind not in LIST_KINDS:
        raise TraceError(f"{where}: unknown attribute kind {kind!r}")
    if kind.endswith("_list"):
        if not isinstance(value, list):
            raise TraceError(f"{where}: {kind} value must be a list")
        scalar = kind[:-5] + "_val"
        return tuple(_json_attr_value(where, scalar, v) for v in value)
    if kind == "bytes_val":
        return base64.b64decode(value)
    if kind == "bool_val":
        if not isinstance(value, bool):
            raise TraceError(f"{where}: bool_val value {value!r} must be true or false")
        return value
    if kind == "string_val":
        if not isinstance(value, str):
            raise TraceError(f"{where}: string_val value {value!r} must be a string")
        return value
    if kind in ("double_val", "float_val"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TraceError(f"{where}: {kind} value {value!r} must be a number")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"{where}: {kind} value {value!r} must be an integer")
    return value


def _json_attrs(where: str, items: Any, attrs: TraceAttrs) -> None:
    if not isinstance(items, list):
        raise TraceError(f"{where}: attr must be a list")
    for attr in items:
        if not isinstance(attr, dict) or not isinstance(attr.get("name"), str):
            raise TraceError(f"{where}: each attr must be an object with a name")
        kinds = [k for k in attr if k not in ("name", "doc_string")]
        if len(kinds) != 1:
            raise TraceError(f"{where}: attr {attr['name']!r} must hold exactly one value kind")
        kind = kinds[0]
        attrs[attr["name"]] = _json_attr_value(where, kind, attr[kind])
        attrs.kinds[attr["name"]] = kind
        if attr.get("doc_string"):
            attrs.docs[attr["name"]] = attr["doc_string"]


def _node_from_json(path: Path, position: int, entry: Any) -> Node:
    where = f"{path}: workload_graph[{position}]"
    if not isinstance(entry, dict):
        raise TraceError(f"{where} must be an object")
    for key in ("Id", "Name", "NodeType"):
        if key not in entry:
            raise TraceError(f"{where} lacks {key!r}")
    node_id = _json_int(where, entry, "Id")
    name = entry["Name"]
    if not isinstance(name, str):
        raise TraceError(f"{where}: Name must be a string")
    try:
        node_type = NodeType(_json_int(where, entry, "NodeType"))
    except ValueError:
        raise TraceError(f"{where}: unknown NodeType {entry['NodeType']!r}") from None
    unset = entry.get("stg_unset", [])
    if not isinstance(unset, list):
        raise TraceError(f"{where}: stg_unset must be a list of key names")

    def opt(key: str) -> int | None:
        return None if key in unset else _json_int(where, entry, key, None)

    comm_type_number = opt("comm_type")
    comm_type = None
    if comm_type_number is not None:
        try:
            comm_type = CollectiveType(comm_type_number)
        except ValueError:
            raise TraceError(f"{where}: unknown comm_type {comm_type_number}") from None
    ctrl_key = "ctrl_deps" if "ctrl_deps" in entry else "ctrlDeps"
    attrs = TraceAttrs()
    comm_group = None
    pg_name = entry.get("pg_name")
    if pg_name is not None:
        if isinstance(pg_name, str) and pg_name.isdecimal() and pg_name.isascii():
            comm_group = int(pg_name)
        elif isinstance(pg_name, str):
            attrs["pg_name"] = pg_name
            attrs.kinds["pg_name"] = "string_val"
        else:
            raise TraceError(f"{where}: pg_name={pg_name!r} must be a string")
    priority = opt("comm_priority")
    if priority is not None:
        attrs["comm_priority"] = priority
        attrs.kinds["comm_priority"] = "int32_val"
    _json_attrs(where, entry.get("attr", []), attrs)
    if "start_time_micros" in entry:
        attrs.extras["start_time_micros"] = _json_int(where, entry, "start_time_micros")
    for io_name in ("inputs", "outputs"):
        if io_name in entry:
            io_info = entry[io_name]
            if not isinstance(io_info, dict):
                raise TraceError(f"{where}: {io_name} must be an object")
            attrs.extras[io_name] = tuple(
                str(io_info.get(k, "")) for k in ("values", "shapes", "types")
            )
    dtype = entry.get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        raise TraceError(f"{where}: dtype must be a string")
    is_cpu_op = entry.get("is_cpu_op", False)
    if not isinstance(is_cpu_op, bool):
        raise TraceError(f"{where}: is_cpu_op must be true or false")
    _imply_op(attrs, name)
    return Node(
        id=node_id,
        name=name,
        type=node_type,
        data_deps=_json_list(where, entry, "data_deps"),
        ctrl_deps=_json_list(where, entry, ctrl_key),
        num_ops=_json_int(where, entry, "num_ops"),
        tensor_size=_json_int(where, entry, "tensor_size"),
        comm_type=comm_type,
        comm_size=_json_int(where, entry, "comm_size"),
        comm_group=comm_group,
        comm_src=opt("comm_src"),
        comm_dst=opt("comm_dst"),
        comm_tag=opt("comm_tag"),
        runtime=_json_int(where, entry, "runtime"),
        is_cpu_op=is_cpu_op,
        dtype=dtype,
        attrs=attrs,
    )


def _metadata_json(path: Path, data: Mapping[str, Any]) -> dict[str, Any]:
    attrs = TraceAttrs()
    version = ""
    meta = data.get("global_metadata")
    if meta is not None:
        where = f"{path}: global_metadata"
        if not isinstance(meta, dict) or not isinstance(meta.get("version", ""), str):
            raise TraceError(f"{where} must be an object with a string version")
        version = meta.get("version", "")
        _json_attrs(where, meta.get("attr", []), attrs)
    for key, value in data.items():
        if key not in ("workload_graph", "global_metadata") and key not in attrs:
            attrs[key] = value
    return {"format": "json", "version": version, "attrs": attrs}


def _iter_json(path: Path) -> Iterator[Node]:
    data = _load_json(path)
    if not data["workload_graph"]:
        raise _no_nodes(path, 'an empty "workload_graph"')
    for position, entry in enumerate(data["workload_graph"]):
        yield _node_from_json(path, position, entry)


# ---------------------------------------------------------------------------------------------
# Public API


def _resolve_format(path: Path, format: str | None) -> str:
    if format is None:
        return detect_format(path)
    if format not in FORMATS:
        raise TraceError(f"format={format!r} is not known; allowed: {', '.join(FORMATS)}")
    _check_head(path, format)
    return format


def iter_nodes(
    path: str | Path, *, format: str | None = None, presence: bool = False
) -> Iterator[Node]:
    """Stream the nodes of one rank file in file order.

    ``format`` is ``"v0.0.4"``, ``"v0.0.1"``, ``"json"`` or ``None`` (detect; see module doc).
    ``presence``: record in ``attrs.field_kinds`` which :data:`DEFAULTED` attributes each node
    of a JSON file gives (v0.0.4 nodes always have them there; see module doc).
    """
    path = Path(path)
    fmt = _resolve_format(path, format)
    from stg.trace import decode

    nodes = decode.iter_nodes(path, fmt) if decode.enabled() else iter_nodes_reference(path, fmt)
    if presence and fmt == "json":
        return _with_json_presence(path, nodes)
    return nodes


_GIVEN_KEYS: dict[tuple[str, ...], tuple[str, ...]] = {}


class _Given:
    """What :func:`_json_given` keeps of a JSON object: the :data:`DEFAULTED` keys it gives
    (less those in its ``stg_unset``) and its ``workload_graph``."""

    __slots__ = ("graph", "keys")

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        obj = dict(pairs)  # the last of repeated keys, as json.load
        unset = obj.get("stg_unset")
        unset = unset if isinstance(unset, list) else ()
        keys = tuple(k for k in DEFAULTED if k in obj and k not in unset)
        self.keys = _GIVEN_KEYS.setdefault(keys, keys)  # a few distinct tuples
        self.graph = obj.get("workload_graph")


def _json_given(path: Path) -> list[tuple[str, ...]]:
    """The :data:`DEFAULTED` keys that each ``workload_graph`` entry of a JSON rank file gives;
    each object is reduced to those as it is parsed (memory: the file's text)."""
    try:
        with _open_binary(path) as stream:
            top = json.load(io.TextIOWrapper(stream, encoding="utf-8"), object_pairs_hook=_Given)
    except (ValueError, EOFError, OSError) as exc:  # the decoder read it: it changed since
        raise TraceError(f"{path}: cannot read: {exc}") from None
    graph = top.graph if isinstance(top, _Given) else None
    if not isinstance(graph, list):
        raise _not_a_trace(path, 'a JSON trace is an object with a "workload_graph" list')
    return [entry.keys if isinstance(entry, _Given) else () for entry in graph]


def _with_json_presence(path: Path, nodes: Iterator[Node]) -> Iterator[Node]:
    """``nodes`` of a JSON rank file with the :data:`DEFAULTED` keys of their entries recorded
    in ``attrs.field_kinds`` (the streaming decoder does not report which keys an entry has)."""
    first = next(nodes, None)  # a file the decoder rejects fails here, with its error
    if first is None:
        return
    given = _json_given(path)
    changed = TraceError(f"{path}: the file changed while it was read; read it again")
    count = 0
    for node in itertools.chain([first], nodes):
        if count == len(given):
            raise changed
        kinds = node.attrs.field_kinds  # type: ignore[attr-defined]
        for key in given[count]:
            kinds[key] = DEFAULTED[key]
        count += 1
        yield node
    if count != len(given):
        raise changed


def iter_nodes_reference(path: str | Path, fmt: str) -> Iterator[Node]:
    """:func:`iter_nodes` through the pure-Python protobuf decoder only (the reference that the
    compiled fast path of :mod:`stg.trace.decode` reproduces)."""
    path = Path(path)
    if fmt == "json":
        return _iter_json(path)
    if fmt == "v0.0.1":
        return _iter_v001(path)
    return _iter_v004(path)


def read_nodes(path: str | Path, *, format: str | None = None) -> list[Node]:
    """All nodes of one rank file, in file order."""
    return list(iter_nodes(path, format=format))


def read_metadata(path: str | Path, *, format: str | None = None) -> dict[str, Any]:
    """The file-level metadata of one rank file.

    Returns ``{"format": ..., "version": ..., "attrs": {...}}``: for v0.0.4 the
    GlobalMetadata version and attributes, for JSON the top-level keys other than
    ``workload_graph`` (version ``""``), for v0.0.1 (which has none) version ``""`` and no
    attrs.
    """
    path = Path(path)
    fmt = _resolve_format(path, format)
    if fmt == "v0.0.4":
        return _metadata_v004(path)
    if fmt == "json":
        from stg.trace import decode

        data = decode.json_metadata(path) if decode.enabled() else None
        return _metadata_json(path, data if data is not None else _load_json(path))
    return {"format": "v0.0.1", "version": "", "attrs": TraceAttrs()}
