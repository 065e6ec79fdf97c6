"""Serving metrics derived from a StepLog, as `vllm bench serve` defines them.

- TTFT is measured from arrival, queueing included.
- ITL pools every gap between consecutive tokens of the same request.
- TPOT is (latency - TTFT) / (output_len - 1) per request, averaged over requests
  with at least two tokens.

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
    several = log.trace.output_lengths > 1
    return (log.latency - log.ttft)[several] / (log.trace.output_lengths[several] - 1)


def summary(log: StepLog) -> dict[str, float]:
    """The headline numbers of one run."""
    return {
        "steps": log.num_steps,
        "tokens": log.num_tokens,
        "utilization (%)": 100 * log.utilization,
        "wasted slot-steps": log.num_slots * log.num_steps - log.num_tokens,
        "tokens/step": log.tokens_per_step,
        "tokens/s": log.tokens_per_second,
        "mean wait (s)": float(np.mean(log.waiting_time)),
        "p99 wait (s)": float(np.percentile(log.waiting_time, 99)),
        "mean TTFT (s)": float(np.mean(log.ttft)),
        "mean latency (s)": float(np.mean(log.latency)),
    }


def table(logs: dict[str, StepLog], digits: int = 3) -> str:
    """A plain-text table of `summary` for several runs, one column per run."""
    rows = {name: summary(log) for name, log in logs.items()}
    metrics = list(next(iter(rows.values())))
    cells = [["", *rows]] + [[m, *(_format(rows[name][m], digits) for name in rows)] for m in metrics]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    return "\n".join(lines)


def _format(value, digits: int) -> str:
    if isinstance(value, (int, np.integer)):
        return f"{value:,}"
    return f"{value:,.{digits}f}"
