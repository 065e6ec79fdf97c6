"""Where a run stands in the TTFT / ITL / throughput trade-off, and which runs dominate which.

`tradeoff_point` reads a run's q-th percentile ITL (ms) and TTFT (s) and its output
tokens per second through `labkit.analysis.metrics`; `dominates`, `pareto_optimal` and
`dominators` compare such points.

Invariants: one run dominates another when it is no worse on every axis (ITL and TTFT
lower, throughput higher) and better on one, where values within `rtol` (1%) of each
other are ties; a point is Pareto-optimal when no other point dominates it. These are
pure functions of their arguments.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from labkit.analysis import metrics
from labkit.sched import StepLog

RTOL = 0.01  # differences within 1% of a value are ties: noise, not a trade-off


class TradeoffPoint(NamedTuple):
    """One run's place in the trade-off: ITL and TTFT at a percentile, and throughput."""

    itl_ms: float
    ttft_s: float
    tokens_per_second: float


def tradeoff_point(log: StepLog, q: float = 99) -> TradeoffPoint:
    """The q-th percentile ITL (ms) and TTFT (s) of a run, and its output tokens per second."""
    itl_ms = 1000 * metrics.percentile(metrics.itl(log), q)
    return TradeoffPoint(itl_ms, metrics.percentile(log.ttft, q), log.tokens_per_second)


def dominates(points: list[TradeoffPoint], rtol: float = RTOL) -> np.ndarray:
    """bool [j, i]: whether point j dominates point i, with differences within `rtol` of
    i's values counted as ties (lower ITL and TTFT, higher throughput)."""
    if not 0 <= rtol < 1:
        raise ValueError(f"rtol = {rtol!r}: must be a fraction in [0, 1)")
    costs = np.array([(p.itl_ms, p.ttft_s, -p.tokens_per_second) for p in points], float).reshape(-1, 3)
    slack = rtol * np.abs(costs)[None, :, :]  # (1, i, axis): how much of i's value is a tie
    no_worse = (costs[:, None, :] <= costs[None, :, :] + slack).all(axis=2)  # [j, i]
    better = (costs[:, None, :] < costs[None, :, :] - slack).any(axis=2)  # [j, i]: beyond a tie somewhere
    return no_worse & better


def pareto_optimal(points: list[TradeoffPoint], rtol: float = RTOL) -> np.ndarray:
    """bool per point: whether no other point dominates it (see `dominates`)."""
    return ~dominates(points, rtol).any(axis=0)


def dominators(logs: dict[str, StepLog], q: float = 99, rtol: float = RTOL) -> dict[str, list[str]]:
    """For each run, the runs that dominate it at the q-th percentile: [] for a Pareto-optimal run."""
    names = list(logs)
    beats = dominates([tradeoff_point(logs[name], q) for name in names], rtol)
    return {name: [names[j] for j in np.flatnonzero(beats[:, i])] for i, name in enumerate(names)}
