"""Who goes first, in numbers: tables that compare queue orders (first come, priority,
shortest predicted first) on the same requests. `labkit.viz.ordering_figures` draws the
figures, and `labkit.exercises.ordering_question` asks lesson 11's question (q9).

- `policy_table`: TTFT, ITL and end-to-end percentiles and throughput, one row per run;
- `group_table`: TTFT and latency of chosen groups of requests (a priority class, the
  longest outputs) in each run;
- `gain_table`: TTFT of several runs (noise levels, say), and how much of the first run's
  gain in mean TTFT over a reference each one keeps; a run may be several (seeds), given
  as a range;
- `length_bins`: groups of requests of about equal size by output length.

Invariants: every number comes from StepLogs (their requests' `ttft`, `latency` and token
times) through `labkit.analysis.metrics`; nothing here runs a simulator, and nothing keeps
state between calls. A group is one bool per request of the run's trace (`group_mask`).
"""

from __future__ import annotations

import numpy as np

from labkit.analysis import metrics
from labkit.sched import StepLog


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
    chosen = group_mask(log, chosen)
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


def gain_table(runs: dict[str, StepLog | list[StepLog]], reference: StepLog, reference_name: str = "FCFS") -> str:
    """A plain-text table of TTFT mean, p50 and p99 (s): the reference first, then each run,
    with the share of the first run's gain in mean TTFT over the reference that each run keeps,
    (reference - run) / (reference - first run): the first keeps 100%, the reference 0%. A run
    may be a list of runs (one per seed, say): its cells then give their range, "lowest–highest";
    the first run's gain is then its runs' mean."""
    if not runs:
        raise ValueError("runs = {}: give at least one run to tabulate")
    empty = [name for name, run in runs.items() if isinstance(run, list) and not run]
    if empty:
        raise ValueError(f"runs[{empty[0]!r}] = []: give at least one run for each name")
    as_lists = {name: run if isinstance(run, list) else [run] for name, run in runs.items()}
    base = statistic(reference.ttft, "mean")
    gain = base - float(np.mean([statistic(log.ttft, "mean") for log in next(iter(as_lists.values()))]))
    rows = []
    for name, logs in {reference_name: [reference], **as_lists}.items():
        means = [statistic(log.ttft, "mean") for log in logs]
        kept = _span([(base - mean) / gain for mean in means], "{:.0%}") if gain else "-"
        rows.append([name, *(_span([statistic(log.ttft, stat) for log in logs], "{:,.2f}")
                             for stat in ("mean", "p50", "p99")), kept])
    return metrics.format_table(["run", "TTFT mean", "TTFT p50", "TTFT p99", "mean gain kept"], rows) + (
        f"\n(TTFT in s; mean gain kept: ({reference_name} - the run) / ({reference_name} - the first run), "
        "in mean TTFT)")


def _span(values: list[float], fmt: str) -> str:
    """One value, or the range of several: "lowest–highest"."""
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return low if low == high else f"{low}–{high}"


def group_mask(log: StepLog, chosen) -> np.ndarray:
    """`chosen` as a bool array, checked to hold one bool per request of the log's trace."""
    chosen = np.asarray(chosen)
    if chosen.dtype != bool or chosen.shape != (len(log.trace),):
        raise ValueError(f"a group must be one bool per request ({len(log.trace)}), got {chosen.dtype} {chosen.shape}")
    return chosen


def length_bins(output_lengths: np.ndarray, num_bins: int) -> np.ndarray:
    """A bin index per request: `num_bins` groups of about equal size by output length
    (fewer where many lengths tie), numbered from 0, shortest first."""
    if num_bins < 1:
        raise ValueError(f"num_bins = {num_bins!r}: must be >= 1")
    edges = np.unique(np.quantile(output_lengths, np.linspace(0, 1, num_bins + 1))[1:-1])
    return np.unique(np.searchsorted(edges, output_lengths, side="right"), return_inverse=True)[1]  # 0, 1, ...
