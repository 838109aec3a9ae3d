"""Sizes and durations as users type them on the command line (``40GiB``, ``150ms``).

One parser for every command and layer that takes them; a bad value is one
:class:`~stg.errors.UserError` line that names the option and shows valid examples.
"""

from __future__ import annotations

import re

from stg.errors import UserError

BYTE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
"""Decimal (kB, MB, GB, TB) and binary (KiB, MiB, GiB, TiB) byte units, any case."""

SECOND_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}

_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_SIZE = re.compile(rf"\s*{_NUMBER}\s*([A-Za-z]*)\s*")
_DURATION = re.compile(rf"\s*{_NUMBER}\s*(s|ms|us|µs)?\s*")


def parse_size(text: str, option: str, *, whole: bool = False) -> float:
    """Bytes from ``40GiB``, ``40GB``, ``512 MiB``, ``4e10`` or ``40000000000``.

    ``whole``: a message size, a whole number of bytes >= 1 (returned as an int); otherwise
    any positive amount (a memory budget).
    """
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in {"", *BYTE_UNITS}:
        examples = "1KiB, 4MiB, 1MB or 65536" if whole else "40GiB, 40GB, 512MiB or 4e10 (bytes)"
        raise UserError(f"{option} {text!r} is not a size; give e.g. {examples}")
    value = float(match.group(1)) * BYTE_UNITS[unit or "b"]
    if whole:
        if value < 1 or value != int(value):
            raise UserError(f"{option} {text!r} must be a whole number of bytes >= 1")
        return int(value)
    if not value > 0:
        raise UserError(f"{option} {text!r} must be positive")
    return value


def parse_duration(text: str, option: str, *, unit_required: bool = False) -> float:
    """Seconds from ``150ms``, ``0.15s``, ``150 us`` or (unless ``unit_required``) ``0.15``."""
    match = _DURATION.fullmatch(text)
    if match is None or not float(match.group(1)) > 0 or (unit_required and match.group(2) is None):
        example = "50ms, 0.05s or 50000us" if unit_required else "150ms, 0.15s or 0.15"
        raise UserError(f"{option} {text!r} is not a positive duration; give e.g. {example}")
    return float(match.group(1)) * SECOND_UNITS[match.group(2) or "s"]


__all__ = ["BYTE_UNITS", "SECOND_UNITS", "parse_duration", "parse_size"]
