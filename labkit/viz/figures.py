"""Static figures: slot diagrams, utilization bars, the harmonic curve and theory plots.

Invariants:

- every figure is a pure function of its arguments: a `StepLog`, a dict of them, or
  plain numbers; nothing here runs a simulator or keeps state between calls;
- in a slot diagram, step s covers [s, s+1) on the x axis ("step") and slot k sits on
  row k of the y axis ("slot"), slot 0 on top; one horizontal bar is one contiguous
  run of one request in one slot, so the bar count grows with runs, not with steps;
- idle slot-steps draw nothing, and a request's colour depends on its id alone, so a
  request looks the same in every diagram of the same trace;
- utilizations are fractions in the data and read as percent on the axes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative

from labkit.sched import StepLog
from labkit.theory import MonteCarlo, exponential_utilization
from labkit.traffic import Trace

PALETTE = tuple(qualitative.Plotly)
GRID = "#e5e5e5"  # light grid lines, shared by every figure
SEED_BATCH_SIZES = (8, 32, 64)
_MAX_SLOT_ROWS = 16  # a slot diagram grows taller up to this many slots; past it, rows thin and ticks space out


class _Runs(NamedTuple):
    """Contiguous runs of one request in one slot; a run covers steps [start, stop)."""

    slot: np.ndarray
    request: np.ndarray
    start: np.ndarray
    stop: np.ndarray


def request_color(request_id: int) -> str:
    """The colour of a request in every slot diagram."""
    return PALETTE[int(request_id) % len(PALETTE)]


def _slot_runs(log: StepLog) -> _Runs:
    """Every run of a request in a slot, ordered by slot, then start."""
    columns = []
    for slot, ids in enumerate(log.slots.T):
        # -2 is never an id, so the first step starts a run and the last one ends one
        starts = np.flatnonzero(np.diff(ids, prepend=-2))
        stops = np.flatnonzero(np.diff(ids, append=-2)) + 1
        busy = ids[starts] >= 0
        columns.append((np.full(busy.sum(), slot), ids[starts][busy], starts[busy], stops[busy]))
    return _Runs(*(np.concatenate(parts).astype(np.int64) for parts in zip(*columns)))


def _labels(log: StepLog, request_ids: np.ndarray) -> list[str]:
    label_of = dict(zip(log.trace.ids.tolist(), log.trace.labels))
    return [label_of[request_id] for request_id in request_ids.tolist()]


def _visible(runs: _Runs, labels: list[str], step: int) -> tuple[np.ndarray, list[str]]:
    """Bar lengths and texts when only steps [0, step) are shown."""
    lengths = np.clip(np.minimum(runs.stop, step) - runs.start, 0, None)
    return lengths, [label if length else "" for label, length in zip(labels, lengths)]


def _run_bars(log: StepLog) -> go.Bar:
    runs = _slot_runs(log)
    labels = _labels(log, runs.request)
    lengths, texts = _visible(runs, labels, log.num_steps)
    hover = [
        f"{label}: slot {slot}, steps {start}–{stop - 1}"
        for label, slot, start, stop in zip(labels, runs.slot.tolist(), runs.start.tolist(), runs.stop.tolist())
    ]
    return go.Bar(
        orientation="h",
        base=runs.start,
        x=lengths,
        y=runs.slot,
        text=texts,
        textposition="inside",
        insidetextanchor="middle",
        hovertext=hover,
        hoverinfo="text",
        marker=dict(color=[request_color(r) for r in runs.request.tolist()], line=dict(color="white", width=1)),
        width=0.8,
        showlegend=False,
    )


def slot_diagram(log: StepLog, title: str | None = None, num_steps: int | None = None) -> go.Figure:
    """Who holds which slot at every step: one row per slot, one bar per run of a request.

    num_steps: the x axis spans steps [0, num_steps), so that diagrams of logs of different
    lengths share one scale; by default the log's own steps.
    """
    if title is None:
        title = f"{log.policy}: {log.num_steps} steps, utilization {log.utilization:.1%}"
    if num_steps is None:
        num_steps = log.num_steps
    elif isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or num_steps < log.num_steps:
        raise ValueError(f"num_steps = {num_steps!r}: must be a whole number >= the log's {log.num_steps} steps")
    num_rows = min(log.num_slots, _MAX_SLOT_ROWS)
    fig = go.Figure(_run_bars(log))
    fig.update_layout(
        title=title,
        height=110 + 40 * num_rows,
        margin=dict(l=50, r=20, t=50, b=40),
        plot_bgcolor="white",
        uniformtext=dict(minsize=8, mode="hide"),
    )
    fig.update_xaxes(title="step", range=[0, max(num_steps, 1)], showgrid=True, gridcolor=GRID)
    fig.update_yaxes(
        title="slot",
        range=[log.num_slots - 0.5, -0.5],
        tick0=0,
        dtick=-(-log.num_slots // _MAX_SLOT_ROWS),
        showgrid=False,
    )
    return fig


def clipped_bars(log: StepLog, step: int) -> dict:
    """The bar lengths (`x`) and texts of `slot_diagram(log)` when only steps [0, step) are shown."""
    runs = _slot_runs(log)
    lengths, texts = _visible(runs, _labels(log, runs.request), step)
    return dict(x=lengths, text=texts)


def show_steps(fig: go.Figure, log: StepLog, step: int) -> None:
    """Clip `fig`, a `slot_diagram(log)`, to steps [0, step), in one update message."""
    bars = clipped_bars(log, step)
    with fig.batch_update():
        fig.data[0].x = bars["x"]
        fig.data[0].text = bars["text"]


def utilization_bars(logs: dict[str, StepLog]) -> go.Figure:
    """One bar per named log: its utilization, printed on the bar."""
    names = list(logs)
    values = [logs[name].utilization for name in names]
    fig = go.Figure(go.Bar(x=names, y=values, text=[f"{value:.1%}" for value in values], textposition="outside"))
    fig.update_layout(title="Slot utilization", height=350, plot_bgcolor="white", margin=dict(t=50, b=40))
    fig.update_yaxes(title="utilization", tickformat=".0%", range=[0, 1.1], dtick=0.2, gridcolor=GRID)
    return fig


def harmonic_curves(
    batch_sizes=range(1, 65),
    simulated: dict[int, float] | None = None,
    seeds=SEED_BATCH_SIZES,
    curves: dict[str, dict[int, float]] | None = None,
) -> go.Figure:
    """Static utilization against batch size B (log scale): the theory line 1/H_B for exponential lengths.

    simulated: {B: utilization} of static batching simulated on a backlogged queue of
        exponential lengths, drawn as crosses on top of everything else.
    seeds: batch sizes marked on the line (open circles, so a cross inside stays visible)
        and annotated with their value.
    curves: extra named lines {name: {B: utilization}}, e.g. other length distributions.
    """
    sizes = np.asarray(list(batch_sizes))
    fig = go.Figure(go.Scatter(x=sizes, y=exponential_utilization(sizes), mode="lines", name="exponential: 1/H_B"))
    for name, points in (curves or {}).items():
        fig.add_trace(_curve(points, name, mode="lines+markers"))
    if len(seeds):
        fig.add_trace(_seed_points(seeds))
    if simulated:
        fig.add_trace(_curve(simulated, "simulated static batching, exponential", mode="markers", marker=dict(symbol="x", size=9)))
    fig.update_layout(
        title="Static batching: utilization against batch size B",
        height=420,
        plot_bgcolor="white",
        margin=dict(r=100),
    )
    powers_of_two = [2**k for k in range(int(np.log2(sizes.max())) + 1) if 2**k >= sizes.min()]
    fig.update_xaxes(title="batch size B (log scale)", type="log", tickvals=powers_of_two, gridcolor=GRID)
    fig.update_yaxes(title="static utilization", tickformat=".0%", rangemode="tozero", gridcolor=GRID)
    return fig


def _seed_points(seeds) -> go.Scatter:
    """The theory line's value at each seed batch size, marked and written out."""
    sizes = np.asarray(list(seeds))
    values = exponential_utilization(sizes)
    return go.Scatter(
        x=sizes,
        y=values,
        mode="markers+text",
        text=[f"B={b}: {value:.1%}" for b, value in zip(sizes.tolist(), values)],
        textposition="top right",
        cliponaxis=False,
        marker=dict(size=13, color="black", symbol="circle-open", line=dict(width=2)),
        name="1/H_B at B = " + ", ".join(map(str, sizes.tolist())),
    )


def _curve(points: dict[int, float], name: str, **style) -> go.Scatter:
    """A {B: utilization} dict as a scatter trace."""
    return go.Scatter(x=list(points), y=list(points.values()), name=name, **style)


def monte_carlo_convergence(result: MonteCarlo, num_points: int = 200) -> go.Figure:
    """Running estimates over repeated batches: pooled utilization against the mean of per-batch ratios.

    Drawn at about `num_points` log-spaced batch counts, so the figure stays small.
    """
    shown = np.unique(np.geomspace(1, len(result.pooled), num_points).astype(np.int64)) - 1
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=shown + 1, y=result.pooled[shown], name="pooled: ΣL / (B·Σmax)"))
    fig.add_trace(go.Scatter(x=shown + 1, y=result.mean_of_ratios[shown], name="mean of per-batch ratios"))
    limit = exponential_utilization(result.batch_size)
    fig.add_hline(y=limit, line_dash="dot", annotation_text=f"1/H_{result.batch_size} = {limit:.1%}")
    fig.update_layout(title=f"Repeated static batches, B = {result.batch_size}", height=380, plot_bgcolor="white")
    fig.update_xaxes(title="batches drawn", type="log", gridcolor=GRID)
    fig.update_yaxes(title="utilization estimate", tickformat=".0%", gridcolor=GRID)
    return fig


def length_histogram(trace: Trace, num_bins: int = 100) -> go.Figure:
    """The distribution of a trace's output lengths (binned here, so the figure stays small), mean marked."""
    lengths = trace.output_lengths
    counts, edges = np.histogram(lengths, bins=num_bins)
    fig = go.Figure(go.Bar(x=(edges[:-1] + edges[1:]) / 2, y=counts, width=np.diff(edges), name="requests"))
    fig.add_vline(x=float(lengths.mean()), line_dash="dot", annotation_text=f"mean {lengths.mean():.0f}")
    fig.update_layout(title=f"Output lengths of {len(trace):,} requests", height=350, plot_bgcolor="white")
    fig.update_xaxes(title="output tokens")
    fig.update_yaxes(title="requests", gridcolor=GRID)
    return fig


def redraw(fig: go.Figure, log: StepLog) -> None:
    """Replace the bars of `fig`, a slot diagram, with `log`'s so far, in one update message."""
    bars = _run_bars(log)
    with fig.batch_update():
        fig.data[0].update(base=bars.base, x=bars.x, y=bars.y, text=bars.text, hovertext=bars.hovertext)
        fig.data[0].marker.color = bars.marker.color
        fig.layout.xaxis.range = [0, max(log.num_steps, 1)]


def phase_split(logs: dict[str, StepLog]) -> go.Figure:
    """Where each engine run's time went: schedule, prepare, forward and sample, stacked."""
    names = list(logs)
    fig = go.Figure()
    for phase in ("schedule", "prepare", "forward", "sample"):
        seconds = [float(logs[name].phase_seconds[phase].sum()) for name in names]
        fig.add_trace(go.Bar(x=names, y=seconds, name=phase))
    fig.update_layout(title="Engine time by phase", barmode="stack", height=350, plot_bgcolor="white")
    fig.update_yaxes(title="seconds", gridcolor=GRID)
    return fig
