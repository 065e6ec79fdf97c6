"""labkit: predict, run and see iteration-level scheduling (continuous batching).

Layers, each importing only those before it: traffic, theory -> sched -> analysis -> engine, viz.
`lk.CostModel` is `labkit.analysis`'s: the simulator's price (`labkit.sched.cost.StepPrice`) plus `fit`.
Importing labkit loads numpy only; `labkit.viz` loads plotly and ipywidgets, and
`labkit.replay` httpx, when first used.
"""

import importlib

from labkit import theory
from labkit.analysis import ByPrice, CostModel, by_price, capacity, hardware, metrics, multiplier, two_prices
from labkit.sched import (Continuous, Decision, Dynamic, ExecutionShape, Fair, Priority, SchedulerState,
                          ShortestPredictedFirst, Static, StepLog, simulate, vllm_capture_sizes)
from labkit.traffic import Trace

__all__ = [
    "ByPrice",
    "Continuous",
    "CostModel",
    "Decision",
    "Dynamic",
    "ExecutionShape",
    "Fair",
    "Priority",
    "SchedulerState",
    "ShortestPredictedFirst",
    "Static",
    "StepLog",
    "Trace",
    "by_price",
    "capacity",
    "hardware",
    "metrics",
    "multiplier",
    "replay",
    "simulate",
    "theory",
    "two_prices",
    "viz",
    "vllm_capture_sizes",
]


def __getattr__(name: str):
    if name == "viz":
        return importlib.import_module("labkit.viz")
    if name == "replay":  # the HTTP client loads only with the `serve` extra, when first used
        return importlib.import_module("labkit.serve.replay").replay
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")
