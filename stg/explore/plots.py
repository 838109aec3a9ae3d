"""Plots of a sweep: iteration time against peak memory with the Pareto front marked, and MFU
against each swept option; interactive HTML (plotly) and a PNG (matplotlib)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stg.errors import check_replaceable, reported_write_faults
from stg.explore.sweep import need


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (lower is better),
    by increasing first coordinate."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front: list[int] = []
    best = float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def _label(row: Mapping[str, Any], swept: Sequence[str]) -> str:
    return " ".join(f"{k}={row.get(k)}" for k in swept) or f"config {row.get('config')}"


def plot_sweep(rows: Sequence[Mapping[str, Any]], swept: Sequence[str], out: Path) -> list[Path]:
    """Write ``out/sweep.html`` and ``out/sweep.png`` (both, or neither: the earlier ones
    stay); returns their paths."""
    go = need("plotly.graph_objects", "--plot")
    subplots = need("plotly.subplots", "--plot")
    matplotlib = need("matplotlib", "--plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [
        r
        for r in rows
        if r.get("status") == "ok" and r.get("iteration_time_s") and r.get("peak_memory_bytes")
    ]
    points = [(r["peak_memory_bytes"] / 2**30, r["iteration_time_s"]) for r in ok]
    front = pareto_front(points)
    options = [k for k in swept if k != "system"] or (["system"] if "system" in swept else [])
    panels = 1 + len(options)
    titles = ["time vs memory (Pareto front)", *(f"MFU vs {k}" for k in options)]
    fig = subplots.make_subplots(rows=panels, cols=1, subplot_titles=titles)
    fits = [bool(r.get("fits")) for r in ok]
    for flag, name, colour in ((True, "fits", "#1f77b4"), (False, "does not fit", "#bbbbbb")):
        chosen = [i for i, f in enumerate(fits) if f is flag]
        fig.add_trace(
            go.Scatter(
                x=[points[i][0] for i in chosen],
                y=[points[i][1] for i in chosen],
                mode="markers",
                name=name,
                marker={"color": colour},
                text=[_label(ok[i], swept) for i in chosen],
            ),
            row=1,
            col=1,
        )
    fig.add_trace(
        go.Scatter(
            x=[points[i][0] for i in front],
            y=[points[i][1] for i in front],
            mode="lines+markers",
            name="Pareto front",
            marker={"color": "#d62728"},
            text=[_label(ok[i], swept) for i in front],
        ),
        row=1,
        col=1,
    )
    fig.update_xaxes(title_text="peak memory per GPU (GiB)", type="log", row=1, col=1)
    fig.update_yaxes(title_text="iteration time (s)", type="log", row=1, col=1)
    for p, key in enumerate(options, start=2):
        fig.add_trace(
            go.Scatter(
                x=[str(r.get(key)) for r in ok],
                y=[100 * (r.get("mfu") or 0) for r in ok],
                mode="markers",
                marker={"color": ["#1f77b4" if f else "#bbbbbb" for f in fits]},
                name=f"MFU vs {key}",
                text=[_label(r, swept) for r in ok],
                showlegend=False,
            ),
            row=p,
            col=1,
        )
        fig.update_xaxes(title_text=key, type="category", row=p, col=1)
        fig.update_yaxes(title_text="MFU (%)", row=p, col=1)
    fig.update_layout(height=380 * panels, title_text=f"stg sweep: {len(ok)} configurations")
    html = out / "sweep.html"
    staged = [
        _staged(
            html,
            lambda tmp: fig.write_html(
                tmp, include_plotlyjs="cdn", full_html=True, div_id="stg-sweep"
            ),
        )
    ]

    figure, axes = plt.subplots(panels, 1, figsize=(7, 3.6 * panels), squeeze=False)
    ax = axes[0][0]
    for flag, name, colour in ((True, "fits", "#1f77b4"), (False, "does not fit", "#bbbbbb")):
        chosen = [i for i, f in enumerate(fits) if f is flag]
        ax.scatter(
            [points[i][0] for i in chosen],
            [points[i][1] for i in chosen],
            s=12,
            c=colour,
            label=name,
        )
    ax.plot(
        [points[i][0] for i in front],
        [points[i][1] for i in front],
        "o-",
        c="#d62728",
        label="Pareto front",
        markersize=4,
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("peak memory per GPU (GiB)")
    ax.set_ylabel("iteration time (s)")
    ax.set_title("time vs memory")
    ax.legend(fontsize=8)
    for p, key in enumerate(options, start=1):
        ax = axes[p][0]
        labels = sorted({str(r.get(key)) for r in ok}, key=_sort_key)
        position = {v: i for i, v in enumerate(labels)}
        ax.scatter(
            [position[str(r.get(key))] for r in ok],
            [100 * (r.get("mfu") or 0) for r in ok],
            s=12,
            c=["#1f77b4" if f else "#bbbbbb" for f in fits],
        )
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel(key)
        ax.set_ylabel("MFU (%)")
    figure.tight_layout()
    png = out / "sweep.png"
    try:
        staged.append(
            _staged(
                png,
                lambda tmp: figure.savefig(tmp, format="png", dpi=100, metadata={"Software": None}),
            )
        )
        _replace_all(staged)
    finally:
        plt.close(figure)
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
    return [html, png]


def _sort_key(text: str) -> tuple[int, float, str]:
    try:
        return (0, float(text), text)
    except ValueError:
        return (1, 0.0, text)


def _staged(path: Path, write: Any) -> tuple[Path, Path]:
    """``(tmp, path)``: ``write(tmp)`` wrote the complete file for ``path`` into ``tmp``, a
    temporary file beside it (removed again if that fails)."""
    with reported_write_faults(path):
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        try:
            write(tmp)
            os.chmod(tmp, 0o644)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return tmp, path


def _replace_all(staged: Sequence[tuple[Path, Path]]) -> None:
    """Move each staged file onto its path; if one move fails, the earlier files are put
    back (the new ones removed), so the files change together or not at all."""
    done: list[tuple[Path, Path | None]] = []  # (path, its backup)
    for _, path in staged:
        check_replaceable(path)
    try:
        for tmp, path in staged:
            with reported_write_faults(path):
                backup = None
                if os.path.lexists(path):
                    backup = tmp.with_name(tmp.name + ".old")
                    os.rename(path, backup)
                done.append((path, backup))
                os.replace(tmp, path)
    except BaseException:
        for path, backup in reversed(done):
            if backup is None:
                path.unlink(missing_ok=True)
            elif os.path.lexists(backup):
                os.replace(backup, path)
        raise
    for _, backup in done:
        if backup is not None:
            backup.unlink(missing_ok=True)
