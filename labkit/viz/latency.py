"""Latency figures: step times over a run, the TTFT / ITL / throughput trade-off, goodput.

Invariants:

- every figure is a pure function of its arguments (StepLogs or plain numbers); nothing
  here runs a simulator or an engine, and nothing keeps state between calls;
- times are drawn in the unit the axis names: step times and ITL in milliseconds,
  TTFT in seconds, throughput in output tokens per second, goodput in requests per second;
- a step is drawn over its own duration, so a long step reads as a long flat stretch,
  never as a slope into the next one;
- the trade-off marks as Pareto-optimal the runs `labkit.analysis.tradeoff` finds so, with
  its ties (`rtol`, 1%); each point's label gives its throughput when the runs'
  throughputs differ by more than that tolerance (a label, not a colour scale, which would
  stretch a few percent across its whole range).
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.analysis.tradeoff import RTOL, pareto_optimal, tradeoff_point
from labkit.sched import StepLog
from labkit.viz.figures import GRID, PALETTE

LABEL_POSITIONS = ("top center", "bottom center", "middle right", "middle left")
LABEL_REACH = 0.08  # share of an axis within which two points' labels would collide


def step_times(logs: dict[str, StepLog]) -> go.Figure:
    """Each step's duration (ms), drawn flat from the step's start to its end (s since the
    first arrival): a staircase per run, broken where the run idled between steps."""
    fig = go.Figure()
    for name, log in logs.items():
        first_arrival = log.trace.arrivals.min()
        x, y, prompt_tokens = staircase(log.step_start - first_arrival, log.step_end - first_arrival,
                                        1000 * log.step_seconds, log.num_prefill_tokens)
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                customdata=prompt_tokens,
                hovertemplate="%{x:.3f} s<br>step of %{y:.1f} ms<br>prompt tokens %{customdata}",
                mode="lines",
                line_shape="hv",
                name=name,
            )
        )
    fig.update_layout(title="Step time over the run: each step drawn over its own duration", height=380,
                      plot_bgcolor="white")
    fig.update_xaxes(title="time since the first arrival (s)", gridcolor=GRID)
    fig.update_yaxes(title="step time (ms)", rangemode="tozero", gridcolor=GRID)
    return fig


def staircase(starts, ends, heights, labels) -> tuple[list, list, list]:
    """x, y and a label per point for a line drawn with line_shape "hv": each step flat at its
    height from its start to its end; None breaks the line where the next step starts later."""
    x, y, shown = [], [], []
    for i, (start, end, height, label) in enumerate(zip(starts, ends, heights, labels)):
        x.append(float(start))
        y.append(float(height))
        shown.append(label)
        is_last = i == len(starts) - 1
        if is_last or not np.isclose(starts[i + 1], end, rtol=0, atol=1e-9):  # the line must end at this step's end
            x += [float(end), None]
            y += [float(height), None]
            shown += [label, None]
    return x, y, shown


def label_positions(x, y) -> list[str]:
    """A text position per point, so that points closer than LABEL_REACH of both axes (which
    start at zero) get different sides: the first one's label above, the next one's below."""
    scaled = np.column_stack([x, y]).astype(float)
    scaled /= np.maximum(np.nanmax(scaled, axis=0), 1e-12)  # each axis as a share of its length
    positions = []
    for i in range(len(scaled)):
        near = np.abs(scaled[:i] - scaled[i]).max(axis=1) < LABEL_REACH  # the earlier points close to this one
        taken = {positions[j] for j in np.flatnonzero(near)}
        positions.append(next((p for p in LABEL_POSITIONS if p not in taken), LABEL_POSITIONS[0]))
    return positions


def latency_tradeoff(logs: dict[str, StepLog], q: float = 99, title: str | None = None,
                     rtol: float = RTOL) -> go.Figure:
    """TTFT against ITL at the q-th percentile, one labelled point per run, in two traces:
    Pareto-optimal runs (ties within `rtol`) as filled circles, dominated ones as open grey
    circles. Each label gives the run's throughput when the runs' throughputs differ by more
    than `rtol`; otherwise the subtitle gives the one throughput they share."""
    if not logs:
        raise ValueError("logs = {}: give at least one run to place")
    names = np.array(list(logs))
    points = [tradeoff_point(logs[name], q) for name in names]
    itl_ms, ttft_s, throughput = (np.array(column, float) for column in zip(*points))
    optimal = pareto_optimal(points, rtol)
    positions = np.array(label_positions(itl_ms, ttft_s))
    title = title or f"TTFT against ITL (p{q:g})"
    differ = throughput.max() - throughput.min() > rtol * throughput.max()
    if not differ:
        title += f"<br><sup>every run: {throughput.mean():,.0f} tokens/s (within {rtol:.0%})</sup>"
    fig = go.Figure()
    for kind, chosen in (("Pareto-optimal", optimal), ("dominated", ~optimal)):
        if not chosen.any():
            continue
        marker = dict(size=14, line=dict(width=2), symbol="circle")
        if kind == "dominated":
            marker |= dict(symbol="circle-open", color="grey")
        fig.add_trace(
            go.Scatter(
                x=itl_ms[chosen],
                y=ttft_s[chosen],
                mode="markers+text",
                text=names[chosen].tolist(),
                texttemplate="%{text}<br>%{customdata:,.0f} tokens/s" if differ else "%{text}",
                textposition=positions[chosen].tolist(),
                cliponaxis=False,  # a label below a point near the axis stays whole
                customdata=throughput[chosen],
                hovertemplate="%{text}<br>ITL %{x:.1f} ms<br>TTFT %{y:.3f} s<br>%{customdata:.0f} tokens/s",
                marker=marker,
                name=f"{kind} (ties within {rtol:.0%})" if kind == "dominated" else kind,
            )
        )
    fig.update_layout(title=title, height=440, plot_bgcolor="white", legend=dict(orientation="h", y=-0.25))
    fig.update_xaxes(title=f"ITL p{q:g} (ms)", range=[0, 1.1 * np.nanmax(itl_ms)], gridcolor=GRID)
    fig.update_yaxes(title=f"TTFT p{q:g} (s)", range=[0, 1.15 * np.nanmax(ttft_s)], gridcolor=GRID)
    return fig


def goodput_bars(goodput: dict[str, float], offered: float | None = None, slo: str = "") -> go.Figure:
    """Requests per second that met the SLOs, one bar per run; `offered` draws the arrival rate."""
    names = list(goodput)
    values = [goodput[name] for name in names]
    fig = go.Figure(go.Bar(x=names, y=values, text=[f"{value:.2f}" for value in values], textposition="inside",
                           insidetextanchor="end"))  # inside the bar's top: never across the offered line
    if offered is not None:
        fig.add_hline(y=offered, line_dash="dot", annotation_text=f"offered {offered:g} requests/s")
    fig.update_layout(title=f"Goodput{': ' + slo if slo else ''}", height=360, plot_bgcolor="white")
    fig.update_xaxes(type="category")
    fig.update_yaxes(title="requests/s meeting every SLO", rangemode="tozero", gridcolor=GRID)
    return fig


def predicted_against_measured(predicted, measured, title: str | None = None) -> go.Figure:
    """Each request's TTFT and end-to-end latency, predicted (x) against measured (y), in ms, one
    panel each; the diagonal is a perfect prediction. Both logs list the same requests in the
    same order (a simulation of the trace a replay sent, say)."""
    if len(predicted.trace) != len(measured.trace) or not np.array_equal(predicted.trace.ids, measured.trace.ids):
        raise ValueError("predicted and measured must cover the same requests, in the same order")
    fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT", "end-to-end latency"), horizontal_spacing=0.12)
    for column, metric in enumerate(("ttft", "latency"), start=1):
        x, y = 1000 * getattr(predicted, metric), 1000 * getattr(measured, metric)
        reach = float(np.nanmax(np.concatenate([x, y]))) * 1.05
        fig.add_trace(go.Scatter(x=[0, reach], y=[0, reach], mode="lines", line=dict(color="grey", dash="dot"),
                                 name="measured = predicted", showlegend=column == 1), row=1, col=column)
        fig.add_trace(go.Scatter(x=x, y=y, mode="markers", name="a request", showlegend=column == 1,
                                 marker=dict(color=PALETTE[0], size=8), text=[f"request {i}" for i in measured.trace.ids],
                                 hovertemplate="%{text}<br>predicted %{x:.0f} ms<br>measured %{y:.0f} ms"),
                      row=1, col=column)
        fig.update_xaxes(title="predicted (ms)", range=[0, reach], gridcolor=GRID, row=1, col=column)
        fig.update_yaxes(title="measured (ms)", range=[0, reach], gridcolor=GRID, row=1, col=column)
    fig.update_layout(title=title or "Each request, predicted against measured", height=420, plot_bgcolor="white",
                      legend=dict(orientation="h", y=-0.25))
    return fig
