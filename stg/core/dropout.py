"""What dropout costs per element: the constants that the symbolic core builds its nodes with
and that the pricing models read back (a light module: no sympy)."""

from __future__ import annotations

MASK_DTYPE = "int8"
"""A dropout mask's storage: 1 byte per element (torch.bool; Megatron-LM's fused
bias-dropout-add keeps the same)."""
DROPOUT_FLOPS = 3
"""Per element forward: compare a random draw with p, apply the mask, scale by 1/(1 - p)."""
DROPOUT_BACKWARD_FLOPS = 2
"""Per element backward: the output gradient times the mask, times 1/(1 - p)."""
