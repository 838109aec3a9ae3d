"""Chakra's feeder JSON: encoding nodes into one rank file (the ``json`` emitter's format).

Each rank file is ``{"global_metadata": {...}, "workload_graph": [node, ...]}`` with one node
object per line. A node carries the keys Chakra's JSON feeder reads — ``Id``, ``Name``,
``NodeType`` (v0.0.4 numbers), ``is_cpu_op``, ``runtime`` (µs), ``data_deps``, and for comm
nodes ``tensor_size``, ``comm_type``, ``comm_priority``, ``comm_size``, ``comm_src``,
``comm_dst``, ``comm_tag`` — plus what makes a round trip lossless: ``ctrl_deps``,
``num_ops``, ``tensor_size`` (COMP), ``pg_name`` (decimal comm-group id), ``dtype``,
``start_time_micros``, ``inputs``/``outputs`` and ``attr`` (further attributes as
``{"name": ..., "<kind>": value}``, bytes in base64; less an ``op`` that the name implies,
:func:`stg.core.workload.implied_op`). Chakra's feeder needs every comm key to
be an integer, so a comm node's key without a value is written as 0 and listed in
``stg_unset``, which stg's reader honours. Keys come in a fixed order; same input, same bytes.

With ``presence`` (nodes read with :func:`stg.trace.reader.iter_nodes`, ``presence=True``, as
``stg convert`` does), ``is_cpu_op``, ``num_ops``, ``tensor_size`` and ``comm_size`` are
written where the source gave them (or they are not False or 0); where it did not and Chakra's
feeder reads the key (``is_cpu_op``; ``tensor_size`` and ``comm_size`` of a comm node), it is
written as false or 0 and listed in ``stg_unset``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping
from typing import Any, BinaryIO

from stg.core.workload import COMM_TYPES, OP_ATTR, Node, NodeType, has_implied_op, implied_op
from stg.trace.reader import attr_kind

SCHEMA_VERSION = "0.0.4"
_COMM_KEYS = ("comm_type", "comm_priority", "comm_size", "comm_src", "comm_dst", "comm_tag")


def _json_value(kind: str, value: Any) -> Any:
    if kind == "bytes_val":
        return base64.b64encode(value).decode("ascii")
    if kind == "bytes_list":
        return [base64.b64encode(v).decode("ascii") for v in value]
    if kind.endswith("_list"):
        return list(value)
    return value


def attr_list(attrs: Mapping[str, Any], skip: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Attributes as ``[{"name": n, "<kind>": v, "doc_string"?: d}, ...]``."""
    skipped = set(skip)
    docs = getattr(attrs, "docs", None) or {}
    out = []
    for name in attrs:
        if name in skipped:
            continue
        kind = attr_kind(attrs, name)
        entry: dict[str, Any] = {"name": name, kind: _json_value(kind, attrs[name])}
        if docs.get(name):
            entry["doc_string"] = docs[name]
        out.append(entry)
    return out


def node_object(node: Node, presence: bool = False) -> dict[str, Any]:
    """The JSON object of one node (keys in their fixed order; ``presence``: see module
    doc)."""
    is_comm = node.type in COMM_TYPES
    attrs = node.attrs
    obj: dict[str, Any] = {
        "Id": node.id,
        "Name": node.name,
        "NodeType": int(node.type),
        "is_cpu_op": bool(node.is_cpu_op),
        "runtime": node.runtime,
        "data_deps": list(node.data_deps),
        "ctrl_deps": list(node.ctrl_deps),
    }
    unset: list[str] = []
    given = getattr(attrs, "field_kinds", None) if presence else None
    if given is None:
        is_comp = node.type is NodeType.COMP
        ops, size, comm = is_comp, is_comp or is_comm, is_comm
    else:
        ops, size, comm = "num_ops" in given, "tensor_size" in given, "comm_size" in given
        if "is_cpu_op" not in given and not node.is_cpu_op:
            unset.append("is_cpu_op")
    if ops or node.num_ops:
        obj["num_ops"] = node.num_ops
    if size or node.tensor_size:
        obj["tensor_size"] = node.tensor_size
    elif is_comm:
        obj["tensor_size"] = 0
        unset.append("tensor_size")
    priority = attrs.get("comm_priority")
    hoist_priority = (
        priority is not None
        and attr_kind(attrs, "comm_priority") == "int32_val"
        and not isinstance(priority, bool)
    )
    values: dict[str, Any] = {
        "comm_type": None if node.comm_type is None else int(node.comm_type),
        "comm_priority": priority if hoist_priority else None,
        "comm_size": node.comm_size if (comm or node.comm_size) else None,
        "comm_src": node.comm_src,
        "comm_dst": node.comm_dst,
        "comm_tag": node.comm_tag,
    }
    for key in _COMM_KEYS:
        if values[key] is not None:
            obj[key] = values[key]
        elif is_comm:
            obj[key] = 0
            unset.append(key)
    if node.comm_group is not None:
        obj["pg_name"] = str(node.comm_group)
    if node.dtype is not None:
        obj["dtype"] = node.dtype
    extras = getattr(attrs, "extras", None) or {}
    if extras.get("start_time_micros"):
        obj["start_time_micros"] = extras["start_time_micros"]
    for io_name in ("inputs", "outputs"):
        if io_name in extras:
            obj[io_name] = dict(zip(("values", "shapes", "types"), extras[io_name], strict=True))
    skip = ["comm_priority"] if hoist_priority else []
    implies_op = has_implied_op(attrs)
    if implies_op and attrs.get(OP_ATTR) == implied_op(node.name):
        skip.append(OP_ATTR)  # readers put it back
    attr = attr_list(attrs, skip)
    if implies_op and OP_ATTR not in attrs:
        attr.append({"name": OP_ATTR, "string_val": ""})  # no op: none is implied
    if attr:
        obj["attr"] = attr
    if unset:
        obj["stg_unset"] = unset
    return obj


def encode_node(node: Node, presence: bool = False) -> bytes:
    """One node as a line of JSON (no trailing separator; ``presence``: see module doc)."""
    return json.dumps(node_object(node, presence), ensure_ascii=False).encode("utf-8")


def _head(metadata: Mapping[str, Any] | None, version: str) -> bytes:
    meta = {"version": version, "attr": attr_list(metadata or {})}
    text = '{\n  "global_metadata": ' + json.dumps(meta, ensure_ascii=False) + ","
    return text.encode("utf-8") + b'\n  "workload_graph": ['


_SEPARATOR = b",\n    "
_TAIL = b"\n  ]\n}\n"


def encode_document(
    metadata: Mapping[str, Any] | None, version: str, records: list[bytes]
) -> bytes:
    if not records:
        return _head(metadata, version) + b"]\n}\n"
    return _head(metadata, version) + b"\n    " + _SEPARATOR.join(records) + _TAIL


def write_stream(
    out: BinaryIO,
    nodes: Iterable[Node],
    metadata: Mapping[str, Any] | None = None,
    *,
    version: str = SCHEMA_VERSION,
    presence: bool = False,
) -> int:
    """Write a whole JSON rank file to a binary stream node by node; return the node count.
    The bytes equal those of :func:`encode_nodes` (``presence``: see module doc)."""
    out.write(_head(metadata, version))
    count = 0
    for node in nodes:
        out.write((b"\n    " if count == 0 else _SEPARATOR) + encode_node(node, presence))
        count += 1
    out.write(_TAIL if count else b"]\n}\n")
    return count


def encode_nodes(
    nodes: Iterable[Node],
    metadata: Mapping[str, Any] | None = None,
    *,
    version: str = SCHEMA_VERSION,
) -> bytes:
    """A whole JSON rank file for ``nodes`` in the order given."""
    return encode_document(metadata, version, [encode_node(node) for node in nodes])
