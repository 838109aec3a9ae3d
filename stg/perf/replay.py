"""The replay engine: a multi-rank DAG replayed event by event on a system.

A *problem* (:class:`Problem`) is the graphs to replay, grouped into *units* of identical
ranks; :func:`replay` simulates it with the cost models of :mod:`stg.perf.costs` (compute)
and :mod:`stg.perf.comm_time` (collectives and sends) and returns every node's start and end
(:class:`Replay`); :func:`unit_breakdown`, :func:`critical_path` and :func:`explain` analyse
the result. The ``time`` predictor (``predictors/time.py``) builds the problem, calls
:func:`replay` and writes the report.

Replay: each rank has a compute stream, a stream for pipeline sends, and one stream per
communicator (NCCL process groups run on their own CUDA streams, so a tensor-parallel
collective never waits behind a data-parallel gradient reduction, nor a send behind either),
and one for copies to and from host memory (MEM_STORE and MEM_LOAD nodes, CPU activation
offload: :data:`HOST_COPY_STREAM`, each copy at the host link's bandwidth,
:func:`stg.perf.costs.host_copy_time`, beside the compute and the communication);
a ready node is issued smallest id first when its stream is free (smallest position, or the
key its unit's ``priority`` gives it in place of that). A collective occupies its
communicator's stream on every member from when the member issues it; its transfer starts
when the last member has issued it (matched per group in issue order). A receive occupies no
stream and completes when its matching send (same source, destination, tag and size, first in
first out) has completed.

Bandwidth sharing: transfers in flight at once on one rank share the bandwidth of the port
they cross (:data:`stg.perf.comm_time.PORTS`: the GPU's NVLink ports inside a node, its NIC
across nodes, each direction on its own: links are full duplex). A collective or send runs as
the phases of its cost model (:func:`stg.api.collective_phases`: per network dimension its
latency, then its bytes); while its bytes move it is one *user* of the port on the sending and
the receiving side of every rank it involves (a collective: both sides of every member; a
send: its source's sending and its destination's receiving side), and it drains its remaining
bytes at ``1 / users`` of its full bandwidth on the busiest of those ports, recomputed whenever
a transfer starts or finishes moving bytes; latencies are never shared. Sources and limits
of the model: :mod:`stg.perf.comm_time` ("Concurrent transfers"). Not shared: hybrid systems
(their own cost model), and tensor-parallel collectives under ``tp_comm_overlap`` (their bytes
move beside their GEMMs, where the replay has no transfer).

Overlap options (a workload's ``overlap_param_gather`` and ``tp_comm_overlap``, Megatron's
``--overlap-param-gather`` and ``--tp-comm-overlap``): the distributed optimizer's parameter
all-gathers open the replayed period and gate only their own part's forward (the steady
state, gathers of one iteration beside the next one's forward); a tensor-parallel all-gather
or reduce-scatter and the GEMMs that consume or produce it take the chunked pipeline's
``max(gemm, comm) + min(gemm, comm) / chunks`` (docs/prediction.md).

Symmetry: ranks of one rank class whose groups have the same placement shape and whose sends
cross links alike (:func:`link_signature`) (and, by refinement, whose group partners are
alike) have identical timelines, so only one representative per such *unit* is simulated;
collectives and sends synchronise the representatives of the units involved. A trace read
from files is simulated rank by rank.

What a node is for comes from its typed attributes (:data:`stg.core.workload.NODE_SEMANTICS`,
which generated traces carry), never from its name: the optimizer step and the parameter
all-gathers that follow it (``role``), the part and phase of a forward node (``part``,
``phase``), sequence parallelism's tensor-parallel collectives (``role``), a recomputed node
(``phase``), and the kernel a node runs (``op``: with the role and whether a weight's fp8
cast is reused, :func:`compute_cost_key`, it keys the per-kernel cost cache, alike nodes of
every micro-batch and layer sharing one entry). A trace without them (a foreign PyTorch trace
converted to Chakra) replays with neutral behaviour: no parameter gather moves, no
tensor-parallel collective overlaps its GEMM, nothing counts as recomputed, every fp8 weight
cast is paid, and compute costs are cached per node name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import heapq
import itertools
import math
import operator
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stg.core.extensions import load_extension
from stg.core.muon import LAUNCHES_ATTR, SHARE_ATTR
from stg.core.recipes import QUANTIZE_KERNEL_ATTR
from stg.core.torchtitan import EAGER_KERNELS_ATTR
from stg.core.workload import (
    COMM_TYPES,
    LAYER_ATTR,
    MICRO_BATCH_ATTR,
    OP_ATTR,
    PART_ATTR,
    PHASE_ATTR,
    ROLE_ATTR,
    STEP_ATTR,
    CollectiveType,
    Node,
    NodeType,
    Phase,
    Role,
    Workload,
    node_micro_batch,
    node_part,
    node_phase,
    node_role,
)
from stg.errors import TraceError, UserError
from stg.perf import comm_time
from stg.perf.calibration import Calibration
from stg.perf.costs import (
    collective_phases,
    collective_time,
    compute_time,
    fp8_quantize_time,
    group_shape,
    host_copy_time,
    link_dimension,
    native_fp8,
    send_phases,
    send_time,
    spanning_byte_rate,
)
from stg.perf.ep_dispatch import Route, dispatch_phases, routed
from stg.perf.hybrid import device_of, group_of_rank, is_hybrid
from stg.perf.kernels import KernelTable, kernel_name
from stg.perf.system import System, non_finite_time, op_class

COMPUTE, COLL, SEND, RECV, INSTANT, COPY = 0, 1, 2, 3, 4, 5
KIND_NAMES = {
    COMPUTE: "compute",
    COLL: "collective",
    SEND: "send",
    RECV: "recv",
    INSTANT: "other",
    COPY: "host copy",
}
HOST_COPY_STREAM = -1
"""The stream of a rank's copies to and from host memory (MEM_STORE, MEM_LOAD nodes: CPU
activation offload, :mod:`stg.core.offload`): one stream for both directions, as Transformer
Engine's offload stream, beside the compute."""
HOST_COPIES = (NodeType.MEM_LOAD, NodeType.MEM_STORE)

ENGINE_ABI_VERSION = 2
"""The version of stg/perf/_engine.c that :meth:`_Sim.run` drives (a stale build is not used)."""


_engine, _engine_status = load_extension("stg.perf._engine", ENGINE_ABI_VERSION, "STG_ENGINE")
compiled_engine: Any = _engine
"""The compiled module (:mod:`stg.perf._engine`) where it is in use, else None."""
_compiled_loop = _compiled_dependencies = _compiled_cost_key = None
if _engine is not None:
    _compiled_loop = _engine.run_loop
    _compiled_dependencies = _engine.earlier_dependencies
    _compiled_cost_key = _engine.cost_key
    _engine.set_cost_key_names(
        (
            OP_ATTR, STEP_ATTR, MICRO_BATCH_ATTR, ROLE_ATTR, "gemm", "attention",
            "attention_scaling", LAUNCHES_ATTR, SHARE_ATTR,
        )
    )  # fmt: skip


@contextlib.contextmanager
def python_engine() -> Iterator[None]:
    """Within the block the replay engine and the periodic check run their Python code only
    (what the compiled parts are tested against)."""
    global _compiled_loop, _compiled_dependencies, _compiled_cost_key, compiled_engine
    saved = _compiled_loop, _compiled_dependencies, _compiled_cost_key, compiled_engine
    _compiled_loop = _compiled_dependencies = _compiled_cost_key = compiled_engine = None
    try:
        yield
    finally:
        _compiled_loop, _compiled_dependencies, _compiled_cost_key, compiled_engine = saved


def engine_status() -> str:
    """``"compiled"``, or why the replay engine runs its event loop in Python."""
    if _compiled_loop is not None:
        return "compiled"
    return "python (turned off)" if _engine_status == "compiled" else _engine_status


# ---------------------------------------------------------------------------------------------
# Contention: compute slowed by concurrent communication


NCCL_CHANNELS: Mapping[str, int] = {"nvlink": 24, "pcie": 2, "network": 8}
"""SMs that NCCL's kernels hold while a collective runs over a link of each kind: one CTA per
channel. NVLink/NVSwitch: 24 channels on 8 A100s (NCCL's own log, "Channel 23/24", in
nccl-tests issue #100 and Megatron-LM issue #516); network: 8 ring channels across two
8-GPU nodes (NCCL's log in NVIDIA/nccl issue #1412); PCIe: 2 (NCCL's default minimum)."""

HBM_BYTES_PER_WIRE_BYTE = 3
"""HBM traffic of a reduction collective per byte it sends: the chunk it sends is read, the
chunk it receives is reduced with the local one (a read) and written."""


def contended_systems(system: System) -> dict[str, System]:
    """Per link kind of the system's network: the system as a compute kernel sees it while a
    NCCL collective runs over that kind of link concurrently (the contention model). NCCL's
    CTAs take ``NCCL_CHANNELS`` SMs away from the kernel (the GEMM and attention models see
    fewer SMs, each at its own rate: more waves), and its traffic takes
    ``HBM_BYTES_PER_WIRE_BYTE`` bytes of HBM bandwidth per byte on the wire (memory-bound
    kernels slow down). Plain alpha-beta links (no ``link``) and hybrid systems contend with
    nothing."""
    out: dict[str, System] = {}
    if is_hybrid(system):
        return out
    for dim in system.network:
        if dim.link is None or dim.link in out:
            continue
        out[dim.link] = contended_system(
            system, dim.link, NCCL_CHANNELS[dim.link], HBM_BYTES_PER_WIRE_BYTE
        )
    return out


def contended_system(system: System, link: str, sms_taken: int, hbm_per_wire: float) -> System:
    """The system as a compute kernel sees it while communication over ``link`` holds
    ``sms_taken`` SMs and moves ``hbm_per_wire`` bytes of HBM per byte on the wire."""
    wire = max(d.effective_bandwidth / d.oversubscription for d in system.network if d.link == link)
    sms = max(1, system.sm_count - sms_taken)
    share = sms / system.sm_count  # the peaks are the whole GPU's: per SM they stay
    return dataclasses.replace(
        system,
        sm_count=sms,
        peak_flops={d: rate * share for d, rate in system.peak_flops.items()},
        hbm_bandwidth=max(0.1 * system.hbm_bandwidth, system.hbm_bandwidth - hbm_per_wire * wire),
    )


SPANNING = "+nodes"
"""Suffix of the contention key of a collective that runs one NCCL algorithm over several GPUs
of each of several nodes (:func:`contention_link`)."""


def spanning_contended_system(system: System, link: str, bytes_per_s: float) -> System:
    """The system as a compute kernel sees it while a ring, tree or NVLSTree over several GPUs
    of several nodes runs with the network's channels (``NCCL_CHANNELS[link]`` SMs) and moves
    ``bytes_per_s`` through the GPU (:func:`stg.perf.costs.spanning_byte_rate`: the node's NIC
    rate, not one NIC's), ``HBM_BYTES_PER_WIRE_BYTE`` bytes of HBM for each."""
    gpu = contended_system(system, link, NCCL_CHANNELS[link], 0.0)
    hbm = max(
        0.1 * system.hbm_bandwidth, system.hbm_bandwidth - HBM_BYTES_PER_WIRE_BYTE * bytes_per_s
    )
    return dataclasses.replace(gpu, hbm_bandwidth=hbm)


def contention_link(
    kind: CollectiveType, shape: Sequence[int], system: System
) -> tuple[str | None, float | None]:
    """The contention key of a collective over a group of ``shape`` and, for one that runs an
    NCCL algorithm over several GPUs of several nodes, the bytes/s it moves through each GPU:
    ``(outermost link, None)``, or ``(outermost link + SPANNING + rate, rate)``."""
    link = outermost_link(shape, system)
    rate = spanning_byte_rate(kind, shape, system)
    if link is None or link not in NCCL_CHANNELS or rate is None:
        return link, None
    return f"{link}{SPANNING}{rate:.6g}", rate


def outermost_link(shape: Sequence[int], system: System) -> str | None:
    """The link kind of the outermost network dimension a group spans (whose channels NCCL
    runs the collective with)."""
    for n, dim in reversed(list(zip(shape, system.network, strict=False))):
        if n > 1:
            return dim.link
    return None


# ---------------------------------------------------------------------------------------------
# Overlap options: the distributed optimizer's parameter gather, tensor-parallel userbuffers


TP_OVERLAP_PIPELINE_SPLITS = 4
"""Chunks of a reduce-scatter that Transformer Engine's userbuffers overlap with the GEMM that
produces it (its "pipeline" method, ``num_splits`` 4 by default: ``initialize_ub`` in
transformer_engine/pytorch/module/base.py). The all-gather before a GEMM uses the
"ring_exchange" method: one chunk per tensor-parallel rank."""

USERBUFFERS_SMS = {"ring_exchange": 1, "pipeline": 16}
"""SMs that userbuffers' communication holds beside the GEMM (Transformer Engine's default
``num_sm`` per method, ``initialize_ub``; the GEMM runs on the others, ``set_sm_margin``): the
ring exchange of an all-gather moves chunks with copy engines and one SM, the pipelined
reduce-scatter reduces with 16."""

USERBUFFERS_HBM_BYTES_PER_WIRE_BYTE = {"ring_exchange": 2, "pipeline": HBM_BYTES_PER_WIRE_BYTE}
"""HBM traffic per byte on the wire: a copied chunk is read and written (2); a reduced one is
read, reduced with the local chunk and written (3, as a NCCL reduction)."""


def chunked_overlap_time(gemm: float, comm: float, chunks: int) -> float:
    """A GEMM and a collective split into ``chunks`` and pipelined against each other (chunk
    k's communication beside chunk k-1's GEMM): ``max(gemm, comm) + min(gemm, comm) / chunks``,
    the longer of the two plus one chunk of the shorter (the pipeline's fill or drain)."""
    return max(gemm, comm) + min(gemm, comm) / max(1, chunks)


def forward_part(node: Any) -> str | None:
    """The part whose forward ``node`` runs (``layer3``, ``embedding``): a node of one
    micro-batch's forward or recompute that names its part; None for any other node (a
    backward, the optimizer, a node without typed attributes)."""
    if node_micro_batch(node) is None or node_phase(node) not in (Phase.FORWARD, Phase.RECOMPUTE):
        return None
    return node_part(node)


def forward_parts(nodes: Sequence[Any]) -> list[str | None]:
    """:func:`forward_part` of each of ``nodes``, worked out once per distinct set of the raw
    attributes it reads (and their types): alike nodes of every micro-batch share one."""
    found: dict[tuple[Any, ...], str | None] = {}
    parts: list[str | None] = []
    for node in nodes:
        attrs = getattr(node, "attrs", None) or {}
        mb, phase = attrs.get(MICRO_BATCH_ATTR), attrs.get(PHASE_ATTR)
        layer, part = attrs.get(LAYER_ATTR), attrs.get(PART_ATTR)
        key = (type(mb) is int, phase, type(phase), layer, type(layer), part, type(part))
        if key in found:
            parts.append(found[key])
        else:
            parts.append(found.setdefault(key, forward_part(node)))
    return parts


def compute_cost_key(node: Any) -> tuple[Any, ...]:
    """What the cost of a compute node (:func:`stg.perf.costs.compute_time`) depends on: the
    op it runs (:func:`stg.perf.kernels.kernel_name`: its typed ``op``, else its whole name),
    its role, whether a weight's fp8 cast is reused there
    (:func:`stg.perf.costs.weight_cast_cached`), its FLOPs, bytes, dtype, recorded runtime and
    further attributes (the kernel shape). Alike nodes of every micro-batch and layer share
    one key."""
    attrs = node.attrs
    try:  # an attribute read, cheaper than getattr with a default
        runtime = node.runtime
    except AttributeError:
        runtime = 0
    # kernel_name and weight_cast_cached, inline: this runs once per node of every unit
    op = attrs.get(OP_ATTR)
    step = attrs.get(STEP_ATTR)
    micro_batch = attrs.get(MICRO_BATCH_ATTR)
    return (
        op if type(op) is str and op else node.name,
        attrs.get(ROLE_ATTR),
        type(step) is int or (type(micro_batch) is int and micro_batch != 0),
        node.num_ops,
        node.tensor_size,
        node.dtype,
        runtime,
        attrs.get("gemm"),
        attrs.get("attention"),
        attrs.get("attention_scaling"),  # training's fp8 attention (its casts follow the shape)
        attrs.get(LAUNCHES_ATTR),  # Muon's kernels in turn (stg.perf.costs.compute_time)
        attrs.get(SHARE_ATTR),
    )


# ---------------------------------------------------------------------------------------------
# Bandwidth sharing: concurrent transfers over the same port of a GPU


Steps = tuple[tuple[str | None, float], ...]
"""A transfer as the replay runs it: ``(port, seconds)`` steps in order. A step with a port
(``nvlink``, ``nic``, ...: :func:`stg.perf.comm_time.port`) moves bytes that take ``seconds``
at the port's full bandwidth and shares it; a step without one (latency, or a time fixed in
advance) takes its seconds whatever else runs."""


def transfer_steps(phases: Iterable[tuple[str, float, float]]) -> Steps:
    """The steps of a transfer's ``(port, latency, transfer)`` phases: each phase's latency,
    then its bytes (zero-length steps left out)."""
    steps: list[tuple[str | None, float]] = []
    for port, latency, transfer in phases:
        if latency > 0:
            steps.append((None, latency))
        if transfer > 0:
            steps.append((port, transfer))
    return tuple(steps)


def fixed_steps(seconds: float) -> Steps:
    """A transfer that takes ``seconds`` whatever else runs."""
    return ((None, seconds),) if seconds > 0 else ()


class _Flow:
    """One transfer in flight: a collective (all its members together, at the pace of its
    most loaded member) or a send. ``ends``: (unit, direction) pairs whose ports it uses, 0
    sending and 1 receiving (a collective both on every member, a send its source's sending
    and its destination's receiving side)."""

    __slots__ = (
        "contends",
        "ends",
        "finish",
        "index",
        "link",
        "members",
        "rate",
        "remaining",
        "resources",
        "since",
        "step",
        "steps",
        "tail",
        "version",
    )

    def __init__(
        self,
        index: int,
        members: list[tuple[int, int]],
        ends: list[tuple[int, int]],
        steps: Steps,
    ) -> None:
        self.index = index
        self.members = members
        self.ends = ends
        self.steps = steps
        self.step = -1
        self.finish = 0.0
        """when the current step ends at the current rate"""
        self.tail = 0.0
        """the steps after the current one at full bandwidth"""
        self.remaining = 0.0
        self.since = 0.0
        self.rate = 0.0
        self.resources: tuple[tuple[int, str, int], ...] = ()
        self.version = 0
        self.link: str | None = None
        self.contends: list[int] = []


class _Contender:
    """A collective within one unit whose ports no other stream uses
    (:meth:`_Sim._private_collectives`): it runs each step at full bandwidth, so it is replayed
    as one event at its end; this stands for it among the transfers that slow the unit's
    compute, as a :class:`_Flow` would (``finish`` + ``tail``: its end). ``index``: its
    (unit, node), where a flow has its number (the engine's state, :class:`EngineState`)."""

    __slots__ = ("finish", "index", "link")

    tail = 0.0

    def __init__(self, link: str, finish: float, index: tuple[int, int]) -> None:
        self.link = link
        self.finish = finish
        self.index = index


# ---------------------------------------------------------------------------------------------
# Units: the timelines that are simulated


@dataclass
class Unit:
    """One simulated timeline standing for ``ranks`` (all identical); ``rank`` simulates it."""

    index: int
    rank: int
    ranks: tuple[int, ...]
    nodes: list[Any]
    rank_class: int | None = None
    stage: int | None = None
    group_keys: dict[int, Any] = field(default_factory=dict)
    """node position -> axes key used to match collectives across units"""
    priority: dict[int, float] = field(default_factory=dict)
    """node position -> the key (not a whole number) by which that node, once ready, is taken
    from its stream's queue in place of its position: between two positions (the periodic
    replay's shorter problem places an end-of-iteration node where the schedule of as many
    micro-batches has it, :func:`stg.perf.periodic.replay_periodic`)"""


@dataclass
class Problem:
    """What the replay needs: units, the unit of every rank, and communicator members."""

    units: list[Unit]
    unit_of_rank: Mapping[int, int]
    comm_groups: Mapping[int, Sequence[int]]
    world_size: int
    alike: list[int | None] | None = field(default=None, repr=False, compare=False)
    """:func:`alike_units` without a system, worked out on its first call"""


def _refine(
    ranks: Sequence[int],
    initial: Mapping[int, Any],
    neighbours: Mapping[int, list[Sequence[int]]],
    peers: Mapping[int, list[int]],
) -> dict[int, int]:
    """Colour refinement: ranks stay together only while their partners are alike.

    Runs until no class splits: a difference travels one partner per round (along a
    pipeline, one stage), so a cap on the rounds would leave deep pipelines with units whose
    ranks are not alike, and their sends and collectives unmatched. Each round either splits
    a class or ends, so there are at most as many rounds as ranks."""
    colour: dict[int, int] = {}
    keys: dict[Any, int] = {}
    for r in ranks:
        colour[r] = keys.setdefault(initial[r], len(keys))
    while True:
        group_colours: dict[int, tuple[int, ...]] = {}
        new_keys: dict[Any, int] = {}
        new: dict[int, int] = {}
        for r in ranks:
            parts = []
            for members in neighbours[r]:
                key = id(members)
                if key not in group_colours:
                    group_colours[key] = tuple(sorted({colour[m] for m in members}))
                parts.append(group_colours[key])
            sig = (colour[r], tuple(parts), tuple(colour[p] for p in peers[r]))
            new[r] = new_keys.setdefault(sig, len(new_keys))
        if len(new_keys) == len(keys):
            return new
        colour, keys = new, new_keys


def link_signature(src: int, dst: int, system: System, memo: dict[int, Any]) -> Any:
    """What a send from ``src`` to ``dst`` costs and shares depends on: the level (bandwidth,
    latency, link kind) and port of the outermost dimension on which they differ
    (:func:`stg.perf.costs.send_phases`), so that sends over two dimensions alike (a rail and
    a spine of the same links) leave their ranks alike; on hybrid systems (sends priced per
    rank pair) and for a send to itself, the dimension. ``memo``: per dimension."""
    dimension = link_dimension(src, dst, system)
    if dimension < 0 or is_hybrid(system):
        return dimension
    signature = memo.get(dimension)
    if signature is None:
        level = comm_time.Level.of(system.network[dimension])
        signature = memo[dimension] = (level, comm_time.port(level, dimension))
    return signature


def problem_from_workload(workload: Workload, system: System) -> Problem:
    """Split a workload into symmetric units (see the module docstring)."""
    layout = workload.layout
    groups = {gid: tuple(m) for gid, m in workload.comm_groups.items()}
    for gid, members in layout.comm_groups.items():
        groups.setdefault(gid, members)
    class_axes: dict[int, list[tuple[str, ...]]] = {}
    class_peers: dict[int, list[int]] = {}
    # per rank class, worked out once for its units: its templates in id order, the positions
    # of its communication nodes (only those differ between ranks) and each collective's key
    class_templates: dict[int, tuple[list[Any], list[int], dict[int, tuple[str, ...]]]] = {}
    sorted_axes: dict[tuple[str, ...], tuple[str, ...]] = {}
    for rc in workload.rank_classes:
        templates = list(rc.nodes)
        ids = [t.id for t in templates]
        if any(map(operator.ge, ids, ids[1:])):
            templates.sort(key=lambda t: t.id)
        comm = [i for i, t in enumerate(templates) if t.type in COMM_TYPES]
        keys: dict[int, tuple[str, ...]] = {}
        axes: set[tuple[str, ...]] = set()
        stages: set[int] = set()
        for i in comm:
            t = templates[i]
            if t.type is NodeType.COMM_COLL:
                key = sorted_axes.get(t.group_axes)
                if key is None:
                    key = sorted_axes[t.group_axes] = tuple(sorted(t.group_axes))
                keys[i] = key
                if t.group_axes:
                    axes.add(t.group_axes)
            elif t.peer_stage is not None:  # a send or a receive
                stages.add(t.peer_stage)
        class_templates[rc.index] = (templates, comm, keys)
        class_axes[rc.index] = sorted(axes)
        class_peers[rc.index] = sorted(stages)
    shapes: dict[int, tuple[int, ...]] = {}
    initial: dict[int, Any] = {}
    neighbours: dict[int, list[Sequence[int]]] = {}
    peers: dict[int, list[int]] = {}
    ranks = [g.rank for g in workload.ranks]
    levels: dict[int, Any] = {}
    for graph in workload.ranks:
        r, rc = graph.rank, graph.rank_class.index
        parts: list[Any] = []
        nbrs: list[Sequence[int]] = []
        for axes in class_axes[rc]:
            try:
                gid = layout.group_id(r, axes)
            except KeyError:
                parts.append(None)
                continue
            members = groups[gid]
            if gid not in shapes:
                shapes[gid] = group_shape(members, system)
            parts.append(shapes[gid])
            nbrs.append(members)
        links = []
        prs = []
        for stage in class_peers[rc]:
            peer = layout.peer(r, stage)
            links.append(link_signature(r, peer, system, levels))
            prs.append(peer)
        initial[r] = (rc, tuple(parts), tuple(links), group_of_rank(system, r))
        neighbours[r] = nbrs
        peers[r] = prs
    colour = _refine(ranks, initial, neighbours, peers)
    by_colour: dict[int, list[int]] = {}
    for r in ranks:
        by_colour.setdefault(colour[r], []).append(r)
    ordered = sorted(by_colour.values(), key=min)
    graphs = {g.rank: g for g in workload.ranks}
    units: list[Unit] = []
    unit_of_rank: dict[int, int] = {}
    for index, members in enumerate(ordered):
        rep = graphs[min(members)]
        templates, comm, keys = class_templates[rep.rank_class.index]
        nodes = templates.copy()
        for i, node in zip(comm, rep.resolve_many([templates[i] for i in comm]), strict=True):
            nodes[i] = node
        units.append(
            Unit(
                index=index,
                rank=rep.rank,
                ranks=tuple(sorted(members)),
                nodes=nodes,
                rank_class=rep.rank_class.index,
                stage=rep.rank_class.stage,
                group_keys=dict(keys),
            )
        )
        for r in members:
            unit_of_rank[r] = index
    return Problem(units, unit_of_rank, groups, workload.world_size)


def problem_from_nodes(
    rank_nodes: Mapping[int, Sequence[Node]], comm_groups: Mapping[int, Sequence[int]]
) -> Problem:
    """One unit per rank: for traces read from files."""
    units = []
    unit_of_rank = {}
    for index, rank in enumerate(sorted(rank_nodes)):
        nodes = sorted(rank_nodes[rank], key=lambda n: n.id)
        keys = {
            i: ("group", n.comm_group) for i, n in enumerate(nodes) if n.type is NodeType.COMM_COLL
        }
        units.append(Unit(index, rank, (rank,), nodes, group_keys=keys))
        unit_of_rank[rank] = index
    groups = {int(g): tuple(m) for g, m in comm_groups.items()}
    return Problem(units, unit_of_rank, groups, len(units))


def problem_from_trace(
    trace: Any, comm_groups: Mapping[int, Sequence[int]], system: System
) -> Problem | None:
    """Units of identical ranks of a trace read from files, as generation has them.

    ``trace`` summarises the rank files (:class:`stg.trace.ranks.TraceRanks`): per rank its
    class (ranks whose node sequences are equal up to peer and communicator ids), the
    communicator of each collective and the peer of each send and receive, in file order; it
    decodes a rank's nodes on demand. The *role* of a communicator is the set of (class,
    positions of its collectives) over its members, the same for, e.g., every TP group of one
    pipeline stage. Ranks start out alike when they have the same class, the same role at each
    collective, the same placement shapes and the same link to each peer; colour refinement
    (as :func:`problem_from_workload`) then keeps together only ranks whose partners are
    alike. Each unit replays its smallest rank, the only one decoded; collectives are matched
    across units by role. None where that does not apply (no summaries, a communicator
    without member list or used by a non-member, a peer outside the world, a rank with two
    communicators of one role): every rank is then replayed.
    """
    if not getattr(trace, "fast", False):
        return None
    world = trace.world_size
    groups = {int(g): tuple(m) for g, m in comm_groups.items()}
    member_sets = {g: frozenset(m) for g, m in groups.items()}
    classes = trace.classes
    uses: dict[int, dict[int, list[int]]] = {}
    for r in range(world):
        for k, g in enumerate(trace.colls(r)):
            if g not in member_sets or r not in member_sets[g]:
                return None
            uses.setdefault(g, {}).setdefault(r, []).append(k)
        if any(not 0 <= p < world for p in (*trace.sends(r), *trace.recvs(r))):
            return None
    role_of: dict[int, int] = {}
    roles: dict[frozenset[tuple[int, tuple[int, ...]]], int] = {}
    for g, per_rank in uses.items():
        if any(not 0 <= m < world for m in groups[g]):
            return None
        signature = frozenset((classes[m], tuple(per_rank.get(m, ()))) for m in groups[g])
        role_of[g] = roles.setdefault(signature, len(roles))
    shapes: dict[int, tuple[int, ...]] = {}
    initial: dict[int, Any] = {}
    neighbours: dict[int, list[Sequence[int]]] = {}
    peers: dict[int, list[int]] = {}
    levels: dict[int, Any] = {}
    for r in range(world):
        colls = trace.colls(r)
        distinct = list(dict.fromkeys(colls))
        if len({role_of[g] for g in distinct}) != len(distinct):
            return None
        for g in distinct:
            if g not in shapes:
                shapes[g] = group_shape(groups[g], system)
        sends, recvs = trace.sends(r), trace.recvs(r)
        initial[r] = (
            classes[r],
            tuple(role_of[g] for g in colls),
            tuple(shapes[g] for g in distinct),
            tuple(link_signature(r, p, system, levels) for p in sends),
            tuple(link_signature(r, p, system, levels) for p in recvs),
            group_of_rank(system, r),
        )
        neighbours[r] = [groups[g] for g in distinct]
        peers[r] = [*sends, *recvs]
    ranks = list(range(world))
    colour = _refine(ranks, initial, neighbours, peers)
    by_colour: dict[int, list[int]] = {}
    for r in ranks:
        by_colour.setdefault(colour[r], []).append(r)
    units: list[Unit] = []
    unit_of_rank: dict[int, int] = {}
    for index, members in enumerate(sorted(by_colour.values(), key=min)):
        rep = min(members)
        file_nodes = trace.nodes(rep)
        role_by_id = {
            n.id: ("role", role_of.get(n.comm_group))
            for n in file_nodes
            if n.type is NodeType.COMM_COLL
        }
        nodes = sorted(file_nodes, key=lambda n: n.id)
        keys = {i: role_by_id[n.id] for i, n in enumerate(nodes) if n.type is NodeType.COMM_COLL}
        units.append(
            Unit(index, rep, tuple(members), nodes, rank_class=classes[rep], group_keys=keys)
        )
        for r in members:
            unit_of_rank[r] = index
    return Problem(units, unit_of_rank, groups, world)


# ---------------------------------------------------------------------------------------------
# Replay


@dataclass
class Costs:
    """Costs a replay works out, for a later replay with the same arguments to reuse."""

    by_key: dict[str, dict[Any, float]] = field(default_factory=dict)
    """per device: the cost of each compute cost key and collective"""
    by_node: dict[str, dict[int, tuple[Any, Any, float]]] = field(default_factory=dict)
    """per device and compute node object (by id, the node kept alive here): its cost key and
    cost; of every compute node where ``nodes_again``, else of those several units share"""
    links: dict[tuple[Any, tuple[int, ...]], tuple[str | None, float | None]] = field(
        default_factory=dict
    )
    """the contention key of each collective kind and group shape (:func:`contention_link`)"""
    keys: dict[Any, Any] = field(default_factory=dict)
    """each distinct compute cost key, once: alike nodes share one key object"""
    nodes_again: bool = True
    """a later replay may run the same node objects (then ``by_node`` keeps every one)"""


@dataclass
class UnitResult:
    """Timeline of one unit: per node start/end (seconds), and what gated each start."""

    unit: Unit
    kind: list[int]
    duration: list[float]
    start: list[float]
    end: list[float]
    transfer_start: list[float]
    cause: list[tuple[int, int] | None]


@dataclass
class EngineState:
    """Everything a replay's future depends on, copied at the end of one instant (after its
    events and the nodes it starts): per unit and node the dependencies still pending and
    whether it ended (``end``: its end, or -1); per unit the nodes ready but not ended
    (``live``: by position, (start, transfer start, duration, cause, ready time, ready
    cause), start and transfer start -1 until set; the others not ended keep their
    prepared duration, :attr:`Replay.prepared`'s ``initial_duration``); the events ahead
    (``heap``: (time, unit, node) of node ends, (time, -1 - flow, 0) of transfers' steps, in
    the order they are taken); per unit and stream the ready nodes (by position, in the order
    they are taken: ascending, but for those a unit's ``priority`` places), whether it is
    busy and what ran on it last; the sends and receives waiting for their partner; each
    communicator's collectives issued per unit and the collectives half issued; the transfers
    in flight with their state (``flows``: by index, (members, ends, steps, step, finish,
    tail, remaining, since, rate, resources, link, contends)), each port's users and each
    unit's contending transfers, in order (a flow by its index; a collective replayed as one
    event, :class:`_Contender`, by its (unit, node))."""

    time: float
    heap: list[tuple[float, int, int]]
    pending: list[list[int]]
    end: list[list[float]]
    live: list[dict[int, tuple[Any, ...]]]
    ready: list[list[list[int]]]
    busy: list[list[bool]]
    last_on_stream: list[list[tuple[int, int] | None]]
    mailbox: dict[Any, list[tuple[float, int, int]]]
    waiting: dict[Any, list[tuple[int, int]]]
    coll_seq: dict[tuple[int, Any], int]
    instances: dict[Any, tuple[tuple[tuple[int, int], ...], float, tuple[int, int] | None]]
    flows: dict[int, tuple[Any, ...]]
    users: dict[tuple[int, str, int], list[int]]
    contending: list[list[int | tuple[int, int]]]


@dataclass
class Replay:
    units: list[UnitResult]
    iteration_time: float
    states: list[EngineState] = field(default_factory=list)
    """the engine's state at the end of the instants asked for (``replay``'s ``states_at``)"""
    prepared: Any = None
    """with ``states``: the per-node costs, streams and matching keys the replay ran with
    (``stream``, ``steps``, ``comm_link``, ``coll_key``, ``coll_needed``, ``p2p_key``,
    ``cost_key``, ``children`` and ``initial_duration``, each per unit)"""


_UNMATCHED = object()
"""a collective without a matching key (:attr:`Unit.group_keys`): matched by communicator"""


@dataclass
class _UnitArrays:
    """What :meth:`_Sim._prepare` works out per node of a unit (see :class:`_Sim`)."""

    kind: list[int]
    duration: list[float]
    stream: list[int]
    cost_key: list[Any]
    coll_key: dict[int, Any]
    coll_needed: dict[int, int]
    p2p_key: dict[int, tuple[int, int, int, int]]
    comm_link: list[str | None]
    steps: list[Steps | None]

    @classmethod
    def empty(cls, n: int) -> _UnitArrays:
        return cls(
            [INSTANT] * n, [0.0] * n, [0] * n, [None] * n, {}, {}, {}, [None] * n, [None] * n
        )


class _Sim:
    """Event-driven replay of all units (see the module docstring)."""

    def __init__(
        self,
        problem: Problem,
        system: System,
        default_dtype: str,
        kernels: KernelTable | None = None,
        profile: str = "megatron",
        calibration: Calibration | None = None,
        overlap_param_gather: bool = False,
        tp_comm_overlap: bool = False,
        share_links: bool = True,
        costs: Costs | None = None,
    ) -> None:
        self.problem = problem
        self.system = system
        self.default_dtype = default_dtype
        self.kernels = kernels
        self.profile = profile
        self.calibration = calibration
        self.results: list[UnitResult] = []
        self.children: list[list[list[int]]] = []
        self.pending: list[list[int]] = []
        self.ordered: list[bool] = []
        """per unit: whether every node depends only on nodes at lower positions"""
        self.ready_time: list[list[float]] = []
        self.ready_cause: list[list[tuple[int, int] | None]] = []
        self.coll_key: list[dict[int, Any]] = []
        self.stream: list[list[int]] = []
        """per unit and node: 0 compute, 1 pipeline sends, 2 + k the k-th communicator's"""
        self.coll_needed: list[dict[int, int]] = []
        self.p2p_key: list[dict[int, tuple[int, int, int, int]]] = []
        self.shape_cache: dict[int, tuple[int, ...]] = {}
        self.steps_cache: dict[Any, Steps] = {}
        self.participants_cache: dict[int, tuple[int, ...]] = {}
        self.contended = contended_systems(system)
        """per link kind: the GPU as a compute kernel sees it while NCCL runs over that link"""
        self.contended_cost: dict[tuple[Any, str], float] = {}
        self.keyed: dict[str, dict[Any, tuple[Any, float]]] = {}
        """per device: each compute cost key met so far, as its interned key and its cost (a
        node's key looked up once, not once to intern it and once for its cost)"""
        # none given: no later replay sees these costs
        costs = Costs(nodes_again=False) if costs is None else costs
        self.cost_caches = costs.by_key
        self.compute_memo = costs.by_node
        self.link_cache = costs.links
        self.interned_keys = costs.keys
        self.remember_nodes = costs.nodes_again
        classes = Counter(u.rank_class for u in problem.units if u.rank_class is not None)
        self.shared_classes = {c for c, units in classes.items() if units > 1}
        """the rank classes of several units (which share their compute node objects)"""
        alike = alike_units(problem, system)
        self.cost_key: list[list[Any]] = []
        self.comm_link: list[list[str | None]] = []
        self.share_links = share_links and not is_hybrid(system)
        """concurrent transfers share their ports' bandwidth (off: each at its full bandwidth)"""
        self.steps: list[list[Steps | None]] = []
        """per unit and node: the steps of a collective's or send's transfer (see ``Steps``)"""
        self.others: dict[int, list[int]] = {}
        """per unit that others are alike (:func:`alike_units`): its nodes' positions that
        are not compute"""
        self.tp_overlaps: dict[int, list[tuple[int, list[int], int, str]]] = {}
        """per unit that others are alike: :meth:`_overlap_tp_collectives`' findings"""
        self.tp_overlap_done: dict[tuple[Any, ...], tuple[float, Steps]] = {}
        """per collective's link, duration, chunks and method and its GEMMs' interned cost
        keys and durations: its duration and steps beside them
        (:meth:`_overlap_tp_collectives`)"""
        for unit, like in zip(problem.units, alike, strict=True):
            self._prepare(unit, like)
        for u, like in enumerate(alike):
            if like is not None:  # the dependencies of the unit it is alike, as edited there
                self.children[u] = self.children[like]  # read only from here on
                self.pending[u] = self.pending[like].copy()
                self.ordered[u] = self.ordered[like]
            elif overlap_param_gather:
                self._gather_before_forward(u)
            if tp_comm_overlap and not is_hybrid(system):
                self._overlap_tp_collectives(u, like)

    def _participants(self, gid: int) -> tuple[int, ...]:
        if gid not in self.participants_cache:
            members = self.problem.comm_groups.get(gid)
            if members is None:
                raise TraceError(f"collective uses communicator {gid}, which has no member list")
            self.participants_cache[gid] = tuple(
                sorted({self.problem.unit_of_rank[m] for m in members})
            )
            self.shape_cache[gid] = group_shape(members, self.system)
        return self.participants_cache[gid]

    def _prepare(self, unit: Unit, like: int | None = None) -> None:
        """Price, stream and match ``unit``'s nodes; ``like``: an earlier unit it is alike
        (:func:`alike_units`), whose compute costs it takes, its dependencies left to
        ``__init__``."""
        nodes = unit.nodes
        n = len(nodes)
        if like is not None:
            self._prepare_alike(unit, like)
            return
        children, pending, ordered = _dependencies(nodes, unit.rank)
        arrays = _UnitArrays.empty(n)
        kind, duration, cost_key = arrays.kind, arrays.duration, arrays.cost_key
        device = device_of(self.system, unit.rank)  # hybrid clusters: this rank's group's GPU
        kernels = self.kernels
        if isinstance(kernels, Mapping):
            kernels = kernels.get(device.name)
        # costs are per device: units on one device share them, and the compute nodes that
        # units of one rank class share (the same objects) are keyed once
        cost_cache = self.cost_caches.setdefault(device.name, {})
        memo = self.compute_memo.setdefault(device.name, {})
        remember = self.remember_nodes or unit.rank_class in self.shared_classes
        interned = self.interned_keys
        comp, memo_get = NodeType.COMP, memo.get
        key_of = compute_cost_key if _compiled_cost_key is None else _compiled_cost_key
        intern, cached_cost = interned.setdefault, cost_cache.get
        keyed = self.keyed.setdefault(device.name, {})
        keyed_get = keyed.get
        positions: Iterable[tuple[int, Any]] = enumerate(nodes)
        if compiled_engine is not None and not memo and not remember:

            def price(node: Any, ckey: Any) -> tuple[Any, float]:
                """A compute node's interned key and cost, its key not yet in ``keyed``."""
                if ckey is NotImplemented:  # attributes in no dict: compute_cost_key's
                    ckey = compute_cost_key(node)
                    found = keyed_get(ckey)
                    if found is not None:
                        return found  # type: ignore[no-any-return]
                ckey = intern(ckey, ckey)
                cost = cached_cost(ckey)
                if cost is None:
                    cost = cost_cache[ckey] = compute_time(
                        node, device, self.default_dtype, kernels, self.profile, self.calibration
                    )
                keyed[ckey] = (ckey, cost)
                return ckey, cost

            # the compute nodes in C (what the loop below does for them), the others here
            others = compiled_engine.compute_costs(
                nodes, comp, keyed, price, kind, duration, cost_key
            )
            positions = zip(others, map(nodes.__getitem__, others), strict=True)
        self._price_others(
            unit, positions, arrays,
            compute=(memo, memo_get, remember, key_of, keyed, intern, cached_cost, cost_cache,
                     device, kernels),
        )  # fmt: skip
        if unit.rank_class in self.shared_classes:  # for the units alike it
            self.others[len(self.results)] = [i for i, k in enumerate(kind) if k != COMPUTE]
        self._append(unit, children, pending, ordered, arrays)

    def _prepare_alike(self, unit: Unit, like: int) -> None:
        """:meth:`_prepare` of a unit alike unit ``like``: its compute nodes' kinds, costs and
        streams copied, the others priced as its own."""
        rep = self.results[like]
        n = len(unit.nodes)
        arrays = _UnitArrays(
            rep.kind.copy(), rep.duration.copy(), self.stream[like].copy(),
            self.cost_key[like].copy(), {}, {}, {}, [None] * n, [None] * n,
        )  # fmt: skip
        nodes = unit.nodes
        self._price_others(unit, [(i, nodes[i]) for i in self.others[like]], arrays, None)
        # its dependencies: the representative's, set by __init__ once edited there
        self._append(unit, [], [], True, arrays)

    def _append(
        self,
        unit: Unit,
        children: list[list[int]],
        pending: list[int],
        ordered: bool,
        arrays: _UnitArrays,
    ) -> None:
        n = len(unit.nodes)
        self.children.append(children)
        self.pending.append(pending)
        self.ordered.append(ordered)
        self.ready_time.append([0.0] * n)
        self.ready_cause.append([None] * n)
        self.coll_key.append(arrays.coll_key)
        self.coll_needed.append(arrays.coll_needed)
        self.stream.append(arrays.stream)
        self.p2p_key.append(arrays.p2p_key)
        self.cost_key.append(arrays.cost_key)
        self.comm_link.append(arrays.comm_link)
        self.steps.append(arrays.steps)
        self.results.append(
            UnitResult(
                unit=unit,
                kind=arrays.kind,
                duration=arrays.duration,
                start=[-1.0] * n,
                end=[-1.0] * n,
                transfer_start=[-1.0] * n,
                cause=[None] * n,
            )
        )

    def _price_others(
        self,
        unit: Unit,
        positions: Iterable[tuple[int, Any]],
        arrays: _UnitArrays,
        compute: tuple[Any, ...] | None,
    ) -> None:
        """The loop of :meth:`_prepare` over ``positions``: compute nodes (``compute``: the
        cost caches, None where there are none among them), host copies, collectives,
        sends and receives."""
        kind, duration, stream, cost_key = (
            arrays.kind,
            arrays.duration,
            arrays.stream,
            arrays.cost_key,
        )
        coll_key, coll_needed, p2p_key = arrays.coll_key, arrays.coll_needed, arrays.p2p_key
        comm_link, steps = arrays.comm_link, arrays.steps
        system = self.system
        unit_of = self.problem.unit_of_rank
        group_keys = unit.group_keys
        steps_cache = self.steps_cache
        group_streams: dict[int, int] = {}
        device = device_of(system, unit.rank)
        comp = NodeType.COMP
        collectives: dict[tuple[int, CollectiveType, int], tuple[Any, ...]] = {}
        """each collective's communicator, type and size priced once (:meth:`_collective`)"""
        cost_cache = self.cost_caches.setdefault(device.name, {})
        if compute is not None:
            (memo, memo_get, remember, key_of, keyed, intern, cached_cost, cost_cache,
             device, kernels) = compute  # fmt: skip
            keyed_get = keyed.get
        for i, node in positions:
            t = node.type
            if t is comp:
                kind[i] = COMPUTE
                known = memo_get(id(node)) if memo else None
                if known is not None and known[0] is node:
                    ckey, cost = known[1], known[2]
                else:
                    ckey = key_of(node)
                    if ckey is NotImplemented:  # attributes in no dict: compute_cost_key's
                        ckey = compute_cost_key(node)
                    found = keyed_get(ckey)
                    if found is not None:
                        ckey, cost = found
                    else:
                        ckey = intern(ckey, ckey)
                        cost = cached_cost(ckey)
                        if cost is None:
                            cost = cost_cache[ckey] = compute_time(
                                node,
                                device,
                                self.default_dtype,
                                kernels,
                                self.profile,
                                self.calibration,
                            )
                        keyed[ckey] = (ckey, cost)
                    if remember:
                        memo[id(node)] = (node, ckey, cost)
                duration[i] = cost
                cost_key[i] = ckey
            elif t in HOST_COPIES:
                kind[i] = COPY
                stream[i] = HOST_COPY_STREAM
                duration[i] = host_copy_time(node.tensor_size, device)
            elif t is NodeType.COMM_COLL:
                group = node.comm_group
                if group is None or node.comm_type is None:
                    raise TraceError(
                        f"rank {unit.rank}: collective {node.id} lacks its group or type"
                    )
                signature: tuple[Any, ...] = (group, node.comm_type, node.comm_size)
                if node.comm_type is CollectiveType.ALL_TO_ALL:
                    # an expert dispatch and a combine of one size are priced apart
                    route = routed(getattr(node, "attrs", None))
                    if route is not None:
                        signature += (route, node.dtype)
                priced = collectives.get(signature)
                if priced is None:
                    priced = collectives[signature] = self._collective(node, cost_cache)
                participants, duration[i], steps[i], comm_link[i] = priced
                kind[i] = COLL
                matched = group_keys.get(i, _UNMATCHED)
                coll_key[i] = (("group", group) if matched is _UNMATCHED else matched, participants)
                coll_needed[i] = len(participants)
                own = group_streams.get(group)
                if own is None:
                    own = group_streams[group] = 2 + len(group_streams)
                stream[i] = own
            elif t is NodeType.COMM_SEND:
                if node.comm_dst is None or node.comm_dst not in unit_of:
                    raise TraceError(f"rank {unit.rank}: send {node.id} has no valid destination")
                kind[i] = SEND
                stream[i] = 1
                if is_hybrid(system):
                    duration[i] = system.send_time(  # type: ignore[attr-defined]
                        node.comm_size, unit.rank, node.comm_dst
                    )
                else:
                    dimension = link_dimension(unit.rank, node.comm_dst, system)
                    duration[i] = send_time(node.comm_size, dimension, system)
                    comm_link[i] = system.network[dimension].link if dimension >= 0 else None
                if self.share_links:
                    skey = ("send", node.comm_size, dimension)
                    plan = steps_cache.get(skey)
                    if plan is None:
                        plan = steps_cache[skey] = transfer_steps(
                            send_phases(node.comm_size, dimension, system)
                        )
                    steps[i] = plan
                else:
                    steps[i] = fixed_steps(duration[i])
                p2p_key[i] = (
                    unit.index,
                    unit_of[node.comm_dst],
                    -1 if node.comm_tag is None else node.comm_tag,
                    node.comm_size,
                )
            elif t is NodeType.COMM_RECV:
                if node.comm_src is None or node.comm_src not in unit_of:
                    raise TraceError(f"rank {unit.rank}: receive {node.id} has no valid source")
                kind[i] = RECV
                p2p_key[i] = (
                    unit_of[node.comm_src],
                    unit.index,
                    -1 if node.comm_tag is None else node.comm_tag,
                    node.comm_size,
                )

    def _collective(
        self, node: Any, cost_cache: dict[Any, float]
    ) -> tuple[tuple[int, ...], float, Steps, str | None]:
        """A collective's participating units, duration, transfer steps and contention key
        (``cost_cache``: its device's costs), from its communicator, type and size."""
        system = self.system
        participants = self._participants(node.comm_group)
        shape = self.shape_cache[node.comm_group]
        route = routed(getattr(node, "attrs", None))
        if route is not None:  # DeepEP or HybridEP: its own transfer, one phase
            if is_hybrid(system):
                raise UserError(
                    f"moe_dispatcher={route[0]} is priced from one GPU kind's links; hybrid "
                    f"system {system.name!r} allows moe_dispatcher=alltoall"
                )
            return self._dispatch(node, route, participants, shape, cost_cache)
        key = (node.comm_type, node.comm_size, shape)
        if is_hybrid(system):
            key = (node.comm_type, node.comm_size, node.comm_group)
        if key not in cost_cache:
            cost_cache[key] = (
                system.collective_time(  # type: ignore[attr-defined]
                    node.comm_type,
                    node.comm_size,
                    self.problem.comm_groups[node.comm_group],
                )
                if is_hybrid(system)
                else collective_time(node.comm_type, node.comm_size, shape, system)
            )
        duration = cost_cache[key]
        if self.share_links:
            plan = self.steps_cache.get(key)
            if plan is None:
                plan = self.steps_cache[key] = transfer_steps(
                    collective_phases(node.comm_type, node.comm_size, shape, system)
                )
        else:
            plan = fixed_steps(duration)
        link = None
        if not is_hybrid(system):
            lkey = (node.comm_type, shape)
            contention = self.link_cache.get(lkey)
            if contention is None:
                contention = self.link_cache[lkey] = contention_link(node.comm_type, shape, system)
            link, rate = contention
            if rate is not None and link not in self.contended:
                self.contended[link] = spanning_contended_system(
                    system, outermost_link(shape, system) or "network", rate
                )
        return participants, duration, plan, link

    def _dispatch(
        self,
        node: Any,
        route: Route,
        participants: tuple[int, ...],
        shape: tuple[int, ...],
        cost_cache: dict[Any, float],
    ) -> tuple[tuple[int, ...], float, Steps, str | None]:
        """:meth:`_collective` of an expert-parallel all-to-all that DeepEP or HybridEP runs
        (:func:`stg.perf.ep_dispatch.dispatch_phases`): no contention key, its bytes share
        their port with the transfers beside them as any phase does."""
        dtype = getattr(node, "dtype", None)
        key = (route, node.comm_size, shape, dtype)
        plan = self.steps_cache.get(key)
        if plan is None:
            phases = dispatch_phases(route, node.comm_size, dtype, shape, self.system)
            cost_cache[key] = sum(latency + transfer for _, latency, transfer in phases)
            plan = self.steps_cache[key] = transfer_steps(phases)
        duration = cost_cache[key]
        return participants, duration, plan if self.share_links else fixed_steps(duration), None

    def _gather_before_forward(self, u: int) -> None:
        """Megatron's ``--overlap-param-gather``, in the steady state: the parameter
        all-gathers that follow the optimizer step (the distributed optimizer's, one per part)
        belong to the next iteration's forward. The replayed iteration runs from one optimizer
        step to the next: each gather is issued at its start, in order on its communicator's
        stream, and the forward nodes of its part (every micro-batch's) wait for it instead of
        the gather waiting for the step."""
        res = self.results[u]
        nodes = res.unit.nodes
        roles: dict[tuple[Any, type], Role | None] = {}  # node_role by raw value, once each
        steps = set()
        for i, k in enumerate(res.kind):
            if k == COMPUTE:
                node = nodes[i]
                raw = (getattr(node, "attrs", None) or {}).get(ROLE_ATTR)
                key = (raw, type(raw))
                role = roles[key] if key in roles else roles.setdefault(key, node_role(node))
                if role is Role.OPTIMIZER_STEP:
                    steps.add(node.id)
        if not steps:
            return
        position = {node.id: i for i, node in enumerate(nodes)}
        gathers: dict[str, list[int]] = {}
        for i, node in enumerate(nodes):
            if (
                res.kind[i] == COLL
                and node.comm_type is CollectiveType.ALL_GATHER
                and node_role(node) is Role.PARAM_ALL_GATHER
                and steps.intersection(node.data_deps)
            ):
                part = node_part(node)
                if part is not None:
                    gathers.setdefault(part, []).append(i)
        if not gathers:
            return
        children, pending = self.children[u], self.pending[u]
        moved = {i for members in gathers.values() for i in members}
        for i in moved:
            for dep in set(nodes[i].data_deps) | set(nodes[i].ctrl_deps):
                j = position[dep]
                children[j].remove(i)
            pending[i] = 0
        for i, part in enumerate(forward_parts(nodes)):
            if part is None or part not in gathers or i in moved:
                continue
            for g in gathers[part]:
                children[g].append(i)
                pending[i] += 1

    def _overlap_tp_collectives(self, u: int, like: int | None = None) -> None:
        """Transformer Engine's ``--tp-comm-overlap`` (userbuffers): sequence parallelism's
        all-gather is split into one chunk per tensor-parallel rank and pipelined with the
        GEMMs that consume it, a reduce-scatter into ``TP_OVERLAP_PIPELINE_SPLITS`` chunks
        with the GEMMs that produce it. Together they take ``chunked_overlap_time`` of the
        GEMMs slowed by the concurrent communication (the contention model) and the
        collective; the collective node keeps what is left beyond the GEMMs' own time (the
        GEMMs still run as separate nodes, at their own speed). ``like``: an earlier unit it
        is alike (:func:`alike_units`), whose collectives and GEMMs these are."""
        res = self.results[u]
        found = self.tp_overlaps.get(like) if like is not None else None
        if found is None:
            found = self._tp_overlapped(u)
            if res.unit.rank_class in self.shared_classes:
                self.tp_overlaps[u] = found
        cost_key, duration, comm_link = self.cost_key[u], res.duration, self.comm_link[u]
        done = self.tp_overlap_done
        for i, gemms, chunks, method in found:
            link = comm_link[i]
            # alike collectives beside alike GEMMs (every layer and micro-batch) once each
            key = (
                link,
                duration[i],
                chunks,
                method,
                *[(id(cost_key[g]), duration[g]) for g in gemms],
            )
            known = done.get(key)
            if known is None:
                free = sum(duration[g] for g in gemms)
                slowed = free
                if link in self.contended:
                    slowed = sum(
                        max(duration[g], self._userbuffers_contended(u, g, link, method))
                        for g in gemms
                    )
                together = chunked_overlap_time(slowed, duration[i], chunks)
                left = max(0.0, together - free)
                # its bytes cross the links beside the GEMMs: what is left is a fixed time
                known = done[key] = (left, fixed_steps(left))
            duration[i], self.steps[u][i] = known
            comm_link[i] = None  # its contention is in ``slowed`` already

    def _tp_overlapped(self, u: int) -> list[tuple[int, list[int], int, str]]:
        """Unit ``u``'s tensor-parallel collectives that overlap GEMMs, each with those GEMMs,
        its chunks and userbuffers' method (:meth:`_overlap_tp_collectives`)."""
        res = self.results[u]
        nodes = res.unit.nodes
        position: dict[int, int] | None = None
        children = self.children[u]
        claimed: set[int] = set()
        found = []
        for i, node in enumerate(nodes):
            if res.kind[i] != COLL:
                continue
            role = node_role(node)
            if role is Role.TP_ALL_GATHER:
                gemms = [c for c in children[i] if self._is_gemm(u, c)]
                chunks = len(self.problem.comm_groups.get(node.comm_group, ())) or 1
                method = "ring_exchange"
            elif role is Role.TP_REDUCE_SCATTER:
                if position is None:
                    position = {n.id: k for k, n in enumerate(nodes)}
                gemms = [position[d] for d in node.data_deps if self._is_gemm(u, position[d])]
                chunks = TP_OVERLAP_PIPELINE_SPLITS
                method = "pipeline"
            else:
                continue
            gemms = [g for g in gemms if g not in claimed]
            if not gemms:
                continue
            claimed.update(gemms)
            found.append((i, gemms, chunks, method))
        return found

    def _userbuffers_contended(self, u: int, i: int, link: str, method: str) -> float:
        """Duration of GEMM ``i`` of unit ``u`` beside userbuffers' ``method`` over ``link``
        (a contention key: a group spanning nodes is priced over its outermost link)."""
        key = (self.cost_key[u][i], link, method)
        cost = self.contended_cost.get(key)
        if cost is None:
            gpu = contended_system(
                self.system,
                link.split(SPANNING, 1)[0],
                USERBUFFERS_SMS[method],
                USERBUFFERS_HBM_BYTES_PER_WIRE_BYTE[method],
            )
            kernels = self.kernels
            if isinstance(kernels, Mapping):
                kernels = kernels.get(self.system.name)
            cost = self.contended_cost[key] = compute_time(
                self.results[u].unit.nodes[i],
                gpu,
                self.default_dtype,
                kernels,
                self.profile,
                self.calibration,
            )
        return cost

    def _is_gemm(self, u: int, i: int) -> bool:
        if self.results[u].kind[i] != COMPUTE:
            return False
        attrs = getattr(self.results[u].unit.nodes[i], "attrs", None) or {}
        return "gemm" in attrs

    def run(self, states_at: Sequence[tuple[int, int]] = ()) -> Replay:
        """Replay; ``states_at``: (unit, node) pairs in the order they start, at the end of
        whose instant the engine's state is copied (:class:`EngineState`)."""
        units = self.problem.units
        results = self.results
        heap: list[tuple[float, int, int, int]] = []
        # the hot loop works on plain per-unit lists bound once (no attribute or method look-
        # ups per event); streams (self.stream) are indexed directly: 0 compute, 1 pipeline
        # sends, 2 + k the k-th communicator's, and HOST_COPY_STREAM (-1) the last entry.
        # NCCL process groups run on their own CUDA streams: a tensor-parallel collective never
        # queues behind a data-parallel gradient reduction, nor a send behind either
        streams = self.stream
        width = [max(s, default=0) + 2 for s in streams]
        ready: list[list[list[int]]] = [[[] for _ in range(w)] for w in width]
        busy: list[list[bool]] = [[False] * w for w in width]
        last_on_stream: list[list[tuple[int, int] | None]] = [[None] * w for w in width]
        kinds = [r.kind for r in results]
        starts = [r.start for r in results]
        ends_at = [r.end for r in results]
        causes = [r.cause for r in results]
        durations = [r.duration for r in results]
        transfer_starts = [r.transfer_start for r in results]
        ready_times, ready_causes = self.ready_time, self.ready_cause
        children, pending = self.children, self.pending
        p2p_keys, coll_keys, coll_needed = self.p2p_key, self.coll_key, self.coll_needed
        # a ready queue holds positions, and the float keys of the nodes a unit's priority
        # places between two positions
        queue_key = [unit.priority or None for unit in units]
        at_key = [{k: i for i, k in unit.priority.items()} for unit in units]
        all_steps = self.steps
        mailbox: dict[tuple[int, int, int, int], deque[tuple[float, int, int]]] = {}
        waiting: dict[tuple[int, int, int, int], deque[tuple[int, int]]] = {}
        coll_seq: dict[tuple[int, Any], int] = {}
        instances: dict[Any, list[Any]] = {}
        touched: set[tuple[bool, int, int]] = set()
        """the streams that may start a node at this instant, as (stream is compute, unit,
        stream): sorted, the dispatch order: communication streams before the compute stream,
        so that a kernel starting together with a collective sees it running"""
        heappush, heappop = heapq.heappush, heapq.heappop
        tick = itertools.count(1).__next__

        def make_ready(u: int, i: int, t: float, cause: tuple[int, int] | None) -> None:
            k = kinds[u][i]
            ready_times[u][i] = t
            ready_causes[u][i] = cause
            if k < RECV or k == COPY:
                s = streams[u][i]
                keyed = queue_key[u]
                heappush(ready[u][s], i if keyed is None else keyed.get(i, i))
                touched.add((s == 0, u, s))
            elif k == RECV:
                starts[u][i] = t
                key = p2p_keys[u][i]
                box = mailbox.get(key)
                if box:
                    sent, su, si = box.popleft()
                    if sent > t:
                        causes[u][i] = (su, si)
                        heappush(heap, (sent, tick(), u, i))
                    else:
                        causes[u][i] = cause
                        heappush(heap, (t, tick(), u, i))
                else:
                    waiting.setdefault(key, deque()).append((u, i))
            else:
                starts[u][i] = t
                causes[u][i] = cause
                heappush(heap, (t, tick(), u, i))

        for u in range(len(results)):
            for i, count in enumerate(pending[u]):
                if count == 0:
                    make_ready(u, i, 0.0, None)

        contended = self.contended
        # bandwidth sharing: the transfers in flight, and per (unit, port, direction) the
        # transfers whose bytes are moving through it now
        flows: list[_Flow] = []
        users: dict[tuple[int, str, int], list[_Flow]] = {}
        # per unit: the transfers in flight whose NCCL kernels slow its compute (contention)
        contending: list[list[_Flow | _Contender]] = [[] for _ in units]
        private = self._private_collectives()
        contenders: dict[tuple[int, int], _Contender] = {}
        comm_link = self.comm_link
        tails: dict[int, tuple[float, ...]] = {}
        """per transfer plan (by id: each is kept alive in self.steps): the seconds of the
        steps after each step at full bandwidth"""

        def start_flow(
            members: list[tuple[int, int]], ends: list[tuple[int, int]], steps: Steps, t: float
        ) -> None:
            f = _Flow(len(flows), members, ends, steps)
            flows.append(f)
            for pu, pi in members:
                link = comm_link[pu][pi]
                if link is not None and link in contended:
                    f.link = link
                    f.contends.append(pu)
                    contending[pu].append(f)
            next_step(f, t)

        def next_step(f: _Flow, t: float) -> None:
            f.step += 1
            steps = f.steps
            if f.step == len(steps):
                for pu in f.contends:
                    contending[pu].remove(f)
                for pu, pi in f.members:
                    durations[pu][pi] = t - transfer_starts[pu][pi]
                    heappush(heap, (t, tick(), pu, pi))
                return
            port, seconds = steps[f.step]
            tail = tails.get(id(steps))
            if tail is None:
                tail = tails[id(steps)] = tuple(
                    sum(s for _, s in steps[k + 1 :]) for k in range(len(steps))
                )
            f.tail = tail[f.step]
            f.version += 1
            if port is None:
                f.finish = t + seconds
                heappush(heap, (f.finish, tick(), -1 - f.index, f.version))
                return
            resources = f.resources = tuple([(x, port, d) for x, d in f.ends])
            alone = True
            for key in resources:
                sharing = users.get(key)
                if sharing is None:
                    users[key] = [f]
                else:
                    sharing.append(f)
                    alone = False
            f.remaining = seconds
            f.since = t
            if alone:  # what reshare gives a transfer that has its ports to itself
                f.rate = 1.0
                f.finish = t + seconds
                heappush(heap, (f.finish, tick(), -1 - f.index, f.version))
                return
            f.rate = 0.0
            reshare(resources, t)

        def reshare(keys: tuple[tuple[int, str, int], ...], t: float) -> None:
            """Each transfer on these ports drains at its fair share from ``t`` on: the
            port's bandwidth over its users, the smallest over the ports it uses."""
            seen: set[int] = set()
            for key in keys:
                for g in users.get(key, ()):
                    if g.index in seen:
                        continue
                    seen.add(g.index)
                    rate = 1.0 / max([len(users[k]) for k in g.resources])
                    if rate == g.rate:
                        continue
                    g.remaining = max(0.0, g.remaining - (t - g.since) * g.rate)
                    g.since = t
                    g.rate = rate
                    g.version += 1
                    g.finish = t + g.remaining / rate
                    heappush(heap, (g.finish, tick(), -1 - g.index, g.version))

        def step_done(f: _Flow, t: float) -> None:
            if f.resources:
                keys = f.resources
                f.resources = ()
                shared = False
                for key in keys:
                    sharing = users[key]
                    sharing.remove(f)
                    if sharing:
                        shared = True
                    else:
                        del users[key]
                if shared:
                    reshare(keys, t)
            next_step(f, t)

        def compute_duration(u: int, i: int, t: float) -> float:
            free = durations[u][i]
            # per link: when the NCCL kernels running over it finish, as projected now (the
            # current step at its share, the rest at full bandwidth)
            until: dict[str, float] = {}
            for f in contending[u]:
                link, end = f.link, f.finish + f.tail
                if link is not None and end > until.get(link, -1.0):
                    until[link] = end
            worst = free
            for link, end in until.items():
                if end <= t:
                    continue
                slow = self._contended(u, i, link)
                if slow <= free:
                    continue
                window = end - t
                # slowed while the collective runs, at full speed after it
                done = window * free / slow
                worst = max(worst, slow if done >= free else window + free - done)
            return worst

        def dispatch(u: int, stream: int, t: float) -> None:
            queue = ready[u][stream]
            if not queue or busy[u][stream]:
                return
            i = heappop(queue)
            if i.__class__ is float:
                i = at_key[u][i]
            busy[u][stream] = True
            starts[u][i] = t
            last = last_on_stream[u][stream]
            if last is not None and t > ready_times[u][i]:
                causes[u][i] = last
            else:
                causes[u][i] = ready_causes[u][i]
            last_on_stream[u][stream] = (u, i)
            k = kinds[u][i]
            if k == COMPUTE:
                transfer_starts[u][i] = t
                if contending[u]:
                    durations[u][i] = compute_duration(u, i, t)
                heappush(heap, (t + durations[u][i], tick(), u, i))
            elif k == COLL:
                group_key = coll_keys[u][i]
                seq_key = (u, group_key)
                seq = coll_seq.get(seq_key, 0)
                coll_seq[seq_key] = seq + 1
                if coll_needed[u][i] == 1:  # a group within this unit (its ranks): issued now
                    transfer_starts[u][i] = t
                    if i in private[u]:
                        # its ports are its stream's alone: each step at full bandwidth, its
                        # end known now (the same sums as step by step)
                        end = t
                        for _, seconds in all_steps[u][i] or ():
                            end += seconds
                        link = comm_link[u][i]
                        if link is not None and link in contended:
                            contender = _Contender(link, end, (u, i))
                            contending[u].append(contender)
                            contenders[u, i] = contender
                        heappush(heap, (end, tick(), u, i))
                        return
                    start_flow([(u, i)], [(u, 0), (u, 1)], all_steps[u][i] or (), t)
                    return
                instance_key = (group_key, seq)
                inst = instances.get(instance_key)
                if inst is None:
                    inst = instances[instance_key] = [[], -1.0, None]
                inst[0].append((u, i))
                if t >= inst[1]:
                    inst[1] = t
                    inst[2] = causes[u][i]
                if len(inst[0]) == coll_needed[u][i]:
                    del instances[instance_key]
                    begin = inst[1]
                    members = inst[0]
                    for pu, pi in members:
                        transfer_starts[pu][pi] = begin
                        causes[pu][pi] = inst[2]
                    plans = [all_steps[pu][pi] or () for pu, pi in members]
                    if all(plan == plans[0] for plan in plans):
                        ends = [(pu, d) for pu, _ in members for d in (0, 1)]
                        start_flow(members, ends, plans[0], begin)
                    else:  # members that price it differently (tp overlap): each its own
                        for (pu, pi), plan in zip(members, plans, strict=True):
                            start_flow([(pu, pi)], [(pu, 0), (pu, 1)], plan, begin)
            elif k == SEND:
                transfer_starts[u][i] = t
                dst = p2p_keys[u][i][1]
                start_flow([(u, i)], [(u, 0), (dst, 1)], all_steps[u][i] or (), t)
            else:
                transfer_starts[u][i] = t
                heappush(heap, (t + durations[u][i], tick(), u, i))

        states: list[EngineState] = []
        watched = 0
        watch_count = len(states_at)
        if states_at:
            self.initial_duration = [list(x) for x in durations]

        def state(t: float) -> EngineState:
            events = []
            for when, _, u, i in sorted(heap):
                if u >= 0:
                    events.append((when, u, i))
                elif i == flows[-1 - u].version:  # else superseded by a new rate
                    events.append((when, u, 0))
            active = {
                f.index: (
                    tuple(f.members),
                    tuple(f.ends),
                    f.steps,
                    f.step,
                    f.finish,
                    f.tail,
                    f.remaining,
                    f.since,
                    f.rate,
                    f.resources,
                    f.link,
                    tuple(f.contends),
                )
                for f in flows
                if f.step < len(f.steps)
            }
            live = []
            for u, (left, ended) in enumerate(zip(pending, ends_at, strict=True)):
                s, ts, d, c = starts[u], transfer_starts[u], durations[u], causes[u]
                rt, rc = ready_times[u], ready_causes[u]
                # the nodes ready (none pending) and not ended (-1), found a column at a time
                ready_not_ended = map(
                    operator.and_,
                    map(operator.not_, left),
                    map(operator.lt, ended, itertools.repeat(0.0)),
                )
                live.append(
                    {
                        j: (s[j], ts[j], d[j], c[j], rt[j], rc[j])
                        for j in itertools.compress(range(len(left)), ready_not_ended)
                    }
                )
            return EngineState(
                time=t,
                heap=events,
                pending=[list(x) for x in pending],
                end=[list(x) for x in ends_at],
                live=live,
                ready=[
                    [[at_key[u].get(k, k) for k in sorted(q)] for q in per_unit]
                    for u, per_unit in enumerate(ready)
                ],
                busy=[list(x) for x in busy],
                last_on_stream=[list(x) for x in last_on_stream],
                mailbox={k: list(q) for k, q in mailbox.items() if q},
                waiting={k: list(q) for k, q in waiting.items() if q},
                coll_seq=dict(coll_seq),
                instances={k: (tuple(v[0]), v[1], v[2]) for k, v in instances.items()},
                flows=active,
                users={k: [f.index for f in v] for k, v in users.items()},
                contending=[[f.index for f in x] for x in contending],
            )

        for _, u, stream in sorted(touched):
            dispatch(u, stream, 0.0)
        touched.clear()
        touched_add = touched.add
        compute_stream = [(True, u, 0) for u in range(len(results))]

        def ended(u: int, i: int, k: int, t: float) -> None:
            """A node of a stream other than compute ends."""
            s = streams[u][i]
            busy[u][s] = False
            touched_add((s == 0, u, s))
            if k == COLL and i in private[u]:
                durations[u][i] = t - transfer_starts[u][i]
                contender = contenders.pop((u, i), None)
                if contender is not None:
                    contending[u].remove(contender)
            if k == SEND:
                key = p2p_keys[u][i]
                queue = waiting.get(key)
                if queue:
                    ru, ri = queue.popleft()
                    causes[ru][ri] = (u, i)
                    heappush(heap, (t, tick(), ru, ri))
                else:
                    mailbox.setdefault(key, deque()).append((t, u, i))

        def flow_event(u: int, version: int, t: float) -> None:
            f = flows[-1 - u]
            if version == f.version:
                step_done(f, t)

        def capture(t: float) -> None:
            states.append(state(t))

        if _compiled_loop is not None:
            _compiled_loop(
                heap, kinds, ends_at, busy, touched, compute_stream, children, pending,
                ready_times, ready_causes, queue_key, ready, starts, last_on_stream, causes,
                transfer_starts, durations, contending, at_key, tick, make_ready, dispatch,
                ended, flow_event, capture, list(states_at), streams, coll_keys, coll_seq,
                coll_needed, private, all_steps, comm_link, contended, contenders, _Contender,
                self._contended,
            )  # fmt: skip
        while heap:  # the reference loop (what the compiled one does, in Python)
            t = heap[0][0]
            while heap and (heap[0][0] is t or heap[0][0] == t):  # as the compiled loop
                _, _, u, i = heappop(heap)
                if u < 0:  # a transfer's step ends (unless superseded by a new rate)
                    flow_event(u, i, t)
                    continue
                ends_at[u][i] = t
                unit_kinds = kinds[u]
                k = unit_kinds[i]
                if k == COMPUTE:  # the commonest case: the compute stream (0) is free
                    busy[u][0] = False
                    touched_add(compute_stream[u])
                elif k < RECV or k == COPY:
                    ended(u, i, k, t)
                pend = pending[u]
                cause = None
                for c in children[u][i]:
                    left = pend[c] - 1
                    pend[c] = left
                    if not left:
                        if cause is None:
                            cause = (u, i)
                        if unit_kinds[c] == COMPUTE:  # make_ready's commonest case, inline
                            ready_times[u][c] = t
                            ready_causes[u][c] = cause
                            keyed = queue_key[u]  # a compute node's stream is 0
                            heappush(ready[u][0], c if keyed is None else keyed.get(c, c))
                            touched_add(compute_stream[u])
                        else:
                            make_ready(u, c, t, cause)
            if len(touched) == 1:
                _, u, stream = touched.pop()
                queue = ready[u][stream]
                if not queue or busy[u][stream]:
                    pass
                elif stream or contending[u]:
                    dispatch(u, stream, t)
                else:  # dispatch's commonest case, inline: a compute node, nothing contending
                    i = heappop(queue)
                    if i.__class__ is float:
                        i = at_key[u][i]
                    busy[u][0] = True
                    starts[u][i] = t
                    last = last_on_stream[u][0]
                    if last is not None and t > ready_times[u][i]:
                        causes[u][i] = last
                    else:
                        causes[u][i] = ready_causes[u][i]
                    last_on_stream[u][0] = (u, i)
                    transfer_starts[u][i] = t
                    heappush(heap, (t + durations[u][i], tick(), u, i))
            elif touched:
                for _, u, stream in sorted(touched):
                    if ready[u][stream] and not busy[u][stream]:
                        dispatch(u, stream, t)
                touched.clear()
            while (
                watched < watch_count and starts[states_at[watched][0]][states_at[watched][1]] >= 0
            ):
                watched += 1
                capture(t)
        self._check_finished()
        end = max((max(r.end, default=0.0) for r in results), default=0.0)
        if not states_at:
            return Replay(results, end)
        return Replay(results, end, states, self)

    def _private_collectives(self) -> list[set[int]]:
        """Per unit, its collectives within the unit (one member) that run each of at most two
        steps at full bandwidth: every port they use (a direction of a unit's ``nvlink``,
        ``nic``, ...) is used by no transfer of another stream, so no other transfer ever
        shares it (a stream runs one node at a time). Their end is then their start plus their
        steps, added in order as the step-by-step replay adds them; beyond two steps that
        replay's projection of the end (a step's end plus the later steps' sum) could round
        otherwise, so they keep it."""
        users: dict[tuple[int, str, int], set[tuple[int, int]]] = {}
        for u, res in enumerate(self.results):
            kinds, steps_of, streams = res.kind, self.steps[u], self.stream[u]
            # the collectives (coll_key) and the sends (p2p_key, with the receives) of the unit
            transfers = [(i, u) for i in self.coll_key[u]]
            transfers += [(i, key[1]) for i, key in self.p2p_key[u].items() if kinds[i] == SEND]
            for i, receiver in transfers:
                ports = {port for port, _ in steps_of[i] or () if port is not None}
                stream = (u, streams[i])
                for port in ports:
                    users.setdefault((u, port, 0), set()).add(stream)
                    users.setdefault((receiver, port, 1), set()).add(stream)
        private: list[set[int]] = []
        for u in range(len(self.results)):
            alone = set()
            for i, needed in self.coll_needed[u].items():
                if needed != 1:
                    continue
                steps = self.steps[u][i] or ()
                if len(steps) > 2:
                    continue
                if all(
                    len(users[u, port, d]) == 1
                    for port, _ in steps
                    if port is not None
                    for d in (0, 1)
                ):
                    alone.add(i)
            private.append(alone)
        return private

    def _contended(self, u: int, i: int, link: str) -> float:
        """Duration of compute node ``i`` of unit ``u`` while NCCL runs over ``link``."""
        key = (self.cost_key[u][i], link)
        cost = self.contended_cost.get(key)
        if cost is None:
            node = self.results[u].unit.nodes[i]
            kernels = self.kernels
            if isinstance(kernels, Mapping):
                kernels = kernels.get(self.system.name)
            cost = self.contended_cost[key] = compute_time(
                node,
                self.contended[link],
                self.default_dtype,
                kernels,
                self.profile,
                self.calibration,
            )
        return cost

    def _check_finished(self) -> None:
        for res in self.results:
            if min(res.end, default=0.0) >= 0:  # every node ended
                continue
            for i, end in enumerate(res.end):
                if end < 0:
                    node = res.unit.nodes[i]
                    state = "never became ready"
                    if res.start[i] >= 0 and res.kind[i] == RECV:
                        state = f"waits for a send from rank {node.comm_src} (tag {node.comm_tag})"
                    elif res.start[i] >= 0 and res.kind[i] == COLL:
                        state = f"waits for the other members of communicator {node.comm_group}"
                    elif self.pending[res.unit.index][i] == 0:
                        state = "is ready but its stream is blocked"
                    raise TraceError(
                        f"replay deadlocked: rank {res.unit.rank} node {node.id} "
                        f"({node.name!r}) {state}"
                    )


def alike_units(problem: Problem, system: System | None = None) -> list[int | None]:
    """Per unit: the first unit of its rank class where that one runs the same nodes (and,
    given ``system``, on the same kind of GPU): the units of a class differ in their
    communicators and peers only (:func:`problem_from_workload`); else None. A unit alike
    another takes its compute costs and its dependencies as edited by the overlap options
    (:class:`_Sim`), and its reduction (:func:`stg.perf.periodic.reduced_problem`), which
    only its node structure decides: per unit they were the replay's largest cost beside
    the engine (a 256-rank plan on GB300 NVL72 domains has 32 units of 8 rank classes)."""
    if problem.alike is None:
        first: dict[int, int] = {}
        found: list[int | None] = []
        groups = problem.comm_groups
        for u, unit in enumerate(problem.units):
            rep = None if unit.rank_class is None else first.setdefault(unit.rank_class, u)
            other = problem.units[rep] if rep is not None and rep != u else None
            same = other is not None and _same_structure(unit.nodes, other.nodes, groups)
            found.append(rep if same else None)
        problem.alike = found
    if system is None:
        return list(problem.alike)
    units = problem.units
    return [
        None
        if like is None
        or device_of(system, units[u].rank).name != device_of(system, units[like].rank).name
        else like
        for u, like in enumerate(problem.alike)
    ]


def _same_structure(
    nodes: Sequence[Any], others: Sequence[Any], groups: Mapping[int, Sequence[int]]
) -> bool:
    """Whether two units' nodes are the same objects or, but for communication nodes'
    communicators and peers, equal: ids, dependencies, attributes, kinds and sizes (what a
    node's cost, and the overlap options' edits, read), communicators of equal size."""
    if len(nodes) != len(others):
        return False
    sizes: dict[int | None, int] = {}
    for i in itertools.compress(range(len(nodes)), map(operator.is_not, nodes, others)):
        a, b = nodes[i], others[i]
        if a.type is not b.type or a.type not in COMM_TYPES:
            if a != b:
                return False
            continue
        try:
            if _COMM_FIELDS(a) != _COMM_FIELDS(b):
                return False
        except AttributeError:  # a node of another kind: not compared
            return False
        if a.type is NodeType.COMM_COLL:
            for g in (a.comm_group, b.comm_group):
                if g not in sizes:
                    sizes[g] = len(groups.get(g, ()))
            if sizes[a.comm_group] != sizes[b.comm_group]:
                return False
    return True


_COMM_FIELDS = operator.attrgetter(
    "id", "data_deps", "ctrl_deps", "comm_type", "comm_size", "comm_tag", "attrs"
)
"""What :func:`_same_structure` compares of two communication nodes"""


def _dependencies(nodes: Sequence[Any], rank: int) -> tuple[list[list[int]], list[int], bool]:
    """Per position: the positions of the nodes that wait for it (ascending) and how many
    distinct nodes it waits for; and whether every node waits only for nodes at lower
    positions."""
    n = len(nodes)
    try:  # every id its position, as lowering makes them
        found = _earlier_dependencies(nodes)
    except TypeError:  # an id or dependency that is no int
        found = None
    if found is not None:
        return found[0], found[1], True
    ids = [node.id for node in nodes]
    position = {node_id: i for i, node_id in enumerate(ids)}
    if len(position) != n:
        raise TraceError(f"rank {rank}: duplicate node ids")
    children: list[list[int]] = [[] for _ in range(n)]
    pending = [0] * n
    ordered = True
    for i, node in enumerate(nodes):
        data = set(node.data_deps).union(node.ctrl_deps)
        for dep in data:
            j = position.get(dep)
            if j is None:
                raise TraceError(f"rank {rank}: node {node.id} depends on missing {dep}")
            if j >= i:
                ordered = False
            children[j].append(i)
        pending[i] = len(data)
    return children, pending, ordered


def _earlier_dependencies(nodes: Sequence[Any]) -> tuple[list[list[int]], list[int]] | None:
    """:func:`_dependencies` where every node's id is its position, None unless every id is
    its position and every node waits only for nodes before it."""
    if _compiled_dependencies is not None:
        found = _compiled_dependencies(nodes)
        if found is not NotImplemented:  # ids or deps of other types: the code below decides
            return found
    return _python_earlier_dependencies(nodes)


def _python_earlier_dependencies(
    nodes: Sequence[Any],
) -> tuple[list[list[int]], list[int]] | None:
    """:func:`_earlier_dependencies` in Python (what the compiled one does)."""
    children: list[list[int]] = [[] for _ in nodes]
    pending = [0] * len(nodes)
    for i, node in enumerate(nodes):
        if node.id != i:
            return None
        data, ctrl = node.data_deps, node.ctrl_deps
        # distinct: the commonest shapes (two data deps, one data and one ctrl dep) at a glance
        if ctrl:
            if len(ctrl) == 1 and len(data) == 1 and data[0] != ctrl[0]:
                data = (data[0], ctrl[0])
            else:
                data = set(data).union(ctrl)
        elif len(data) > 1 and (len(data) != 2 or data[0] == data[1]):
            data = set(data)
        for dep in data:
            if not 0 <= dep < i:
                return None
            children[dep].append(i)
        pending[i] = len(data)
    return children, pending


def replay(
    problem: Problem,
    system: System,
    default_dtype: str = "bf16",
    kernels: KernelTable | None = None,
    profile: str = "megatron",
    calibration: Calibration | None = None,
    overlap_param_gather: bool = False,
    tp_comm_overlap: bool = False,
    share_links: bool = True,
    costs: Costs | None = None,
    states_at: Sequence[tuple[int, int]] = (),
) -> Replay:
    """Simulate every unit of ``problem`` on ``system`` (ops priced with ``kernels`` under
    execution ``profile``); ``overlap_param_gather`` and ``tp_comm_overlap``: Megatron's
    options of those names (see :meth:`_Sim._gather_before_forward` and
    :meth:`_Sim._overlap_tp_collectives`). ``share_links`` False runs every transfer at its
    ports' full bandwidth whatever else is in flight (the model without bandwidth sharing, for
    comparison). ``costs``: the node costs worked out by an earlier replay with the same
    arguments (of a problem sharing node objects, as two reduced ones), filled in further.
    ``states_at``: (unit, node) pairs, in the order they start: the engine's state at the end
    of the instant each starts (:class:`EngineState`, in the result's ``states``)."""
    # millions of small lists and tuples, none cyclic: the cyclic collector only costs time
    enabled = gc.isenabled()
    gc.disable()
    try:
        result = _Sim(
            problem,
            system,
            default_dtype,
            kernels,
            profile,
            calibration,
            overlap_param_gather,
            tp_comm_overlap,
            share_links,
            costs,
        ).run(states_at)
    finally:
        if enabled:
            gc.enable()
    if not math.isfinite(result.iteration_time):
        raise non_finite_time("the replay", result.iteration_time, system.name)
    return result


# ---------------------------------------------------------------------------------------------
# Report


def _union_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The length of the union of the intervals of ``a`` and ``b``: its pieces' lengths added
    in order."""
    intervals = a + b
    if not intervals:
        return 0.0
    intervals.sort(key=_interval_start)  # the pieces do not depend on how ties are ordered
    total = 0.0
    cur_start, cur_end = intervals[0]
    for s, e in intervals[1:]:
        if s > cur_end:
            total += cur_end - cur_start
            cur_start, cur_end = s, e
        elif e > cur_end:
            cur_end = e
    return total + (cur_end - cur_start)


_interval_start = operator.itemgetter(0)

_IS_COMPUTE = bytes(k == COMPUTE for k in range(256))
_IS_TRANSFER = bytes(k in (COLL, SEND) for k in range(256))
"""per node kind: whether it is compute, a collective or a send (``bytes.translate`` tables)"""


def nonnegative_duration(difference: float) -> float:
    """A duration found as a difference of sums of interval lengths (a union's length less
    the compute's, the iteration less the busy time; a periodic replay's extrapolation of
    them): never below 0. The intervals' ends are the same floats on both sides, so a
    difference that is 0 in exact arithmetic comes out as a few units of the last place
    either side of 0 (pieces summed merged on one side and one by one on the other; a
    period's increment, a difference of two such sums, times the periods): what lies below 0
    is that rounding, not time, and prints as 0.0 (not -1.5e-16 s)."""
    return difference if difference > 0.0 else 0.0


def unit_breakdown(res: UnitResult, iteration_time: float) -> dict[str, float]:
    """Compute, communication, exposed communication and idle (bubble) time of one unit;
    where it copies to or from host memory (CPU activation offload) also the copies' time
    (``host_copy_s``) and the part of it that neither compute nor communication hides
    (``exposed_host_copy_s``, out of the bubble)."""
    kinds = bytes(res.kind)
    start, end = res.start, res.end
    # the nodes of each kind, in node order, a column at a time; sums in node order
    mask = kinds.translate(_IS_COMPUTE)
    compute_start = list(itertools.compress(start, mask))
    compute_end = list(itertools.compress(end, mask))
    mask = kinds.translate(_IS_TRANSFER)
    comm_start = list(itertools.compress(res.transfer_start, mask))
    comm_end = list(itertools.compress(end, mask))
    issued = itertools.compress(start, mask)
    compute = list(zip(compute_start, compute_end, strict=True))
    comm = list(zip(comm_start, comm_end, strict=True))
    compute_s = sum(map(operator.sub, compute_end, compute_start))
    comm_s = sum(map(operator.sub, comm_end, comm_start))
    waiting = functools.reduce(operator.add, map(operator.sub, comm_start, issued), 0.0)
    busy = _union_length(compute, comm)
    out = {
        "compute_s": compute_s,
        "communication_s": comm_s,
        "exposed_communication_s": nonnegative_duration(busy - compute_s),
        "collective_wait_s": waiting,
        "bubble_s": nonnegative_duration(iteration_time - busy),
    }
    if COPY in kinds:
        copies = [(start[i], end[i]) for i, k in enumerate(kinds) if k == COPY]
        with_copies = _union_length(compute + comm, copies)
        out["host_copy_s"] = sum(e - s for s, e in copies)
        out["exposed_host_copy_s"] = nonnegative_duration(with_copies - busy)
        out["bubble_s"] = nonnegative_duration(iteration_time - with_copies)
    return out


def critical_path(replay_: Replay) -> list[dict[str, Any]]:
    """The chain of nodes that determines the iteration time, earliest first, as runs of
    consecutive nodes on one rank and stream."""
    return path_runs(
        (
            res.unit.rank,
            KIND_NAMES[res.kind[i]],
            res.unit.nodes[i].name,
            res.start[i],
            res.end[i],
        )
        for res, i in ((replay_.units[u], i) for u, i in critical_chain(replay_))
    )


def path_runs(chain: Iterable[tuple[int, str, str, float, float]]) -> list[dict[str, Any]]:
    """(rank, kind, node name, start, end) of a chain's nodes as runs of consecutive nodes of
    one kind on one rank."""
    runs: list[dict[str, Any]] = []
    for rank, kind, name, start, end in chain:
        if runs and runs[-1]["rank"] == rank and runs[-1]["kind"] == kind:
            run = runs[-1]
            run["end_s"] = end
            run["nodes"] += 1
            run["last"] = name
        else:
            runs.append(
                {
                    "rank": rank,
                    "kind": kind,
                    "start_s": start,
                    "end_s": end,
                    "nodes": 1,
                    "first": name,
                    "last": name,
                }
            )
    return runs


def critical_chain(replay_: Replay) -> list[tuple[int, int]]:
    """(unit, node) pairs of the chain that ends last, earliest first (each node's ``cause``
    back from the last to end)."""
    best: tuple[float, int, int] | None = None
    for u, res in enumerate(replay_.units):
        if res.end:
            last = max(res.end)
            if best is None or last > best[0]:
                best = (last, u, res.end.index(last))
    chain: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    current = (best[1], best[2]) if best is not None else None
    while current is not None and current not in seen:
        seen.add(current)
        chain.append(current)
        current = replay_.units[current[0]].cause[current[1]]
    chain.reverse()
    return chain


EXPLAINED_ROLES = {
    Role.FP8_AMAX: "fp8 amax",
    Role.TP_ALL_GATHER: "tp",
    Role.TP_REDUCE_SCATTER: "tp",
    Role.PARAM_ALL_GATHER: "param",
    Role.ORTHOGONALIZE: "muon momentum",
}
"""How :func:`explain` names the nodes of a typed role (collectives, and the amax
bookkeeping's kernels)."""


def explain(
    replay_: Replay, comm_groups: Mapping[int, Sequence[int]], system: System | None = None
) -> dict[str, Any]:
    """The iteration time split along its critical path: compute by kernel class
    (``gemm``, ``attention``, ``memory-bound``, ``recompute``, ``optimizer``, ``fp8 amax``
    for Transformer Engine's amax bookkeeping, and with ``system`` ``fp8 quantize`` for the
    quantization that a GEMM node carries; ``quantize`` for a low-precision recipe's quantize
    nodes), exposed communication by role (``fp8 amax``,
    ``tp``, ``param``), collective type and group size (sends and receives: ``p2p``),
    copies to and from host memory (``host copy``), and
    ``wait`` (time the chain waits on other ranks: pipeline bubble, stragglers). The parts add
    up to the iteration time."""
    parts: dict[str, float] = {}
    comm: dict[str, float] = {}
    clock = 0.0
    for u, i in critical_chain(replay_):
        res = replay_.units[u]
        node = res.unit.nodes[i]
        start, end = res.start[i], res.end[i]
        if start > clock:
            parts["wait"] = parts.get("wait", 0.0) + start - clock
        spent = max(0.0, end - max(start, clock))
        clock = max(clock, end)
        if not spent:
            continue
        if res.kind[i] == COMPUTE:
            attrs = getattr(node, "attrs", None) or {}
            role = node_role(node)
            if node_phase(node) is Phase.RECOMPUTE:
                key = "recompute"
            elif role is Role.OPTIMIZER_STEP or role is Role.ORTHOGONALIZE:
                key = "optimizer"
            elif role is Role.FP8_AMAX:
                key = "fp8 amax"
            elif QUANTIZE_KERNEL_ATTR in attrs:
                key = "quantize"
            elif EAGER_KERNELS_ATTR in attrs:  # memory-bound kernels, whatever the node's name
                key = "memory-bound"
            elif "attention" in attrs or op_class(
                kernel_name(node), node.num_ops, node.tensor_size
            ) == ("attention"):
                key = "attention"
            elif "gemm" in attrs:
                key = "gemm"
                device = device_of(system, res.unit.rank) if system is not None else None
                if device is not None and native_fp8(device, "gemm", node.dtype or ""):
                    quantize = min(spent, fp8_quantize_time(node, device))
                    if quantize:
                        parts["compute: fp8 quantize"] = (
                            parts.get("compute: fp8 quantize", 0.0) + quantize
                        )
                        spent -= quantize
            else:
                key = "memory-bound"
            parts[f"compute: {key}"] = parts.get(f"compute: {key}", 0.0) + spent
        elif res.kind[i] == COLL:
            size = len(comm_groups.get(node.comm_group, ())) if node.comm_group else 0
            ctype = node.comm_type.name.lower() if node.comm_type is not None else "collective"
            role = EXPLAINED_ROLES.get(node_role(node))  # type: ignore[arg-type]
            key = f"{role + ' ' if role else ''}{ctype} ({size} ranks)"
            comm[key] = comm.get(key, 0.0) + spent
        elif res.kind[i] in (SEND, RECV):
            comm["p2p"] = comm.get("p2p", 0.0) + spent
        elif res.kind[i] == COPY:
            parts["host copy"] = parts.get("host copy", 0.0) + spent
    total = replay_.iteration_time
    if total > clock:
        parts["wait"] = parts.get("wait", 0.0) + total - clock
    for key, seconds in comm.items():
        parts[f"communication: {key}"] = seconds
    return {
        "iteration_time_s": total,
        "breakdown_s": dict(sorted(parts.items(), key=lambda kv: -kv[1])),
    }
