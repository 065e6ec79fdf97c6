"""labkit.analysis: what is read from runs, apart from what schedules them.

- `metrics`: TTFT, ITL, TPOT, goodput and their tables, from any run's log;
- `cost_fit`: `CostModel.fit`, a step's price fitted to measured steps (`CostFit`);
- `multiplier`: a headline multiplier taken apart into factors, each the ratio of two runs;
- `hardware`: step prices from public GPU figures;
- `lanes`: host and device lanes, laid out or measured, and what overlap buys;
- `host`: the CPU time of one scheduling decision;
- `ordering`: tables that compare queue orders; `tradeoff`: the TTFT / ITL / throughput
  trade-off and its Pareto front.

Imports numpy, labkit.traffic, labkit.theory and labkit.sched, never torch or plotly;
sched never imports it. Every function here reads runs or numbers and returns numbers or
text; none keeps state between calls.
"""

from labkit.analysis import hardware, metrics, multiplier
from labkit.analysis.cost_fit import CostFit, CostModel

__all__ = ["CostFit", "CostModel", "hardware", "metrics", "multiplier"]
