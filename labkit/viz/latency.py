"""Latency figures: step times over a run, the TTFT / ITL / throughput trade-off, goodput.

Invariants:

- every figure is a pure function of its arguments (StepLogs or plain numbers); nothing
  here runs a simulator or an engine, and nothing keeps state between calls;
- times are drawn in the unit the axis names: step times and ITL in milliseconds,
  TTFT in seconds, throughput in output tokens per second, goodput in requests per second;
- a trade-off point is Pareto-optimal when no other point is at least as good on every
  axis (ITL and TTFT lower, throughput higher) and strictly better on one; ties keep both.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import plotly.graph_objects as go

from labkit.sched import StepLog, metrics
from labkit.viz.figures import GRID


class TradeoffPoint(NamedTuple):
    """One run's place in the trade-off: ITL and TTFT at a percentile, and throughput."""

    itl_ms: float
    ttft_s: float
    tokens_per_second: float


def tradeoff_point(log: StepLog, q: float = 99) -> TradeoffPoint:
    """The q-th percentile ITL (ms) and TTFT (s) of a run, and its output tokens per second."""
    itl_ms = 1000 * metrics.percentile(metrics.itl(log), q)
    return TradeoffPoint(itl_ms, metrics.percentile(log.ttft, q), log.tokens_per_second)


def pareto_optimal(points: list[TradeoffPoint]) -> np.ndarray:
    """bool per point: whether no other point dominates it (lower ITL and TTFT, higher throughput)."""
    costs = np.array([(p.itl_ms, p.ttft_s, -p.tokens_per_second) for p in points], float).reshape(-1, 3)
    no_worse = (costs[:, None, :] <= costs[None, :, :]).all(axis=2)  # [j, i]: j at least as good as i
    better = (costs[:, None, :] < costs[None, :, :]).any(axis=2)  # [j, i]: j strictly better somewhere
    return ~(no_worse & better).any(axis=0)


def step_times(logs: dict[str, StepLog]) -> go.Figure:
    """Each step's duration (ms) against the time it started (s), one line per run."""
    fig = go.Figure()
    for name, log in logs.items():
        fig.add_trace(
            go.Scatter(
                x=log.step_start - log.trace.arrivals.min(),
                y=1000 * log.step_seconds,
                customdata=log.num_prefill_tokens,
                hovertemplate="start %{x:.3f} s<br>%{y:.1f} ms<br>prompt tokens %{customdata}",
                mode="lines+markers",
                marker=dict(size=4),
                name=name,
            )
        )
    fig.update_layout(title="Step time over the run", height=380, plot_bgcolor="white")
    fig.update_xaxes(title="step start (s)", gridcolor=GRID)
    fig.update_yaxes(title="step time (ms)", rangemode="tozero", gridcolor=GRID)
    return fig


def latency_tradeoff(logs: dict[str, StepLog], q: float = 99, title: str | None = None) -> go.Figure:
    """TTFT against ITL at the q-th percentile, one labelled point per run, coloured by
    throughput; Pareto-optimal runs are drawn as filled circles, dominated ones as open."""
    names = list(logs)
    points = [tradeoff_point(logs[name], q) for name in names]
    optimal = pareto_optimal(points)
    itl_ms, ttft_s, throughput = (np.array(column, float) for column in zip(*points))
    fig = go.Figure(
        go.Scatter(
            x=itl_ms,
            y=ttft_s,
            mode="markers+text",
            text=names,
            textposition="top right",
            customdata=throughput,
            hovertemplate="%{text}<br>ITL %{x:.1f} ms<br>TTFT %{y:.3f} s<br>%{customdata:.0f} tokens/s",
            marker=dict(
                size=14,
                color=throughput,
                colorscale="Viridis",
                colorbar=dict(title="tokens/s"),
                symbol=["circle" if is_optimal else "circle-open" for is_optimal in optimal],
                line=dict(width=2),
            ),
            name="runs",
        )
    )
    fig.update_layout(title=title or f"TTFT against ITL (p{q:g})", height=420, plot_bgcolor="white")
    fig.update_xaxes(title=f"ITL p{q:g} (ms)", rangemode="tozero", gridcolor=GRID)
    fig.update_yaxes(title=f"TTFT p{q:g} (s)", rangemode="tozero", gridcolor=GRID)
    return fig


def goodput_bars(goodput: dict[str, float], offered: float | None = None, slo: str = "") -> go.Figure:
    """Requests per second that met the SLOs, one bar per run; `offered` draws the arrival rate."""
    names = list(goodput)
    values = [goodput[name] for name in names]
    fig = go.Figure(go.Bar(x=names, y=values, text=[f"{value:.2f}" for value in values], textposition="outside"))
    if offered is not None:
        fig.add_hline(y=offered, line_dash="dot", annotation_text=f"offered {offered:g} requests/s")
    fig.update_layout(title=f"Goodput{': ' + slo if slo else ''}", height=360, plot_bgcolor="white")
    fig.update_xaxes(type="category")
    fig.update_yaxes(title="requests/s meeting every SLO", rangemode="tozero", gridcolor=GRID)
    return fig
