"""How long one collective takes, from its size, its group's placement and the network.

The sub-model of the time predictor for communication. A network is a list of dimensions,
innermost first (:class:`stg.perf.system.NetworkDim`): NVLink inside a node, then the
rail-optimised fabric that joins nodes (the GPUs with the same local index in a scalable unit
share one leaf switch, their *rail*), then the spine above it. A group spans ``n_i`` ranks
along dimension ``i`` (:func:`stg.predictors.time.group_shape`). A group of several GPUs of
each of several nodes runs one of NCCL's algorithms over all of them (**Across nodes** below);
otherwise a collective runs dimension by dimension: the innermost on the whole buffer, each
outer one on the shard the inner ones leave (so a tensor-parallel group inside a node never
touches a NIC, and a data-parallel group with one GPU per node moves everything over that
GPU's rail at the NIC's bandwidth).

**One dimension** runs the collective the way NCCL does: NCCL's tuner picks an algorithm and a
protocol (:func:`choose`), and the time is that choice's latency plus its bytes at its rate
(:func:`level_parts`). The tuner is NCCL's own model (NVIDIA/nccl v2.18.5
``src/graph/tuning.cc``, ``ncclTopoGetAlgoTime``: latency + bytes / bandwidth) over the
candidates (:func:`candidates`):

- *ring* (every collective): ``base + steps · step_latency`` with ``steps`` = 2(n-1) for
  all-reduce and n-1 for reduce-scatter and all-gather; each GPU moves the nccl-tests bus
  bytes (all-reduce ``2(n-1)/n · S``, reduce-scatter and all-gather ``(n-1)/n · S`` with S
  the full buffer, broadcast and reduce ``S``) at ``B · protocol_bandwidth``;
- *tree* (all-reduce): ``base + hops · tree_step_latency``, ``2(n-1)`` hops inside a node
  (NCCL's intra-node tree is a chain) and ``2·ceil(log2 n)`` across nodes (a double binary
  tree), ``2 · S`` at NCCL's tree bandwidths (0.92 of the ring's; LL a further 1/3.8, LL128
  7/9 in a node) times its ``treeCorrectionFactor``;
- *NVLS* (all-reduce on an NVLink dimension that declares ``sharp_efficiency``, an NVSwitch
  reducing in the network): only for groups of three GPUs or more (``src/transport/nvls.cc``
  turns NVLS off for two) and, as in NCCL 2.18, for all-reduce only; 23 us, and each GPU
  sends its buffer to the switch once and receives the result once, ``S`` at
  ``B_line · sharp_efficiency`` (nccl-tests: ~275 GB/s of algorithm bandwidth on 8 H100s).
  NCCL's tuner weighs it at its own NVLS bandwidth (:func:`nccl_nvls_rate`: one channel per
  GPU at the fastest Hopper speed that fits), so four H100s run the ring above a few MiB and
  eight run NVLS at every size;
- *CollNet* (all-reduce on a network dimension that declares ``sharp_efficiency``: SHARP on
  InfiniBand switches): ``base + 2 · step_latency`` and ``S`` at ``B_line ·
  sharp_efficiency``;
- *all-to-all* is NCCL's group of sends and receives to every peer at once (nccl-tests
  ``alltoall_perf``): one step of latency, ``(n-1)/n · S`` at ``B``.

``B`` is the dimension's ``bandwidth · efficiency / oversubscription`` (per GPU, per
direction). The protocols are NCCL's: *Simple* (full bandwidth, the dimension's
``latency_us`` per step), and, on a dimension that names its ``link``, the low-latency *LL*
(a quarter of the bandwidth for all-reduce rings) and *LL128* (120 of 128 bytes carry data)
with NCCL's fixed latencies and their steps scaled by NCCL's ``hwLat`` ratios. A dimension
without ``link`` (a hand-written or ``stg bench comms``-fitted alpha-beta link) has only the
Simple ring and tree, with no base latency and no ramp: the plain alpha-beta closed forms.

**The ramp.** nccl-tests' bandwidth climbs to its plateau far more slowly than the tuner's
latency-plus-bandwidth line (a 16 MiB all-reduce on 8 GPUs reaches about 60 % of the
bandwidth its latency leaves room for). Each channel streams its share of the bytes a GPU
moves through a pipeline of NCCL's buffer slots (``NCCL_STEPS``), chunked smaller the fewer
bytes there are (``src/enqueue.cc``, the chunk-size loops of ``computeColl``), so the
fraction of the plateau reached is a function of the bytes each GPU puts through that pipeline:
:func:`mid_size_efficiency` (:func:`ramp`), measured on one machine (an 8-GPU H200 NVLS
all-reduce, where each GPU reduces and multicasts its eighth of the buffer) and applied on
NVLink to the protocols that pipeline buffer slots step by step around the group (Simple,
LL128; LL flags every 8-byte line and runs at its own quarter rate from the first line; sends
and all-to-all, point to point, have no ring of steps to fill). **Group size inside a node**:
a ring (all-reduce, reduce-scatter, all-gather) cuts the buffer into one chunk per rank and
moves one chunk per step, so its pipeline holds the share ``S / n`` as NVLS's does, read on the
8-GPU curve at ``8 · S / n`` (:func:`ring_ramp`): at a given buffer two or four GPUs ramp
faster than eight (the 4-GPU H100 curve and the 8-GPU A100 ring of
``tests/test_nccl_curves.py``, neither fitted), while NCCL's per-step latency grows with ``n``;
on an H100 five GPUs or more switch to NVLS, whose bus bandwidth is ``2(n-1)/n`` times an
algorithm bandwidth that does not depend on ``n``, so eight top two and four at large buffers.

**Measured curves.** A dimension may carry measured curves (:class:`MeasuredCurve`, from
``stg bench comms`` on the real machine: ``stg predict --calibration``); a curve replaces the
model for its collective and group size (sends: ``send_recv``).

**Across nodes.** NCCL does not decompose a collective by dimension: a group of ``local`` GPUs
in each of ``nodes`` nodes runs one ring, tree or NVLSTree over all its ranks, and every chunk
streams through the NVLink and the NIC hops at once (:func:`spanning_candidates`): the slower
of the two sets the pace, not their sum. A ring's bus bytes cross each GPU's NVLinks and,
together, the node's ``local`` NICs (the NIC bandwidth is shared by the ring's channels);
the tree's NVLink chain carries ``2 S`` and the NICs ``2 (nodes-1)/nodes · S``; NVLSTree
reduces inside the node through the switch and runs that tree between nodes at NCCL's 0.70;
an all-to-all sends to the node's peers over NVLink and to the others through the GPU's own
NIC at once. Latencies are NCCL's tuner's (intra- and inter-node steps of each algorithm).
Groups with one GPU per node, plain alpha-beta dimensions and dimensions with measured curves
keep the dimension-by-dimension decomposition.

**Sends.** A send is one step of the link (NCCL's tuner gives point-to-point no base latency)
and its bytes at ``B``. Not modelled: NCCL's point-to-point path's own bandwidth at large
sizes (nccl-tests' sendrecv reaches about 195 GB/s on A100 NVLink where a send here runs at
225; an all-to-all of 4 H100s 335 GB/s of bus bandwidth against 369).

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
(:func:`collective_phases`, :func:`send_parts`: per dimension its latency, then its bytes;
an algorithm across nodes as one phase on the dimension that sets its pace) and
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

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

# ---------------------------------------------------------------------------------------------
# NCCL's protocols, from its tuning model: NVIDIA/nccl v2.18.5-1 src/graph/tuning.cc (the
# release the nccl-tests curves of tests/data/nccl/published.jsonl ran), tables ``baseLat``
# (fixed latency per collective, us) and ``hwLat`` (latency per step, us), and the bandwidth
# refinements of ``ncclTopoTuneModel``.


@dataclass(frozen=True)
class Protocol:
    """One NCCL protocol: fixed latency of a collective (ring and tree), per-step latency of
    the ring and of the tree relative to the Simple ring's on the same link (``hwLat``
    ratios), and the fraction of the link's bus bandwidth its ring and its tree carry."""

    name: str
    ring_base_s: float
    tree_base_s: float
    step_ratio: dict[str, float]
    """per link kind: this protocol's ring step latency over the Simple ring's"""
    bandwidth: float
    """the ring's fraction of the bus bandwidth"""
    tree_step_ratio: dict[str, float]
    """per link kind: this protocol's tree step latency over the Simple ring's"""
    tree_bandwidth: dict[str, float]
    """per link kind: the tree's fraction of the bus bandwidth"""


LINKS = ("nvlink", "pcie", "network")
"""Link kinds a network dimension may name (NCCL's NCCL_HW_NVLINK, _PCI, _NET)."""

# hwLat, Simple ring: NVLink 3.4, PCI 5.7, NET 14.0 (the ratios below divide by these). The tree
# runs at ``busBw * .92`` (all-reduce), LL at a further 1/3.8, LL128 at 7/9 on one node (NVLink,
# PCI: NCCL's intra-node tree is a chain) and 120/128 across nodes.
_TREE = 0.92
SIMPLE = Protocol(
    "simple",
    8.4e-6,
    0.0,
    {"nvlink": 1.0, "pcie": 1.0, "network": 1.0},
    1.0,
    {"nvlink": 4.0 / 3.4, "pcie": 6.0 / 5.7, "network": 14.0 / 14.0},
    {"nvlink": _TREE, "pcie": _TREE, "network": _TREE},
)
# ring LL: hwLat NVLink .6, PCI 1.0, NET 2.7; "busBw * 1.0/4.0" for all-reduce rings; tree LL:
# hwLat .6, 1.0, 5.0 and "busBw*1.0/3.8".
LL = Protocol(
    "ll",
    6.6e-6,
    6.8e-6,
    {"nvlink": 0.6 / 3.4, "pcie": 1.0 / 5.7, "network": 2.7 / 14.0},
    0.25,
    {"nvlink": 0.6 / 3.4, "pcie": 1.0 / 5.7, "network": 5.0 / 14.0},
    {"nvlink": _TREE / 3.8, "pcie": _TREE / 3.8, "network": _TREE / 3.8},
)
# ring LL128: hwLat NVLink 1.9, PCI 2.5, NET 4.0 and 120/128 of the link ("busBw * 0.92"); tree
# LL128: hwLat 1.25, 1.9, 8.5.
LL128 = Protocol(
    "ll128",
    14.0e-6,
    14.0e-6,
    {"nvlink": 1.9 / 3.4, "pcie": 2.5 / 5.7, "network": 4.0 / 14.0},
    0.92,
    {"nvlink": 1.25 / 3.4, "pcie": 1.9 / 5.7, "network": 8.5 / 14.0},
    {"nvlink": _TREE * 7 / 9, "pcie": _TREE * 7 / 9, "network": _TREE * 120 / 128},
)
PROTOCOLS: tuple[Protocol, ...] = (SIMPLE, LL, LL128)

TREE_BANDWIDTH = _TREE
"""NCCL's tree all-reduce runs at 0.92 of the ring's bus bandwidth (tuning.cc: ``busBw*.92``)."""

NVLS_LATENCY_S = 23.0e-6
"""NVLink SHARP all-reduce on one node: NCCL's fixed latency of the NVLS algorithm
(``baseLat`` NVLS Simple, 23 us; no per-step latency, ``hwLat`` NVLink NVLS is 0)."""

NVLS_CURVE_RANKS = 8
"""The GPUs of the NVLS all-reduce that :data:`MID_SIZE_EFFICIENCY` was measured on (8 H200s)."""

NVLS_MIN_RANKS = 3
"""NCCL enables NVLS only for communicators of more than two GPUs of a node
(src/transport/nvls.cc, ``ncclNvlsInit``: ``if (... gpuCount <= 2) return``)."""

NVLS_BUS_RATIO = 5.0 / 6.0
"""NCCL's tuner converts the NVLS channels' bandwidth to algorithm bandwidth with 5/6
(src/graph/tuning.cc, ``else if (a == NCCL_ALGO_NVLS) ratio = 5.0/6.0``)."""

NVLS_SPEEDS: tuple[float, ...] = (60.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 6.0, 3.0)
"""Per-channel speeds (GB/s) NCCL's topology search tries on Hopper, fastest first
(src/graph/search.cc, ``sm90SpeedArrayIntra``)."""

NCCL_NVLINK_PER_LINK = 20.0
"""GB/s NCCL's topology assigns one NVLink of an A100 or H100 (src/graph/topo.h,
``SM80_NVLINK_BW``, ``SM90_NVLINK_BW``)."""

NVLINK_PER_LINK = 25.0
"""GB/s per direction of one NVLink 3 or 4 link on the data sheets (A100: 12 links, 600 GB/s
both directions; H100 SXM: 18 links, 900 GB/s)."""

# fmt: off
TREE_CORRECTION: dict[str, tuple[float, ...]] = {
    "ll": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0,
           1.0, 1.0, 1.0),
    "ll128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9,
              .9, .9, 1.0, 1.0),
    "simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7,
               .8, .9, .9),
}
# fmt: on
"""NCCL's ``treeCorrectionFactor``: the tree's bandwidth at buffer sizes 64 B · 2^i
(i = 0..22, 64 B to 256 MiB), "trees are not perfectly sticking to the model for medium
sizes"; 1 above 256 MiB."""

MID_SIZE_EFFICIENCY: tuple[tuple[int, float], ...] = (
    (2**20, 0.328),
    (2**21, 0.417),
    (2**22, 0.509),
    (2**23, 0.530),
    (2**24, 0.617),
    (2**25, 0.710),
    (2**26, 0.826),
    (2**27, 0.895),
    (2**28, 0.919),
    (2**29, 0.932),
    (2**30, 0.979),
    (2**31, 0.987),
    (2**32, 0.995),
    (2**33, 1.0),
)
"""The fraction of its saturated bandwidth an NCCL kernel reaches over NVLink when each GPU moves
that many bytes (:func:`ramp`): nccl-tests bus bandwidths ramp far more slowly than NCCL's
latency-plus-bandwidth model (whose own tuning table, :data:`TREE_CORRECTION`, corrects its
trees the same way). Measured
on one machine, the Azure ND H200 v5 (8 H200, NVSwitch, NVLS all-reduce, NCCL 2.20.5;
``tests/data/nccl/published.jsonl``): ``(S / B) / (t - 23 us)`` with ``B`` the NVLS
algorithm bandwidth of the h200-141g preset (450 GB/s · 0.61), where each GPU sends its
buffer to the switch once. The same curve predicts the ND H100 v5 NVLS all-reduce and the ND
A100 v4 ring all-reduce (another GPU, switch and algorithm) within a few percent
(``tests/test_nccl_curves.py``). Geometric interpolation between the sizes; the smallest entry
below 1 MiB, 1 above 8 GiB. Only NVLink dimensions (the link it was measured on) apply it."""


def mid_size_efficiency(size: float) -> float:
    """:data:`MID_SIZE_EFFICIENCY` at a buffer of ``size`` bytes."""
    sizes = MID_SIZE_EFFICIENCY
    if size <= sizes[0][0]:
        return sizes[0][1]
    for (lo, lo_eff), (hi, hi_eff) in itertools.pairwise(sizes):
        if size <= hi:
            weight = math.log(size / lo) / math.log(hi / lo)
            return lo_eff + (hi_eff - lo_eff) * weight
    return sizes[-1][1]


def tree_correction(protocol: Protocol, size: float) -> float:
    """NCCL's :data:`TREE_CORRECTION` for a tree all-reduce of ``size`` bytes."""
    index = int(math.log2(max(int(size) >> 6, 1)))
    table = TREE_CORRECTION[protocol.name]
    return table[index] if index < len(table) else 1.0


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
class MeasuredCurve:
    """A collective measured on one network dimension (``stg bench comms``): its times at
    increasing buffer sizes (nccl-tests' size convention, as ``buffer`` in
    :func:`level_time`) for one group size. It replaces the modelled curve of that collective
    and group size: log-log interpolation between the measured sizes, the smallest size's
    time below them (a latency floor), and the largest size's bandwidth above them."""

    collective: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all`` or ``send_recv``"""
    ranks: int
    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.collective not in MEASURED_COLLECTIVES:
            allowed = ", ".join(MEASURED_COLLECTIVES)
            raise ValueError(f"collective {self.collective!r} is not known; allowed: {allowed}")
        if self.ranks < 2:
            raise ValueError(f"ranks must be at least 2, got {self.ranks}")
        if not self.sizes or len(self.sizes) != len(self.seconds):
            raise ValueError("sizes and seconds must be non-empty lists of the same length")
        if any(s <= 0 for s in self.sizes) or any(not t > 0 for t in self.seconds):
            raise ValueError("sizes and seconds must be > 0")
        if any(a >= b for a, b in itertools.pairwise(self.sizes)):
            raise ValueError("sizes must increase")

    def time(self, size: float) -> float:
        """Seconds at ``size`` bytes."""
        sizes, seconds = self.sizes, self.seconds
        if size <= sizes[0]:
            return seconds[0]
        if size >= sizes[-1]:
            return seconds[-1] * size / sizes[-1]
        for (s0, t0), (s1, t1) in itertools.pairwise(zip(sizes, seconds, strict=True)):
            if size <= s1:
                weight = math.log(size / s0) / math.log(s1 / s0)
                return math.exp(math.log(t0) + weight * math.log(t1 / t0))
        raise AssertionError("unreachable")

    def parts(self, size: float) -> tuple[float, float]:
        """:meth:`time` as ``(latency, transfer)``: the smallest measured time is latency."""
        total = self.time(size)
        latency = min(self.seconds[0], total)
        return latency, total - latency

    def as_dict(self) -> dict[str, Any]:
        return {
            "collective": self.collective,
            "ranks": self.ranks,
            "sizes": list(self.sizes),
            "seconds": list(self.seconds),
        }

    @classmethod
    def from_dict(cls, raw: Any) -> MeasuredCurve:
        """The JSON form of :meth:`as_dict`; a mistake raises ``ValueError``."""
        if not isinstance(raw, dict):
            raise ValueError("a measured curve must be a JSON object")
        unknown = sorted(set(raw) - {"collective", "ranks", "sizes", "seconds"})
        if unknown:
            raise ValueError(
                f"unknown key {unknown[0]!r}; allowed: collective, ranks, sizes, seconds"
            )
        try:
            collective, ranks = raw["collective"], raw["ranks"]
            sizes, seconds = raw["sizes"], raw["seconds"]
        except KeyError as missing:
            raise ValueError(f"missing key {missing.args[0]!r}") from None
        if isinstance(ranks, bool) or not isinstance(ranks, int):
            raise ValueError(f"ranks must be an integer, got {ranks!r}")
        numbers = (int, float)
        if not isinstance(sizes, list) or not all(
            isinstance(x, numbers) and not isinstance(x, bool) for x in [*sizes, *seconds]
        ):
            raise ValueError("sizes and seconds must be lists of numbers")
        return cls(str(collective), ranks, tuple(int(x) for x in sizes), tuple(map(float, seconds)))


MEASURED_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
"""Collectives a :class:`MeasuredCurve` may hold (``stg bench comms`` names; ``send_recv``
prices a send)."""


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
    measured: tuple[MeasuredCurve, ...] = ()
    """measured curves that replace the model for their collective and group size"""

    @classmethod
    def of(cls, dim: Any) -> Level:
        """The level of a :class:`stg.perf.system.NetworkDim`."""
        return cls(
            bandwidth=dim.bandwidth * dim.efficiency / getattr(dim, "oversubscription", 1.0),
            latency=dim.latency,
            link=getattr(dim, "link", None),
            sharp_efficiency=getattr(dim, "sharp_efficiency", 0.0),
            line_bandwidth=dim.bandwidth / getattr(dim, "oversubscription", 1.0),
            measured=tuple(getattr(dim, "measured", ())),
        )

    def curve(self, collective: str, ranks: int) -> MeasuredCurve | None:
        """The measured curve of ``collective`` over ``ranks`` ranks, if there is one."""
        for curve in self.measured:
            if curve.collective == collective and curve.ranks == ranks:
                return curve
        return None


class Algorithm(Enum):
    """NCCL's algorithms (``NCCL_ALGO``): the ring, the tree (all-reduce), NVLink SHARP (NVLS,
    an NVSwitch reducing in the network) and CollNet (a switch fabric reducing in the network,
    InfiniBand SHARP), and the point-to-point sends that NCCL's all-to-all is made of."""

    RING = "ring"
    TREE = "tree"
    NVLS = "nvls"
    COLLNET = "collnet"
    P2P = "p2p"
    NVLS_TREE = "nvls_tree"


@dataclass(frozen=True)
class Choice:
    """One algorithm and protocol for a collective: its fixed and per-step latency, the bytes
    each GPU moves per direction (``moved``) and the rate its kernel moves them at once the
    pipeline is full (``rate``, bytes/s), and the rate NCCL's tuner assumes (``tuner_rate``)."""

    algorithm: Algorithm
    protocol: Protocol
    latency: float
    moved: float
    rate: float
    tuner_rate: float
    share: float = 0.0
    """bytes each GPU moves per step of a ring that cuts the buffer into one chunk per rank
    (all-reduce, reduce-scatter, all-gather): ``buffer / n``; 0 for the others"""

    def tuner_time(self) -> float:
        """The time NCCL's tuner gives this choice (``ncclTopoGetAlgoTime``)."""
        return self.latency + self.moved / self.tuner_rate

    def transfer(self, efficiency: float) -> float:
        """Seconds of the bytes at ``efficiency`` of the saturated rate."""
        return self.moved / (self.rate * efficiency)


def nccl_nvls_rate(n: int, level: Level) -> float:
    """The NVLS all-reduce bandwidth NCCL's tuner assumes for ``n`` GPUs of one NVSwitch node
    (bytes of buffer per second): one NVLS channel per GPU (src/graph/search.cc: "Force
    intra-node NVLS algorithm to pull evenly from all GPUs"), each at the fastest speed of
    ``sm90SpeedArrayIntra`` with ``n · speed`` within the GPU's NVLink bandwidth as NCCL sees
    it times ``n/(n-1)`` (``totalBw *= ngpus/(ngpus-1)``), times NCCL's NVLS bus ratio 5/6
    (src/graph/tuning.cc)."""
    total = level.line_bandwidth * NCCL_NVLINK_PER_LINK / NVLINK_PER_LINK
    cap = total * n / (n - 1)
    for speed in NVLS_SPEEDS:
        if speed * 1e9 <= total and n * speed * 1e9 <= cap:
            return n * speed * 1e9 * NVLS_BUS_RATIO
    return n * NVLS_SPEEDS[-1] * 1e9 * NVLS_BUS_RATIO


SHARED_RINGS = (Kind.ALL_REDUCE, Kind.REDUCE_SCATTER, Kind.ALL_GATHER)
"""Collectives whose NCCL ring moves one chunk per rank of the buffer per step (a broadcast's
and a reduce's ring forwards the whole of each chunk)."""


def candidates(kind: Kind, buffer: float, n: int, level: Level) -> list[Choice]:
    """Every algorithm and protocol NCCL may run for this collective on one dimension (see the
    module docstring), ``buffer`` as in :func:`level_time`."""
    link = level.link or "network"
    protocols = PROTOCOLS if level.link else (SIMPLE,)
    choices: list[Choice] = []
    if kind is Kind.ALL_TO_ALL:
        # NCCL's all-to-all is a group of sends and receives, one per peer, all at once
        moved = bus_factor(kind, n) * buffer
        rate = level.bandwidth
        return [Choice(Algorithm.P2P, SIMPLE, level.latency, moved, rate, rate)]
    for proto in protocols:
        base_ring = proto.ring_base_s if level.link else 0.0
        base_tree = proto.tree_base_s if level.link else 0.0
        step = level.latency * proto.step_ratio[link]
        rate = level.bandwidth * proto.bandwidth
        if kind is Kind.BARRIER:
            choices.append(Choice(Algorithm.RING, proto, base_ring + 2 * (n - 1) * step, 0, 1, 1))
            continue
        steps = 2 * (n - 1) if kind is Kind.ALL_REDUCE else n - 1
        moved = bus_factor(kind, n) * buffer
        # a ring cuts the buffer into one chunk per rank and moves one chunk per step
        share = buffer / n if kind in SHARED_RINGS else 0.0
        latency = base_ring + steps * step
        choices.append(Choice(Algorithm.RING, proto, latency, moved, rate, rate, share))
        if kind is Kind.ALL_REDUCE:
            # NCCL's tree is a chain inside a node and a double binary tree across nodes
            chain = level.link in ("nvlink", "pcie")
            hops = 2 * (n - 1) if chain else 2 * math.ceil(math.log2(n))
            if level.link:
                tree_step = level.latency * proto.tree_step_ratio[link]
                tree_rate = level.bandwidth * proto.tree_bandwidth[link]
                tree_rate *= tree_correction(proto, buffer)
            else:
                tree_step, tree_rate = step, rate
            latency = base_tree + hops * tree_step
            choices.append(Choice(Algorithm.TREE, proto, latency, 2 * buffer, tree_rate, tree_rate))
    if kind is Kind.ALL_REDUCE and level.sharp_efficiency > 0:
        rate = level.line_bandwidth * level.sharp_efficiency
        if level.link == "nvlink":
            if n >= NVLS_MIN_RANKS:
                tuner = nccl_nvls_rate(n, level)
                choices.append(Choice(Algorithm.NVLS, SIMPLE, NVLS_LATENCY_S, buffer, rate, tuner))
        else:
            latency = (SIMPLE.ring_base_s if level.link else 0.0) + 2 * level.latency
            choices.append(Choice(Algorithm.COLLNET, SIMPLE, latency, buffer, rate, rate))
    return choices


def choose(kind: Kind, buffer: float, n: int, level: Level) -> Choice:
    """The algorithm and protocol NCCL runs: the fastest by its own tuning model
    (``ncclTopoGetAlgoTime``: latency plus bytes at the tuner's bandwidth)."""
    return min(candidates(kind, buffer, n, level), key=Choice.tuner_time)


def ramp(choice: Choice, level: Level, ranks: int = NVLS_CURVE_RANKS) -> float:
    """The fraction of its saturated rate ``choice`` reaches on NVLink, for the collectives whose
    protocol pipelines NCCL's buffer slots step by step (Simple, LL128); the LL protocol (a flag
    in every 8-byte line) runs at its own rate from the first line, and so do point-to-point
    transfers (sends, all-to-all): no ring of dependent steps to fill. A ring that moves one
    chunk per rank of the buffer per step: :func:`ring_ramp` of that chunk (``Choice.share``);
    NVLS over ``ranks`` GPUs: :func:`nvls_share_ramp`; any other (the tree's chain, a
    broadcast's ring) :func:`mid_size_efficiency` of the bytes each GPU moves."""
    if level.link != "nvlink" or choice.protocol is LL or choice.algorithm is Algorithm.P2P:
        return 1.0
    if choice.algorithm is Algorithm.NVLS:
        return nvls_share_ramp(choice.moved, ranks)
    if choice.share > 0:
        return ring_ramp(choice.share)
    return mid_size_efficiency(choice.moved)


def ring_ramp(share: float) -> float:
    """The ramp of a ring whose GPUs each move ``share`` bytes per step: NCCL's ring all-reduce,
    reduce-scatter and all-gather cut each channel's part of the buffer into one chunk per rank
    and move one chunk per step (NVIDIA/nccl v2.18.5-1 src/collectives/device/all_reduce.h,
    ``runRing``: ``loopSize = nChannels*nranks*chunkSize``, ``realChunkSize = min(chunkSize,
    divUp(size-gridOffset, nChannels*nranks))``), so the pipeline a GPU fills holds the
    buffer's share ``S / n``, as an NVLS all-reduce's does (each GPU reduces and multicasts
    its ``1/n`` of the buffer). :data:`MID_SIZE_EFFICIENCY` was measured on 8 GPUs, whose
    share of a buffer ``S`` is ``S / 8``: a share is read at ``8 · share``. At a given buffer
    two GPUs (chunks of half the buffer) ramp faster than eight (chunks of an eighth): the
    4-GPU H100 curve of tests/data/nccl/published.jsonl (no constant is fitted to it)."""
    return mid_size_efficiency(share * NVLS_CURVE_RANKS)


def nvls_share_ramp(buffer: float, ranks: int) -> float:
    """The ramp of an NVLS all-reduce of ``buffer`` bytes over ``ranks`` GPUs: each GPU reduces
    (``multimem.ld_reduce``) and multicasts its ``1/ranks`` share of the buffer through the
    switches, so the pipeline it fills holds ``buffer / ranks`` bytes. Beyond the 8 GPUs the
    curve was measured on (:data:`MID_SIZE_EFFICIENCY`), it is read at the buffer whose share of
    8 is that: a whole GB200 NVL72 rack (72 GPUs, 18 NVLink switch chips) ramps that much more
    slowly (tests/data/nccl/nvl72.jsonl). Fewer GPUs keep the measured curve: the 5-GPU NVLS
    bus bandwidth of NVIDIA/nccl issue #1455 (420 GB/s at 2-4 GiB) is already below the
    plateau the model gives it, so no faster ramp is measured there."""
    return mid_size_efficiency(buffer * NVLS_CURVE_RANKS / max(ranks, NVLS_CURVE_RANKS))


def level_parts(kind: Kind, buffer: float, n: int, level: Level) -> tuple[float, float]:
    """One collective over ``n`` ranks of one dimension as ``(latency, transfer)`` seconds:
    a measured curve of the dimension for this collective and group size where it has one
    (:class:`MeasuredCurve`), else the algorithm and protocol NCCL's tuner picks
    (:func:`choose`), its latency, and its bytes at its rate times, on an NVLink dimension,
    :func:`mid_size_efficiency` (the part that concurrent traffic on the same links shares,
    see :data:`PORTS`). ``buffer`` as in :func:`level_time`."""
    if n <= 1:
        return 0.0, 0.0
    curve = level.curve(kind.value, n)
    if curve is not None:
        return curve.parts(buffer)
    choice = choose(kind, buffer, n, level)
    if choice.moved == 0:
        return choice.latency, 0.0
    return choice.latency, choice.transfer(ramp(choice, level, n))


def level_time(kind: Kind, buffer: float, n: int, level: Level) -> float:
    """Seconds of one collective over ``n`` ranks of one dimension; ``buffer`` is the full
    buffer (all-gather: the gathered result; all-to-all: this rank's send buffer)."""
    latency, transfer = level_parts(kind, buffer, n, level)
    return latency + transfer


# ---------------------------------------------------------------------------------------------
# Groups that span a node's GPUs and several nodes: NCCL runs one algorithm over all of them
# (NVIDIA/nccl v2.18.5-1 src/graph/tuning.cc, ncclTopoTuneModel), not one per dimension.

INTRA_NODE_LINKS = ("nvlink", "pcie")
"""Link kinds that join the GPUs of one node (NCCL's intra-node hardware, ``intraHw``)."""

NET_OVERHEAD_S = 1.0e-6
"""NCCL's network post overhead (tuning.cc ``getNetOverhead``: 1 us on Intel and other x86
CPUs, 2 us on AMD), three times over for Simple: a ring step inside a multi-node ring takes at
least that long (``intraLat = std::max(intraLat, netOverhead)``)."""

RING_PLATEAU = 1.4
"""tuning.cc ``ncclTopoGetAlgoTime``: a multi-node Simple ring all-reduce's latency times 1.4
on sm80 and newer ("Plateau effect of ring"; 1.9 before sm80)."""

NVLS_TREE_STEP_RATIO = 19.0 / 14.0
"""tuning.cc ``hwLat``: NVLSTree's network step (19 us) over the Simple ring's (14 us); NVLSTree
adds ``2 (nNodes - 1)`` of them to its 23 us ``baseLat``."""

NVLS_TREE_EFFICIENCY = 0.70
"""The fraction of the inter-node bandwidth NCCL's tuner gives NVLSTree (tuning.cc: ``ratio =
.70 * nNodes / (2*(nNodes-1))``, the rest of the ratio being the tree's bytes per node)."""


@dataclass(frozen=True)
class Spanning:
    """One of NCCL's algorithms over a group spanning ``local`` GPUs of a node and several
    nodes: its latency, the bytes each GPU moves over its intra-node link (``moved``, the ramp's
    argument) and, per network dimension, the seconds its bytes take there at the saturated
    rate (``seconds``). The dimensions stream at once (NCCL pipelines every chunk through the
    intra-node and the inter-node hops), so the slowest sets the pace."""

    algorithm: Algorithm
    protocol: Protocol
    latency: float
    moved: float
    seconds: tuple[tuple[int, float], ...]

    @property
    def bottleneck(self) -> int:
        """The dimension whose bytes take longest."""
        return max(self.seconds, key=lambda item: item[1])[0]

    def saturated(self) -> float:
        """Seconds of the bytes at the saturated rates."""
        return max(seconds for _, seconds in self.seconds)

    def tuner_time(self) -> float:
        return self.latency + self.saturated()


def _spanned(
    kind: Kind, shape: Sequence[int], levels: Sequence[Level]
) -> tuple[int, list[int]] | None:
    """The intra-node dimension and the network dimensions a group spans, where NCCL runs one
    algorithm over all of them: the innermost spanned dimension joins a node's GPUs, every other
    spanned one is a network (``link`` set), and none of them carries a measured curve of the
    collective (a measured curve replaces the model of its own dimension)."""
    if kind not in (Kind.ALL_REDUCE, Kind.REDUCE_SCATTER, Kind.ALL_GATHER):
        return None
    spanned = [i for i, n in enumerate(shape) if n > 1 and i < len(levels)]
    if len(spanned) < 2 or levels[spanned[0]].link not in INTRA_NODE_LINKS:
        return None
    if any(levels[i].link != "network" for i in spanned[1:]):
        return None
    if any(level.curve(kind.value, shape[i]) for i, level in enumerate(levels[: len(shape)])):
        return None
    return spanned[0], spanned[1:]


def spanning_candidates(
    kind: Kind, buffer: float, shape: Sequence[int], levels: Sequence[Level]
) -> list[Spanning]:
    """NCCL's algorithms for a group over ``shape`` that spans a node's GPUs and several nodes
    (none where it does not: :func:`collective_time` then runs the dimensions one by one).
    ``buffer`` as in :func:`level_time`. With ``local`` GPUs per node, ``nodes`` nodes and
    ``n = local · nodes`` ranks; one NIC per GPU (the presets' DGX nodes), so a node's NICs carry
    ``local`` times the network dimension's per-GPU bandwidth (the slowest network dimension
    spanned, e.g. an oversubscribed spine):

    - *ring* over all ``n`` ranks: each GPU moves the bus bytes over its intra-node link, and a
      node's NICs together carry the same bus bytes (each of NCCL's channels leaves the node
      once: the NIC bandwidth is shared by the ring's channels). Latency as NCCL's tuner:
      ``nsteps - nInterSteps`` intra-node steps (at least the network post overhead) and
      ``nInterSteps`` network steps (all-reduce ``2 nodes``, reduce-scatter and all-gather
      ``nodes - 1``), the Simple all-reduce's times :data:`RING_PLATEAU`;
    - *tree* (all-reduce): a chain through the node's GPUs and a double binary tree between
      nodes; each GPU moves ``2 S`` over its intra-node link and a node's NICs carry
      ``2 (nodes-1)/nodes · S`` (``S`` up and down between two nodes, ``2 S`` through an
      interior node of a large tree: the search gives 2-node trees up to twice the inter-node
      bandwidth inside the node, src/graph/search.cc); NCCL's multi-node tree bandwidths
      (``.92``, LL ``/3.8``, LL128 ``120/128``) and ``treeCorrectionFactor``; latency
      ``2 ((local-1) intraLat + log2(nodes) interLat)``;
    - *NVLSTree* (all-reduce, Simple; NVLink SHARP nodes of three GPUs or more): NVLS inside each
      node (``S`` at the switch's reduction rate, as on one node) and the tree between nodes
      (``2 (nodes-1)/nodes · S`` through each node's NICs at :data:`NVLS_TREE_EFFICIENCY` of
      their bandwidth); ``23 us + 2 (nodes-1)`` network steps of NVLSTree
      (:data:`NVLS_TREE_STEP_RATIO`);
    - *all-to-all*: :func:`all_to_all_spanning`.
    """
    if kind is Kind.ALL_TO_ALL:
        return all_to_all_spanning(buffer, shape, levels)
    span = _spanned(kind, shape, levels)
    if span is None:
        return []
    inner_index, outer = span
    inner = levels[inner_index]
    local = shape[inner_index]
    nodes = math.prod(shape[i] for i in outer)
    net_index = min(outer, key=lambda i: levels[i].bandwidth)
    net = levels[net_index]
    n = local * nodes
    node_nics = local * net.bandwidth
    intra_link = inner.link or "nvlink"

    def timed(
        inner_bytes: float, inner_rate: float, net_bytes: float, net_rate: float
    ) -> tuple[tuple[int, float], ...]:
        """Seconds of the intra-node and of the inter-node bytes, by dimension."""
        return ((inner_index, inner_bytes / inner_rate), (net_index, net_bytes / net_rate))

    choices: list[Spanning] = []
    if kind is Kind.ALL_REDUCE:
        nsteps, inter_steps = 2 * (n - 1), 2 * nodes
    else:
        nsteps, inter_steps = n - 1, nodes - 1
    bus = bus_factor(kind, n) * buffer
    for proto in PROTOCOLS:
        overhead = NET_OVERHEAD_S * (3 if proto is SIMPLE else 1)
        intra_step = max(inner.latency * proto.step_ratio[intra_link], overhead)
        inter_step = net.latency * proto.step_ratio["network"]
        latency = proto.ring_base_s + (nsteps - inter_steps) * intra_step + inter_steps * inter_step
        if kind is Kind.ALL_REDUCE and proto is SIMPLE:
            latency *= RING_PLATEAU
        rate = proto.bandwidth
        seconds = timed(bus, inner.bandwidth * rate, bus, node_nics * rate)
        choices.append(Spanning(Algorithm.RING, proto, latency, bus, seconds))
        if kind is not Kind.ALL_REDUCE:
            continue
        factor = proto.tree_bandwidth["network"] * tree_correction(proto, buffer)
        intra_tree = inner.latency * proto.tree_step_ratio[intra_link]
        inter_tree = net.latency * proto.tree_step_ratio["network"]
        latency = proto.tree_base_s + 2 * (
            (local - 1) * intra_tree + int(math.log2(nodes)) * inter_tree
        )
        between = 2 * (nodes - 1) / nodes * buffer
        seconds = timed(2 * buffer, inner.bandwidth * factor, between, node_nics * factor)
        choices.append(Spanning(Algorithm.TREE, proto, latency, 2 * buffer, seconds))
    nvls = inner.link == "nvlink" and inner.sharp_efficiency > 0 and local >= NVLS_MIN_RANKS
    if kind is Kind.ALL_REDUCE and nvls:
        switch_rate = inner.line_bandwidth * inner.sharp_efficiency
        between = 2 * (nodes - 1) / nodes * buffer
        seconds = timed(buffer, switch_rate, between, node_nics * NVLS_TREE_EFFICIENCY)
        latency = NVLS_LATENCY_S + 2 * (nodes - 1) * net.latency * NVLS_TREE_STEP_RATIO
        choices.append(Spanning(Algorithm.NVLS_TREE, SIMPLE, latency, buffer, seconds))
    return choices


def all_to_all_spanning(
    buffer: float, shape: Sequence[int], levels: Sequence[Level]
) -> list[Spanning]:
    """NCCL's all-to-all over a group that leaves the node through the GPU's NIC and spans
    several GPUs of the node too, or several network dimensions (a rail and the spine): one
    group of a send and a receive per peer, all at once, not a collective per dimension. Each
    GPU keeps ``1/n`` of its buffer ``S``, sends ``(local-1)/n · S`` over its intra-node link and
    ``(n-local)/n · S`` through its own NIC whichever network dimension the peer is across (the
    rail and the spine go through that NIC, :data:`PORTS`), at the slowest network dimension
    spanned; both links stream at once, one step of latency. All peers at once is NCCL's
    schedule (NVIDIA/nccl v2.27.7-1): ``scheduleP2pTasksToPlan`` (src/enqueue.cc) fills one
    kernel plan with every round its work budget holds, ``ncclP2pChannelBaseForRound``
    (src/include/channel.h) gives the GPUs of each destination node a channel of their own, and
    a channel runs ``NCCL_MAX_DEV_WORK_P2P_PER_BATCH`` (8, src/include/device.h) peers at once,
    so no round of peers waits for another. An NCCL maintainer's rule,
    NVIDIA/nccl-tests issue #130: the bus bandwidth is the network bandwidth per GPU with one
    GPU per node and ``N/(N-1)`` times it over ``N`` nodes of several GPUs. Empty for a group on
    one dimension (:func:`level_parts` prices it), over a plain alpha-beta link, or over a
    dimension with a measured all-to-all curve."""
    spanned = [i for i, n in enumerate(shape) if n > 1 and i < len(levels)]
    measured = enumerate(levels[: len(shape)])
    if any(level.curve(Kind.ALL_TO_ALL.value, shape[i]) for i, level in measured):
        return []
    inner = [i for i in spanned[:1] if levels[i].link in INTRA_NODE_LINKS]
    outer = spanned[len(inner) :]
    if not outer or any(levels[i].link != "network" for i in outer):
        return []
    if not inner and len(outer) < 2:
        return []
    local = shape[inner[0]] if inner else 1
    n = local * math.prod(shape[i] for i in outer)
    net_index = min(outer, key=lambda i: levels[i].bandwidth)
    net = levels[net_index]
    seconds = [(net_index, (n - local) / n * buffer / net.bandwidth)]
    latency = net.latency
    if inner:
        intra = levels[inner[0]]
        seconds.insert(0, (inner[0], (local - 1) / n * buffer / intra.bandwidth))
        latency = max(intra.latency, net.latency)
    return [Spanning(Algorithm.P2P, SIMPLE, latency, (n - 1) / n * buffer, tuple(seconds))]


def spanning_byte_rate(kind: Kind, shape: Sequence[int], levels: Sequence[Level]) -> float | None:
    """Bytes/s each GPU moves through its own links while a ring, tree or NVLSTree spans the
    node's GPUs and several nodes (:func:`spanning_candidates`), alone on its links; ``None``
    for any other collective or group. Every GPU of such a ring forwards the bus bytes over its
    NVLinks at the pace the node's ``local`` NICs allow together, so it moves
    ``min(intra-node bandwidth, local · NIC bandwidth)``: the whole node's NIC rate, where a
    group with one GPU per node moves one NIC's."""
    if kind not in (Kind.ALL_REDUCE, Kind.REDUCE_SCATTER, Kind.ALL_GATHER):
        return None
    span = _spanned(kind, shape, levels)
    if span is None:
        return None
    inner_index, outer = span
    network = min(levels[i].bandwidth for i in outer)
    return min(levels[inner_index].bandwidth, shape[inner_index] * network)


def spanning_parts(
    kind: Kind,
    buffer: float,
    shape: Sequence[int],
    levels: Sequence[Level],
    algorithm: Algorithm | None = None,
    protocol: Protocol | None = None,
) -> tuple[int, float, float] | None:
    """The algorithm NCCL runs over a group spanning a node's GPUs and several nodes, as
    ``(bottleneck dimension, latency, transfer)`` seconds: the fastest of
    :func:`spanning_candidates` (NCCL's tuner weighs the same latencies and bandwidths), or of
    those of ``algorithm`` and ``protocol`` where given (a run that sets ``NCCL_ALGO`` or
    ``NCCL_PROTO``), its bytes at :func:`mid_size_efficiency` of what each GPU moves over its
    NVLinks where the protocol pipelines buffer slots (as :func:`ramp`); ``None`` where the
    group does not span nodes that way or has no such candidate."""
    choices = [
        choice
        for choice in spanning_candidates(kind, buffer, shape, levels)
        if algorithm in (None, choice.algorithm) and protocol in (None, choice.protocol)
    ]
    if not choices:
        return None
    best = min(choices, key=Spanning.tuner_time)
    inner = next(levels[i] for i, n in enumerate(shape) if n > 1)
    pipelined = best.protocol is not LL and best.algorithm is not Algorithm.P2P
    efficiency = mid_size_efficiency(best.moved) if pipelined and inner.link == "nvlink" else 1.0
    return best.bottleneck, best.latency, best.saturated() / efficiency


def collective_time(
    kind: Kind, size: float, shape: Sequence[int], levels: Sequence[Level]
) -> float:
    """Seconds of a collective over a group spanning ``shape[i]`` ranks of network dimension
    ``i`` (inner first). ``size`` follows the Chakra convention: all-gather this rank's input
    shard; reduce-scatter and all-reduce the full buffer; all-to-all this rank's buffer.

    A group spanning several GPUs of several nodes runs one NCCL algorithm over all of them
    (:func:`spanning_parts`). Otherwise hierarchical: reduce-scatter runs inner to outer, each
    dimension on the shard left by the inner ones; all-gather the same sizes outer to inner;
    all-reduce is a reduce-scatter and an all-gather per dimension except where an all-reduce of
    the dimension's shard is faster (a tree, or the switch's in-network reduction); all-to-all
    and broadcast move their buffer over every dimension they span."""
    members = math.prod(shape) if shape else 1
    if members <= 1:
        return 0.0
    buffer = float(size) * members if kind is Kind.ALL_GATHER else float(size)
    spanning = spanning_parts(kind, buffer, shape, levels)
    if spanning is not None:
        return spanning[1] + spanning[2]
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
    """One point-to-point transfer over a dimension (see :func:`send_parts`)."""
    latency, transfer = send_parts(size, level)
    return latency + transfer


def send_parts(size: float, level: Level) -> tuple[float, float]:
    """A send as ``(latency, transfer)`` seconds: a measured ``send_recv`` curve of the
    dimension where it has one, else one step of the Simple protocol (the dimension's
    ``latency_us``; NCCL's tuner gives a point-to-point operation no base latency: ``baseLat``
    prices the ring and tree collectives only) and the bytes at the dimension's bandwidth, with
    no ramp (:func:`ramp`)."""
    curve = next((c for c in level.measured if c.collective == "send_recv"), None)
    if curve is not None:
        return curve.parts(size)
    return level.latency, size / level.bandwidth


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
    transfers add up to it): an algorithm over whole nodes (:func:`spanning_parts`) as one
    phase on its bottleneck dimension; a reduce-scatter from the innermost dimension outwards, an
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
    spanning = spanning_parts(kind, buffer, shape, levels)
    if spanning is not None:
        return (Phase(*spanning),)
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
    "MEASURED_COLLECTIVES",
    "PORTS",
    "PROTOCOLS",
    "Algorithm",
    "Choice",
    "Kind",
    "Level",
    "MeasuredCurve",
    "Phase",
    "Spanning",
    "all_to_all_spanning",
    "bus_bandwidth",
    "bus_factor",
    "candidates",
    "choose",
    "collective_phases",
    "collective_time",
    "level_parts",
    "level_time",
    "mid_size_efficiency",
    "nccl_nvls_rate",
    "port",
    "ramp",
    "ring_ramp",
    "send_parts",
    "send_time",
    "spanning_byte_rate",
    "spanning_candidates",
    "spanning_parts",
]
