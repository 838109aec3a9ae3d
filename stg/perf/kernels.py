"""Kernels as the predictors use them: which (op class, precision) pairs run natively, how fast,
what a cast into a precision costs, and how many bytes a saved tensor takes.

Plugins register :class:`stg.host.records.Kernel` records (``stg_register_kernels``). For one system
they form a :class:`KernelTable` keyed by (op class, dtype), with op classes as
:func:`stg.perf.system.op_class` names them (``gemm``, ``attention``, ``other``; a kernel's
``einsum`` means ``gemm`` and ``elementwise`` means ``other``). Rules (documented in README):

- **Native precisions.** fp32, tf32, bf16 and fp16 matmuls always run natively, at the system's
  peak for that dtype. fp8 and int8 (*quantized*) ops run natively only where a kernel for
  (op class, dtype) is registered; without one, a quantized op in a workload that computes in
  a wider dtype is priced as what a framework does without such a kernel: dequantize and
  compute in the workload's dtype (the casts in front of it are still paid).
- **Speedup.** A kernel's ``speedup`` divides the FLOP term of the roofline (the memory term
  is unchanged): ``max(flops / (peak(dtype)·eff·speedup), bytes / (hbm·mem_eff))``.
- **Casts.** A cast node (the op it runs, :func:`kernel_name`, contains ``.cast_``; it
  converts ``num_ops`` elements into its ``dtype``) costs ``cast_alpha·elements + cast_beta``
  when a kernel for that dtype declares a cast cost (the first of the gemm, attention, other
  kernels that does); otherwise the roofline prices it like any elementwise op.
- **Memory.** A tensor saved for the backward pass of an op that runs natively in a planned
  precision occupies ``bytes_per_element`` of that kernel (default: the dtype's width).
- **Choice.** A kernel whose ``systems`` names the system beats a generic one; among equals
  the one registered last wins (plugins load in a fixed order, so this is deterministic).

Without kernels (an empty table, the default) every prediction is what the roofline gives.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stg.core.precision import DTYPE_BYTES
from stg.core.workload import node_op
from stg.host.records import Kernel

QUANTIZED_DTYPES = frozenset({"fp8", "int8"})
"""Precisions that run natively only where a kernel is registered."""

OP_CLASS_OF_KERNEL: Mapping[str, str] = {
    "einsum": "gemm",
    "gemm": "gemm",
    "attention": "attention",
    "elementwise": "other",
    "other": "other",
}


def is_cast(name: str) -> bool:
    """Whether a node is a precision cast (``<op>.cast_<operand>``, or its gradient), by the
    name of the op it runs (:func:`kernel_name`)."""
    return ".cast_" in name


def kernel_name(node: Any) -> str:
    """The name of the op a compute node runs, which the kernel models classify (``fc1``,
    ``fc1_bias``, ``scores.grad_q``, ``fc1.cast_w1``): its typed ``op`` attribute
    (generated traces), else its whole name (a foreign trace's node is named after its op,
    ``aten::mm``)."""
    op = node_op(node)
    return op if op is not None else getattr(node, "name", "")


@dataclass(frozen=True)
class KernelTable:
    """The kernels that apply on one system, by (op class, dtype)."""

    system: str = ""
    kernels: Mapping[tuple[str, str], Kernel] = field(default_factory=dict)

    @classmethod
    def build(cls, kernels: Iterable[Any] | None, system: str = "") -> KernelTable:
        """A table from Kernel records (or registry entries holding them) for ``system``."""
        chosen: dict[tuple[str, str], tuple[int, Kernel]] = {}
        for item in kernels or ():
            kernel = getattr(item, "item", item)
            if not isinstance(kernel, Kernel):
                raise TypeError(f"not a Kernel record: {kernel!r}")
            if kernel.systems and system not in kernel.systems:
                continue
            rank = 1 if kernel.systems else 0
            key = (OP_CLASS_OF_KERNEL[kernel.op_class], kernel.dtype)
            if key not in chosen or rank >= chosen[key][0]:
                chosen[key] = (rank, kernel)
        return cls(system, {key: chosen[key][1] for key in sorted(chosen)})

    def __bool__(self) -> bool:
        return bool(self.kernels)

    def get(self, op_class: str, dtype: str) -> Kernel | None:
        """The kernel for an op class (``gemm``, ``attention``, ``other``) and dtype, if any."""
        return self.kernels.get((op_class, dtype))

    def native(self, op_class: str, dtype: str) -> bool:
        """Whether an op of this class runs natively in ``dtype`` (see the module docstring)."""
        return dtype not in QUANTIZED_DTYPES or (op_class, dtype) in self.kernels

    def cast_kernel(self, dtype: str) -> Kernel | None:
        """The kernel that prices casts into ``dtype``: the first with a declared cast cost."""
        for op_class in ("gemm", "attention", "other"):
            kernel = self.kernels.get((op_class, dtype))
            if kernel is not None and (kernel.cast_alpha > 0 or kernel.cast_beta > 0):
                return kernel
        return None

    def bytes_per_element(self, op_class: str, dtype: str) -> float:
        """Bytes of one element saved in ``dtype`` for an op of this class."""
        kernel = self.kernels.get((op_class, dtype))
        if kernel is not None and kernel.bytes_per_element is not None:
            return float(kernel.bytes_per_element)
        return float(DTYPE_BYTES[dtype])

    def names(self) -> list[str]:
        """Names of the kernels in the table, sorted."""
        return sorted(k.name for k in self.kernels.values())


def kernel_table(kernels: KernelTable | Iterable[Any] | None, system: str) -> KernelTable:
    """``kernels`` as a table for ``system`` (a table is returned as is)."""
    if isinstance(kernels, KernelTable):
        return kernels
    return KernelTable.build(kernels, system)


__all__ = [
    "QUANTIZED_DTYPES",
    "KernelTable",
    "is_cast",
    "kernel_table",
]
