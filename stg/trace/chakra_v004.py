"""Chakra protobuf schema v0.0.4: encoding nodes into one rank file (the ``chakra-v0.0.4``
emitter's format).

Each rank file is a ``GlobalMetadata`` record (version ``"0.0.4"``, attrs ``generator`` =
``"stg"``, ``generator_version``, ``rank``, ``world_size``, ``comm_group_file`` (the name of the
comm-group file beside it, which readers prefer) and the workload's metadata) followed
by the rank's nodes in id order, each record preceded by its length as a varint. Attributes
carry the value kinds of TRACES.md: ``is_cpu_op`` bool_val on every node; ``num_ops``
int64_val and ``tensor_size`` uint64_val on COMP nodes (elsewhere when non-zero);
``comm_type`` and ``comm_size`` int64_val; ``pg_name`` string_val (decimal comm-group id);
``comm_src``, ``comm_dst``, ``comm_tag`` int32_val; ``dtype`` string_val when known; then any
further attributes of ``Node.attrs`` with their remembered (or inferred) kinds, less an ``op``
that the name implies (:func:`stg.core.workload.implied_op`).

Speed: ranks of one class share their node templates and only comm nodes differ, so every
non-comm node is serialized once per class and every comm node once per distinct resolved
(group, source, destination); a rank file is then one ``b"".join``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, BinaryIO

from stg.core.workload import COMM_TYPES, OP_ATTR, Node, NodeType, has_implied_op, implied_op
from stg.errors import UserError
from stg.trace.proto import chakra_v004_pb2 as pb4
from stg.trace.reader import attr_kind
from stg.trace.writer import frame

SCHEMA_VERSION = "0.0.4"


def set_attr(attr: Any, name: str, kind: str, value: Any, doc: str = "") -> None:
    """Fill one AttributeProto; a value its kind cannot hold (an int64 overflow of a huge
    model) is a :class:`UserError` naming the attribute."""
    attr.name = name
    if doc:
        attr.doc_string = doc
    try:
        if kind.endswith("_list"):
            getattr(attr, kind).values.extend(value)
        else:
            setattr(attr, kind, value)
    except (ValueError, TypeError) as exc:
        raise UserError(
            f"attribute {name}={value!r} does not fit Chakra's {kind} ({exc}); "
            "the model or batch sizes are too large for a trace"
        ) from None


def _add(msg: Any, name: str, kind: str, value: Any) -> None:
    set_attr(msg.attr.add(), name, kind, value)


def node_message(node: Node, presence: bool = False) -> Any:
    """The v0.0.4 protobuf ``Node`` of a node. With ``presence`` (a node read with
    :func:`stg.trace.reader.iter_nodes`, ``presence=True``), ``is_cpu_op``, ``num_ops``,
    ``tensor_size`` and ``comm_size`` are written where its file gave them or they are not
    False or 0, instead of by the rules of the module doc."""
    msg = pb4.Node()
    if node.id:
        msg.id = node.id
    msg.name = node.name
    msg.type = int(node.type)
    msg.ctrl_deps.extend(node.ctrl_deps)
    msg.data_deps.extend(node.data_deps)
    if node.runtime:
        msg.duration_micros = node.runtime
    attrs = node.attrs
    extras = getattr(attrs, "extras", None) or {}
    if extras.get("start_time_micros"):
        msg.start_time_micros = extras["start_time_micros"]
    for io_name in ("inputs", "outputs"):
        if io_name in extras:
            io_info = getattr(msg, io_name)
            io_info.SetInParent()
            io_info.values, io_info.shapes, io_info.types = extras[io_name]
    written: set[str] = set()
    given = getattr(attrs, "field_kinds", None) if presence else None
    if given is None:
        is_comp = node.type is NodeType.COMP
        cpu, ops, size = True, is_comp, is_comp
        comm = node.type in COMM_TYPES
    else:
        cpu, ops = "is_cpu_op" in given, "num_ops" in given
        size, comm = "tensor_size" in given, "comm_size" in given
    if cpu or node.is_cpu_op:
        _add(msg, "is_cpu_op", "bool_val", bool(node.is_cpu_op))
        written.add("is_cpu_op")
    if ops or node.num_ops:
        _add(msg, "num_ops", "int64_val", node.num_ops)
        written.add("num_ops")
    if size or node.tensor_size:
        _add(msg, "tensor_size", "uint64_val", node.tensor_size)
        written.add("tensor_size")
    if node.comm_type is not None:
        _add(msg, "comm_type", "int64_val", int(node.comm_type))
        written.add("comm_type")
    if comm or node.comm_size:
        _add(msg, "comm_size", "int64_val", node.comm_size)
        written.add("comm_size")
    if node.comm_group is not None:
        _add(msg, "pg_name", "string_val", str(node.comm_group))
        written.add("pg_name")
    for name in ("comm_src", "comm_dst", "comm_tag"):
        value = getattr(node, name)
        if value is not None:
            _add(msg, name, "int32_val", value)
            written.add(name)
    if node.dtype is not None:
        _add(msg, "dtype", "string_val", node.dtype)
        written.add("dtype")
    docs = getattr(attrs, "docs", None) or {}
    implies_op = has_implied_op(attrs)
    for name in attrs:
        if name in written:
            raise ValueError(f"node {node.id}: attribute {name!r} duplicates a node field")
        if implies_op and name == OP_ATTR and attrs[name] == implied_op(node.name):
            continue  # readers put it back
        set_attr(msg.attr.add(), name, attr_kind(attrs, name), attrs[name], docs.get(name, ""))
    if implies_op and OP_ATTR not in attrs:
        _add(msg, OP_ATTR, "string_val", "")  # no op: none is implied
    return msg


def encode_node(node: Node, presence: bool = False) -> bytes:
    """One framed Node record (``presence``: see :func:`node_message`)."""
    return frame(node_message(node, presence).SerializeToString())


def metadata_message(attrs: Mapping[str, Any] | None = None, version: str = SCHEMA_VERSION) -> Any:
    """A ``GlobalMetadata`` with ``version`` and ``attrs`` (kinds remembered or inferred)."""
    meta = pb4.GlobalMetadata()
    meta.version = version or (SCHEMA_VERSION if not attrs else "")
    attrs = attrs or {}
    docs = getattr(attrs, "docs", None) or {}
    for name in attrs:
        set_attr(meta.attr.add(), name, attr_kind(attrs, name), attrs[name], docs.get(name, ""))
    return meta


def encode_metadata(attrs: Mapping[str, Any] | None = None, version: str = SCHEMA_VERSION) -> bytes:
    """The framed ``GlobalMetadata`` record."""
    return frame(metadata_message(attrs, version).SerializeToString())


def encode_nodes(
    nodes: Iterable[Node],
    metadata: Mapping[str, Any] | None = None,
    *,
    version: str = SCHEMA_VERSION,
) -> bytes:
    """A whole rank file: ``GlobalMetadata`` (``version``, ``metadata`` as attrs), then the
    nodes in the order given."""
    parts = [encode_metadata(metadata, version)]
    parts.extend(encode_node(node) for node in nodes)
    return b"".join(parts)


def write_stream(
    out: BinaryIO,
    nodes: Iterable[Node],
    metadata: Mapping[str, Any] | None = None,
    *,
    version: str = SCHEMA_VERSION,
    presence: bool = False,
) -> int:
    """Write a whole rank file to a binary stream node by node; return the node count
    (``presence``: see :func:`node_message`)."""
    out.write(encode_metadata(metadata, version))
    count = 0
    for node in nodes:
        out.write(encode_node(node, presence))
        count += 1
    return count
