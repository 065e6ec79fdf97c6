"""labkit.sched: every scheduling decision and every counter. Imports numpy and labkit.traffic only;
what is measured from a run (metrics, cost fits, multipliers) is `labkit.analysis`,
which imports sched and is never imported by it."""

from labkit.sched.blocks import BlockPool
from labkit.sched.cost import StepPrice
from labkit.sched.driver import drive
from labkit.sched.ordered import Fair, Priority, ShortestPredictedFirst
from labkit.sched.policy import Continuous, Dynamic, Static
from labkit.sched.scheduler import Scheduler
from labkit.sched.shape import ExecutionShape, vllm_capture_sizes
from labkit.sched.simulator import DEFAULT_STEP_TIME, simulate
from labkit.sched.state import Decision, Request, SchedulerState
from labkit.sched.steplog import StepLog

__all__ = [
    "BlockPool",
    "Continuous",
    "DEFAULT_STEP_TIME",
    "Decision",
    "Dynamic",
    "ExecutionShape",
    "Fair",
    "Priority",
    "Request",
    "Scheduler",
    "SchedulerState",
    "ShortestPredictedFirst",
    "Static",
    "StepLog",
    "StepPrice",
    "drive",
    "vllm_capture_sizes",
    "simulate",
]
