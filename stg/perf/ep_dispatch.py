"""Expert-parallel token dispatch through DeepEP or HybridEP instead of NCCL's all-to-all.

NCCL's all-to-all (Megatron-core's ``alltoall`` token dispatcher, stg's default) sends every
routed copy of a token: ``k`` rows per token, two of them to the same rank if two of its
experts live there. DeepEP and HybridEP (Megatron-core's flex dispatcher backends, NeMo
AutoModel's ``dispatcher``) send a token once per destination rank inside an NVLink domain
and once per destination node across the network, where the peer with the same local rank
fans it out over NVLink (described, and stated to be the same for both libraries, in
NVIDIA-NeMo/Automodel ``docs/deepep_vs_hybridep_benchmark.md`` at 18007663a8, section 5.4;
DeepEP's ``tests/test_internode.py`` at v1.2.1 counts a token's RDMA traffic once per
destination node). Their kernels move
the deduplicated bytes at rates of their own, measured on H100s (:data:`KERNEL_RATES`).

The model, per all-to-all node (:func:`dispatch_phases`):

- ``comm_size`` is NCCL's buffer, ``k`` rows per token (with any capacity padding); with
  ``k`` of ``E`` experts routed uniformly at random (a balanced router; the report's kernel
  measurements route by random scores), a token reaches
  ``D(n) = n·(1 - C(E - E/n, k) / C(E, k))`` of ``n`` equal holders of the experts on average
  (:func:`distinct_holders`), so DeepEP moves ``comm_size · D(n) / k``, the rows of every
  rank of the group to each rank;
- inside one NVLink domain: those bytes at the library's NVLink rate; across ``N`` domains:
  ``comm_size · D(N) / k`` at its RDMA rate (every (token, node) pair, the own node's included,
  as DeepEP's tests count RDMA bytes: ``tests/test_internode.py`` at v1.2.1,
  ``num_rdma_token_sent``), or the NVLink bytes at the NVLink rate if that takes longer;
- a rate is per direction (``dispatch``: tokens to their experts; ``combine``: back, reduced
  by the gate weights), per transport dtype (bf16, or fp8 with ``fp8_dispatch``) and per SM
  budget (``moe_dispatcher_sms``; Megatron-core's defaults otherwise, :data:`DEFAULT_SMS`),
  interpolated linearly in the SMs and in the hidden size between the measured points
  (hidden 2048 and 7168) and held constant outside them;
- where a token's experts fall (``moe_gate``): uniformly at random, or ``k`` consecutive
  experts (NeMo AutoModel's fake balanced gate), which reach
  :func:`consecutive_holders` ranks or nodes;
- on a system other than an H100, each rate scales with the line bandwidth of the link it
  crosses against the ``h100-80g`` preset's (NVLink 450 GB/s, NIC 50 GB/s per direction): an
  assumption (the libraries' kernels are link-bound near the rates measured), no measurement;
- no latency apart: the rates are whole-kernel rates of 4096-token dispatches, which include
  it. Not modelled: DeepEP's layout kernel and host wait before a forward dispatch (~39 and
  ~35 us per MoE layer, the report's section 3.1), the permutation kernels either library
  runs around the transfer (stg prices the dispatch and combine ops of the layer as it does
  for every dispatcher), and expert-load imbalance in the deduplication (a dropless plan's
  capacity padding scales the bytes as it scales NCCL's).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from stg.core.routing import (
    DISPATCHER_ATTR,
    EP_EXPERTS_ATTR,
    EP_GATE_ATTR,
    EP_HIDDEN_ATTR,
    EP_KEXPERTS_ATTR,
    EP_ROUTE_ATTR,
    EP_SMS_ATTR,
    GATES,
    NCCL_DISPATCHER,
    RANDOM_GATE,
)
from stg.errors import TraceError, UserError
from stg.perf.system import System, load_system

REFERENCE_SYSTEM = "h100-80g"
"""The preset whose links the measured rates were taken on (DGX-class H100 SXM: NVLink 4 over
NVSwitch, one 400 Gb/s ConnectX-7 per GPU), as the report's section 2 states its cluster."""

KERNEL_RATES: dict[tuple[str, str, str, str], dict[int, dict[int, float]]] = {
    # (library, link, direction, transport dtype) -> {hidden: {SMs: bytes/s}}, in DeepEP's
    # tests' accounting (NVLink: the rows a rank receives, deduplicated per rank, its own
    # included; RDMA: (token, node) pairs, the own node's included). NVIDIA-NeMo/Automodel
    # docs/deepep_vs_hybridep_benchmark.md at 18007663a8 (H100 80GB SXM, CX7 400 Gb/s;
    # DeepEP v1.2.1, HybridEP hybrid-ep@17cfb81; 4096 tokens per rank, top-8): NVLink over
    # EP 8 (sections 3.1 and 3.3), RDMA over EP 16 on 2 nodes (sections 3.2 and 3.3).
    ("deepep", "nvlink", "dispatch", "bf16"): {
        2048: {8: 139e9, 24: 302e9},
        7168: {8: 168e9, 16: 322e9, 24: 335e9, 32: 308e9},
    },
    ("deepep", "nvlink", "dispatch", "fp8"): {
        2048: {8: 80e9, 24: 210e9},
        7168: {8: 148e9, 16: 282e9, 24: 323e9, 32: 315e9},
    },
    ("deepep", "nvlink", "combine", "bf16"): {
        2048: {8: 134e9, 24: 287e9},
        7168: {8: 151e9, 16: 284e9, 24: 326e9, 32: 322e9},
    },
    ("deepep", "rdma", "dispatch", "bf16"): {2048: {24: 58.9e9}, 7168: {24: 84.9e9}},
    ("deepep", "rdma", "dispatch", "fp8"): {2048: {24: 36.2e9}, 7168: {24: 79.5e9}},
    ("deepep", "rdma", "combine", "bf16"): {2048: {24: 59.1e9}, 7168: {24: 68.2e9}},
    ("hybridep", "nvlink", "dispatch", "bf16"): {
        2048: {8: 304e9, 24: 325e9},
        7168: {4: 197e9, 8: 360e9, 16: 362e9, 24: 367e9},
    },
    ("hybridep", "nvlink", "dispatch", "fp8"): {
        2048: {8: 205e9, 24: 272e9},
        7168: {4: 189e9, 8: 352e9, 16: 358e9, 24: 358e9},
    },
    ("hybridep", "nvlink", "combine", "bf16"): {
        2048: {8: 188e9, 24: 304e9},
        7168: {4: 222e9, 8: 344e9, 16: 357e9, 24: 364e9},
    },
    ("hybridep", "rdma", "dispatch", "bf16"): {2048: {8: 65.3e9, 24: 72.1e9}, 7168: {8: 85.7e9}},
    ("hybridep", "rdma", "dispatch", "fp8"): {2048: {8: 42.0e9, 24: 61.4e9}, 7168: {8: 81.6e9}},
    ("hybridep", "rdma", "combine", "bf16"): {2048: {8: 33.5e9, 24: 49.3e9}, 7168: {8: 76.5e9}},
}

ARCHS: Mapping[str, tuple[str, ...]] = {
    "deepep": ("ampere", "hopper", "blackwell", "cdna3", "cdna4"),
    "hybridep": ("hopper", "blackwell"),
}
"""GPU architectures each library's kernels run on: DeepEP's README (Requirements: "Ampere
(SM80), Hopper (SM90) GPUs, or other architectures with SM90 PTX ISA support"), and AMD's
Instinct GPUs through ROCm's port of DeepEP (its README: "preliminary AMD GPU (ROCm)
enablement", xGMI inside a node; which CDNA generations it builds for is not stated, so both
are allowed); HybridEP moves tokens with the Tensor Memory Accelerator (DeepEP
``docs/README_Hybrid-EP.md``: "TMA instructions"), which Hopper introduced."""

DEFAULT_SMS = {"deepep": 20, "hybridep": 16}
"""SMs a library's kernels get where the run does not say (``moe_dispatcher_sms``):
Megatron-core's defaults, ``moe_deepep_num_sms = 20`` and ``moe_hybridep_num_sms = 16``
(``megatron/core/transformer/transformer_config.py``)."""

WIDE_TRANSPORT = frozenset({"bf16", "fp16", "fp32"})
"""Node dtypes that dispatch at the bf16 rates; any narrower one (``fp8_dispatch``: the
recipe's quantized copies) at the fp8 rates."""


def distinct_holders(holders: int, experts: int, kexperts: int) -> float:
    """Expected distinct holders among ``holders`` equal holders of ``experts`` experts that
    a token routed to ``kexperts`` distinct experts uniformly at random reaches:
    ``holders · (1 - C(E - E/holders, k) / C(E, k))``."""
    if holders <= 1:
        return 1.0
    others = experts - experts / holders
    missed = 1.0
    for i in range(kexperts):
        missed *= max(others - i, 0.0) / (experts - i)
    return holders * (1.0 - missed)


@functools.cache
def consecutive_holders(holders: int, experts: int, kexperts: int) -> float:
    """Mean distinct holders among ``holders`` holders of consecutive blocks of
    ``experts / holders`` experts that a token reaches when token ``t`` takes experts ``t·k``
    to ``t·k + k - 1`` modulo ``E`` (``moe_gate`` consecutive), over the token positions of
    one cycle."""
    if holders <= 1:
        return 1.0
    block = experts / holders
    starts = experts // math.gcd(experts, kexperts)
    reached = 0
    for t in range(starts):
        first = t * kexperts % experts
        reached += len({int(((first + j) % experts) // block) for j in range(kexperts)})
    return reached / starts


def holders_reached(gate: str, holders: int, experts: int, kexperts: int) -> float:
    """:func:`distinct_holders` or :func:`consecutive_holders`, as ``gate`` places experts."""
    if gate == RANDOM_GATE:
        return distinct_holders(holders, experts, kexperts)
    return consecutive_holders(holders, experts, kexperts)


def _between(points: Mapping[int, float], x: float) -> float:
    """Piecewise-linear through ``points`` (x: value), constant beyond the first and last."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    if x >= xs[-1]:
        return points[xs[-1]]
    upper = next(i for i, v in enumerate(xs) if v >= x)
    a, b = xs[upper - 1], xs[upper]
    return points[a] + (points[b] - points[a]) * (x - a) / (b - a)


def kernel_rate(
    library: str, link: str, direction: str, transport: str, hidden: int, sms: int
) -> float:
    """The measured rate of ``library``'s kernel over ``link`` (bytes/s, H100) for rows of
    ``hidden`` elements on ``sms`` SMs: piecewise-linear in the SMs through each measured
    shape's points, then linear in the hidden size between the two shapes
    (2048 and 7168), constant beyond the measured ranges."""
    if transport != "bf16" and direction == "combine":
        transport = "bf16"  # combines run in bf16 (the report: FP8 dispatch, BF16 combine)
    shapes = KERNEL_RATES[(library, link, direction, transport)]
    at = {h: _between(by_sms, sms) for h, by_sms in shapes.items()}
    return _between(at, hidden)


def _line(dim: Any) -> float:
    return dim.bandwidth / getattr(dim, "oversubscription", 1.0)


@functools.cache
def _reference_lines() -> tuple[float, float]:
    network = load_system(REFERENCE_SYSTEM).network
    nvlink = next(d for d in network if getattr(d, "link", None) == "nvlink")
    nic = next(d for d in network if getattr(d, "link", None) == "network")
    return _line(nvlink), _line(nic)


Route = tuple[str, str, int, int, int, str, int]
"""(library, direction, k, E, hidden, gate, SMs) of a dispatch: :func:`routed`."""


def routed(attrs: Mapping[str, Any] | None) -> Route | None:
    """(library, direction, k, E, hidden, gate, SMs) of an expert-parallel all-to-all that a
    DeepEP-class dispatcher runs (its typed attributes, :mod:`stg.core.routing`), else
    None."""
    if not attrs:
        return None
    library = attrs.get(DISPATCHER_ATTR)
    if library is None or library == NCCL_DISPATCHER:
        return None
    try:
        route: Route = (
            str(library),
            str(attrs[EP_ROUTE_ATTR]),
            int(attrs[EP_KEXPERTS_ATTR]),
            int(attrs[EP_EXPERTS_ATTR]),
            int(attrs[EP_HIDDEN_ATTR]),
            str(attrs.get(EP_GATE_ATTR, RANDOM_GATE)),
            int(attrs.get(EP_SMS_ATTR) or DEFAULT_SMS[str(library)]),
        )
    except (KeyError, TypeError, ValueError):
        route = None
    if (
        route is None
        or route[0] not in DEFAULT_SMS
        or route[1] not in ("dispatch", "combine")
        or route[5] not in GATES
        or min(route[2:5]) <= 0
        or route[6] <= 0
    ):
        raise TraceError(
            f"an all-to-all marked {DISPATCHER_ATTR}={library!r} lacks valid routing attributes "
            f"({EP_ROUTE_ATTR} dispatch|combine, {EP_KEXPERTS_ATTR}, {EP_EXPERTS_ATTR}, "
            f"{EP_HIDDEN_ATTR} > 0; library one of {', '.join(DEFAULT_SMS)})"
        )
    return route


def check_arch(library: str, system: System) -> None:
    """Raise :class:`UserError` where ``system``'s GPUs cannot run ``library``'s kernels
    (:data:`ARCHS`)."""
    if library in ARCHS and system.arch not in ARCHS[library]:
        raise UserError(
            f"moe_dispatcher={library} runs on {', '.join(ARCHS[library])} GPUs: system "
            f"{system.name!r} has {system.arch} GPUs; allowed there: moe_dispatcher=alltoall"
        )


def dispatch_phases(
    route: Route,
    comm_size: int,
    transport: str | None,
    shape: Sequence[int],
    system: System,
) -> tuple[tuple[str, float, float], ...]:
    """The transfer of one dispatch or combine (``route``: :func:`routed`) of ``comm_size``
    bytes (NCCL's buffer) over a group spanning ``shape`` (ranks per network dimension, inner
    first) as one phase ``(port, latency, transfer)`` on the link that bounds it (``nvlink``
    inside an NVLink domain, ``nic`` across domains), as
    :func:`stg.perf.costs.collective_phases` writes phases. Empty for a group of one rank."""
    library, direction, kexperts, experts, hidden, gate, sms = route
    members = math.prod(shape) if shape else 1
    if members <= 1:
        return ()
    check_arch(library, system)
    kind = "bf16" if transport is None or transport in WIDE_TRANSPORT else "fp8"
    network = system.network
    spanned = [i for i, n in enumerate(shape) if n > 1 and i < len(network)]
    inner = spanned[0]
    inner_dim = network[inner]
    within = getattr(inner_dim, "link", None) == "nvlink"
    for i in spanned:
        link = getattr(network[i], "link", None)
        if link != "network" and not (i == inner and within):
            kind_of = f"a {link} link" if link else "a link of no declared kind"
            raise UserError(
                f"moe_dispatcher={library} moves tokens over NVLink inside a node and RDMA "
                f"between nodes: system {system.name!r} joins its GPUs over "
                f"{network[i].name!r} ({kind_of}); allowed there: moe_dispatcher=alltoall"
            )
    local = shape[inner] if within else 1
    domains = members // local
    ref_nvlink, ref_nic = _reference_lines()
    per_rank = comm_size / kexperts
    seconds: list[tuple[str, float]] = []
    if local > 1:
        # the rows a rank receives over NVLink come from every rank of the group
        rate = kernel_rate(library, "nvlink", direction, kind, hidden, sms)
        rate *= _line(inner_dim) / ref_nvlink
        reached = holders_reached(gate, members, experts, kexperts)
        seconds.append(("nvlink", per_rank * reached / rate))
    if domains > 1:
        outer = [network[i] for i in spanned if i != inner or not within]
        slowest = min(outer, key=_line)
        rate = kernel_rate(library, "rdma", direction, kind, hidden, sms)
        rate *= _line(slowest) / ref_nic
        pairs = holders_reached(gate, domains, experts, kexperts)
        seconds.append(("nic", per_rank * pairs / rate))
    port, transfer = max(seconds, key=lambda s: s[1])
    return ((port, 0.0, transfer),)


__all__ = [
    "ARCHS",
    "DEFAULT_SMS",
    "KERNEL_RATES",
    "REFERENCE_SYSTEM",
    "WIDE_TRANSPORT",
    "Route",
    "check_arch",
    "consecutive_holders",
    "dispatch_phases",
    "distinct_holders",
    "holders_reached",
    "kernel_rate",
    "routed",
]
