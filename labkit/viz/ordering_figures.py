"""Who goes first, drawn: figures that compare queue orders (first come, priority, shortest
predicted first) on the same requests. `labkit.analysis.ordering` holds the tables, and
`labkit.exercises.ordering_question` lesson 11's question (q9).

- `ttft_waiting`: the share of requests still without a first token after x seconds, log-log;
- `ttft_by_length`: mean TTFT against output length, in groups of equal size: who pays;
- `noise_sweep`: TTFT (mean, median, p99) of noisier and noisier length predictors, as a
  share of a reference run's (first come, first served).

Invariants: every number comes from StepLogs (their requests' `ttft` and token times)
through `labkit.analysis.ordering`; nothing here runs a simulator, and nothing keeps
state between calls. Runs compared request by request (groups, output-length bins) must
cover the same requests in the same order. `ttft_waiting` draws fixed shares of requests
(`WAITING_SHARES`), so a figure stays small whatever the run's size.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from labkit.analysis.ordering import group_mask, length_bins, statistic
from labkit.sched import StepLog
from labkit.viz.figures import GRID, PALETTE

ONE_TWO_FIVE = [m * 10.0**e for e in range(-3, 4) for m in (1, 2, 5)]  # log-axis ticks, labelled in full
TTFT_STATS = {"mean": "mean", "p50": "median", "p99": "p99"}  # noise_sweep's lines: a stat and its name
WAITING_SHARES = np.logspace(0, -3, 121)  # ttft_waiting's points: shares of requests from all to 0.1%, log-spaced


def _same_requests(logs) -> None:
    first = next(iter(logs))
    for log in logs:
        if not np.array_equal(log.trace.ids, first.trace.ids):
            raise ValueError("every run must cover the same requests, in the same order")


def ttft_waiting(runs: dict[str, StepLog | tuple[StepLog, np.ndarray]], title: str | None = None) -> go.Figure:
    """The share of requests still without a first token x seconds after arriving (one minus
    the TTFT's distribution), one line per run, both axes log, so the median (0.5) and the
    tail (0.01 is p99) both show. A run may be `(log, chosen)` to draw only the chosen
    requests (a bool each)."""
    if not runs:
        raise ValueError("runs = {}: give at least one run to draw")
    fig = go.Figure()
    for index, (name, run) in enumerate(runs.items()):
        log, chosen = run if isinstance(run, tuple) else (run, np.ones(len(run.trace), bool))
        ttft = log.ttft[group_mask(log, chosen)]
        ttft = ttft[~np.isnan(ttft)]
        fig.add_trace(go.Scatter(
            x=np.quantile(ttft, 1 - WAITING_SHARES), y=WAITING_SHARES, mode="lines", name=name,
            line=dict(color=PALETTE[index % len(PALETTE)], width=2),
            hovertemplate=f"{name}<br>%{{y:.2%}} still waiting after %{{x:.3g}} s<extra></extra>"))
    fig.update_layout(title=title or "Still waiting: the share of requests with no first token after x seconds",
                      height=460, plot_bgcolor="white", legend=dict(orientation="h", y=-0.25))
    fig.update_xaxes(type="log", title="seconds since arrival (log scale)", gridcolor=GRID)
    shares = [1, 0.5, 0.1, 0.01, 0.001]
    fig.update_yaxes(type="log", title="share still waiting (log scale)", gridcolor=GRID, tickvals=shares,
                     ticktext=[f"{share:.1%}".replace(".0%", "%") for share in shares])
    for share, label in ((0.5, "median"), (0.01, "p99")):  # at the left, where every run still waits
        fig.add_hline(y=share, line=dict(color="grey", dash="dot", width=1))
        fig.add_annotation(x=0, xref="paper", xanchor="left", y=np.log10(share), yref="y", yanchor="bottom",
                           text=f"{label}: {share:.0%} still waiting", showarrow=False, font=dict(color="grey"))
    return fig


def ttft_by_length(logs: dict[str, StepLog], num_bins: int = 10, title: str | None = None) -> go.Figure:
    """Mean TTFT of each output-length group (about equal sizes, shortest first, labelled by
    their range of lengths), one line per run, on a log y axis: who waits, by size."""
    if not logs:
        raise ValueError("logs = {}: give at least one run to draw")
    _same_requests(logs.values())
    lengths = next(iter(logs.values())).trace.output_lengths
    bins = length_bins(lengths, num_bins)
    members = [bins == b for b in np.unique(bins)]
    labels = [f"{int(lengths[m].min())}–{int(lengths[m].max())}" for m in members]
    fig = go.Figure()
    for index, (name, log) in enumerate(logs.items()):
        fig.add_trace(go.Scatter(
            x=labels, y=[statistic(log.ttft[m], "mean") for m in members], mode="lines+markers", name=name,
            customdata=[int(m.sum()) for m in members], line=dict(color=PALETTE[index % len(PALETTE)], width=2),
            marker=dict(size=8),
            hovertemplate=(f"{name}<br>outputs of %{{x}} tokens (%{{customdata}} requests)<br>"
                           "mean TTFT %{y:.3g} s<extra></extra>")))
    fig.update_layout(title=title or "Who waits: mean TTFT by output length, in groups of about equal size",
                      height=440, plot_bgcolor="white", legend=dict(orientation="h", y=-0.28))
    fig.update_xaxes(type="category", title="output length (tokens), shortest group first", gridcolor=GRID)
    fig.update_yaxes(type="log", title="mean TTFT (s, log scale)", gridcolor=GRID, tickvals=ONE_TWO_FIVE)
    return fig


def noise_sweep(runs: dict[str, StepLog], reference: StepLog, reference_name: str = "FCFS",
                title: str | None = None) -> go.Figure:
    """Each run's TTFT mean, median and p99 as a share of `reference`'s, one line per statistic
    over the runs in the order given (noise levels, say), on a log y axis where 1 is the
    reference: below it a run beats the reference, above it a run is worse."""
    if not runs:
        raise ValueError("runs = {}: give at least one run to draw")
    names = list(runs)
    fig = go.Figure()
    for index, (stat, label) in enumerate(TTFT_STATS.items()):
        base = statistic(reference.ttft, stat)
        seconds = [statistic(runs[name].ttft, stat) for name in names]
        fig.add_trace(go.Scatter(
            x=names, y=[s / base for s in seconds], mode="lines+markers", name=f"TTFT {label}",
            customdata=[[s, base] for s in seconds], line=dict(color=PALETTE[index], width=2), marker=dict(size=9),
            hovertemplate=(f"noise %{{x}}: TTFT {label} %{{customdata[0]:.3g}} s<br>"
                           f"{reference_name} %{{customdata[1]:.3g}} s (%{{y:.2f}}×)<extra></extra>")))
    fig.add_hline(y=1, line=dict(color="black", dash="dash", width=1.5))
    fig.add_annotation(x=0, xref="paper", xanchor="left", y=0, yref="y", yanchor="bottom", showarrow=False,
                       text=f"{reference_name} = 1")  # y in log10 units on a log axis: 10^0 = 1
    fig.update_layout(title=title or f"TTFT of shortest-predicted-first as the predictor gets noisier, "
                                     f"as a share of {reference_name}'s",
                      height=420, plot_bgcolor="white", legend=dict(orientation="h", y=-0.22))
    fig.update_xaxes(type="category", title="predictor noise (log-normal σ)", gridcolor=GRID)
    fig.update_yaxes(type="log", title=f"TTFT / {reference_name}'s (log scale)", gridcolor=GRID, tickvals=ONE_TWO_FIVE)
    return fig
