"""Plots of a ``stg serve`` simulation: the latency CDFs (TTFT, TPOT, end to end) and the KV
occupancy of each replica over time, as one interactive HTML page (plotly, the ``explore``
extra), written atomically and the same bytes for the same simulation."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from stg.errors import write_replacing
from stg.explore.serve import Simulation, request_table, timeline
from stg.explore.sweep import need

DIV_ID = "stg-serve"
"""A fixed element id: plotly draws a random one otherwise, and the bytes would change."""


def _cdf(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ordered = np.sort(values[~np.isnan(values)])
    return ordered, np.arange(1, len(ordered) + 1) / max(len(ordered), 1)


def plot_serving(sim: Simulation, path: str | Path) -> None:
    """Write the plots of ``sim`` to ``path`` (an .html file)."""
    go = need("plotly.graph_objects", "--plot")
    subplots = need("plotly.subplots", "--plot")
    table = request_table(sim)
    fig = subplots.make_subplots(
        rows=2,
        cols=1,
        subplot_titles=("latency CDF (requests)", "KV-cache occupancy per replica"),
        vertical_spacing=0.12,
    )
    for name, column in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("end to end", "e2e_s")):
        x, y = _cdf(table[column])
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=name), row=1, col=1)
    samples = timeline(sim)
    for replica in sorted(set(samples["replica"].tolist())):
        mine = samples["replica"] == replica
        fig.add_trace(
            go.Scatter(
                x=samples["time_s"][mine],
                y=samples["kv_occupancy"][mine],
                mode="lines",
                name=f"replica {replica}",
            ),
            row=2,
            col=1,
        )
    fig.update_xaxes(type="log", title_text="seconds", row=1, col=1)
    fig.update_yaxes(title_text="share of requests", range=[0, 1], row=1, col=1)
    fig.update_xaxes(title_text="simulated seconds", row=2, col=1)
    fig.update_yaxes(title_text="share of KV blocks", range=[0, 1], row=2, col=1)
    fig.update_layout(height=900, template="plotly_white")
    html = fig.to_html(include_plotlyjs="cdn", full_html=True, div_id=DIV_ID)
    write_replacing(path, lambda tmp: tmp.write_text(html, encoding="utf-8"))


__all__ = ["plot_serving"]
