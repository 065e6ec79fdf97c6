"""Serving metrics derived from a StepLog, as `vllm bench serve` defines them.

- TTFT is measured from arrival, queueing included.
- ITL pools every gap between consecutive tokens of the same request.
- TPOT is (latency - TTFT) / (output_len - 1) per request, averaged over requests
  with at least two tokens.
- Goodput is the number of requests that meet every given SLO, divided by the run's
  duration.

Invariant: these are pure functions of a finished StepLog; nothing here writes to it.
"""

from __future__ import annotations

import numpy as np

from labkit.sched.steplog import StepLog


def token_times(log: StepLog) -> tuple[np.ndarray, np.ndarray]:
    """(request ids, token times) of every emitted token, grouped by request in time order."""
    steps, _ = np.nonzero(log.slots >= 0)
    ids = log.slots[log.slots >= 0]
    order = np.lexsort((steps, ids))
    return ids[order], log.step_end[steps[order]]


def itl(log: StepLog) -> np.ndarray:
    """Every gap between consecutive tokens of one request, pooled over requests (s)."""
    ids, times = token_times(log)
    same_request = ids[1:] == ids[:-1]
    return np.diff(times)[same_request]


def tpot(log: StepLog) -> np.ndarray:
    """Per request with two or more tokens: (latency - TTFT) / (output_len - 1), in s."""
    return _tpot_per_request(log)[log.trace.output_lengths > 1]


def _tpot_per_request(log: StepLog) -> np.ndarray:
    """TPOT of every request; 0 for a one-token request, which has no gap to measure."""
    gaps = np.maximum(log.trace.output_lengths - 1, 1)
    return (log.latency - log.ttft) / gaps


def meets_slos(log: StepLog, ttft: float | None = None, tpot: float | None = None, e2e: float | None = None):
    """bool per request: whether it met every SLO given, in seconds (TTFT, TPOT, latency)."""
    met = np.ones(len(log.trace), bool)
    for limit, values in ((ttft, log.ttft), (tpot, _tpot_per_request(log)), (e2e, log.latency)):
        if limit is not None:
            met &= values <= limit
    return met


def goodput(log: StepLog, ttft: float | None = None, tpot: float | None = None, e2e: float | None = None) -> float:
    """Requests per second that met every SLO given (TTFT, TPOT, end-to-end latency, in s)."""
    return float(meets_slos(log, ttft, tpot, e2e).sum() / log.duration)


def percentile(values: np.ndarray, q: float) -> float:
    """The q-th percentile, or NaN when there is nothing to measure (e.g. no ITL gaps)."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summary(log: StepLog) -> dict[str, float]:
    """The headline numbers of one run."""
    gaps, per_token = itl(log), tpot(log)
    return {
        "steps": log.num_steps,
        "tokens": log.num_tokens,
        "utilization (%)": 100 * log.utilization,
        "wasted slot-steps": log.num_slots * log.num_steps - log.num_tokens,
        "tokens/step": log.tokens_per_step,
        "tokens/s": log.tokens_per_second,
        "mean wait (s)": float(np.mean(log.waiting_time)),
        "p99 wait (s)": percentile(log.waiting_time, 99),
        "TTFT p50 (s)": percentile(log.ttft, 50),
        "TTFT p99 (s)": percentile(log.ttft, 99),
        "ITL p50 (ms)": 1000 * percentile(gaps, 50),
        "ITL p99 (ms)": 1000 * percentile(gaps, 99),
        "TPOT mean (ms)": 1000 * float(np.mean(per_token)) if len(per_token) else float("nan"),
        "latency p50 (s)": percentile(log.latency, 50),
        "latency p99 (s)": percentile(log.latency, 99),
    }


def table(logs: dict[str, StepLog], digits: int = 3) -> str:
    """A plain-text table of `summary` for several runs, one column per run."""
    rows = {name: summary(log) for name, log in logs.items()}
    metrics = list(next(iter(rows.values())))
    return format_table(["", *rows], [[m, *(_format(rows[name][m], digits) for name in rows)] for m in metrics])


LATENCY_COLUMNS = {"TTFT p50 (s)": 3, "TTFT p99 (s)": 3, "ITL p50 (ms)": 1, "ITL p99 (ms)": 1, "TPOT mean (ms)": 1,
                   "tokens/s": 0}  # summary's name of each column, and its digits


def latency_table(logs: dict[str, StepLog], label: str = "run") -> str:
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
