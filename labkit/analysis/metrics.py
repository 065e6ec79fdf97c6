"""Serving metrics derived from a run's log, as `vllm bench serve` defines them.

- TTFT is measured from arrival, queueing included.
- ITL pools every gap between consecutive tokens of the same request.
- TPOT is (latency - TTFT) / (output_len - 1) per request, averaged over requests
  with at least two tokens.
- Goodput is the number of requests that meet every given SLO, divided by the run's
  duration.

A log is a `StepLog` (simulator or engine) or any `RunLog`, such as the `ReplayLog` of
`labkit.serve.replay`: the same per-request fields, and its own `token_times()`.

Invariants: these are pure functions of a finished log; nothing here writes to it. A
request with NaN times (one a replay saw fail) counts in no percentile, mean or ITL gap,
and meets no SLO. Step counts, utilization and waiting times exist only for a StepLog.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from labkit.sched.steplog import StepLog
from labkit.traffic import Trace


class RunLog(Protocol):
    """What the metrics read from a run that is not a StepLog: per request (indexed like
    `trace`), seconds from arrival to the first and to the last token, NaN for a failed one."""

    trace: Trace
    num_output_tokens: int
    ttft: np.ndarray
    latency: np.ndarray
    duration: float
    tokens_per_second: float

    def token_times(self) -> tuple[np.ndarray, np.ndarray]: ...


def token_times(log: StepLog | RunLog) -> tuple[np.ndarray, np.ndarray]:
    """(request ids, token times) of every emitted token, grouped by request in time order:
    a log's own `token_times()` when it has one, else a StepLog's slots and step ends."""
    if hasattr(log, "token_times"):
        return log.token_times()
    steps, _ = np.nonzero(log.slots >= 0)
    ids = log.slots[log.slots >= 0]
    order = np.lexsort((steps, ids))
    return ids[order], log.step_end[steps[order]]


def itl(log: StepLog | RunLog) -> np.ndarray:
    """Every gap between consecutive tokens of one request, pooled over requests (s)."""
    ids, times = token_times(log)
    same_request = ids[1:] == ids[:-1]
    return np.diff(times)[same_request]


def tpot(log: StepLog | RunLog) -> np.ndarray:
    """Per finished request with two or more tokens: (latency - TTFT) / (output_len - 1), in s."""
    per_request = _tpot_per_request(log)
    return per_request[(log.trace.output_lengths > 1) & ~np.isnan(per_request)]


def _tpot_per_request(log: StepLog | RunLog) -> np.ndarray:
    """TPOT of every request; 0 for a one-token request, which has no gap to measure."""
    gaps = np.maximum(log.trace.output_lengths - 1, 1)
    return (log.latency - log.ttft) / gaps


def meets_slos(log: StepLog | RunLog, ttft: float | None = None, tpot: float | None = None, e2e: float | None = None):
    """bool per request: whether it met every SLO given, in seconds (TTFT, TPOT, latency);
    a failed request (NaN times) meets none."""
    met = ~np.isnan(log.latency)
    for limit, values in ((ttft, log.ttft), (tpot, _tpot_per_request(log)), (e2e, log.latency)):
        if limit is not None:
            met &= values <= limit
    return met


def goodput(log: StepLog | RunLog, ttft: float | None = None, tpot: float | None = None, e2e: float | None = None) -> float:
    """Requests per second that met every SLO given (TTFT, TPOT, end-to-end latency, in s)."""
    return float(meets_slos(log, ttft, tpot, e2e).sum() / log.duration)


def percentile(values: np.ndarray, q: float) -> float:
    """The q-th percentile of the values that are not NaN (a failed request's times are NaN,
    and np.percentile would return NaN for them all), or NaN when none is left (e.g. no ITL gaps)."""
    values = np.asarray(values, float)
    values = values[~np.isnan(values)]
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summary(log: StepLog | RunLog) -> dict[str, float]:
    """The headline numbers of one run: step counts, utilization and waiting times for a
    StepLog only, failed requests for a log that records failures (a replay's) only."""
    gaps, per_token = itl(log), tpot(log)
    row = {
        "tokens": log.num_output_tokens,
        "tokens/s": log.tokens_per_second,
        "TTFT p50 (s)": percentile(log.ttft, 50),
        "TTFT p99 (s)": percentile(log.ttft, 99),
        "ITL p50 (ms)": 1000 * percentile(gaps, 50),
        "ITL p99 (ms)": 1000 * percentile(gaps, 99),
        "TPOT mean (ms)": 1000 * float(np.mean(per_token)) if len(per_token) else float("nan"),
        "latency p50 (s)": percentile(log.latency, 50),
        "latency p99 (s)": percentile(log.latency, 99),
    }
    if isinstance(log, StepLog):
        row = _with_step_fields(log, row)
    if hasattr(log, "failures"):
        row["failed requests"] = len(log.failures)
    return row


def _with_step_fields(log: StepLog, row: dict[str, float]) -> dict[str, float]:
    """`row` with a StepLog's step counts, utilization and waiting times, in the table's order."""
    return {
        "steps": log.num_steps,
        "tokens": row.pop("tokens"),
        "utilization (%)": 100 * log.utilization,
        "wasted slot-steps": log.num_slots * log.num_steps - log.num_output_tokens,
        "tokens/step": log.tokens_per_step,
        "tokens/s": row.pop("tokens/s"),
        "mean wait (s)": float(np.mean(log.waiting_time)),
        "p99 wait (s)": percentile(log.waiting_time, 99),
        **row,
    }


def table(logs: dict[str, StepLog | RunLog], digits: int = 3) -> str:
    """A plain-text table of `summary` for several runs, one column per run; a run without
    a metric (a replay has no steps, a simulation no failures) shows a dash."""
    rows = {name: summary(log) for name, log in logs.items()}
    metrics = _merged_order([list(row) for row in rows.values()])
    return format_table(
        ["", *rows], [[m, *(_format(rows[name][m], digits) if m in rows[name] else "-" for name in rows)] for m in metrics]
    )


def _merged_order(orders: list[list[str]]) -> list[str]:
    """Every name in `orders`, once, each new one placed right after the name before it in its own list."""
    merged: list[str] = []
    for names in orders:
        at = 0
        for name in names:
            if name in merged:
                at = merged.index(name) + 1
            else:
                merged.insert(at, name)
                at += 1
    return merged


LATENCY_COLUMNS = {"TTFT p50 (s)": 3, "TTFT p99 (s)": 3, "ITL p50 (ms)": 1, "ITL p99 (ms)": 1, "TPOT mean (ms)": 1,
                   "tokens/s": 0}  # summary's name of each column, and its digits


def latency_table(logs: dict[str, StepLog | RunLog], label: str = "run") -> str:
    """A plain-text table of the latency side of `summary`, one row per run: TTFT and ITL
    percentiles, mean TPOT and output tokens/s. `label` heads the column of run names."""
    if not logs:
        raise ValueError("logs = {}: give at least one run to tabulate")
    rows = []
    for name, log in logs.items():
        values = summary(log)
        rows.append([name, *(_format(values[column], digits) for column, digits in LATENCY_COLUMNS.items())])
    return format_table([label, *LATENCY_COLUMNS], rows)


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Plain-text columns: the first left-aligned, the rest right-aligned."""
    cells = [list(header), *rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    return "\n".join(lines)


def _format(value, digits: int) -> str:
    if isinstance(value, (int, np.integer)):
        return f"{value:,}"
    return f"{value:,.{digits}f}"
