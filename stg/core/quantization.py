"""Serving weight formats: what a precision plan entry means in a serving phase.

Serving engines quantize a model once, offline, and store its weights in the low format; a
step reads them at that width and never casts them. In a serving phase (prefill, decode,
mixed) a precision plan entry (:mod:`stg.core.precision`) that names one of
:data:`WEIGHT_FORMATS` therefore stores the weight operand of the op's matmul in the format's
element dtype, with its scale factors beside it, instead of casting a 16-bit weight every
step. The activation operand is quantized per step (a cast node into the format's activation
dtype, its scales written with it) where the format is weight-activation, and left in the
workload's dtype where it is weight-only (the GEMM dequantizes the weight as it reads it).

- ``fp8`` (W8A8 FP8: vLLM ``--quantization fp8``, compressed-tensors FP8): fp8 weights with
  one fp32 scale per tensor; activations quantized to fp8 with one fp32 scale per tensor;
- ``int8`` (W8A8 INT8: compressed-tensors, SmoothQuant): int8 weights with one fp32 scale per
  output channel; activations quantized to int8 with one fp32 scale per token;
- ``w4a16`` (GPTQ/AWQ through Marlin): int4 weights with one fp16 scale per 128 elements along
  k; activations stay 16-bit (weight-only);
- ``nvfp4`` (ModelOpt NVFP4, W4A4): fp4 (E2M1) weights and activations, one fp8 E4M3 scale
  per 16 elements along k plus one fp32 scale per tensor;
- ``mxfp8``, ``mxfp4`` (OCP MX v1.0; AMD Quark serves MXFP4): fp8 (E4M3) or fp4 (E2M1)
  weights and activations, one E8M0 (8-bit) scale per 32 elements along k.

Sources: vLLM's quantization docs (``docs/features/quantization/fp8.md``: per-tensor weight
scales, dynamic per-tensor activation scales; ``int8.md``: channelwise weight scales and
dynamic per-token activation scales); GPTQ (Frantar et al., 2022) and AWQ (Lin et al., 2023)
with group size 128 and fp16 scales, as vLLM's Marlin kernels take them (AWQ's 4-bit zero
point per group, 1/256 of a bit per weight more, is left out); NVIDIA, "Introducing NVFP4 for
Efficient and Accurate Low-Precision Inference" (developer blog, June 2025) and "Pretraining
Large Language Models with NVFP4" (arXiv 2509.25149, section 2): E2M1 elements, one E4M3 scale
per 16 elements, one fp32 scale per tensor; the OCP Microscaling Formats (MX) Specification
v1.0 (2023), section 5: blocks of 32 elements sharing one E8M0 scale, MXFP8 E4M3 and MXFP4
E2M1 elements.

Blocks run along the reduction dimension k of the matmul (the contracted letters of the
einsum), so a weight ``[k, n]`` has ``n · ceil(k / block)`` block scales; a k that a tensor
split cuts is the rank's part of it.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BITS: dict[str, int] = {
    "fp64": 64,
    "fp32": 32,
    "tf32": 32,
    "bf16": 16,
    "fp16": 16,
    "fp8": 8,
    "int8": 8,
    "fp4": 4,
    "int4": 4,
}
"""Bits per element of every dtype a tensor may be stored in (sub-byte ones included: the
elements of a weight format)."""


@dataclass(frozen=True)
class Scaling:
    """The scale factors of a quantized tensor: one of ``bits`` per ``block`` elements along
    the reduction dimension (``block`` 0: one per row, an output channel of a weight or a token
    of an activation; ``None``: one for the whole tensor), plus one per-tensor scale of
    ``tensor_bits`` (0: none) over the blocks' scales."""

    block: int | None
    bits: int
    tensor_bits: int = 0

    def nbytes(self, elements: int, row: int) -> int:
        """Bytes of the scales of a tensor of ``elements`` elements whose reduction dimension
        holds ``row`` of them."""
        rows = elements // row if row else 1
        if self.block is None:
            scales = 1
        elif self.block == 0:
            scales = rows
        else:
            scales = rows * -(-row // self.block)
        return -(-scales * self.bits // 8) + self.tensor_bits // 8


@dataclass(frozen=True)
class WeightFormat:
    """How a serving engine stores a weight and feeds a matmul (see the module docstring)."""

    name: str
    weight_dtype: str
    weight_scaling: Scaling
    activation_dtype: str | None
    """the matmul's activation operand dtype; None: weight-only (the workload's dtype)"""
    activation_scaling: Scaling | None = None

    @property
    def weight_only(self) -> bool:
        return self.activation_dtype is None


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("fp8", "fp8", Scaling(None, 32), "fp8", Scaling(None, 32)),
        WeightFormat("int8", "int8", Scaling(0, 32), "int8", Scaling(0, 32)),
        WeightFormat("w4a16", "int4", Scaling(128, 16), None),
        WeightFormat("nvfp4", "fp4", Scaling(16, 8, 32), "fp4", Scaling(16, 8, 32)),
        WeightFormat("mxfp8", "fp8", Scaling(32, 8), "fp8", Scaling(32, 8)),
        WeightFormat("mxfp4", "fp4", Scaling(32, 8), "fp4", Scaling(32, 8)),
    )
}
"""Serving weight formats by the name a precision plan gives them."""

FORMAT_ONLY = tuple(name for name in WEIGHT_FORMATS if name not in ("fp8", "int8"))
"""Plan values that are formats and not dtypes (fp8 and int8 are both)."""


def weight_format(value: str) -> WeightFormat | None:
    """The serving weight format a plan value names, or None (a 16- or 32-bit dtype: a cast
    as in training)."""
    return WEIGHT_FORMATS.get(value)


__all__ = [
    "DTYPE_BITS",
    "FORMAT_ONLY",
    "WEIGHT_FORMATS",
    "Scaling",
    "WeightFormat",
    "weight_format",
]
