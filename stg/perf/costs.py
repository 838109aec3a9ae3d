"""What one node costs: the price of a compute node (kernel models of
:mod:`stg.perf.kernel_time`, kernel tables, calibration) and of a collective or a send
(alpha-beta per network dimension) on a :class:`~stg.perf.system.System`.

Shared by the DAG ``time`` predictor, which replays these costs over the multi-rank graph,
and the closed-form ``analytical`` predictor, which composes them per layer and stage; both
reach them through :mod:`stg.api`. (Moved here unchanged from ``predictors/time.py``.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from stg.core.workload import CollectiveType
from stg.perf.calibration import Calibration
from stg.perf.kernel_time import attention_time, gemm_time, memory_bound_time, memory_kind
from stg.perf.kernels import KernelTable, is_cast
from stg.perf.system import System, normalize_dtype, op_class

WIDE_DTYPES = frozenset({"fp32", "tf32"})
NO_KERNELS = KernelTable()

EAGER_OP_HOST_S = 27.7e-6
"""Host time of one eager PyTorch op with autograd (dispatch, autograd bookkeeping, launch):
median forward time of the small (<= 1 MiB) elementwise cases with requires_grad inputs in
the H100 kernel measurements (data/kernels/h100-elementwise.jsonl), where the GPU is idle
most of the time. An eager step cannot issue kernels faster than this."""

def attention_impl(profile: str, system: System) -> str:
    """The fused attention kernel a training stack runs: Megatron with Transformer Engine uses
    cuDNN's fused attention on Hopper and FlashAttention-2 on Ampere; eager PyTorch's SDPA
    runs FlashAttention-2."""
    if profile == "megatron" and system.arch == "hopper":
        return "cudnn"
    return "flash2"


def compute_time(
    node: Any,
    system: System,
    default_dtype: str = "bf16",
    kernels: KernelTable | None = None,
    profile: str = "megatron",
    calibration: Calibration | None = None,
) -> float:
    """Time of one compute node in seconds on ``system`` under execution ``profile``.

    A node that carries its kernel shape (generated traces) is priced by the kernel models of
    :mod:`stg.perf.kernel_time`: ``gemm`` = (batch, m, n, k) as a cuBLAS GEMM, ``attention``
    = (batch, heads, s_q, s_kv, head_dim, causal, backward) as the profile's fused attention
    kernel; other compute nodes are memory-bound kernels (streaming, normalisation, softmax)
    unless their FLOPs take longer at the sustained SIMT rate. A node without a shape (a
    foreign trace) gets the roofline with the system's ``compute_efficiency`` per op class.
    Each kernel then pays its launch: ``kernel_overhead`` of the system (Megatron), or at
    least the eager host time per op (eager).

    A matmul whose output is fp32 in a workload that computes in a narrower dtype is a
    narrow matmul accumulating into fp32 (Megatron's weight gradients into fp32 main
    gradients): it runs at the rate of the workload's compute dtype. Kernels (see
    :mod:`stg.perf.kernels`) price casts, divide a matmul's time by their speedup, and decide
    whether an fp8/int8 op runs natively or is priced in the workload's dtype.
    """
    if node.num_ops <= 0 and node.tensor_size <= 0:
        return getattr(node, "runtime", 0) * 1e-6
    if calibration is not None:  # measured kernel times first (stg bench calibrate)
        measured = calibration.node_time(node, default_dtype)
        if measured is not None:
            return measured
    table = kernels if kernels is not None else NO_KERNELS
    if table and node.dtype and is_cast(node.name):
        cast = table.cast_kernel(node.dtype)
        if cast is not None:
            return cast.cast_alpha * node.num_ops + cast.cast_beta
    attrs = getattr(node, "attrs", None) or {}
    gemm = attrs.get("gemm")
    attention = attrs.get("attention")
    kind = (
        "attention"
        if attention is not None
        else "gemm"
        if gemm is not None
        else op_class(node.name, node.num_ops, node.tensor_size)
    )
    dtype = node.dtype or default_dtype
    speedup = 1.0
    if kind != "other":
        if dtype in WIDE_DTYPES and default_dtype not in WIDE_DTYPES:
            dtype = default_dtype
        kernel = table.get(kind, dtype)
        if kernel is not None:
            speedup = kernel.speedup
        elif dtype != default_dtype and not table.native(kind, dtype):
            dtype = default_dtype  # no native kernel: dequantize, compute in the workload dtype
    dtype = normalize_dtype(dtype)
    gpu = system.gpu
    if attention is not None and len(attention) >= 7:
        batch, heads, s_q, s_kv, head_dim, causal, backward = attention[:7]
        impl = attention_impl(profile, system)
        if dtype not in ("bf16", "fp16", "fp8"):
            dtype = "bf16"
        seconds = (
            attention_time(
                gpu,
                impl,
                batch,
                heads,
                s_q,
                s_kv,
                head_dim,
                causal=bool(causal),
                backward=bool(backward),
                dtype=dtype,
            )
            / speedup
        )
        # a kernel cannot read its Q, K, V (a decode step's whole KV cache) faster than HBM
        seconds = max(seconds, memory_bound_time(gpu, node.tensor_size, "stream", dtype))
    elif gemm is not None and len(gemm) == 4:
        batch, m, n, k = gemm
        # a convolution (implicit GEMM) moves its tensor_size, not its window matrix
        nbytes = node.tensor_size if attrs.get("implicit_gemm") else None
        seconds = gemm_time(gpu, m, n, k, dtype, batch, nbytes) / speedup
    elif kind == "other":
        simt = node.num_ops / gpu.rate("fp32") if node.num_ops > 0 else 0.0
        memory = memory_bound_time(gpu, node.tensor_size, memory_kind(node.name), dtype)
        seconds = max(simt, memory)
    else:
        flops = node.num_ops / (system.peak(dtype) * system.compute_efficiency[kind] * speedup)
        memory = node.tensor_size / (system.hbm_bandwidth * system.memory_efficiency)
        seconds = max(flops, memory)
    seconds += system.kernel_overhead
    if profile == "eager":
        seconds = max(seconds, EAGER_OP_HOST_S)
    return seconds


def group_shape(ranks: Iterable[int], system: System) -> tuple[int, ...]:
    """Ranks a group spans along each network dimension (inner first).

    For dimension i: the largest number of distinct coordinates along i among members that
    share all outer coordinates (so an irregular group of 4 ranks over two nodes is 2 x 2).
    """
    coords = [system.coordinates(r) for r in ranks]
    shape = []
    for i in range(len(system.network)):
        buckets: dict[tuple[int, ...], set[int]] = {}
        for c in coords:
            buckets.setdefault(c[i + 1 :], set()).add(c[i])
        shape.append(max((len(v) for v in buckets.values()), default=1))
    return tuple(shape)


def collective_time(kind: CollectiveType, size: int, shape: Sequence[int], system: System) -> float:
    """Alpha-beta time of one collective; ``size`` follows the Chakra convention (all-gather:
    this rank's input shard; reduce-scatter, all-reduce: the full buffer; all-to-all: this
    rank's buffer). A group spanning several network dimensions runs hierarchically: the
    innermost dimension on the whole buffer, each outer one on the shard left by the inner
    ones. An all-reduce uses a ring or a tree per dimension, whichever is faster."""
    members = 1
    for n in shape:
        members *= n
    if members <= 1:
        return 0.0
    dims = system.network
    if kind in (CollectiveType.ALL_GATHER, CollectiveType.GATHER):
        buffer = float(size) * members
    else:
        buffer = float(size)
    total = 0.0
    if kind is CollectiveType.BARRIER:
        return sum(2 * (n - 1) * d.latency for n, d in zip(shape, dims, strict=False))
    for n, dim in zip(shape, dims, strict=False):
        if n <= 1:
            continue
        bandwidth = dim.effective_bandwidth
        if kind is CollectiveType.ALL_TO_ALL:
            total += (n - 1) / n * size / bandwidth + (n - 1) * dim.latency
            continue
        if kind in (CollectiveType.BROADCAST, CollectiveType.REDUCE):
            total += buffer / bandwidth + (n - 1) * dim.latency
            continue
        step = (n - 1) / n * buffer / bandwidth + (n - 1) * dim.latency
        if kind is CollectiveType.ALL_REDUCE:
            total += min(2 * step, tree_all_reduce_time(buffer, n, bandwidth, dim.latency))
        else:
            total += step
        buffer /= n
    return total


def tree_all_reduce_time(size: float, n: int, bandwidth: float, latency: float) -> float:
    """All-reduce over a pipelined binary tree (reduce up, broadcast down), as NCCL's tree
    algorithm: every rank moves the whole buffer twice, over 2·ceil(log2 n) latency hops. It
    beats the ring (2(n-1)/n·S/B + 2(n-1)·alpha) for small buffers on many ranks; each
    dimension takes the faster of the two, as NCCL chooses per message size."""
    return 2 * size / bandwidth + 2 * math.ceil(math.log2(n)) * latency


def link_dimension(src: int, dst: int, system: System) -> int:
    """The outermost network dimension on which two ranks differ (-1 for the same rank)."""
    a, b = system.coordinates(src), system.coordinates(dst)
    for i in range(len(a) - 1, -1, -1):
        if a[i] != b[i]:
            return i
    return -1


def send_time(size: int, dimension: int, system: System) -> float:
    if dimension < 0:
        return 0.0
    dim = system.network[dimension]
    return size / dim.effective_bandwidth + dim.latency
