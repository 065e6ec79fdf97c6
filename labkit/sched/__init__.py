"""labkit.sched: every scheduling decision and every counter. Imports numpy and labkit.traffic only."""

from labkit.sched import hardware, metrics, multiplier
from labkit.sched.blocks import BlockPool
from labkit.sched.cost import CostFit, CostModel
from labkit.sched.driver import drive
from labkit.sched.ordered import Priority, ShortestPredictedFirst
from labkit.sched.policy import Continuous, Decision, Dynamic, Static
from labkit.sched.simulator import DEFAULT_STEP_TIME, simulate
from labkit.sched.state import Request, SchedulerState
from labkit.sched.steplog import StepLog

__all__ = [
    "BlockPool",
    "CostFit",
    "CostModel",
    "Continuous",
    "DEFAULT_STEP_TIME",
    "Decision",
    "Dynamic",
    "Priority",
    "Request",
    "SchedulerState",
    "ShortestPredictedFirst",
    "Static",
    "StepLog",
    "drive",
    "hardware",
    "metrics",
    "multiplier",
    "simulate",
]
