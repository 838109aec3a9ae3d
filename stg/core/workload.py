"""Concrete workloads: what lowering produces and emitters, validators and predictors read.

A :class:`Workload` holds one :class:`RankGraph` per rank. Ranks that do the same work share a
:class:`RankClass` (a tuple of :class:`NodeTemplate`); a RankGraph is a cheap view that resolves
only what differs between ranks of a class: communicator ids and send/recv peers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
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


class Phase(IntEnum):
    """Which pass of a training iteration (or serving step) a node belongs to; the value is
    the ``phase`` attribute's int64 code in traces."""

    FORWARD = 1
    BACKWARD = 2
    RECOMPUTE = 3
    """a forward op run again before its backward (activation recomputation)"""
    OPTIMIZER = 4
    """the optimizer step and what follows it (the distributed optimizer's parameter gather)"""


class Role(IntEnum):
    """What a node does beyond its op, where a consumer must know it; the value is the
    ``role`` attribute's int64 code in traces (most nodes have no role and no attribute)."""

    OPTIMIZER_STEP = 1
    PARAM_ALL_GATHER = 2
    """the distributed optimizer's (ZeRO-1/2) all-gather of updated parameters"""
    TP_ALL_GATHER = 3
    """sequence parallelism's all-gather over the tensor-parallel group"""
    TP_REDUCE_SCATTER = 4
    """sequence parallelism's reduce-scatter over the tensor-parallel group"""
    FP8_AMAX = 5
    """Transformer Engine's amax reduction (concatenation, all-reduce, history update)"""
    ORTHOGONALIZE = 6
    """Muon's orthogonalization of the gradients before the optimizer step (its momentum
    all-gather, normalisation and Newton-Schulz GEMMs: :mod:`stg.core.muon`): optimizer work,
    not model FLOPs"""


class PartCode(IntEnum):
    """The parts besides the layers, as the ``part`` attribute's int64 code in traces (a
    layer's nodes carry its index in the ``layer`` attribute instead)."""

    EMBEDDING = 1
    HEAD = 2


PHASE_ATTR = "phase"
"""int64 attribute: a :class:`Phase` code"""
MICRO_BATCH_ATTR = "micro_batch"
"""integer attribute: the micro-batch (from 0) a node works on; absent outside micro-batches"""
LAYER_ATTR = "layer"
"""integer attribute: the layer (from 0) a node belongs to"""
PART_ATTR = "part"
"""int64 attribute: the :class:`PartCode` (embedding, head) a node outside the layers belongs to"""
ROLE_ATTR = "role"
"""int64 attribute: a :class:`Role` code"""
STEP_ATTR = "step"
"""integer attribute: the step (from 0) of a serving run of several steps"""
CHUNK_ATTR = "chunk"
"""integer attribute: the model chunk (from 0) of an fp8 amax reduction that ends a chunk's
forward or backward (Transformer Engine's autocast region)"""
OP_ATTR = "op"
"""string attribute: the model op the node runs (``fc1``, ``fc1_bias``, ``scores.grad_q``): the
same on every micro-batch and layer, so it keys per-kernel caches. Traces leave it out where
it is :func:`implied_op` of a node with a ``phase`` code, and readers put it back."""
NODE_SEMANTICS = (
    PHASE_ATTR,
    MICRO_BATCH_ATTR,
    LAYER_ATTR,
    PART_ATTR,
    ROLE_ATTR,
    OP_ATTR,
    STEP_ATTR,
    CHUNK_ATTR,
)
"""the attributes :mod:`stg.core.lowering` sets on generated nodes (docs/generation.md)"""


# codes, and the names an earlier development version wrote as strings
_PHASES: dict[int | str, Phase] = {
    **{int(p): p for p in Phase},
    **{p.name.lower(): p for p in Phase},
}
_ROLES: dict[int | str, Role] = {**{int(r): r for r in Role}, **{r.name.lower(): r for r in Role}}
_PART_NAMES = {int(p): p.name.lower() for p in PartCode}
_PART_CODES = {name: code for code, name in _PART_NAMES.items()}
_LAYER_NAMES = tuple(f"layer{i}" for i in range(1024))


def _attrs(node: Any) -> Mapping[str, Any]:
    return getattr(node, "attrs", None) or {}


def _code(value: Any) -> int | str | None:
    """An attribute value as a key of the code tables (a bool is no code)."""
    return value if type(value) is int or type(value) is str else None


def node_phase(node: Any) -> Phase | None:
    """The phase a node declares (its ``phase`` attribute), None where absent or unknown."""
    return _PHASES.get(_code(_attrs(node).get(PHASE_ATTR)))  # type: ignore[arg-type]


def node_role(node: Any) -> Role | None:
    """The role a node declares (its ``role`` attribute), None where absent or unknown."""
    return _ROLES.get(_code(_attrs(node).get(ROLE_ATTR)))  # type: ignore[arg-type]


def node_micro_batch(node: Any) -> int | None:
    """The micro-batch a node declares (its ``micro_batch`` attribute), None where absent."""
    value = _attrs(node).get(MICRO_BATCH_ATTR)
    return value if type(value) is int else None


def node_step(node: Any) -> int | None:
    """The serving step a node declares (its ``step`` attribute), None where absent."""
    value = _attrs(node).get(STEP_ATTR)
    return value if type(value) is int else None


def node_chunk(node: Any) -> int | None:
    """The model chunk of a chunk's fp8 amax reduction (its ``chunk`` attribute), None
    where absent."""
    value = _attrs(node).get(CHUNK_ATTR)
    return value if type(value) is int else None


def node_part(node: Any) -> str | None:
    """The part instance a node declares (``layer3`` from its ``layer`` attribute,
    ``embedding`` or ``head`` from its ``part`` code), None where absent."""
    attrs = _attrs(node)
    layer = attrs.get(LAYER_ATTR)
    if type(layer) is int and layer >= 0:
        return _LAYER_NAMES[layer] if layer < len(_LAYER_NAMES) else f"layer{layer}"
    value = attrs.get(PART_ATTR)
    if type(value) is int:
        return _PART_NAMES.get(value)
    return value if type(value) is str and value else None


def part_attrs(part: str | int) -> dict[str, int]:
    """The attributes that name a part instance: ``layer`` for a layer (its index, or its
    name ``layer3``), the ``part`` code for ``embedding`` and ``head``."""
    if isinstance(part, int):
        return {LAYER_ATTR: part}
    code = _PART_CODES.get(part)
    if code is not None:
        return {PART_ATTR: code}
    if part.startswith("layer") and part[5:].isdigit():
        return {LAYER_ATTR: int(part[5:])}
    raise ValueError(f"unknown part {part!r}: a layer index, layerN, embedding or head")


def implied_op(name: str) -> str:
    """The op of a node with an integer ``phase`` whose trace has no ``op`` attribute: its name
    after the last ``/`` (``mb0/layer3/bwd/fc1`` runs ``fc1``)."""
    return name[name.rfind("/") + 1 :]


def has_implied_op(attrs: Mapping[str, Any]) -> bool:
    """Whether a trace leaves out ``op`` for a node with these attributes where it equals
    :func:`implied_op` (those with an integer ``phase`` code)."""
    return type(attrs.get(PHASE_ATTR)) is int


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


@dataclass(slots=True)
class NodeTemplate:
    """A node of a rank class: like :class:`Node`, with rank-dependent fields left symbolic.

    ``group_axes`` names the mesh axes a collective spans (resolved per rank to a communicator
    id); ``peer_stage`` is the pipeline stage of a send's destination or a receive's source
    (resolved per rank to the peer's global rank).

    Not frozen, unlike :class:`Node`: lowering makes hundreds of thousands of them, and a
    frozen dataclass sets each field through ``object.__setattr__`` (0.50 → 0.30 CPU s for the
    201,967 templates of GPT-3 175B at 34 micro-batches, ``benchmarks/lowering_speed.py``).
    Nothing changes a template once lowering has made it. ``_Nodes.run`` in
    :mod:`stg.core.lowering` sets every field of the templates it lays out in turn, without
    ``__init__``: a field added here is set there too (tests/test_lowering_runs.py compares
    its templates with those made by ``__init__``).
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


_COLLECTIVE, _SEND, _RECV = NodeType.COMM_COLL, NodeType.COMM_SEND, NodeType.COMM_RECV


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
        return self._resolve(template, None, None)

    def resolve_many(self, templates: Iterable[NodeTemplate]) -> list[Node]:
        """:meth:`resolve` of each of ``templates``, each communicator and peer looked up
        once."""
        groups: dict[tuple[str, ...], int] = {}
        peers: dict[int | None, int] = {}
        resolve = self._resolve
        return [resolve(t, groups, peers) for t in templates]

    def _resolve(
        self,
        template: NodeTemplate,
        groups: dict[tuple[str, ...], int] | None,
        peers: dict[int | None, int] | None,
    ) -> Node:
        """:meth:`resolve`, the communicators and peers found so far in ``groups`` and
        ``peers`` (None: none kept)."""
        group = src = dst = None
        kind = template.type
        if kind is _COLLECTIVE:
            axes = template.group_axes
            group = None if groups is None else groups.get(axes)
            if group is None:
                group = self.layout.group_id(self.rank, axes)
                if groups is not None:
                    groups[axes] = group
        elif kind is _SEND or kind is _RECV:
            stage = template.peer_stage
            peer = None if peers is None else peers.get(stage)
            if peer is None:
                peer = self.layout.peer(self.rank, stage)
                if peers is not None:
                    peers[stage] = peer
            src, dst = (peer, self.rank) if kind is _RECV else (self.rank, peer)
        # positional, in Node's field order: a frozen dataclass's keywords cost more
        return Node(
            template.id,
            template.name,
            kind,
            template.data_deps,
            template.ctrl_deps,
            template.num_ops,
            template.tensor_size,
            template.comm_type,
            template.comm_size,
            group,
            src,
            dst,
            template.comm_tag,
            template.runtime,
            False,  # is_cpu_op
            template.dtype,
            template.attrs,
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
