"""An stg plugin: quantized matmul kernels (int8 on A100, H100, T4, A10 and L4; fp8 on H100
and L4).

Each kernel prices the matmuls (op class ``einsum``) that a precision plan puts in its dtype
on one system preset; see README.md for where every number comes from. The physics:

- **Throughput.** The system presets already give the dense tensor-core peaks
  (groundtruth-dev.json hardware_profiles): A100 int8 624 TOPS = 2 x bf16 312; H100 int8 and
  fp8 1978.9 = 2 x bf16 989.4. A quantized GEMM also rescales its int32/fp32 accumulators
  per row and column in the epilogue and is fed by quantized operands; we estimate that this
  costs 10 % of the GEMM time, hence ``speedup = 0.9`` over the int8/fp8 roofline (net
  1.8 x the bf16 GEMM at the same efficiency).
- **Casts.** Dynamic per-tensor quantization reads the 16-bit tensor twice (an absmax
  reduction, then scale-and-convert) and writes one byte per element: 5 bytes per element,
  memory bound: ``cast_alpha = 5 B / (HBM bandwidth x 0.8)`` (0.8 is the presets' memory
  efficiency), and ``cast_beta`` = two kernel launches of 2 us (the presets' kernel overhead).
- **Memory.** A saved quantized tensor takes 1 byte per element (one fp32 scale per tensor
  is negligible).
"""

from __future__ import annotations

from collections.abc import Callable

import stg
from stg.api import Kernel

__version__ = "0.1.0"

EPILOGUE_SPEEDUP = 0.9
"""Quantized GEMM time over the int8/fp8 roofline: 10 % for scaling epilogues (estimate)."""

CAST_BYTES_PER_ELEMENT = 5
"""absmax pass (read 2 B) + convert (read 2 B, write 1 B)."""

MEMORY_EFFICIENCY = 0.8
"""Fraction of HBM bandwidth a streaming kernel reaches (as in the stg presets)."""

LAUNCHES_US = 2 * 2.0
"""Two kernels (absmax, convert) of 2 us launch and tail each."""

HBM_GBPS = {
    "a100-80g": 2039,
    "h100-80g": 3350,
    "a100-40g": 1555,
    "t4-16g": 320,
    "a10-24g": 600,
    "l4-24g": 300,
}
"""Memory bandwidth, 10^9 B/s (A100 SXM4 80GB and 40GB, H100 SXM 80GB, T4, A10, L4 data
sheets)."""

DTYPES_PER_SYSTEM = {
    "a100-80g": ("int8",),
    "h100-80g": ("int8", "fp8"),
    "a100-40g": ("int8",),
    "t4-16g": ("int8",),
    "a10-24g": ("int8",),
    "l4-24g": ("int8", "fp8"),
}
"""Native tensor-core formats: Ampere and Turing have int8 but no fp8; Ada (L4) and Hopper
both. V100 has no int8 tensor cores (no kernel: an int8 op there runs in the workload dtype)."""


def cast_alpha(system: str) -> float:
    """Seconds per element of a memory-bound cast on ``system``."""
    return CAST_BYTES_PER_ELEMENT / (HBM_GBPS[system] * 1e9 * MEMORY_EFFICIENCY)


def kernels() -> list[Kernel]:
    """The Kernel records this plugin registers."""
    records = []
    for system, dtypes in sorted(DTYPES_PER_SYSTEM.items()):
        # int8-gemm-a100 is the 80GB's (the first preset); the 40GB's keeps its memory size
        gpu = system if system == "a100-40g" else system.split("-")[0]
        for dtype in dtypes:
            records.append(
                Kernel(
                    name=f"{dtype}-gemm-{gpu}",
                    op_class="einsum",
                    dtype=dtype,
                    speedup=EPILOGUE_SPEEDUP,
                    bytes_per_element=1.0,
                    cast_alpha=cast_alpha(system),
                    cast_beta=LAUNCHES_US * 1e-6,
                    description=f"{dtype} tensor-core GEMM with per-tensor dynamic scaling "
                    f"on {system}",
                    systems=(system,),
                )
            )
    return records


@stg.hookimpl
def stg_register_kernels(register: Callable[[Kernel], None]) -> None:
    for record in kernels():
        register(record)
