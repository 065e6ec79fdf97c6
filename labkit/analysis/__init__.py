"""labkit.analysis: what is read from runs, apart from what schedules them.

- `metrics`: TTFT, ITL, TPOT, goodput and their tables, from any run's log;
- `cost_fit`: `CostModel.fit`, a step's price fitted to measured steps (`CostFit`);
- `multiplier`: a headline multiplier taken apart into factors, each the ratio of two runs;
- `hardware`: step prices from public GPU figures;
- `prices`: a conclusion about cost under this CPU's price and a GPU's, side by side;
- `load`: a server's capacity, measured, so that an experiment's load is a fraction of it;
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
from labkit.analysis.load import capacity
from labkit.analysis.prices import ByPrice, by_price, two_prices

__all__ = ["ByPrice", "CostFit", "CostModel", "by_price", "capacity", "hardware", "metrics", "multiplier", "two_prices"]
