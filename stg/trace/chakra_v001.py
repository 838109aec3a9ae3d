"""The legacy proto2 Chakra schema v0.0.1: encoding nodes into one rank file (the
``chakra-v0.0.1`` emitter's format).

No GlobalMetadata: every record is a flat v0.0.1 ``Node``, framed like v0.0.4. As the original
STG did: ``parent`` lists the data deps then the ctrl deps (merged, each parent once); COMP
nodes carry ``num_ops`` and ``tensor_size``; collectives ``comm_type``, ``comm_size`` and
``involved_dim`` (three ``true`` unless the node has an ``involved_dim`` attribute); sends
``comm_dst``, receives ``comm_src`` (both written whenever known), plus ``comm_size`` and
``comm_tag``; memory nodes ``tensor_size`` and ``tensor_loc`` REMOTE. ``communicator_id``
carries the comm-group id (as TRACES.md asks; the comm-group file is written as for v0.0.4).
Node types and collective types are renumbered to the v0.0.1 enums.

What v0.0.1 cannot hold, and is therefore lost: the data/ctrl distinction of deps,
``is_cpu_op``, ``dtype``, any other attribute (except the v0.0.1 fields ``tensor_loc``,
``input_tensor_loc``, ``input_tensor_size``, ``output_tensor_loc``, ``output_tensor_size``,
``comm_priority`` and ``involved_dim`` kept in ``Node.attrs``), ``start_time_micros``,
``inputs``/``outputs``, and the file's GlobalMetadata. Collective types other than
ALL_REDUCE, ALL_TO_ALL, ALL_GATHER and REDUCE_SCATTER, METADATA nodes, negative sizes and ids,
peers or tags above 2**32 - 1 are rejected with a :class:`stg.errors.UserError`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, BinaryIO

from stg.core.workload import Node, NodeType
from stg.errors import UserError
from stg.trace.proto import chakra_v001_pb2 as pb1
from stg.trace.reader import V001_COLLECTIVES, V001_EXTRA_FIELDS, V001_NODE_TYPES
from stg.trace.writer import frame

NETWORK_DIMS = 3
_NODE_TYPES = {v4: v1 for v1, v4 in V001_NODE_TYPES.items()}
_COLLECTIVES = {v4: v1 for v1, v4 in V001_COLLECTIVES.items() if v4 is not None}
_UINT32 = (1 << 32) - 1
_UINT64 = (1 << 64) - 1


class V001Error(UserError):
    """A node that schema v0.0.1 cannot express."""


def _check(node: Node, field: str, value: int, limit: int) -> int:
    if not 0 <= value <= limit:
        raise V001Error(
            f"node {node.id}: {field}={value} does not fit v0.0.1 (0..{limit}); "
            "use --format chakra-v0.0.4"
        )
    return value


def node_message(node: Node) -> Any:
    """The v0.0.1 protobuf ``Node`` of a node."""
    msg = pb1.Node()
    msg.id = _check(node, "id", node.id, _UINT64)
    msg.name = node.name
    if node.type not in _NODE_TYPES:
        raise V001Error(
            f"node {node.id}: type {node.type.name} has no v0.0.1 equivalent; "
            "allowed: MEM_LOAD, MEM_STORE, COMP, COMM_SEND, COMM_RECV, COMM_COLL"
        )
    msg.node_type = _NODE_TYPES[node.type]
    seen: set[int] = set()
    for dep in (*node.data_deps, *node.ctrl_deps):
        if dep not in seen:
            seen.add(dep)
            msg.parent.append(_check(node, "dep", dep, _UINT64))
    if node.runtime:
        msg.simulated_run_time = _check(node, "runtime", node.runtime, _UINT64)
    attrs = node.attrs
    if node.type is NodeType.COMP or node.num_ops:
        msg.num_ops = _check(node, "num_ops", node.num_ops, _UINT64)
    if node.type in (NodeType.COMP, NodeType.MEM_LOAD, NodeType.MEM_STORE) or node.tensor_size:
        msg.tensor_size = _check(node, "tensor_size", node.tensor_size, _UINT64)
    if node.type in (NodeType.MEM_LOAD, NodeType.MEM_STORE) and "tensor_loc" not in attrs:
        msg.tensor_loc = pb1.REMOTE_MEMORY
    if node.comm_type is not None:
        if node.comm_type not in _COLLECTIVES:
            allowed = ", ".join(c.name for c in _COLLECTIVES)
            raise V001Error(
                f"node {node.id}: collective {node.comm_type.name} has no v0.0.1 equivalent; "
                f"allowed: {allowed}"
            )
        msg.comm_type = _COLLECTIVES[node.comm_type]
    elif getattr(attrs, "extras", {}).get("v001_comm_type_invalid"):
        msg.comm_type = pb1.INVALID_COMM
    if node.type is NodeType.COMM_COLL:
        dims = attrs.get("involved_dim", (True,) * NETWORK_DIMS)
        msg.involved_dim.extend(bool(d) for d in dims)
    elif "involved_dim" in attrs:
        msg.involved_dim.extend(bool(d) for d in attrs["involved_dim"])
    if node.type in (NodeType.COMM_COLL, NodeType.COMM_SEND, NodeType.COMM_RECV) or node.comm_size:
        msg.comm_size = _check(node, "comm_size", node.comm_size, _UINT64)
    if node.comm_group is not None:
        msg.communicator_id = _check(node, "comm_group", node.comm_group, _UINT32)
    for name in ("comm_src", "comm_dst", "comm_tag"):
        value = getattr(node, name)
        if value is not None:
            setattr(msg, name, _check(node, name, value, _UINT32))
    for name in V001_EXTRA_FIELDS:
        if name in attrs:
            value = attrs[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise V001Error(f"node {node.id}: attribute {name}={value!r} must be an integer")
            limit = _UINT64 if name.endswith("size") else _UINT32
            setattr(msg, name, _check(node, name, value, limit))
    return msg


def encode_node(node: Node) -> bytes:
    """One framed v0.0.1 Node record."""
    return frame(node_message(node).SerializeToString())


def encode_nodes(nodes: Iterable[Node]) -> bytes:
    """A whole v0.0.1 rank file."""
    return b"".join(encode_node(node) for node in nodes)


def write_stream(out: BinaryIO, nodes: Iterable[Node]) -> int:
    """Write a whole v0.0.1 rank file to a binary stream node by node; return the count."""
    count = 0
    for node in nodes:
        out.write(encode_node(node))
        count += 1
    return count
