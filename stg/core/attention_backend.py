"""Which fused attention kernel a training stack runs, written on the attention nodes.

Megatron-LM's ``--attention-backend`` (``flash``, ``fused``; ``auto`` by default) and
Transformer Engine's environment switches ``NVTE_FLASH_ATTN`` / ``NVTE_FUSED_ATTN`` pick the
kernel of ``DotProductAttention``: FlashAttention from the flash-attn package or the vendor's
fused attention (cuDNN). Left to itself, Transformer Engine takes cuDNN's on Hopper when both
are available (``transformer_engine/pytorch/attention.py``, v1.3 and later: "Select
FusedAttention on sm90 and FlashAttention on others for performance"); a launcher that sets
``NVTE_FUSED_ATTN=0`` leaves it FlashAttention. ``GenerateOptions.attention_backend`` other
than ``auto`` puts the choice on every fused attention node as the attribute
:data:`ATTENTION_BACKEND_ATTR`, which the time predictor reads
(:func:`stg.perf.kernel_time.attention_kernel_for`)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the predictors read the attribute's name without loading lowering (sympy)
    from stg.core.lowering import BoundOp, BoundPart

ATTENTION_BACKEND_ATTR = "attention_backend"
"""Node attribute naming the fused attention kernel family (``flash`` or ``fused``)."""


def with_attention_backend(part: BoundPart, backend: str) -> BoundPart:
    """``part`` with ``backend`` on each of its fused attention nodes (those with an
    ``attention`` shape), forward and backward; ``auto`` leaves it as it is."""
    if backend == "auto":
        return part

    def tagged(ops: list[BoundOp]) -> list[BoundOp]:
        return [
            replace(op, attrs=(*op.attrs, (ATTENTION_BACKEND_ATTR, backend)))
            if any(name == "attention" for name, _ in op.attrs)
            else op
            for op in ops
        ]

    return replace(part, forward=tagged(part.forward), backward=tagged(part.backward))


def runs_fused_attention(part: BoundPart) -> bool:
    """Whether ``part`` has a fused attention node (one with an ``attention`` shape)."""
    return any(name == "attention" for op in part.forward for name, _ in op.attrs)
