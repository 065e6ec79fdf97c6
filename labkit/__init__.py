"""labkit: predict, run and see iteration-level scheduling (continuous batching).

Layers, each importing only those before it: traffic, theory -> sched -> engine, viz.
Importing labkit loads numpy only; `labkit.viz` loads plotly and ipywidgets on use.
"""

from labkit import theory
from labkit.sched import Continuous, Decision, Dynamic, SchedulerState, Static, StepLog, simulate
from labkit.traffic import Trace

__all__ = ["Continuous", "Decision", "Dynamic", "SchedulerState", "Static", "StepLog", "Trace", "simulate", "theory"]
