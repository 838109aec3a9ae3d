"""How long one collective takes, from its size, its group's placement and the network.

The sub-model of the time predictor for communication. A network is a list of dimensions,
innermost first (:class:`stg.perf.system.NetworkDim`): NVLink inside a node, then the
rail-optimised fabric that joins nodes (the GPUs with the same local index in a scalable unit
share one leaf switch, their *rail*), then the spine above it. A group spans ``n_i`` ranks
along dimension ``i`` (:func:`stg.predictors.time.group_shape`); a collective runs
hierarchically, as NCCL does on such machines: the innermost dimension on the whole buffer,
each outer one on the shard the inner ones leave (so a tensor-parallel group inside a node
never touches a NIC, and a data-parallel group with one GPU per node moves everything over
that GPU's rail at the NIC's bandwidth).

**One dimension** runs the collective with the fastest of NCCL's algorithms and protocols,
each priced as NCCL's own tuning model prices it (``src/graph/tuning.cc``,
``ncclTopoGetAlgoTime``: time = latency + bytes / bandwidth):

- *ring*: ``base + steps · step_latency + bus_bytes / (B · protocol_bandwidth)``, with
  ``steps`` = 2(n-1) for all-reduce and n-1 for reduce-scatter and all-gather, and the
  nccl-tests bus-bandwidth conventions for ``bus_bytes`` (all-reduce ``2(n-1)/n · S``,
  reduce-scatter and all-gather ``(n-1)/n · S`` with S the full buffer, broadcast and reduce
  ``S``);
- *tree* (all-reduce): ``base + hops · step_latency + 2 · S / (B · 0.9)``, with
  ``2·ceil(log2 n)`` hops across nodes (a double binary tree) and ``2(n-1)`` inside a node
  (NCCL's intra-node tree is a chain);
- *in-network reduction* (all-reduce, where the dimension declares ``sharp_efficiency``:
  NVLink SHARP on an NVSwitch, SHARP on InfiniBand switches): every GPU sends its buffer to
  the switch once and receives the result once, ``base + 2 · step_latency + S /
  (B · sharp_efficiency)``.

``B`` is the dimension's ``bandwidth · efficiency / oversubscription`` (per GPU, per
direction). The protocols are NCCL's: *Simple* (full bandwidth, the dimension's
``latency_us`` per step), and, on a dimension that names its ``link``, the low-latency *LL*
(a quarter of the bandwidth, 8-byte lines of which half are flags, and NCCL's allreduce rings
halve that again) and *LL128* (120 of 128 bytes carry data) with their shorter steps. The
minimum over them is a latency-plus-saturation curve: the bus bandwidth of a collective
rises with its size and saturates at ``B``, as nccl-tests shows. A dimension without ``link``
(a hand-written or ``stg bench comms``-fitted alpha-beta link) has only the Simple ring and
tree, with no base latency: the plain alpha-beta closed forms.

**Concurrent transfers.** The times above are those of a transfer alone on its links. Each NCCL
communicator (each process group) sets up its own channels, but they all run over the same
NVLinks and the same NIC of the GPU, and nothing coordinates them: collectives of different
communicators in flight at once split the bandwidth. Measured: two 256 MB all-reduces on the
same four NVLink A100s take 1.8 ms alone and about 4.2 ms each together (NVIDIA/nccl issue
#1094); Meta's competing-communicators benchmark (meta-pytorch/torchrec pull request #4251)
states that collectives of different process groups compete for NVLink bandwidth, each getting
a fraction; and a NIC's line rate is shared by whatever crosses it (``ib_write_bw`` reaches the
same 392 Gb/s of a 400 Gb/s NIC with one queue pair as with eight: NVIDIA/nccl issue #2409). So
the time replay (:mod:`stg.predictors.time`) runs each transfer as its phases
(:func:`collective_phases`, :func:`send_parts`: per dimension its latency, then its bytes) and
lets the transfers whose bytes cross the same :func:`port` of a GPU at the same time share its
bandwidth equally (each direction on its own: NVLink and InfiniBand are full duplex, and the
bandwidths here are per direction). The latencies are not shared (they are handshakes and
pipeline fill, not bytes). A transfer held back on another port does not hand its unused share
to the others (an equal split, not max-min fairness); NCCL's choice of algorithm and protocol
is made for the transfer alone, as NCCL's tuner makes it (it knows nothing of other
communicators). Not modelled: PCIe peer-to-peer paths that do not reach both directions at once
(NVIDIA/nccl issue #204), and the switch fabric above the NIC (oversubscription is a
per-dimension bandwidth, not a contended resource).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

# ---------------------------------------------------------------------------------------------
# NCCL's protocols, from its tuning model (NVIDIA/nccl src/graph/tuning.cc, tables baseLat and
# hwLat, latencies in microseconds; and the bandwidth factors applied to busBw there).


@dataclass(frozen=True)
class Protocol:
    """One NCCL protocol: fixed latency of a collective, per-step latency relative to the
    Simple protocol's on the same link, and the fraction of the link bandwidth it carries."""

    name: str
    ring_base_s: float
    tree_base_s: float
    step_ratio: dict[str, float]
    """per link kind: this protocol's per-step latency over Simple's (hwLat ratios)"""
    bandwidth: float


LINKS = ("nvlink", "pcie", "network")
"""Link kinds a network dimension may name (NCCL's NCCL_HW_NVLINK, _PCI, _NET)."""

SIMPLE = Protocol("simple", 8.4e-6, 0.0, {"nvlink": 1.0, "pcie": 1.0, "network": 1.0}, 1.0)
# hwLat ring LL / Simple: NVLink .47/3.4, PCI 1.0/5.7, NET 2.7/9.6; bandwidth busBw/4 for
# allreduce rings (tuning.cc: "busBw *= 1.0/4.0").
LL = Protocol(
    "ll", 3.6e-6, 4.4e-6, {"nvlink": 0.47 / 3.4, "pcie": 1.0 / 5.7, "network": 2.7 / 9.6}, 0.25
)
# hwLat ring LL128 / Simple: NVLink 1.9/3.4, PCI 2.5/5.7, NET 4.0/9.6; bandwidth 120/128 of
# the link ("busBw * 0.92").
LL128 = Protocol(
    "ll128", 10.0e-6, 4.4e-6, {"nvlink": 1.9 / 3.4, "pcie": 2.5 / 5.7, "network": 4.0 / 9.6}, 0.92
)
PROTOCOLS: tuple[Protocol, ...] = (SIMPLE, LL, LL128)

TREE_BANDWIDTH = 0.9
"""NCCL's tree runs at 0.9 of the ring's bus bandwidth (tuning.cc: ``busBw*.9``)."""


class Kind(Enum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    BARRIER = "barrier"


def bus_factor(kind: Kind, n: int) -> float:
    """nccl-tests' busBW / algBW (doc/PERFORMANCE.md): all-reduce 2(n-1)/n, reduce-scatter,
    all-gather and all-to-all (n-1)/n, broadcast and reduce 1."""
    if n <= 1:
        return 0.0
    if kind is Kind.ALL_REDUCE:
        return 2 * (n - 1) / n
    if kind in (Kind.REDUCE_SCATTER, Kind.ALL_GATHER, Kind.ALL_TO_ALL):
        return (n - 1) / n
    return 1.0


@dataclass(frozen=True)
class Level:
    """What the collective model needs of one network dimension (seconds, bytes/s)."""

    bandwidth: float
    """per GPU per direction, after efficiency and oversubscription"""
    latency: float
    """per-step latency of the Simple protocol"""
    link: str | None = None
    sharp_efficiency: float = 0.0
    line_bandwidth: float = 0.0
    """per GPU per direction before efficiency (in-network reduction's reference)"""

    @classmethod
    def of(cls, dim: Any) -> Level:
        """The level of a :class:`stg.perf.system.NetworkDim`."""
        return cls(
            bandwidth=dim.bandwidth * dim.efficiency / getattr(dim, "oversubscription", 1.0),
            latency=dim.latency,
            link=getattr(dim, "link", None),
            sharp_efficiency=getattr(dim, "sharp_efficiency", 0.0),
            line_bandwidth=dim.bandwidth / getattr(dim, "oversubscription", 1.0),
        )


def level_parts(kind: Kind, buffer: float, n: int, level: Level) -> tuple[float, float]:
    """The fastest algorithm and protocol of one collective over ``n`` ranks of one dimension,
    as ``(latency, transfer)`` seconds: its fixed and per-step latencies, and its bytes at the
    protocol's bandwidth (the part that concurrent traffic on the same links shares, see
    :data:`PORTS`). ``buffer`` as in :func:`level_time`."""
    if n <= 1:
        return 0.0, 0.0
    protocols = PROTOCOLS if level.link else (SIMPLE,)
    best = math.inf
    parts = (0.0, 0.0)

    def consider(latency: float, transfer: float) -> None:
        nonlocal best, parts
        total = latency + transfer
        if total < best:
            best, parts = total, (latency, transfer)

    for proto in protocols:
        base_ring = proto.ring_base_s if level.link else 0.0
        base_tree = proto.tree_base_s if level.link else 0.0
        step = level.latency * proto.step_ratio.get(level.link or "network", 1.0)
        bandwidth = level.bandwidth * proto.bandwidth
        if kind is Kind.BARRIER:
            consider(base_ring + 2 * (n - 1) * step, 0.0)
            continue
        steps = 2 * (n - 1) if kind is Kind.ALL_REDUCE else n - 1
        consider(base_ring + steps * step, bus_factor(kind, n) * buffer / bandwidth)
        if kind is Kind.ALL_REDUCE:
            # NCCL's tree is a chain inside a node and a double binary tree across nodes
            chain = level.link in ("nvlink", "pcie")
            hops = 2 * (n - 1) if chain else 2 * math.ceil(math.log2(n))
            tree_bw = bandwidth * (TREE_BANDWIDTH if level.link else 1.0)
            consider(base_tree + hops * step, 2 * buffer / tree_bw)
    if kind is Kind.ALL_REDUCE and level.sharp_efficiency > 0:
        base = SIMPLE.ring_base_s if level.link else 0.0
        consider(base + 2 * level.latency, buffer / (level.line_bandwidth * level.sharp_efficiency))
    return parts


def level_time(kind: Kind, buffer: float, n: int, level: Level) -> float:
    """Seconds of one collective over ``n`` ranks of one dimension; ``buffer`` is the full
    buffer (all-gather: the gathered result; all-to-all: this rank's send buffer)."""
    latency, transfer = level_parts(kind, buffer, n, level)
    return latency + transfer


def collective_time(
    kind: Kind, size: float, shape: Sequence[int], levels: Sequence[Level]
) -> float:
    """Seconds of a collective over a group spanning ``shape[i]`` ranks of network dimension
    ``i`` (inner first). ``size`` follows the Chakra convention: all-gather this rank's input
    shard; reduce-scatter and all-reduce the full buffer; all-to-all this rank's buffer.

    Hierarchical: reduce-scatter runs inner to outer, each dimension on the shard left by the
    inner ones; all-gather the same sizes outer to inner; all-reduce is a reduce-scatter and an
    all-gather per dimension except where an all-reduce of the dimension's shard is faster (a
    tree, or the switch's in-network reduction); all-to-all and broadcast move their buffer
    over every dimension they span."""
    members = math.prod(shape) if shape else 1
    if members <= 1:
        return 0.0
    buffer = float(size) * members if kind is Kind.ALL_GATHER else float(size)
    total = 0.0
    for n, level in zip(shape, levels, strict=False):
        if n <= 1:
            continue
        if kind in (Kind.ALL_TO_ALL, Kind.BROADCAST, Kind.REDUCE, Kind.BARRIER):
            total += level_time(kind, float(size), n, level)
            continue
        if kind is Kind.ALL_REDUCE:
            total += level_time(Kind.ALL_REDUCE, buffer, n, level)
        else:
            total += level_time(kind, buffer, n, level)
        buffer /= n
    return total


def bus_bandwidth(kind: Kind, size: float, n: int, level: Level) -> float:
    """The bus bandwidth nccl-tests would report for ``size`` bytes over ``n`` ranks of one
    dimension (bytes/s): ``bus_factor · size / time``."""
    t = level_time(kind, size, n, level)
    return bus_factor(kind, n) * size / t if t > 0 else 0.0


def send_time(size: float, level: Level) -> float:
    """One point-to-point transfer over a dimension: ``S / B`` plus one step (and, on a named
    link, NCCL's base latency of the Simple protocol)."""
    latency, transfer = send_parts(size, level)
    return latency + transfer


def send_parts(size: float, level: Level) -> tuple[float, float]:
    """:func:`send_time` as ``(latency, transfer)`` seconds."""
    base = SIMPLE.ring_base_s if level.link else 0.0
    return base + level.latency, size / level.bandwidth


# ---------------------------------------------------------------------------------------------
# Concurrent transfers: which of a GPU's links a transfer uses, and its phases


PORTS: dict[str, str] = {"nvlink": "nvlink", "pcie": "pcie", "network": "nic"}
"""The physical resource of one GPU that a transfer over a dimension of each link kind uses.
Every dimension of kind ``network`` (a rail-optimised fabric's rail and the spine above it)
goes through the GPU's own NIC: one ConnectX per GPU on DGX A100/H100 (the system presets), so
a rail and a spine transfer of one GPU share that NIC. NVLink (and PCIe) dimensions use the
GPU's NVLink ports (its PCIe link). A dimension without a ``link`` kind is a resource of its
own."""


def port(level: Level, dimension: int) -> str:
    """The resource a transfer over network dimension ``dimension`` (``level``) uses on each
    GPU it involves: :data:`PORTS` by link kind, ``dim<i>`` for a plain alpha-beta link."""
    if level.link is None:
        return f"dim{dimension}"
    return PORTS[level.link]


@dataclass(frozen=True)
class Phase:
    """One part of a transfer on one network dimension, in the order it runs: ``latency``
    seconds (fixed and per-step latencies: not slowed by other traffic), then ``transfer``
    seconds of bytes at the dimension's full bandwidth (shared with the transfers that use
    the same port at the same time)."""

    dimension: int
    latency: float
    transfer: float


def collective_phases(
    kind: Kind, size: float, shape: Sequence[int], levels: Sequence[Level]
) -> tuple[Phase, ...]:
    """The phases of :func:`collective_time` in the order they run (their latencies and
    transfers add up to it): a reduce-scatter from the innermost dimension outwards, an
    all-gather from the outermost inwards (the same shards), an all-reduce as the reduce
    half of each inner dimension, the outermost dimension's whole all-reduce and the gather
    half of each inner dimension on the way back (a ring all-reduce is a reduce-scatter and
    an all-gather; a tree reduces up and broadcasts down; in-network reduction sends up and
    receives down: each splits into two equal halves); all-to-all, broadcast and reduce inner
    to outer."""
    members = math.prod(shape) if shape else 1
    if members <= 1:
        return ()
    buffer = float(size) * members if kind is Kind.ALL_GATHER else float(size)
    phases: list[Phase] = []
    for i, (n, level) in enumerate(zip(shape, levels, strict=False)):
        if n <= 1:
            continue
        if kind in (Kind.ALL_TO_ALL, Kind.BROADCAST, Kind.REDUCE, Kind.BARRIER):
            phases.append(Phase(i, *level_parts(kind, float(size), n, level)))
            continue
        phases.append(Phase(i, *level_parts(kind, buffer, n, level)))
        buffer /= n
    if kind is Kind.ALL_GATHER:
        phases.reverse()
    elif kind is Kind.ALL_REDUCE and len(phases) > 1:
        halves = [Phase(p.dimension, p.latency / 2, p.transfer / 2) for p in phases[:-1]]
        phases = [*halves, phases[-1], *reversed(halves)]
    return tuple(phases)


__all__ = [
    "LINKS",
    "PORTS",
    "PROTOCOLS",
    "Kind",
    "Level",
    "Phase",
    "bus_bandwidth",
    "bus_factor",
    "collective_phases",
    "collective_time",
    "level_parts",
    "level_time",
    "port",
    "send_parts",
    "send_time",
]
