"""The SM clock a GPU sustains under a board power limit below its TDP.

Under sustained tensor-core load a data-center GPU runs at its power limit, and the firmware
holds the board's power there by lowering the SM clock (and with it the voltage). CMOS
dynamic power is ``P = a·C·V²·f``, a the switching activity (Weste and Harris, "CMOS VLSI
Design", 4th ed., section 5.1), and along a GPU's voltage-frequency curve the voltage rises
about in proportion to the clock, so the power drawn at a given load grows as ``f³`` and
the clock sustained under a limit ``P`` is ``f(P) = f(TDP) · (P / TDP)^(1/3)``. The anchor
``f(TDP)`` is the system's measured ``sustained_clock_ghz`` at the data-sheet TDP (an H100
SXM 1.38 GHz and an H200 SXM 1.46 GHz at 700 W under 8192³ bf16 GEMMs:
tests/data/kernels/). Leakage power, which does not scale with the clock, is left out: the
cube law is the smallest clock drop a cap can cause.

Only tensor-core (compute-bound) rates follow the clock; HBM runs on its own clock and its
bandwidth does not change. A limit above the TDP is refused (the boards' maximum power limit
is their TDP), and so is one below :data:`MIN_POWER_LIMIT_FRACTION` of it.
"""

from __future__ import annotations

MIN_POWER_LIMIT_FRACTION = 200 / 700
"""The lowest power limit as a fraction of the TDP: an H100 SXM5 accepts limits from 200 W to
its 700 W TDP (``nvidia-smi -q``'s Min and Max Power Limit; the range that Ujeniya et al.,
"A Comparative Study of power-capping NVIDIA H100 and H200", arXiv:2604.11391, sweep); no other
device's minimum is at hand, so every device is held to the same fraction."""

CLOCK_POWER_EXPONENT = 1 / 3
"""``f ∝ P^(1/3)``: dynamic power ``∝ V²·f`` with ``V ∝ f`` along the DVFS curve."""


def clock_under_power_limit(clock_at_tdp_ghz: float, tdp_w: float, limit_w: float) -> float:
    """The sustained SM clock (GHz) under a board power limit of ``limit_w`` watts, given the
    clock sustained at the TDP: ``f(TDP) · (limit / TDP)^(1/3)``."""
    return clock_at_tdp_ghz * (limit_w / tdp_w) ** CLOCK_POWER_EXPONENT
