"""System descriptions for predictors: compute, memory and network of one GPU cluster.

A system is a JSON object (stdlib ``json``; no YAML dependency). Units are in the key names::

    {
      "name": "a100-80g",
      "description": "NVIDIA DGX A100 80GB: 8 GPUs per node, NVLink 3, 8x HDR 200 Gb/s",
      "peak_tflops": {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312,
                      "fp8": 312, "int8": 624},
      "hbm_gbps": 2039,
      "hbm_gib": 80,
      "compute_efficiency": {"gemm": 0.8, "attention": 0.6, "other": 0.8},
      "memory_efficiency": 0.8,
      "kernel_overhead_us": 2.0,
      "sm_count": 108, "peak_clock_ghz": 1.41, "sustained_clock_ghz": 1.41, "arch": "ampere",
      "network": [
        {"name": "nvlink", "size": 8, "bandwidth_gbps": 300, "latency_us": 1.0,
         "efficiency": 0.75},
        {"name": "infiniband", "size": 0, "bandwidth_gbps": 25, "latency_us": 3.0,
         "efficiency": 0.9}
      ]
    }

- ``peak_tflops``: dense (not 2:4-sparse) peak per dtype, in 10^12 operations per second.
  A dtype without hardware support (fp8 on A100) lists the rate its kernels actually run at.
  ``fp6`` and ``fp4`` are optional: only GPUs whose tensor cores have them (Blackwell,
  CDNA 4) list them.
- ``hbm_gbps`` (10^9 B/s) and ``hbm_gib`` (2^30 B): device memory bandwidth and capacity.
- ``compute_efficiency``: the fraction of peak a compute-bound op of that class sustains;
  ``memory_efficiency`` the fraction of ``hbm_gbps`` a memory-bound op sustains;
  ``kernel_overhead_us``: fixed cost per compute op (launch and tail).
- ``sm_count``, ``peak_clock_ghz`` (the clock the tensor-core peaks are computed at),
  ``sustained_clock_ghz`` (the SM clock under sustained tensor-core load) and ``arch``
  (``blackwell``, ``hopper``, ``ampere``, ``ada``, ``turing``, ``volta``, or AMD's
  ``cdna3`` and ``cdna4``: whose attention kernels apply; ``sm_count`` counts AMD's compute
  units)
  describe the GPU for the kernel models of :mod:`stg.perf.kernel_time`; an H100 SXM's
  values where omitted.
- ``compute_capability`` (optional, NVIDIA's ``"major.minor"``, as ``"9.0"`` or ``"10.3"``):
  which of an architecture's chips it is, where a stack's choice depends on it (eager
  PyTorch's attention, :func:`stg.perf.kernel_time.attention_kernel_for`).
- ``tdp_w`` (W): the board power (data-sheet TDP) at which ``sustained_clock_ghz`` holds;
  ``power_limit_w`` (W, optional): a lower power cap (``nvidia-smi -pl``), which lowers the
  sustained clock and so the compute-bound rates (:mod:`stg.perf.power`).
- ``network``: dimensions innermost first. ``size`` is the number of ranks along the
  dimension (0 = as many as needed: only the outermost dimension may say so);
  ``bandwidth_gbps`` is per GPU per direction (10^9 B/s); ``latency_us`` the per-step latency
  (alpha); ``efficiency`` the fraction of bandwidth collectives achieve. Global rank ``r``
  sits at coordinate ``r % size0`` of the first dimension, ``(r // size0) % size1`` of the
  second, and so on. The first dimension is the scale-up domain (an NVLink node of 8, a
  rack-scale NVLink domain of 72): ranks fill it first. Optional per dimension: ``link``,
  ``oversubscription``, ``sharp_efficiency`` and ``measured`` (curves from ``stg bench comms``:
  :class:`stg.perf.comm_time.MeasuredCurve`), see :mod:`stg.perf.comm_time`.
- ``host_link_gbps`` (optional, 10^9 B/s): what one GPU copies to or from host memory per
  direction while every GPU of its host copies at once (CPU activation offload, a serving
  engine's swap): a GB200/GB300 NVL72 superchip's NVLink-C2C to its Grace, shared by its two
  GPUs. Where omitted, the architecture's PCIe x16 (:data:`HOST_LINK_BYTES_PER_S`).
- ``sources`` (optional): where each figure comes from, by key (presets cite their data
  sheets here; ``stg inspect system NAME --json`` shows them).

Built-in presets: ``a100-80g``, ``h100-80g``, ``h200-141g``, ``h800-80g``, and the GPUs of
hybrid clusters ``v100-32g``, ``t4-16g``, ``a10-24g``, ``l4-24g``, ``l40s-48g``, ``a100-40g``
(:mod:`stg.perf.devices`), ``h20-96g``, and the accelerators of 2025-26 ``b200-180g``,
``b300-288g``, ``gb200-nvl72``, ``gb300-nvl72``, ``mi300x-192g``, ``mi325x-256g``,
``mi355x-288g`` (:mod:`stg.perf.accelerators`). A file with ``groups`` describes a hybrid cluster
(:mod:`stg.perf.hybrid`). :func:`load_system` accepts a preset name or the path of a JSON file.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stg.errors import UnknownNameError, UserError
from stg.perf.accelerators import ACCELERATOR_PRESETS
from stg.perf.comm_time import LINKS, MeasuredCurve
from stg.perf.devices import DEVICE_PRESETS
from stg.perf.kernel_time import FUSED_ATTENTION, Gpu
from stg.perf.power import MIN_POWER_LIMIT_FRACTION, clock_under_power_limit

DTYPES: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")
"""Dtypes a system must give a peak rate for."""

LOW_PRECISION_DTYPES: tuple[str, ...] = ("fp6", "fp4")
"""Dtypes a system may give a peak rate for: those of GPUs whose tensor cores have them
(Blackwell, CDNA 4); a system without one has no such rate."""

OP_CLASSES: tuple[str, ...] = ("gemm", "attention", "other")
"""Op classes with their own compute efficiency (see :func:`op_class`)."""

DTYPE_ALIASES: Mapping[str, str] = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "e4m3": "fp8",
    "e5m2": "fp8",
    "e2m1": "fp4",
    "fp4_e2m1": "fp4",
    "float4_e2m1fn": "fp4",
}


class SystemDescriptionError(UserError):
    """A malformed system description."""


@dataclass(frozen=True)
class NetworkDim:
    """One network dimension: ``size`` ranks (0 = unbounded), per-GPU per-direction bandwidth."""

    name: str
    size: int
    bandwidth: float
    """bytes per second per GPU per direction"""
    latency: float
    """seconds per step"""
    efficiency: float = 1.0
    link: str | None = None
    """``nvlink``, ``pcie`` or ``network``: NCCL's low-latency protocols apply (see
    :mod:`stg.perf.comm_time`); None: a plain alpha-beta link"""
    oversubscription: float = 1.0
    """traffic through this dimension's switches gets ``bandwidth / oversubscription``"""
    sharp_efficiency: float = 0.0
    """> 0: the switches reduce in the network (NVLink SHARP, InfiniBand SHARP); an all-reduce
    moves its buffer once each way at this fraction of ``bandwidth``"""
    measured: tuple[MeasuredCurve, ...] = ()
    """collectives measured on this dimension (``stg bench comms``), each replacing the model
    for its collective and group size (:class:`stg.perf.comm_time.MeasuredCurve`)"""

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth * self.efficiency


@dataclass(frozen=True)
class System:
    """A cluster as predictors see it. Rates are in operations, bytes and seconds."""

    name: str
    peak_flops: Mapping[str, float]
    hbm_bandwidth: float
    hbm_capacity: int
    network: tuple[NetworkDim, ...]
    compute_efficiency: Mapping[str, float] = field(
        default_factory=lambda: {c: 1.0 for c in OP_CLASSES}
    )
    memory_efficiency: float = 1.0
    kernel_overhead: float = 0.0
    description: str = ""
    sm_count: int = 132
    peak_clock_ghz: float = 1.83
    sustained_clock_ghz: float = 1.38
    arch: str = "hopper"
    compute_capability: str | None = None
    """NVIDIA's compute capability, ``"major.minor"`` (None: not given)"""
    tdp_w: float = 700.0
    power_limit_w: float | None = None
    host_link: float | None = None
    """bytes/s one GPU copies to or from host memory, per direction, while every GPU of its
    host copies at once (None: its architecture's PCIe, :data:`HOST_LINK_BYTES_PER_S`)"""
    sources: Mapping[str, str] = field(default_factory=dict)
    """where each figure comes from, by key (a preset's data sheets)"""

    @property
    def clock_ghz(self) -> float:
        """The SM clock under sustained tensor-core load at the power limit: the measured
        ``sustained_clock_ghz`` (at the TDP), lowered under a ``power_limit_w`` below the TDP
        (:mod:`stg.perf.power`)."""
        if self.power_limit_w is None:
            return self.sustained_clock_ghz
        return clock_under_power_limit(self.sustained_clock_ghz, self.tdp_w, self.power_limit_w)

    @property
    def power_clock_scale(self) -> float:
        """How much the power limit slows compute-bound (tensor-core) kernels: 1 at the TDP."""
        return self.clock_ghz / self.sustained_clock_ghz

    @property
    def gpu(self) -> Gpu:
        """The GPU as the kernel models of :mod:`stg.perf.kernel_time` see it."""
        return Gpu(
            sm_count=self.sm_count,
            peak_clock_ghz=self.peak_clock_ghz,
            sustained_clock_ghz=self.clock_ghz,
            peak_flops=dict(self.peak_flops),
            hbm_bandwidth=self.hbm_bandwidth,
            arch=self.arch,
            compute_capability=self.compute_capability,
            stream_efficiency=self.memory_efficiency,
        )

    def peak(self, dtype: str | None) -> float:
        """Dense peak operations per second for ``dtype`` (``None`` means bf16); ``fp6`` and
        ``fp4`` where the GPU has them."""
        name = (dtype or "bf16").lower()
        if name in LOW_PRECISION_DTYPES:
            if name not in self.peak_flops:
                have = [d for d in LOW_PRECISION_DTYPES if d in self.peak_flops]
                raise UnknownNameError(
                    f"system {self.name!r} has no {name} tensor cores; its dtypes: "
                    + ", ".join([*DTYPES, *have])
                )
            return self.peak_flops[name]
        return self.peak_flops[normalize_dtype(name)]

    def coordinates(self, rank: int) -> tuple[int, ...]:
        """The coordinate of global rank ``rank`` along each network dimension."""
        coords = []
        for dim in self.network:
            if dim.size:
                coords.append(rank % dim.size)
                rank //= dim.size
            else:
                coords.append(rank)
                rank = 0
        return tuple(coords)

    @property
    def capacity(self) -> int:
        """How many ranks the network holds (0 = unbounded)."""
        if self.network[-1].size == 0:
            return 0
        return math.prod(d.size for d in self.network)

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (the inverse of :func:`system_from_dict`)."""
        return {
            "name": self.name,
            "description": self.description,
            "peak_tflops": {
                d: _num(self.peak_flops[d] / 1e12)
                for d in (*DTYPES, *LOW_PRECISION_DTYPES)
                if d in self.peak_flops
            },
            "hbm_gbps": _num(self.hbm_bandwidth / 1e9),
            "hbm_gib": _num(self.hbm_capacity / 2**30),
            "compute_efficiency": {c: self.compute_efficiency[c] for c in OP_CLASSES},
            "memory_efficiency": self.memory_efficiency,
            "kernel_overhead_us": _num(self.kernel_overhead * 1e6),
            "sm_count": self.sm_count,
            "peak_clock_ghz": self.peak_clock_ghz,
            "sustained_clock_ghz": self.sustained_clock_ghz,
            "arch": self.arch,
            **(
                {}
                if self.compute_capability is None
                else {"compute_capability": self.compute_capability}
            ),
            "tdp_w": _num(self.tdp_w),
            **({} if self.power_limit_w is None else {"power_limit_w": _num(self.power_limit_w)}),
            **({} if self.host_link is None else {"host_link_gbps": _num(self.host_link / 1e9)}),
            "network": [
                {
                    "name": d.name,
                    "size": d.size,
                    "bandwidth_gbps": _num(d.bandwidth / 1e9),
                    "latency_us": _num(d.latency * 1e6),
                    "efficiency": d.efficiency,
                    **_network_extras(d),
                }
                for d in self.network
            ],
            **({"sources": dict(self.sources)} if self.sources else {}),
        }


def _network_extras(dim: NetworkDim) -> dict[str, Any]:
    """The optional keys of a network dimension that differ from their defaults."""
    extras: dict[str, Any] = {}
    if dim.link is not None:
        extras["link"] = dim.link
    if dim.oversubscription != 1.0:
        extras["oversubscription"] = dim.oversubscription
    if dim.sharp_efficiency:
        extras["sharp_efficiency"] = dim.sharp_efficiency
    if dim.measured:
        extras["measured"] = [curve.as_dict() for curve in dim.measured]
    return extras


def _num(value: float) -> float | int:
    rounded = round(value, 9)
    return int(rounded) if rounded == int(rounded) else rounded


def normalize_dtype(dtype: str) -> str:
    """``bfloat16`` -> ``bf16`` etc.; raises :class:`UnknownNameError` for anything else.

    ``fp6`` and ``fp4`` (E2M1, the elements of NVFP4 and MXFP4) are names of what a node may
    compute in: the matmuls of a serving weight format (:mod:`stg.core.quantization`), at the
    system's fp4 peak where it has one (:meth:`System.peak`). They are no workload dtype
    (``--dtype``) and no training precision."""
    name = dtype.lower()
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES and name not in LOW_PRECISION_DTYPES:
        allowed = ", ".join((*DTYPES, *LOW_PRECISION_DTYPES))
        raise UnknownNameError(f"unknown dtype {dtype!r}; allowed: {allowed}")
    return name


ATTENTION_CORE_NAMES = frozenset({"scores", "softmax", "context", "attention", "core_attention"})


def op_class(name: str, num_ops: int, tensor_size: int) -> str:
    """The efficiency class of a compute node, from its name.

    The attention core (the score and context matmuls and the softmax between them, named
    ``scores``, ``softmax``, ``context``, or containing ``flash``/``core_attention``, with
    their gradients ``scores.grad_*`` etc.) runs below GEMM efficiency because its inner
    dimension is one head; other ops with an arithmetic intensity of at least 32 FLOP/B are
    GEMMs; the rest are elementwise/reductions (``other``).
    """
    base = name.rsplit("/", 1)[-1].split(".", 1)[0].lower()
    if base in ATTENTION_CORE_NAMES or "flash" in base or "core_attention" in base:
        return "attention"
    if tensor_size and num_ops / tensor_size >= 32:
        return "gemm"
    return "other"


# Peak rates and bandwidths: data sheets as collected in groundtruth-dev.json
# (hardware_profiles). Efficiency factors are physical, not fitted to any iteration time:
# - gemm 0.80 (A100) / 0.75 (H100): large bf16 cuBLAS GEMMs sustain 80-90 % of the boost-clock
#   peak, and power capping during training lowers clocks; H100 SXM is more power-limited.
# - attention 0.60: the attention-core matmuls have a head-sized (64-128) inner dimension and
#   are interleaved with softmax, so they reach a lower fraction of peak.
# - memory 0.87 (A100, measured: see the preset) / 0.89 (H100, measured).
# - networks: A100_NETWORK and H100_NETWORK above; kernel overhead 2 us (launch and tail
#   effect of one kernel).
# Networks (stg.perf.comm_time). Per-step latencies are NCCL's own (NVIDIA/nccl
# src/graph/tuning.cc, hwLat, Simple protocol ring: NVLink 3.4 us, network 9.6 us); the
# low-latency protocols follow from the link kind.
# - DGX A100: NVLink 3, 12 links x 25 GB/s = 300 GB/s per direction per GPU (A100 whitepaper);
#   NCCL reaches 200-235 GB/s of all-reduce bus bandwidth on 8 GPUs (nccl-tests issues #149:
#   ~200, #178: 208; NCCL's tuning model caps sm80 at 235): efficiency 0.75. One ConnectX-6
#   HDR 200 Gb/s (25 GB/s) NIC per GPU; nccl-tests issue #119 measured 85-96 of 100 GB/s over
#   4 HDR NICs: efficiency 0.9. DGX SuperPOD (A100) reference architecture: rail-optimised
#   leaves per scalable unit of 20 nodes, a non-blocking (1:1) spine above.
# - DGX H100: NVLink 4, 18 links = 450 GB/s per direction; NCCL's rings reach ~370 GB/s of bus
#   bandwidth (protocol overhead ~20 %) and NVLink SHARP all-reduce ~480 GB/s bus bandwidth,
#   i.e. ~275 GB/s algorithm bandwidth, on 8 GPUs (NCCL maintainer in nccl-tests issue #212):
#   efficiency 0.82, sharp_efficiency 275/450 = 0.61. One ConnectX-7 NDR 400 Gb/s (50 GB/s)
#   NIC per GPU, efficiency 0.9 as for HDR; DGX SuperPOD (H100) reference architecture:
#   scalable units of 32 nodes on rail-optimised leaves, non-blocking spine.
A100_NETWORK: list[dict[str, Any]] = [
    {
        "name": "nvlink",
        "size": 8,
        "bandwidth_gbps": 300,
        "latency_us": 3.4,
        "efficiency": 0.75,
        "link": "nvlink",
    },
    {
        "name": "rail",
        "size": 20,
        "bandwidth_gbps": 25,
        "latency_us": 9.6,
        "efficiency": 0.9,
        "link": "network",
    },
    {
        "name": "spine",
        "size": 0,
        "bandwidth_gbps": 25,
        "latency_us": 9.6,
        "efficiency": 0.9,
        "link": "network",
        "oversubscription": 1.0,
    },
]
H100_NETWORK: list[dict[str, Any]] = [
    {
        "name": "nvlink",
        "size": 8,
        "bandwidth_gbps": 450,
        "latency_us": 3.4,
        "efficiency": 0.82,
        "link": "nvlink",
        "sharp_efficiency": 0.61,
    },
    {
        "name": "rail",
        "size": 32,
        "bandwidth_gbps": 50,
        "latency_us": 9.6,
        "efficiency": 0.9,
        "link": "network",
    },
    {
        "name": "spine",
        "size": 0,
        "bandwidth_gbps": 50,
        "latency_us": 9.6,
        "efficiency": 0.9,
        "link": "network",
        "oversubscription": 1.0,
    },
]

HOST_LINK_BYTES_PER_S = {
    # per direction, PCIe x16 to the host: NVIDIA H100 and H200 data sheets (PCIe Gen5,
    # 128 GB/s both ways), A100 data sheet (PCIe Gen4, 64 GB/s both ways)
    "hopper": 64e9,
    "ampere": 32e9,
    # HGX B200 and B300 (DGX B200: Xeon Platinum 8570, DGX B300: Xeon 6776P hosts): PCIe Gen5
    # x16 to the x86 host, as Hopper's (the GB200/GB300 NVL72 presets give their NVLink-C2C)
    "blackwell": 64e9,
    # AMD Instinct MI300X, MI325X and MI355X data sheets: PCIe Gen5 x16, 128 GB/s both ways
    "cdna3": 64e9,
    "cdna4": 64e9,
    # L4 and L40S data sheets: PCIe Gen4 x16, 64 GB/s both ways
    "ada": 32e9,
    # V100 and T4 data sheets: PCIe Gen3 x16, 32 GB/s both ways
    "volta": 16e9,
    "turing": 16e9,
}
"""Bytes/s a GPU copies to or from host memory (a serving engine's swap preemption, CPU
activation offload), by architecture: every architecture a system may name (``arch``), so
that a plan that offloads, whose trace validates, predicts on every system."""


def check_capacity(system: System, world_size: int, ranks: str = "ranks") -> None:
    """Raise :class:`UserError` where ``world_size`` ranks (``ranks``: what they are) exceed
    the GPUs of a system that counts them (a hybrid cluster, or a network whose outermost
    dimension has a size)."""
    if system.capacity and world_size > system.capacity:
        groups = getattr(system, "groups", ())
        detail = f" in groups {', '.join(f'{g.name}: {g.size}' for g in groups)}" if groups else ""
        raise UserError(
            f"{world_size} {ranks} do not fit system {system.name!r} "
            f"({system.capacity} GPUs{detail})"
        )


def non_finite_time(subject: str, seconds: float, system_name: str) -> UserError:
    """The refusal of an iteration time that is not finite (``subject``: what gave it), which
    only a system figure out of proportion to the work produces (a 5e-324 GB/s link)."""
    return UserError(
        f"{subject} gives an iteration time of {seconds}: a figure of system {system_name!r} "
        "(a bandwidth, a peak or a latency) is out of proportion to the work; give it a "
        "finite, positive value of the right order"
    )


def host_link_bandwidth(system: System) -> float:
    """Bytes/s one GPU of ``system`` copies to or from host memory, per direction: the
    system's ``host_link_gbps`` where it gives one (a Grace-Blackwell superchip's NVLink-C2C),
    else its architecture's PCIe (:data:`HOST_LINK_BYTES_PER_S`); a one-line error where
    neither is known."""
    if system.host_link is not None:
        return system.host_link
    arch = system.arch
    if arch not in HOST_LINK_BYTES_PER_S:
        raise UserError(
            f"no host link bandwidth is known for {system.name} (a {arch} GPU): give its "
            "system file host_link_gbps; allowed without one: a GPU of architecture "
            f"{', '.join(sorted(HOST_LINK_BYTES_PER_S))}"
        )
    return HOST_LINK_BYTES_PER_S[arch]


PRESETS: dict[str, dict[str, Any]] = {
    "a100-80g": {
        "name": "a100-80g",
        "description": "NVIDIA DGX A100 80GB: 8 GPUs per node (NVLink 3, 300 GB/s per "
        "direction), one HDR 200 Gb/s InfiniBand NIC per GPU",
        "peak_tflops": {
            "fp32": 19.5,
            "tf32": 156,
            "bf16": 312,
            "fp16": 312,
            "fp8": 312,
            "int8": 624,
        },
        "hbm_gbps": 2039,
        "hbm_gib": 80,
        # NVIDIA A100 Tensor Core GPU Architecture whitepaper: 108 SMs, peaks at the 1410 MHz
        # boost clock. Sustained: 1305 MHz, the clock an A100 SXM holds at its 400 W limit
        # under dense tensor-core GEMMs (HPL), which NVIDIA's Top500 submissions use for
        # Rpeak (glennklockwood.com/garden/peak-FLOPS). The one 16-bit cuBLAS GEMM published as
        # timed under sustained load (8192^3 fp16 at 230 TFLOP/s over >= 3 s, 2022 software,
        # mli/transformers-benchmarks; tests/data/kernels/a100-published.jsonl) runs 9 % below
        # the model at this clock; it cannot tell a lower clock from that era's lower cuBLAS
        # efficiency, and Megatron-LM's A100 runs of the same year (../shared/data, Korthikanti
        # et al. Table 5) stay within 3 % at 1305 MHz and miss by 7-9 % at the 1.19 GHz it
        # would imply, so the HPL clock stays. Short runs reach 258-271 TFLOP/s, between this
        # rate and the tile model's at the boost clock (271.2 at 1024 x 10240 x 5120 against
        # 269.1 predicted): the H100's pipeline efficiency holds.
        "sm_count": 108,
        "peak_clock_ghz": 1.41,
        "sustained_clock_ghz": 1.305,
        "arch": "ampere",
        "compute_capability": "8.0",  # NVIDIA's CUDA GPUs page: A100 8.0
        "tdp_w": 400,  # A100 SXM4 data sheet: max TDP 400 W
        "compute_efficiency": {"gemm": 0.8, "attention": 0.6, "other": 0.8},
        # streaming kernels on an A100 SXM4 80GB at full occupancy, 2 GiB arrays: scale
        # 1.737 TB/s and triad 1.794 TB/s (RRZE-HPC/gpu-benches gpu-stream; a100-published.jsonl),
        # mean 1.766 of 2.039 TB/s
        "memory_efficiency": 0.87,
        "kernel_overhead_us": 2,
        "network": A100_NETWORK,
    },
    "h100-80g": {
        "name": "h100-80g",
        "description": "NVIDIA HGX H100 SXM 80GB: 8 GPUs per node (NVLink 4, 450 GB/s per "
        "direction), one 400 Gb/s NIC per GPU",
        "peak_tflops": {
            "fp32": 66.9,
            "tf32": 494.7,
            "bf16": 989.4,
            "fp16": 989.4,
            "fp8": 1978.9,
            "int8": 1978.9,
        },
        "hbm_gbps": 3350,
        "hbm_gib": 80,
        # NVIDIA H100 Tensor Core GPU data sheet and Hopper whitepaper: 132 SMs, 4096 dense
        # bf16 FLOP per SM per clock, so the 989.4 TFLOP/s peak is at 1.83 GHz; sustained
        # clock under GEMM load at the 700 W cap: 1.38 GHz (data/kernels/h100-data-effect.jsonl)
        "sm_count": 132,
        "peak_clock_ghz": 1.83,
        "sustained_clock_ghz": 1.38,
        "arch": "hopper",
        "compute_capability": "9.0",  # NVIDIA's CUDA GPUs page: H100 (and H200, H800, H20) 9.0
        "tdp_w": 700,  # H100 SXM data sheet: max TDP up to 700 W (H200 and H800 SXM: the same)
        "compute_efficiency": {"gemm": 0.75, "attention": 0.55, "other": 0.8},
        "memory_efficiency": 0.89,  # measured: streaming kernels 2.95-3.0 of 3.35 TB/s
        "kernel_overhead_us": 2,
        "network": H100_NETWORK,
    },
}

# NVIDIA H200 Tensor Core GPU data sheet: the H100's GH100 die and 700 W (so the same SMs
# and peaks), 141 GB of HBM3e (140 GiB usable as the driver reports it) at 4.8 TB/s; HGX H200
# keeps NVLink 4 and one 400 Gb/s NIC per GPU. Sustained clock under GEMM load at the 700 W
# cap: 1.46 GHz, measured (median SM clock of the last 10 s of 20 s of 8192^3 bf16 GEMMs,
# tests/data/kernels/h200-clock.jsonl, benchmarks/measure_kernels.py); the H100 measured
# 1.38 GHz the same way.
PRESETS["h200-141g"] = {
    **PRESETS["h100-80g"],
    "sustained_clock_ghz": 1.46,
    "name": "h200-141g",
    "description": "NVIDIA HGX H200 141GB: 8 GPUs per node (NVLink 4, 450 GB/s per "
    "direction), one 400 Gb/s NIC per GPU",
    "hbm_gbps": 4800,
    "hbm_gib": 140,
}

# NVIDIA H800 SXM5 data sheet: the H100 SXM's GH100 (same SMs, peaks, HBM3 80 GB at 3.35 TB/s)
# with NVLink cut to 400 GB/s (bidirectional: 200 GB/s per direction, against the H100's 900);
# DeepSeek-V3's cluster (arXiv:2412.19437, section 3.1) adds one 400 Gb/s (50 GB/s) InfiniBand
# NIC per GPU, as the h100-80g preset has.
PRESETS["h800-80g"] = {
    **PRESETS["h100-80g"],
    "name": "h800-80g",
    "description": "NVIDIA H800 SXM 80GB: 8 GPUs per node (NVLink, 200 GB/s per direction), "
    "one 400 Gb/s NIC per GPU",
    # the HGX H100 baseboard with fewer NVLinks: NVSwitch 3 keeps NVLink SHARP (nccl issue
    # #1374 measured 215 GB/s all-reduce bus bandwidth on 8 H800s)
    "network": [
        {**PRESETS["h100-80g"]["network"][0], "bandwidth_gbps": 200},
        *PRESETS["h100-80g"]["network"][1:],
    ],
}

# NVIDIA H20 (HGX H20, sold in China), which people serve on: the H100's GH100 die cut to 78 SMs
# and a quarter of its tensor rate, on the HGX H100 baseboard (NVLink 4 with NVLink SHARP, as
# NVIDIA/nccl issue #1244 ran NVLS on 16 H20s with one ConnectX-7 NIC per GPU). No public
# NVIDIA data sheet; figures as NVIDIA's partners published them.
PRESETS["h20-96g"] = {
    **PRESETS["h100-80g"],
    "name": "h20-96g",
    "description": "NVIDIA HGX H20 96GB: 8 GPUs per node (NVLink 4, 450 GB/s per direction), "
    "one 400 Gb/s NIC per GPU",
    "peak_tflops": {
        "fp32": 44,
        "tf32": 74,
        "bf16": 148,
        "fp16": 148,
        "fp8": 296,
        "int8": 296,
    },
    "hbm_gbps": 4000,
    "hbm_gib": 96,
    "sm_count": 78,
    "peak_clock_ghz": 1.98,
    "sustained_clock_ghz": 1.98,
    "tdp_w": 400,
    "sources": {
        "peak_tflops": "NVIDIA H20 specifications as reported by SemiAnalysis ('Nvidia's New "
        "China AI Chips Circumvent US Restrictions', 2023-11-09): FP8 296, FP16/BF16 148, TF32 "
        "74, FP32 44 TFLOPS, INT8 296 TOPS (dense)",
        "hbm": "the same report: 96 GB HBM3 at 4.0 TB/s",
        "sm_count": "78 SMs (Geekbench 6 listing of an H20, reported by Wccftech, 2024)",
        "peak_clock_ghz": "the GH100's 1.98 GHz boost clock (H100 SXM data sheet)",
        "sustained_clock_ghz": "no measurement: the boost clock (data sheet only); at 400 W "
        "and a quarter of the H100's tensor rate the H20 is not expected to throttle",
        "tdp_w": "the same report: 400 W",
        "network": "HGX H20: NVLink 4 at 900 GB/s bidirectional (the same report), NVLink "
        "SHARP (NVIDIA/nccl issue #1244); the h100-80g preset's fabric",
    },
}

# The GPUs of hybrid clusters (v100-32g, t4-16g, a10-24g, l4-24g, l40s-48g, a100-40g): data
# sheets cited in stg.perf.devices.
PRESETS.update(DEVICE_PRESETS)
# Blackwell (HGX B200/B300, GB200/GB300 NVL72) and AMD Instinct MI300X/MI325X/MI355X: data
# sheets cited in each preset's sources (stg.perf.accelerators).
PRESETS.update(ACCELERATOR_PRESETS)


def preset_names() -> tuple[str, ...]:
    return tuple(sorted(PRESETS))


def _positive(where: str, value: object, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SystemDescriptionError(f"{where} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise SystemDescriptionError(f"{where} must be {bound}, got {value!r}")
    return float(value)


def _fraction(where: str, value: object) -> float:
    number = _positive(where, value)
    if number > 1:
        raise SystemDescriptionError(f"{where} must be in (0, 1], got {value!r}")
    return number


def _mapping(where: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SystemDescriptionError(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


KNOWN_KEYS = frozenset(
    {
        "name",
        "description",
        "peak_tflops",
        "hbm_gbps",
        "hbm_gib",
        "compute_efficiency",
        "memory_efficiency",
        "kernel_overhead_us",
        "network",
        "sm_count",
        "peak_clock_ghz",
        "sustained_clock_ghz",
        "arch",
        "compute_capability",
        "tdp_w",
        "power_limit_w",
        "host_link_gbps",
        "sources",
    }
)
NETWORK_KEYS = frozenset(
    {
        "name",
        "size",
        "bandwidth_gbps",
        "latency_us",
        "efficiency",
        "link",
        "oversubscription",
        "sharp_efficiency",
        "measured",
    }
)


def system_from_dict(data: object, source: str = "system") -> System:
    """Check and convert the JSON form; a mistake raises a one-line :class:`UserError`."""
    data = _mapping(source, data)
    unknown = sorted(set(data) - KNOWN_KEYS)
    if unknown:
        raise SystemDescriptionError(
            f"{source}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(KNOWN_KEYS))}"
        )
    for key in ("peak_tflops", "hbm_gbps", "hbm_gib", "network"):
        if key not in data:
            raise SystemDescriptionError(f"{source}: missing key {key!r}")
    peaks = _mapping(f"{source}: peak_tflops", data["peak_tflops"])
    missing = [d for d in DTYPES if d not in peaks]
    extra = sorted(set(peaks) - set(DTYPES) - set(LOW_PRECISION_DTYPES))
    if missing or extra:
        raise SystemDescriptionError(
            f"{source}: peak_tflops must give exactly the dtypes {', '.join(DTYPES)} "
            f"(and {' and '.join(LOW_PRECISION_DTYPES)} where the GPU has them)"
            + (f" (missing {', '.join(missing)})" if missing else f" (unknown {extra[0]})")
        )
    given = [d for d in (*DTYPES, *LOW_PRECISION_DTYPES) if d in peaks]
    peak_flops = {d: _positive(f"{source}: peak_tflops.{d}", peaks[d]) * 1e12 for d in given}
    efficiency_in = _mapping(f"{source}: compute_efficiency", data.get("compute_efficiency", {}))
    extra = sorted(set(efficiency_in) - set(OP_CLASSES))
    if extra:
        raise SystemDescriptionError(
            f"{source}: compute_efficiency has unknown op class {extra[0]!r}; "
            f"allowed: {', '.join(OP_CLASSES)}"
        )
    compute_efficiency = {
        c: _fraction(f"{source}: compute_efficiency.{c}", efficiency_in.get(c, 1.0))
        for c in OP_CLASSES
    }
    network_in = data["network"]
    if not isinstance(network_in, list) or not network_in:
        raise SystemDescriptionError(f"{source}: network must be a non-empty list of dimensions")
    dims: list[NetworkDim] = []
    for i, raw in enumerate(network_in):
        where = f"{source}: network[{i}]"
        raw = _mapping(where, raw)
        unknown = sorted(set(raw) - NETWORK_KEYS)
        if unknown:
            raise SystemDescriptionError(
                f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(NETWORK_KEYS))}"
            )
        for key in ("size", "bandwidth_gbps", "latency_us"):
            if key not in raw:
                raise SystemDescriptionError(f"{where}: missing key {key!r}")
        size = raw["size"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise SystemDescriptionError(f"{where}.size must be an integer >= 0, got {size!r}")
        if size == 0 and i != len(network_in) - 1:
            raise SystemDescriptionError(
                f"{where}.size=0 (unbounded) is allowed only for the last dimension"
            )
        dims.append(
            NetworkDim(
                name=str(raw.get("name", f"dim{i}")),
                size=size,
                bandwidth=_positive(f"{where}.bandwidth_gbps", raw["bandwidth_gbps"]) * 1e9,
                latency=_positive(f"{where}.latency_us", raw["latency_us"], allow_zero=True) * 1e-6,
                efficiency=_fraction(f"{where}.efficiency", raw.get("efficiency", 1.0)),
                **_network_fields(raw, where),
            )
        )
    return System(
        name=str(data.get("name", source)),
        description=str(data.get("description", "")),
        peak_flops=peak_flops,
        hbm_bandwidth=_positive(f"{source}: hbm_gbps", data["hbm_gbps"]) * 1e9,
        hbm_capacity=int(_positive(f"{source}: hbm_gib", data["hbm_gib"]) * 2**30),
        network=tuple(dims),
        compute_efficiency=compute_efficiency,
        memory_efficiency=_fraction(
            f"{source}: memory_efficiency", data.get("memory_efficiency", 1.0)
        ),
        kernel_overhead=_positive(
            f"{source}: kernel_overhead_us", data.get("kernel_overhead_us", 0), allow_zero=True
        )
        * 1e-6,
        host_link=(
            None
            if data.get("host_link_gbps") is None
            else _positive(f"{source}: host_link_gbps", data["host_link_gbps"]) * 1e9
        ),
        sources=_sources(data.get("sources", {}), source),
        **_gpu_fields(data, source),
    )


def _sources(value: object, source: str) -> dict[str, str]:
    """The optional ``sources``: a JSON object of text by key."""
    sources = _mapping(f"{source}: sources", value)
    for key, text in sources.items():
        if not isinstance(text, str):
            raise SystemDescriptionError(
                f"{source}: sources.{key} must be text, got {type(text).__name__}"
            )
    return dict(sources)


def _network_fields(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The optional topology keys of one network dimension (:mod:`stg.perf.comm_time`)."""
    link = raw.get("link")
    if link is not None and link not in LINKS:
        raise SystemDescriptionError(
            f"{where}.link {link!r} is not known; allowed: {', '.join(LINKS)}"
        )
    over = _positive(f"{where}.oversubscription", raw.get("oversubscription", 1.0))
    if over < 1:
        raise SystemDescriptionError(f"{where}.oversubscription must be >= 1, got {over!r}")
    sharp = raw.get("sharp_efficiency")
    measured = raw.get("measured", [])
    if not isinstance(measured, list):
        raise SystemDescriptionError(f"{where}.measured must be a list of measured curves")
    curves = []
    for i, curve in enumerate(measured):
        try:
            curves.append(MeasuredCurve.from_dict(curve))
        except ValueError as exc:
            raise SystemDescriptionError(f"{where}.measured[{i}]: {exc}") from None
    return {
        "link": link,
        "oversubscription": over,
        "sharp_efficiency": 0.0 if sharp is None else _fraction(f"{where}.sharp_efficiency", sharp),
        "measured": tuple(curves),
    }


def _gpu_fields(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The optional GPU keys; an H100 SXM's (see the h100-80g preset) where not given."""
    sm_count = data.get("sm_count", 132)
    if isinstance(sm_count, bool) or not isinstance(sm_count, int) or sm_count <= 0:
        raise SystemDescriptionError(f"{source}: sm_count must be a positive integer")
    peak_clock = _positive(f"{source}: peak_clock_ghz", data.get("peak_clock_ghz", 1.83))
    sustained = _positive(
        f"{source}: sustained_clock_ghz", data.get("sustained_clock_ghz", min(1.38, peak_clock))
    )
    arch = data.get("arch", "hopper")
    if arch not in FUSED_ATTENTION:
        raise SystemDescriptionError(
            f"{source}: arch {arch!r} is not known; allowed: {', '.join(sorted(FUSED_ATTENTION))}"
        )
    capability = data.get("compute_capability")
    if capability is not None and (
        not isinstance(capability, str) or not re.fullmatch(r"\d+\.\d+", capability)
    ):
        raise SystemDescriptionError(
            f"{source}: compute_capability {capability!r} is not a 'major.minor' string "
            "(as '9.0' or '10.3')"
        )
    tdp = _positive(f"{source}: tdp_w", data.get("tdp_w", 700))
    limit = data.get("power_limit_w")
    if limit is not None:
        limit = _positive(f"{source}: power_limit_w", limit)
        lowest = tdp * MIN_POWER_LIMIT_FRACTION
        if not lowest <= limit <= tdp:
            raise SystemDescriptionError(
                f"{source}: power_limit_w={_num(limit)} is outside the GPU's power-limit range; "
                f"allowed: {_num(round(lowest, 1))} to {_num(tdp)} W (2/7 of tdp_w to tdp_w)"
            )
    return {
        "sm_count": sm_count,
        "peak_clock_ghz": peak_clock,
        "sustained_clock_ghz": sustained,
        "arch": arch,
        "compute_capability": capability,
        "tdp_w": tdp,
        "power_limit_w": limit,
    }


def load_system(spec: str | Path | System) -> System:
    """A preset by name (``a100-80g``, ``h100-80g``) or a JSON file by path."""
    if isinstance(spec, System):
        return spec
    text = str(spec)
    if text in PRESETS:
        return system_from_dict(PRESETS[text], text)
    path = Path(text)
    if path.suffix.lower() == ".json" or path.exists() or "/" in text:
        allowed = f"allowed: a preset ({', '.join(preset_names())}) or a system JSON file"
        if path.is_dir():
            raise SystemDescriptionError(f"system {text!r} is a directory; {allowed}")
        if not path.is_file():
            raise SystemDescriptionError(f"system file {text!r} does not exist; {allowed}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise SystemDescriptionError(f"cannot read system file {text!r}: {exc}") from None
        except json.JSONDecodeError as exc:
            raise SystemDescriptionError(
                f"system file {text!r} is not valid JSON: {exc.msg} at line {exc.lineno}"
            ) from None
        if isinstance(data, dict) and "groups" in data:  # a hybrid cluster: stg.perf.hybrid
            from stg.perf.hybrid import hybrid_from_dict

            return hybrid_from_dict(data, text)
        return system_from_dict(data, text)
    raise UnknownNameError(
        f"unknown system {text!r}; allowed: {', '.join(preset_names())} or a path to a JSON file"
    )
