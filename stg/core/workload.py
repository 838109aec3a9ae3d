"""Concrete workloads: what lowering produces and emitters, validators and predictors read.

A :class:`Workload` holds one :class:`RankGraph` per rank. Ranks that do the same work share a
:class:`RankClass` (a tuple of :class:`NodeTemplate`); a RankGraph is a cheap view that resolves
only what differs between ranks of a class: communicator ids and send/recv peers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stg.core.layout import Layout


class NodeType(IntEnum):
    """Chakra node types, numbered as in schema v0.0.4."""

    INVALID = 0
    METADATA = 1
    MEM_LOAD = 2
    MEM_STORE = 3
    COMP = 4
    COMM_SEND = 5
    COMM_RECV = 6
    COMM_COLL = 7


class CollectiveType(IntEnum):
    """Chakra collective types, numbered as in schema v0.0.4."""

    ALL_REDUCE = 0
    REDUCE = 1
    ALL_GATHER = 2
    GATHER = 3
    SCATTER = 4
    BROADCAST = 5
    ALL_TO_ALL = 6
    REDUCE_SCATTER = 7
    REDUCE_SCATTER_BLOCK = 8
    BARRIER = 9


COMM_TYPES = frozenset({NodeType.COMM_SEND, NodeType.COMM_RECV, NodeType.COMM_COLL})


class Phase(StrEnum):
    """Which pass of a training iteration (or serving step) a node belongs to."""

    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    """a forward op run again before its backward (activation recomputation)"""
    OPTIMIZER = "optimizer"
    """the optimizer step and what follows it (the distributed optimizer's parameter gather)"""


class Role(StrEnum):
    """What a node does beyond its op, where a consumer must know it."""

    OPTIMIZER_STEP = "optimizer_step"
    PARAM_ALL_GATHER = "param_all_gather"
    """the distributed optimizer's (ZeRO-1/2) all-gather of updated parameters"""
    TP_ALL_GATHER = "tp_all_gather"
    """sequence parallelism's all-gather over the tensor-parallel group"""
    TP_REDUCE_SCATTER = "tp_reduce_scatter"
    """sequence parallelism's reduce-scatter over the tensor-parallel group"""
    FP8_AMAX = "fp8_amax"
    """Transformer Engine's amax reduction (concatenation, all-reduce, history update)"""


PHASE_ATTR = "phase"
"""string attribute: a :class:`Phase` value"""
MICRO_BATCH_ATTR = "micro_batch"
"""integer attribute: the micro-batch (from 0) a node works on; absent outside micro-batches"""
PART_ATTR = "part"
"""string attribute: the part instance a node belongs to (``embedding``, ``layer3``, ``head``)"""
ROLE_ATTR = "role"
"""string attribute: a :class:`Role` value"""
STEP_ATTR = "step"
"""integer attribute: the step (from 0) of a serving run of several steps"""
OP_ATTR = "op"
"""string attribute: the model op the node runs (``fc1``, ``fc1_bias``, ``scores.grad_q``): the
same on every micro-batch and layer, so it keys per-kernel caches"""
NODE_SEMANTICS = (PHASE_ATTR, MICRO_BATCH_ATTR, PART_ATTR, ROLE_ATTR, OP_ATTR, STEP_ATTR)
"""the attributes :mod:`stg.core.lowering` sets on generated nodes (docs/generation.md)"""


_PHASES = {str(p): p for p in Phase}
_ROLES = {str(r): r for r in Role}


def _attrs(node: Any) -> Mapping[str, Any]:
    return getattr(node, "attrs", None) or {}


def node_phase(node: Any) -> Phase | None:
    """The phase a node declares (its ``phase`` attribute), None where absent or unknown."""
    value = _attrs(node).get(PHASE_ATTR)
    return _PHASES.get(value) if type(value) is str else None


def node_role(node: Any) -> Role | None:
    """The role a node declares (its ``role`` attribute), None where absent or unknown."""
    value = _attrs(node).get(ROLE_ATTR)
    return _ROLES.get(value) if type(value) is str else None


def node_micro_batch(node: Any) -> int | None:
    """The micro-batch a node declares (its ``micro_batch`` attribute), None where absent."""
    value = _attrs(node).get(MICRO_BATCH_ATTR)
    return value if type(value) is int else None


def node_step(node: Any) -> int | None:
    """The serving step a node declares (its ``step`` attribute), None where absent."""
    value = _attrs(node).get(STEP_ATTR)
    return value if type(value) is int else None


def node_part(node: Any) -> str | None:
    """The part instance a node declares (its ``part`` attribute), None where absent."""
    value = _attrs(node).get(PART_ATTR)
    return value if type(value) is str and value else None


def node_op(node: Any) -> str | None:
    """The model op a node declares (its ``op`` attribute), None where absent."""
    value = _attrs(node).get(OP_ATTR)
    return value if type(value) is str and value else None


@dataclass(frozen=True, slots=True)
class Node:
    """One node of one rank's graph, fully resolved.

    Units: ``num_ops`` in floating-point operations (2 per multiply-accumulate),
    ``tensor_size`` and ``comm_size`` in bytes, ``runtime`` in microseconds.
    ``comm_group`` is the communicator id of a collective (a key of the comm-group file).
    ``attrs`` carries any further attributes by name (e.g. read from a foreign trace).
    """

    id: int
    name: str
    type: NodeType
    data_deps: tuple[int, ...] = ()
    ctrl_deps: tuple[int, ...] = ()
    num_ops: int = 0
    tensor_size: int = 0
    comm_type: CollectiveType | None = None
    comm_size: int = 0
    comm_group: int | None = None
    comm_src: int | None = None
    comm_dst: int | None = None
    comm_tag: int | None = None
    runtime: int = 0
    is_cpu_op: bool = False
    dtype: str | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class NodeTemplate:
    """A node of a rank class: like :class:`Node`, with rank-dependent fields left symbolic.

    ``group_axes`` names the mesh axes a collective spans (resolved per rank to a communicator
    id); ``peer_stage`` is the pipeline stage of a send's destination or a receive's source
    (resolved per rank to the peer's global rank).
    """

    id: int
    name: str
    type: NodeType
    data_deps: tuple[int, ...] = ()
    ctrl_deps: tuple[int, ...] = ()
    num_ops: int = 0
    tensor_size: int = 0
    comm_type: CollectiveType | None = None
    comm_size: int = 0
    group_axes: tuple[str, ...] = ()
    peer_stage: int | None = None
    comm_tag: int | None = None
    dtype: str | None = None
    runtime: int = 0
    """the node's duration in microseconds (Chakra's ``duration_micros``; 0: none)"""
    attrs: Mapping[str, Any] = field(default_factory=dict)
    """further attributes, the same on every rank: the kernel shape of a compute node, and
    what the node is for (:data:`NODE_SEMANTICS`: phase, micro-batch, part, role, op)"""


@dataclass(frozen=True, slots=True)
class RankClass:
    """The node templates shared by all ranks that do the same work (e.g. one pipeline stage).

    ``facts`` records what lowering knows beyond the nodes, for predictors: ``parameters``
    (weight elements held by one rank of the class; under FSDP its padded shard),
    ``replica_parameters`` (the elements of one unsharded replica of its stage),
    ``shard_parameters`` (the sum over units of the padded flat shard under FSDP/ZeRO),
    ``layers`` (blocks on this stage), ``has_embedding``, ``has_head``, ``micro_batches``,
    ``weight_dtype``, ``grad_dtype``.
    """

    index: int
    stage: int
    nodes: tuple[NodeTemplate, ...]
    facts: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RankGraph:
    """One rank's graph: a view of its :class:`RankClass` bound to a global rank."""

    rank: int
    rank_class: RankClass
    layout: Layout

    def __len__(self) -> int:
        return len(self.rank_class.nodes)

    def resolve(self, template: NodeTemplate) -> Node:
        """The concrete node of this rank for one template of its class."""
        group = src = dst = None
        if template.type is NodeType.COMM_COLL:
            group = self.layout.group_id(self.rank, template.group_axes)
        elif template.type is NodeType.COMM_SEND:
            src = self.rank
            dst = self.layout.peer(self.rank, template.peer_stage)
        elif template.type is NodeType.COMM_RECV:
            src = self.layout.peer(self.rank, template.peer_stage)
            dst = self.rank
        return Node(
            id=template.id,
            name=template.name,
            type=template.type,
            data_deps=template.data_deps,
            ctrl_deps=template.ctrl_deps,
            num_ops=template.num_ops,
            tensor_size=template.tensor_size,
            comm_type=template.comm_type,
            comm_size=template.comm_size,
            comm_group=group,
            comm_src=src,
            comm_dst=dst,
            comm_tag=template.comm_tag,
            runtime=template.runtime,
            dtype=template.dtype,
            attrs=template.attrs,
        )

    def nodes(self) -> Iterator[Node]:
        """All nodes of this rank in id order."""
        for template in self.rank_class.nodes:
            yield self.resolve(template)


@dataclass(frozen=True, slots=True)
class Workload:
    """Everything one ``stg generate`` produces, before any file is written.

    ``comm_groups`` maps each communicator id used by some node to its sorted member ranks.
    ``metadata`` holds the generating options (model, dims, degrees) for emitters to record.
    """

    ranks: tuple[RankGraph, ...]
    comm_groups: Mapping[int, tuple[int, ...]]
    layout: Layout
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank_classes(self) -> tuple[RankClass, ...]:
        seen: dict[int, RankClass] = {}
        for graph in self.ranks:
            seen.setdefault(graph.rank_class.index, graph.rank_class)
        return tuple(seen[i] for i in sorted(seen))


SYSTEM_METADATA = "system"
"""metadata key: the system whose kernel models gave the COMP nodes' durations
(``stg generate --system``); a trace that records one carries every COMP node's duration"""
