"""Figures of what an engine step costs: step time against batch size or context, and its parts.

They read plain dicts of measured seconds (from `Engine.time_decode_step` and
`Engine.decode_step_parts`), never an engine.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.viz.figures import GRID, request_color

AXES = {"batch size": "batch size (requests per step)", "context": "context (tokens in each request's cache)"}
PARTS = ("GEMMs", "attention", "other")
PER_TOKEN = {False: "ms per token", True: "per token, share of the smallest batch's"}
PER_TOKEN_AXIS = {False: "ms per token", True: "per token, share<br>of the smallest batch's"}  # fits its panel
MARK_DASHES = ("dot", "dash", "dashdot", "longdash")
MARK_COLORS = ("dimgrey", "#8c564b", "#2ca02c", "#9467bd")  # apart from the curves' colours


def step_time_curve(seconds: dict[str, dict[int, float]], against: str = "batch size", *,
                    marks: dict[str, float] | None = None, relative: bool = False,
                    title: str | None = None) -> go.Figure:
    """Measured step time, one curve per name (an attention layout, say), against batch size (on a
    log axis) or context (on a linear one). Against batch size, a second panel below shows each
    curve's time per token, on a scale of its own, in the same colour; with `relative`, as a
    share of that curve's time per token at its smallest batch, so curves of different scales
    compare. `marks` draws a vertical line at each x, across the step-time panel, each in a dash of its
    own and named in the legend (labels on the plot would overlap where marks lie close)."""
    if against not in AXES:
        raise ValueError(f"against = {against!r}: must be one of {', '.join(AXES)}")
    per_token = against == "batch size"
    if relative and not per_token:
        raise ValueError("relative = True: needs against = 'batch size', where there is a time per token")
    fig = make_subplots(rows=1 + per_token, cols=1, shared_xaxes=True, vertical_spacing=0.1)
    for i, (name, by_x) in enumerate(seconds.items()):
        x, ms = np.array(list(by_x)), 1000 * np.array(list(by_x.values()))
        color = request_color(i)
        fig.add_trace(go.Scatter(x=x, y=ms, mode="lines+markers", name=f"{name}: ms per step", line_color=color),
                      row=1, col=1)
        if per_token:
            y = (ms / x) / (ms[0] / x[0]) if relative else ms / x
            fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=f"{name}: {PER_TOKEN[relative]}",
                                     line=dict(color=color, dash="dash")), row=2, col=1)
    top = 1.05 * max(1000 * max(by_x.values()) for by_x in seconds.values())
    for i, (label, x) in enumerate((marks or {}).items()):
        style = dict(color=MARK_COLORS[i % len(MARK_COLORS)], dash=MARK_DASHES[i % len(MARK_DASHES)])
        fig.add_trace(go.Scatter(x=[x, x], y=[0, top], mode="lines", name=label, hoverinfo="name", line=style),
                      row=1, col=1)
    fig.update_layout(title=title or f"Decode step time against {against}", height=380 + 160 * per_token,
                      plot_bgcolor="white", showlegend=True)
    if per_token:  # batch sizes double: a log axis spaces them evenly
        fig.update_xaxes(type="log", tickvals=sorted({x for by_x in seconds.values() for x in by_x}))
    else:  # a linear axis, on which a time proportional to the context is a straight line
        fig.update_xaxes(rangemode="tozero")
    fig.update_xaxes(gridcolor=GRID)
    fig.update_xaxes(title=AXES[against], row=1 + per_token, col=1)
    fig.update_yaxes(title="ms per step", rangemode="tozero", gridcolor=GRID, row=1, col=1)
    if per_token:
        fig.update_yaxes(title=PER_TOKEN_AXIS[relative], rangemode="tozero", gridcolor=GRID, row=2, col=1)
    return fig


def step_breakdown(parts: dict[int, dict[str, float]]) -> go.Figure:
    """A decode step's time at each batch size, stacked: GEMMs, attention, everything else."""
    sizes = [f"B = {b}" for b in parts]
    fig = go.Figure([go.Bar(x=sizes, y=[1000 * p[part] for p in parts.values()], name=part) for part in PARTS])
    fig.update_layout(title="What a decode step is made of", barmode="stack", height=350, plot_bgcolor="white")
    fig.update_yaxes(title="milliseconds", gridcolor=GRID)
    return fig
