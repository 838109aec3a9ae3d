"""Plots of benchmark results (matplotlib, from the ``bench`` extra; written as PNG files).

- :func:`roofline_plot`: achieved TFLOP/s of each measured case against its arithmetic
  intensity (FLOPs per byte), log-log, over the roofline of the measurements themselves: the
  best achieved bandwidth (GB/s x intensity) capped by the best achieved TFLOP/s.
- :func:`busbw_plot`: bus bandwidth against message size, one line per collective.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from stg.bench import require


def _pyplot() -> Any:
    matplotlib = require("matplotlib", "--plot")
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path) -> None:
    """Save atomically: into a temporary file beside ``path``, then renamed."""
    from stg.errors import write_replacing

    write_replacing(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"), suffix=".png")


def roofline_plot(records: Iterable[Mapping[str, Any]], path: str | Path, title: str = "") -> int:
    """Write the roofline plot of result lines; returns how many cases it shows."""
    points: dict[str, list[tuple[float, float]]] = {}
    best_gbps = 0.0
    best_tflops = 0.0
    for record in records:
        extra = record.get("extra") or {}
        flops, nbytes, tflops = extra.get("flops"), extra.get("bytes"), extra.get("tflops")
        if not flops or not nbytes or not tflops:
            continue
        label = f"{extra.get('op_class', 'other')} {extra.get('dtype', '')}".strip()
        points.setdefault(label, []).append((flops / nbytes, tflops))
        best_tflops = max(best_tflops, tflops)
        best_gbps = max(best_gbps, float(extra.get("gbps") or 0.0))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        for label, xy in sorted(points.items()):
            ax.scatter([x for x, _ in xy], [y for _, y in xy], s=14, label=label)
        intensities = [x for xy in points.values() for x, _ in xy]
        if intensities and best_gbps > 0:
            low, high = min(intensities) / 2, max(intensities) * 2
            xs = [low * (high / low) ** (i / 100) for i in range(101)]
            ax.plot(
                xs,
                [min(best_tflops, best_gbps * x / 1e3) for x in xs],
                color="gray",
                linestyle="--",
                label=f"measured roofline ({best_gbps:.3g} GB/s, {best_tflops:.3g} TFLOP/s)",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP/byte)")
        ax.set_ylabel("achieved TFLOP/s")
        ax.set_title(title or "stg bench compute")
        if points:
            ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        _save(fig, path)
    finally:
        plt.close(fig)
    return sum(len(v) for v in points.values())


def busbw_plot(rows: Iterable[Any], path: str | Path, title: str = "") -> int:
    """Write bus bandwidth (GB/s) against message size per collective; returns the rows."""
    lines: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        lines.setdefault(row.collective, []).append((row.size, row.busbw / 1e9))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        for name, xy in sorted(lines.items()):
            xy.sort()
            ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(title or "stg bench comms")
        if lines:
            ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        _save(fig, path)
    finally:
        plt.close(fig)
    return sum(len(v) for v in lines.values())


__all__ = ["busbw_plot", "roofline_plot"]
