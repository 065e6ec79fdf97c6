"""Memory figures: the KV block pool step by step, preemptions, idle slots beside a queue, a
sweep of pool sizes, and a real server's own occupancy during a replay.

Invariants:

- every figure is a pure function of its arguments: a `StepLog`, a dict of them, a
  replay's `ScrapedSeries`, or plain numbers; nothing here runs a simulator or a replay,
  changes a log or keeps state between calls;
- step s covers [s, s+1) on the x axis ("step"), as in `slot_diagram`, so the figures
  line up with it; per-step values are drawn as steps (`line_shape="hv"`);
- `server_occupancy` draws a replay's scraped gauges against seconds on the trace's clock
  instead, each value held from its scrape to the next, as the series records them;
- blocks are drawn exactly as the log records them (`StepLog.num_blocks_used`);
- `preemption_steps(log)` lists every preemption the log records (`log.preempted_at`):
  its length is `log.num_preemptions`, and it names each request as often as
  `log.preemptions` says.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.sched import StepLog
from labkit.viz.figures import GRID, PALETTE


class GaugeSeries(Protocol):
    """What `server_occupancy` reads: a server's gauges at `times` (s), as a replay's
    `ScrapedSeries` holds them."""

    times: np.ndarray
    running: np.ndarray  # requests running
    waiting: np.ndarray  # requests waiting
    kv_usage: np.ndarray  # share of the KV cache in use, 0..1


def preemption_steps(log: StepLog) -> list[tuple[int, int]]:
    """(step, request id) of every preemption, by step: the request lost its slot before `step`."""
    return sorted(log.preempted_at)


def _stairs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x and y that draw value s over [s, s+1) with line_shape="hv"."""
    values = np.asarray(values)
    return np.arange(len(values) + 1), np.append(values, values[-1:])


def _named(logs: StepLog | dict[str, StepLog]) -> dict[str, StepLog]:
    return logs if isinstance(logs, dict) else {logs.policy: logs}


def _preemption_marks(log: StepLog, name: str, color: str) -> go.Scatter:
    """A cross at each preemption, at the blocks held in the step it happened."""
    marks = preemption_steps(log)
    steps = np.array([step for step, _ in marks], np.int64)
    label_of = dict(zip(log.trace.ids.tolist(), log.trace.labels))
    return go.Scatter(
        x=steps + 0.5,
        y=log.num_blocks_used[steps],
        mode="markers",
        marker=dict(symbol="x", size=10, color=color),
        hovertext=[f"step {step}: request {label_of[request]} preempted" for step, request in marks],
        hoverinfo="text",
        name=f"{name}: preemptions ({len(marks)})",
    )


def pool_usage(
    logs: StepLog | dict[str, StepLog], num_blocks: int | None = None, title: str | None = None
) -> go.Figure:
    """KV blocks held at every step, one line per log, with the pool size and preemptions marked."""
    fig = go.Figure()
    for i, (name, log) in enumerate(_named(logs).items()):
        color = PALETTE[i % len(PALETTE)]
        x, y = _stairs(log.num_blocks_used)
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines", line_shape="hv", line=dict(color=color), name=name))
        if log.num_preemptions:
            fig.add_trace(_preemption_marks(log, name, color))
    if num_blocks is not None:
        fig.add_hline(y=num_blocks, line_dash="dash", annotation_text=f"pool: {num_blocks} blocks")
    fig.update_layout(title=title or "KV blocks in use", height=380, plot_bgcolor="white", hovermode="closest")
    fig.update_xaxes(title="step", rangemode="tozero", gridcolor=GRID)
    fig.update_yaxes(title="KV blocks held", rangemode="tozero", gridcolor=GRID)
    return fig


def running_requests(logs: dict[str, StepLog], title: str | None = None) -> go.Figure:
    """Requests working in a slot at every step, one line per log."""
    fig = go.Figure()
    for name, log in logs.items():
        x, y = _stairs((log.slots >= 0).sum(axis=1))
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines", line_shape="hv", name=name))
    fig.update_layout(title=title or "Requests running per step", height=350, plot_bgcolor="white")
    fig.update_xaxes(title="step", rangemode="tozero", gridcolor=GRID)
    fig.update_yaxes(title="requests running", rangemode="tozero", gridcolor=GRID)
    return fig


def server_occupancy(series: GaugeSeries, title: str | None = None) -> go.Figure:
    """A server's requests running and waiting (top) and its KV cache usage (bottom) over a
    replay, as scraped from its /metrics (`ReplayLog.server`)."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.6, 0.4])
    for i, (name, values) in enumerate((("running", series.running), ("waiting", series.waiting))):
        fig.add_trace(go.Scatter(x=series.times, y=values, mode="lines", line_shape="hv", line_color=PALETTE[i],
                                 name=name), row=1, col=1)
    fig.add_trace(go.Scatter(x=series.times, y=series.kv_usage, mode="lines", line_shape="hv",
                             line_color=PALETTE[2], name="KV cache in use"), row=2, col=1)
    title = title or "The server's own count of who runs and who waits"
    if not len(series):
        title += "<br><sup>nothing scraped: the server has no /metrics</sup>"
    fig.update_layout(title=title, height=460, plot_bgcolor="white", legend=dict(orientation="h", y=-0.2))
    fig.update_xaxes(title="time since the replay began (s)", rangemode="tozero", row=2, col=1, gridcolor=GRID)
    fig.update_xaxes(rangemode="tozero", row=1, col=1, gridcolor=GRID)
    fig.update_yaxes(title="requests", rangemode="tozero", row=1, col=1, gridcolor=GRID)
    fig.update_yaxes(title="KV cache in use", tickformat=".0%", range=[0, 1.05], row=2, col=1, gridcolor=GRID)
    return fig


def idle_beside_queue(log: StepLog, title: str | None = None) -> go.Figure:
    """Requests running and requests waiting at every step; where a slot idles while the head
    of the queue waits, the idle slots are shaded, one colour per reason the log records."""
    running = (log.slots >= 0).sum(axis=1)
    fig = go.Figure()
    gap = (running < log.num_slots) & (log.num_queued > 0)
    for i, reason in enumerate(sorted(set(log.blocked[gap]))):
        steps = np.flatnonzero(gap & (log.blocked == reason))
        idle = log.num_slots - running[steps]
        fig.add_trace(go.Bar(x=steps + 0.5, y=idle, base=running[steps], width=1, opacity=0.45,
                             marker=dict(color=PALETTE[(2 + i) % len(PALETTE)], line_width=0),
                             name=f"idle slots beside a queue: {reason} ({idle.sum()} slot-steps)"))
    for i, (name, values) in enumerate((("running", running), ("waiting", log.num_queued))):
        x, y = _stairs(values)
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines", line_shape="hv", line_color=PALETTE[i], name=name))
    fig.add_hline(y=log.num_slots, line_dash="dash", annotation_text=f"{log.num_slots} slots")
    fig.update_layout(title=title or "Who runs and who waits", height=400, plot_bgcolor="white", bargap=0,
                      legend=dict(orientation="h", y=-0.25))
    fig.update_xaxes(title="step", rangemode="tozero", gridcolor=GRID)
    fig.update_yaxes(title="requests", rangemode="tozero", gridcolor=GRID)
    return fig


def _check_lengths(num_blocks: Sequence, **columns: Sequence) -> None:
    for name, values in columns.items():
        if len(values) != len(num_blocks):
            raise ValueError(f"{name} has {len(values)} values but num_blocks has {len(num_blocks)}")


_DASHES = ("solid", "dash", "dot", "dashdot")


def _sweep_line(key: str | tuple[str, str], keys: list) -> dict:
    """A pair's line: its policy's color and its group's dash; a plain name keeps plotly's defaults."""
    if not isinstance(key, tuple):
        return {}
    policies = list(dict.fromkeys(k[0] for k in keys if isinstance(k, tuple)))
    groups = list(dict.fromkeys(k[1] for k in keys if isinstance(k, tuple)))
    return {"color": PALETTE[policies.index(key[0]) % len(PALETTE)],
            "dash": _DASHES[groups.index(key[1]) % len(_DASHES)]}


def pool_sweep(
    num_blocks: Sequence[int],
    tokens_per_second: dict[str | tuple[str, str], Sequence[float]],
    recomputed_tokens: Sequence[int],
    num_preemptions: Sequence[int] | None = None,
    peak: int | None = None,
    y_title: str = "tokens/s",
) -> go.Figure:
    """Throughput (top, one line per policy) and recomputed tokens (bottom) against the pool size.

    tokens_per_second: a series per name; a name that is a pair (policy, group), such as
    (policy, price), draws each policy in one color and each group in its own dash.
    num_preemptions: shown when hovering over the recompute bars.
    peak: a pool size to mark, e.g. the most blocks an unbounded run ever held.
    y_title: the top panel's axis, e.g. "share of the best tokens/s" for series scaled to it.
    """
    names = {key: ", ".join(key) if isinstance(key, tuple) else key for key in tokens_per_second}
    _check_lengths(num_blocks, recomputed_tokens=recomputed_tokens,
                   **{names[key]: values for key, values in tokens_per_second.items()})
    if num_preemptions is not None:
        _check_lengths(num_blocks, num_preemptions=num_preemptions)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.6, 0.4])
    for key, values in tokens_per_second.items():
        fig.add_trace(go.Scatter(x=list(num_blocks), y=list(values), mode="lines+markers", name=names[key],
                                 line=_sweep_line(key, list(tokens_per_second))), row=1, col=1)
    hover = None if num_preemptions is None else [f"{n} preemptions" for n in num_preemptions]
    fig.add_trace(
        go.Bar(x=list(num_blocks), y=list(recomputed_tokens), hovertext=hover, name="recomputed tokens"), row=2, col=1
    )
    if peak is not None:
        fig.add_vline(x=peak, line_dash="dot", row=1, col=1)
        fig.add_vline(x=peak, line_dash="dot", annotation_text=f"peak demand {peak}", annotation_position="top right",
                      row=2, col=1)  # labelled in the lower panel, where no bars stand beyond the peak
    fig.update_layout(title="KV pool size against throughput and recompute", height=520, plot_bgcolor="white")
    fig.update_xaxes(title="KV pool (blocks)", row=2, col=1, gridcolor=GRID)
    fig.update_yaxes(title=y_title, rangemode="tozero", row=1, col=1, gridcolor=GRID)
    fig.update_yaxes(title="recomputed tokens", rangemode="tozero", row=2, col=1, gridcolor=GRID)
    return fig
