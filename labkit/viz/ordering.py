"""Who goes first: the numbers and figures that compare queue orders (first come, priority,
shortest predicted first) on the same requests.

- `policy_table`: TTFT, ITL and end-to-end percentiles and throughput, one row per run;
- `group_table`: TTFT and latency of chosen groups of requests (a priority class, the
  longest outputs) in each run;
- `gain_table`: TTFT of several runs (noise levels, say), and how much of the first run's
  gain in mean TTFT over a reference each one keeps;
- `ttft_waiting`: the share of requests still without a first token after x seconds, log-log;
- `ttft_by_length`: mean TTFT against output length, in groups of equal size: who pays;
- `noise_sweep`: TTFT (mean, median, p99) of noisier and noisier length predictors, as a
  share of a reference run's (first come, first served).

Invariants: every number comes from StepLogs (their requests' `ttft`, `latency` and token
times) through `labkit.sched.metrics`; nothing here runs a simulator, and nothing keeps
state between calls. Runs compared request by request (groups, output-length bins) must
cover the same requests in the same order. `ttft_waiting` draws fixed shares of requests
(`WAITING_SHARES`), so a figure stays small whatever the run's size.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from labkit.sched import StepLog, metrics
from labkit.viz.figures import GRID, PALETTE

ONE_TWO_FIVE = [m * 10.0**e for e in range(-3, 4) for m in (1, 2, 5)]  # log-axis ticks, labelled in full
TTFT_STATS = {"mean": "mean", "p50": "median", "p99": "p99"}  # noise_sweep's lines: a stat and its name
WAITING_SHARES = np.logspace(0, -3, 121)  # ttft_waiting's points: shares of requests from all to 0.1%, log-spaced


def statistic(values: np.ndarray, stat: str) -> float:
    """"mean", "p50", "p99" or "max" of the values that are not NaN."""
    values = np.asarray(values, float)
    values = values[~np.isnan(values)]
    if stat == "mean":
        return float(values.mean()) if len(values) else float("nan")
    if stat == "max":
        return float(values.max()) if len(values) else float("nan")
    if stat.startswith("p"):
        return metrics.percentile(values, float(stat[1:]))
    raise ValueError(f"stat = {stat!r}: choose mean, max or a percentile such as p50")


POLICY_COLUMNS = ("TTFT mean", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "e2e p50", "e2e p99", "tokens/s")


SUMMARY_KEYS = {"TTFT p50": "TTFT p50 (s)", "TTFT p99": "TTFT p99 (s)", "ITL p50": "ITL p50 (ms)",
                "ITL p99": "ITL p99 (ms)", "e2e p50": "latency p50 (s)", "e2e p99": "latency p99 (s)",
                "tokens/s": "tokens/s"}  # policy_row's columns, as `metrics.summary` names them


def policy_row(log: StepLog) -> dict[str, float]:
    """One run's TTFT (s), ITL (ms) and end-to-end latency (s) percentiles, and output tokens/s:
    `metrics.summary`'s, with the mean TTFT."""
    summary = metrics.summary(log)
    return {"TTFT mean": statistic(log.ttft, "mean"), **{column: summary[key] for column, key in SUMMARY_KEYS.items()}}


def policy_table(logs: dict[str, StepLog]) -> str:
    """A plain-text table of `policy_row` for several runs, one row each; TTFT and e2e in s, ITL in ms."""
    if not logs:
        raise ValueError("logs = {}: give at least one run to tabulate")
    digits = {"ITL p50": 1, "ITL p99": 1, "tokens/s": 0}
    rows = [[name, *(f"{row[c]:,.{digits.get(c, 2)}f}" for c in POLICY_COLUMNS)]
            for name, row in ((name, policy_row(log)) for name, log in logs.items())]
    return metrics.format_table(["run", *POLICY_COLUMNS], rows) + "\n(TTFT and e2e in s, ITL in ms)"


GROUP_COLUMNS = ("requests", "TTFT mean", "TTFT p50", "TTFT p99", "TTFT max", "e2e p99")


def group_row(log: StepLog, chosen: np.ndarray) -> dict[str, float]:
    """The number of chosen requests (a bool per request of the log's trace), their TTFT mean,
    p50, p99 and max, and their end-to-end p99, in s."""
    chosen = _mask(log, chosen)
    ttft = {f"TTFT {stat}": statistic(log.ttft[chosen], stat) for stat in ("mean", "p50", "p99", "max")}
    return {"requests": int(chosen.sum()), **ttft, "e2e p99": statistic(log.latency[chosen], "p99")}


def group_table(logs: dict[str, StepLog], groups: dict[str, np.ndarray]) -> str:
    """A plain-text table of `group_row`, a row per run and group ("run, group"); times in s."""
    if not logs or not groups:
        raise ValueError("give at least one run and one group")
    rows = []
    for name, log in logs.items():
        for group, chosen in groups.items():
            row = group_row(log, chosen)
            rows.append([f"{name}, {group}", f"{row['requests']:,}",
                         *(f"{row[c]:,.2f}" for c in GROUP_COLUMNS[1:])])
    return metrics.format_table(["run, group", *GROUP_COLUMNS], rows) + "\n(times in s)"


def gain_table(runs: dict[str, StepLog], reference: StepLog, reference_name: str = "FCFS") -> str:
    """A plain-text table of TTFT mean, p50 and p99 (s): the reference first, then each run,
    with the share of the first run's gain in mean TTFT over the reference that each run keeps,
    (reference - run) / (reference - first run): the first keeps 100%, the reference 0%."""
    if not runs:
        raise ValueError("runs = {}: give at least one run to tabulate")
    base = statistic(reference.ttft, "mean")
    gain = base - statistic(next(iter(runs.values())).ttft, "mean")
    rows = []
    for name, log in {reference_name: reference, **runs}.items():
        mean = statistic(log.ttft, "mean")
        kept = f"{(base - mean) / gain:.0%}" if gain else "-"
        rows.append([name, *(f"{statistic(log.ttft, stat):,.2f}" for stat in ("mean", "p50", "p99")), kept])
    return metrics.format_table(["run", "TTFT mean", "TTFT p50", "TTFT p99", "mean gain kept"], rows) + (
        f"\n(TTFT in s; mean gain kept: ({reference_name} - the run) / ({reference_name} - the first run), "
        "in mean TTFT)")


def _mask(log: StepLog, chosen) -> np.ndarray:
    chosen = np.asarray(chosen)
    if chosen.dtype != bool or chosen.shape != (len(log.trace),):
        raise ValueError(f"a group must be one bool per request ({len(log.trace)}), got {chosen.dtype} {chosen.shape}")
    return chosen


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
        ttft = log.ttft[_mask(log, chosen)]
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


def length_bins(output_lengths: np.ndarray, num_bins: int) -> np.ndarray:
    """A bin index per request: `num_bins` groups of about equal size by output length
    (fewer where many lengths tie), numbered from 0, shortest first."""
    if num_bins < 1:
        raise ValueError(f"num_bins = {num_bins!r}: must be >= 1")
    edges = np.unique(np.quantile(output_lengths, np.linspace(0, 1, num_bins + 1))[1:-1])
    return np.unique(np.searchsorted(edges, output_lengths, side="right"), return_inverse=True)[1]  # 0, 1, ...


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
