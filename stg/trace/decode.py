"""The streaming decoder that every trace reader shares, and its compiled fast path.

All readers (``stg feed``, ``validate``, ``inspect``, ``convert``, ``predict``) read rank files
through this module: :func:`stg.trace.reader.iter_nodes` for whole
:class:`~stg.core.workload.Node` objects, or the per-rank entry points below, which decode only
the fields their caller needs:

:func:`rank_summary`
    ``stg validate``: the per-node and structure checks of one rank file, returning only its
    communication (collectives per group, sends, receives) and its *communication skeleton*
    (each comm node's nearest comm ancestors), on which the cross-rank checks run.
:func:`comm_summary`
    ``stg predict``: a rank's fingerprint (a hash of its node sequence less peer and
    communicator ids) and its communicators and peers in file order.
:func:`drain`
    ``stg feed`` / ``stg inspect trace``: the statistics of draining the file through the
    ETFeeder protocol (the compiled drain follows :class:`stg.trace.feeder.ETFeeder` and
    :func:`stg.trace.stats.analyze` step by step: same windowing, same rounds).
:func:`columns`
    Any caller: chosen columns of a rank file as little-endian arrays.

The fast path is the C extension ``stg.trace._chakra`` (stg/trace/_chakra.c), which pip builds
from source when it installs stg. It reads its stream in place (``readinto``, :data:`CHUNK`
bytes at a time) into a bounded buffer that the next rank file reuses (gzip streams too), so
memory per rank file stays constant, and decodes v0.0.4, v0.0.1 and feeder JSON. A JSON file
is read twice through that buffer, one value at a time (an entry of ``workload_graph``, or
another top-level value): first to check the whole document as ``json.load`` would, then,
rewound to ``workload_graph``, to decode its entries; so a document that the reference
rejects yields no node, and memory is that of the largest entry, not of the document.

The pure-Python protobuf decoder of :mod:`stg.trace.reader` stays the *reference*: whenever a
record holds anything whose meaning the fast path does not reproduce exactly (unknown fields,
unusual wire encodings, invalid UTF-8, values the reference rejects, malformed input), the fast
path hands that record, or the whole file, to the reference. So results, error messages
included, are the reference's; tests/test_decode.py checks that on every test trace and on
fuzzed inputs.

Why compiled: measured on rank 0 of the 128-rank dp8 tp4 pp4 trace (10,834 nodes, one core),
the reference decodes 91k nodes/s; the upb backend with one reused message and only the
needed fields reaches 580k nodes/s without reading attributes and 290k with them (framing in
Python alone is capped at 1.6M records/s); a numpy scanner that frames records by decoding
a varint at every byte reaches 24k records/s. The compiled decoder: see
benchmarks/bench_read.py (on ../shared/data/chakra/chakra.0.et, 3,664 PyTorch nodes of 810
bytes, mostly ASCII strings, the columns of ``stg validate`` decode at 1.8 M nodes per CPU
second: strings are checked for UTF-8 eight ASCII bytes at a time, and reading in place into a
reused buffer took the page faults and copies that were half the time).

``STG_DECODER=python`` in the environment turns the fast path off (the reference everywhere).
"""

from __future__ import annotations

import dataclasses
import io
import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from stg.core.extensions import load_extension
from stg.core.workload import CollectiveType, Node, NodeType
from stg.errors import TraceError
from stg.trace import reader as _ref
from stg.trace.proto import chakra_v004_pb2 as pb4

ABI_VERSION = 6
"""The version of stg/trace/_chakra.c this module drives (a stale build is not used)."""

FORMAT_CODES = {"v0.0.4": 4, "v0.0.1": 1, "json": 2}
NODE_FIELDS = (
    "id", "name", "type", "data_deps", "ctrl_deps", "num_ops", "tensor_size", "comm_type",
    "comm_size", "comm_group", "comm_src", "comm_dst", "comm_tag", "runtime", "is_cpu_op",
    "dtype", "attrs",
)  # fmt: skip
BATCH = 64
"""Nodes decoded per call into the extension by :func:`stg.trace.reader.iter_nodes`: small
batches keep few fresh nodes alive when the cyclic collector runs (1,024 costs a third of the
speed of 64 on a stg rank file)."""

CHUNK = 1 << 18
"""Bytes the compiled reader asks its stream for at a time (read in place with readinto)."""

# Reader.status
MORE, END, UNUSUAL, ERROR = 0, 1, 2, 3

# Reader.columns masks and flag bits
IDS, FLAGS, SIZES, COMM, DEPS = 1, 2, 4, 8, 16
F_HAS_CPU, F_CPU, F_CTYPE, F_GROUP, F_SRC, F_DST, F_TAG, F_SPECIAL = 1, 2, 4, 8, 16, 32, 64, 128
_FIELD_MASKS = {
    "id": IDS, "flags": FLAGS, "num_ops": SIZES, "tensor_size": SIZES, "comm_size": SIZES,
    "runtime": SIZES, "comm_type": COMM, "comm_group": COMM, "comm_src": COMM, "comm_dst": COMM,
    "comm_tag": COMM, "data": DEPS, "ctrl": DEPS, "type": 0,
}  # fmt: skip

_ext: Any = None
_reason = "not loaded yet"
_disabled = 0


def _setup(ext: Any) -> None:
    """Bind the extension to stg's Node, TraceAttrs and enums."""
    fields = {f.name: f for f in dataclasses.fields(Node)}
    if hasattr(Node, "__post_init__") or set(NODE_FIELDS) - set(fields):
        raise RuntimeError("Node's fields changed; the compiled decoder needs an update")
    extras = []
    for name, f in fields.items():
        if name in NODE_FIELDS:
            continue
        if f.default is dataclasses.MISSING:
            raise RuntimeError(f"Node.{name} has no plain default")
        extras.append((Node.__dict__[name], f.default))
    ext.setup(
        Node,
        tuple(Node.__dict__[name] for name in NODE_FIELDS),
        tuple(extras),
        _ref.TraceAttrs,
        tuple(_ref.TraceAttrs.__dict__[n] for n in ("kinds", "docs", "extras", "field_kinds")),
        tuple(NodeType(i) for i in range(8)),
        tuple(CollectiveType(i) for i in range(10)),
        TraceError,
        (EOFError, OSError, zlib.error),
        _ref._MAX_RECORD,
    )


def _self_test(ext: Any) -> None:
    """Decode one node with every kind of content both ways; they must agree."""
    node = pb4.Node(id=7, name="selftest/é", type=pb4.COMM_COLL_NODE, data_deps=[3, 1000])
    node.ctrl_deps.append(2)
    node.start_time_micros = 5
    node.duration_micros = 9
    node.inputs.values = "[1]"
    for name, kind, value in (
        ("is_cpu_op", "bool_val", False), ("comm_type", "int64_val", 2),
        ("comm_size", "int64_val", 1 << 40), ("pg_name", "string_val", "12"),
        ("dtype", "string_val", "bf16"), ("comm_tag", "int32_val", -3),
        ("gemm", "int64_list", [1, 2, 3]), ("ratio", "float_val", 0.1),
        ("flags", "bool_list", [True, False]), ("note", "string_val", "x"),
    ):  # fmt: skip
        attr = node.attr.add(name=name)
        if kind.endswith("_list"):
            getattr(attr, kind).values.extend(value)
        else:
            setattr(attr, kind, value)
    node.attr[-1].doc_string = "doc"
    data = node.SerializeToString()
    reader = ext.Reader(io.BytesIO(_ref_frame(data)), 4, "selftest", b"", 0, 1)
    (fast,) = reader.nodes(4)
    msg = pb4.Node()
    msg.ParseFromString(data)
    slow = _ref._node_from_v004(msg, Path("selftest"), 1, 0)
    if not same_node(fast, slow):
        raise RuntimeError(f"self-test: {fast!r} != {slow!r}")


def _ref_frame(data: bytes) -> bytes:
    from stg.trace.writer import frame

    return frame(data)


def same_node(a: Node, b: Node) -> bool:
    """Equal nodes, attribute kinds, doc strings and extras included (types of values too)."""
    if a != b or type(a) is not type(b):
        return False
    for name in NODE_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if type(x) is not type(y) and name != "attrs":
            return False
        if isinstance(x, tuple) and [type(v) for v in x] != [type(v) for v in y]:
            return False
    aa, bb = a.attrs, b.attrs
    if list(aa.items()) != list(bb.items()):
        return False
    if [type(v) for v in aa.values()] != [type(v) for v in bb.values()]:
        return False
    for slot in ("kinds", "docs", "extras", "field_kinds"):
        x, y = getattr(aa, slot, None), getattr(bb, slot, None)
        if x is None or y is None or list(x.items()) != list(y.items()):
            return False
    return True


def _load() -> None:
    global _ext, _reason
    _chakra, _reason = load_extension("stg.trace._chakra", ABI_VERSION, "STG_DECODER")
    if _chakra is None:
        _ext = None
        return
    try:
        _setup(_chakra)
        _self_test(_chakra)
    except Exception as exc:  # a failed self-test only costs speed
        _ext, _reason = None, f"stg.trace._chakra failed its self-test: {exc}"
        return
    _ext, _reason = _chakra, "compiled"


_load()


def enabled() -> bool:
    """Whether the compiled fast path is in use."""
    return _ext is not None and not _disabled


def status() -> str:
    """``"compiled"``, or why the reference decoder is used everywhere."""
    return "reference (disabled for this block)" if _disabled and _ext else _reason


@contextmanager
def reference_only() -> Iterator[None]:
    """Within the block, every reader uses the pure-Python reference decoder."""
    global _disabled
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1


# ---------------------------------------------------------------------------------------------
# Whole nodes (stg.trace.reader.iter_nodes)


def iter_nodes(path: Path, fmt: str) -> Iterator[Node]:
    """The nodes of one rank file, as the reference decodes them (see module doc)."""
    if fmt == "json":
        return _iter_json(path)
    return _iter_protobuf(path, fmt)


def _iter_protobuf(path: Path, fmt: str) -> Iterator[Node]:
    with _ref._open_binary(path) as stream:
        reader = _ext.Reader(stream, FORMAT_CODES[fmt], str(path), b"", 0, 0, CHUNK)
        if fmt == "v0.0.4":
            first = reader.record()
            if first is None:
                raise _ref._empty(path)
            _, offset, data = first
            if not _ref._is_global_metadata(data):
                raise TraceError(
                    f"{path}: record 0 at byte {offset} is not a GlobalMetadata; a v0.0.4 "
                    "trace must start with one"
                )
        count = 0
        while True:
            batch = reader.nodes(BATCH)
            count += len(batch)
            yield from batch
            status = reader.status
            if status == END:
                break
            if status == ERROR:
                reader.raise_error()
            elif status == UNUSUAL:
                index, offset, data = reader.unusual()
                yield _reference_record(path, fmt, index, offset, data)
                count += 1
        if count == 0:
            if fmt == "v0.0.4":
                raise _ref._no_nodes(path, "GlobalMetadata")
            raise _ref._empty(path)


def _reference_record(path: Path, fmt: str, index: int, offset: int, data: bytes) -> Node:
    if fmt == "v0.0.4":
        msg = pb4.Node()
        _ref._parse(msg, data, path, index, offset, "a v0.0.4 Node")
        return _ref._node_from_v004(msg, path, index, offset)
    from stg.trace.proto import chakra_v001_pb2 as pb1

    msg = pb1.Node()
    _ref._parse(msg, data, path, index, offset, "a v0.0.1 Node")
    return _ref._node_from_v001(msg, path, index, offset)


def _iter_json(path: Path) -> Iterator[Node]:
    with _ref._open_binary(path) as stream:
        reader = _ext.Reader(stream, 2, str(path), b"", 0, 0, CHUNK)
        first = reader.nodes(BATCH)
        if not first and reader.status == UNUSUAL and reader.unusual()[0] < 0:
            # the document as a whole is for the reference (its errors, its values)
            stream.close()
            yield from _ref._iter_json(path)
            return
        batch = first
        while True:
            yield from batch
            status = reader.status
            if status == END:
                break
            if status == ERROR:
                reader.raise_error()
            elif status == UNUSUAL:
                position, _, text = reader.unusual()
                entry = json.loads(text.decode("utf-8"))
                yield _ref._node_from_json(path, position, entry)
            batch = reader.nodes(BATCH)


# ---------------------------------------------------------------------------------------------
# Per-rank entry points (None: use the reference for this file)


@contextmanager
def _reader(path: Path, fmt: str, hashing: bool = False) -> Iterator[Any]:
    """A compiled reader positioned at the first node, or None where the reference must read
    the file (no fast path, a first record that is not a valid GlobalMetadata, unreadable)."""
    if not enabled():
        yield None
        return
    try:
        stream = _ref._open_binary(path)
    except TraceError:
        yield None
        return
    with stream:
        try:
            code = FORMAT_CODES[fmt]
            reader = _ext.Reader(stream, code, str(path), b"", 0, 0, CHUNK, hashing)
            if fmt == "v0.0.4":
                first = reader.record()
                if first is None or not _ref._is_global_metadata(first[2]):
                    yield None
                    return
        except (TraceError, OSError, EOFError, zlib.error):
            yield None
            return
        yield reader


def rank_summary(
    path: Path, fmt: str, world: int | None, rank: int | None, astra: bool
) -> dict[str, Any] | None:
    """What ``stg validate`` needs of one rank file that passes every per-node and structure
    check: ``nodes``, ``colls`` (group -> [(id, type, size)] in file order), ``sends`` and
    ``recvs`` ([(id, peer, tag, size)]) and ``skeleton`` (a :class:`Skeleton`: the comm nodes
    with their nearest comm ancestors, or, when ``whole``, every node with its parents, for
    graphs where that is smaller). None when the file has
    any violation or warning, or needs the reference decoder: the reference then validates
    it."""
    with _reader(path, fmt) as reader:
        if reader is None:
            return None
        out = reader.rank_summary(
            -1 if world is None else world, -1 if rank is None else rank, astra
        )
    if out is None:
        return None
    colls: dict[int, list[tuple[int, int, int]]] = {}
    flat = _ints(out["colls"])
    for k in range(0, len(flat), 4):
        colls.setdefault(flat[k], []).append((flat[k + 1], flat[k + 2], flat[k + 3]))
    return {
        "nodes": out["nodes"],
        "colls": colls,
        "sends": _quads(out["sends"]),
        "recvs": _quads(out["recvs"]),
        "skeleton": Skeleton(_ints(out["skel_ids"]), out["skel_off"], out["skel_par"]),
        "whole": out["full"],
    }


@dataclasses.dataclass(frozen=True)
class Skeleton:
    """A rank's graph reduced to its comm nodes, compactly: ``ids`` of its nodes, and each
    node's parents as indices into ``ids`` (CSR: ``off`` and ``par``, little-endian int64)."""

    ids: list[int]
    off: bytes
    par: bytes

    @classmethod
    def from_parents(cls, parents: dict[int, list[int]]) -> Skeleton:
        """From a whole graph ``{id: [parent ids]}``."""
        import array

        ids = list(parents)
        index = {nid: i for i, nid in enumerate(ids)}
        off = array.array("q", [0])
        par = array.array("q")
        for nid in ids:
            par.extend(index[p] for p in parents[nid])
            off.append(len(par))
        return cls(ids, off.tobytes(), par.tobytes())

    def parents(self) -> dict[int, list[int]]:
        """As ``{id: [parent ids]}``."""
        ids, off, par = self.ids, _ints(self.off), _ints(self.par)
        return {nid: [ids[p] for p in par[off[i] : off[i + 1]]] for i, nid in enumerate(ids)}


def deadlock_free(
    skeletons: dict[int, Skeleton],
    pairs: list[tuple[tuple[int, int], tuple[int, int]]],
    instances: list[list[tuple[int, int]]],
) -> bool | None:
    """Whether all ranks run together to the end (the check of validate's ``deadlock``) on
    the ranks' skeletons: receives wait for their matched sends, collective instances for all
    their members. None without the compiled fast path."""
    if not enabled():
        return None
    import array

    ranks = sorted(skeletons)
    slot = {rank: i for i, rank in enumerate(ranks)}
    local = {rank: {nid: i for i, nid in enumerate(skeletons[rank].ids)} for rank in ranks}
    flat_pairs = array.array("q")
    for (src, send), (dst, recv) in pairs:
        flat_pairs.extend((slot[src], local[src][send], slot[dst], local[dst][recv]))
    inst_off = array.array("q", [0])
    members = array.array("q")
    for instance in instances:
        for rank, nid in instance:
            members.extend((slot[rank], local[rank][nid]))
        inst_off.append(len(members) // 2)
    return bool(
        _ext.deadlock_free(
            [(skeletons[r].off, skeletons[r].par) for r in ranks],
            flat_pairs.tobytes(),
            inst_off.tobytes(),
            members.tobytes(),
        )
    )


def comm_summary(path: Path, fmt: str) -> dict[str, Any] | None:
    """What ``stg predict`` needs of one rank file: ``nodes``, ``fingerprint`` (16 bytes: equal
    for ranks whose node sequences are equal up to peer and communicator ids), ``colls`` (the
    communicator of each collective, in file order), ``sends`` (destinations), ``recvs``
    (sources) and ``problem`` (a collective without group or type, a send or receive without
    peer). None where the reference must read the file."""
    with _reader(path, fmt, hashing=True) as reader:
        if reader is None:
            return None
        out = reader.comm_summary()
    if out is None:
        return None
    return {
        "nodes": out["nodes"],
        "fingerprint": out["fingerprint"],
        "problem": out["problem"],
        "colls": _ints(out["colls"]),
        "sends": _ints(out["sends"]),
        "recvs": _ints(out["recvs"]),
    }


def drain(path: Path, fmt: str, window: int, use_ctrl: bool) -> dict[str, Any] | None:
    """The statistics of :func:`stg.trace.stats.analyze` for a valid rank file: ``nodes``,
    ``rounds``, ``max_width``, ``critical_path``, ``critical_path_us``, ``flops``,
    ``tensor_bytes``, ``send_count``/``send_bytes``, ``recv_count``/``recv_bytes``,
    ``by_type`` [(NodeType value, count)] and ``collectives`` [(CollectiveType value or None,
    count, bytes)], both in first-issue order. None for a file the reference must drain
    (any feeder error: its message and partial counts are the reference's)."""
    with _reader(path, fmt) as reader:
        if reader is None:
            return None
        return reader.drain(window, use_ctrl)


def columns(path: Path, fmt: str, names: tuple[str, ...]) -> dict[str, memoryview] | None:
    """Columns ``names`` of a rank file (keys of the Reader: ``type`` int8, ``flags`` int32,
    ``comm_type`` int8, ``data``/``ctrl`` with their ``data_off``/``ctrl_off`` offsets, the
    rest int64), or None where the reference must read the file."""
    mask = 0
    for name in names:
        mask |= _FIELD_MASKS[name]
    with _reader(path, fmt) as reader:
        if reader is None:
            return None
        out = reader.columns(mask, -1)
        if reader.status != END or reader.count == 0:
            return None
    casts = {"type": "b", "comm_type": "b", "flags": "i"}
    return {k: memoryview(v).cast(casts.get(k, "q")) for k, v in out.items()}


def json_metadata(path: Path) -> dict[str, Any] | None:
    """The top-level members of a JSON rank file other than ``workload_graph`` (as
    ``json.load`` gives them), read through the bounded buffer; None where the reference must
    load the document (it also reports the errors)."""
    with _reader(path, "json") as reader:
        if reader is None:
            return None
        text = reader.json_metadata()
    if text is None:
        return None
    data = json.loads(text.decode("utf-8"))
    data["workload_graph"] = []  # checked to be a list; its entries are not needed here
    return data


def _ints(data: bytes) -> list[int]:
    return memoryview(data).cast("q").tolist()


def _quads(data: bytes) -> list[tuple[int, int, int, int]]:
    flat = _ints(data)
    return [tuple(flat[k : k + 4]) for k in range(0, len(flat), 4)]  # type: ignore[misc]
