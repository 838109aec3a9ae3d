"""What a precision cast costs on one device: ``alpha + beta · bytes``.

A cast node (``<op>.cast_<operand>``, :mod:`stg.core.precision`) reads its input and writes it
in another dtype: a streaming kernel. Its time on a device is

    t = alpha + beta · bytes,   bytes = elements · (width(from) + width(to))

with three sources, the first that applies winning (the time predictor's order):

1. **measured** (``stg predict --calibration``, one device): ``stg bench compute`` timing
   ``torch.Tensor.copy_`` from one dtype into another, fitted by ``stg bench calibrate`` into
   the streaming model of the target dtype, ``latency + bytes / rate``: alpha and beta as
   measured on the user's GPU;
2. a **kernel plugin**'s cast cost for the target dtype (``Kernel.cast_alpha`` per element,
   ``cast_beta`` fixed: e.g. dynamic int8 quantisation with its absmax pass,
   ``plugins/stg-int8-kernels``);
3. the **default** (:func:`default_cast_model`): ``alpha`` = the device's kernel overhead
   (launch and tail), ``beta = 1 / (memory bandwidth · memory_efficiency)`` (the streaming
   rate of the device's data sheet bandwidth). The pair depends on the device and on the
   dtype pair only through the bytes each element moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stg.core.precision import DTYPE_BYTES
from stg.perf.system import System


@dataclass(frozen=True)
class CastModel:
    """``seconds = alpha + beta · bytes`` of one cast kernel."""

    alpha: float
    """seconds per cast kernel"""
    beta: float
    """seconds per byte moved (read and written)"""

    def time(self, elements: int, source: str, target: str) -> float:
        return self.alpha + self.beta * elements * (DTYPE_BYTES[source] + DTYPE_BYTES[target])

    def as_dict(self) -> dict[str, Any]:
        return {"alpha_s": self.alpha, "beta_s_per_byte": self.beta}


def default_cast_model(device: System) -> CastModel:
    """The default of the module docstring, from the device's data sheet bandwidth and its
    kernel overhead."""
    return CastModel(device.kernel_overhead, 1 / (device.hbm_bandwidth * device.memory_efficiency))


__all__ = ["CastModel", "default_cast_model"]
