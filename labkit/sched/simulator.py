"""The step simulator: the "predict" back end.

Every step lasts `step_time` seconds (a cost model can replace this later), and the
simulator does no work per step: `drive` (labkit.sched.driver) runs each decision until
the next event in one go. Scheduling rules and invariants are the driver's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from labkit.sched.driver import drive
from labkit.sched.state import Request, SchedulerState
from labkit.sched.steplog import StepLog
from labkit.traffic import Trace

DEFAULT_STEP_TIME = 0.025  # seconds per decode step: a mid-sized model's iteration


@dataclass(frozen=True)
class FixedStepTime:
    """A back end whose steps take `step_time` seconds and compute nothing."""

    step_time: float

    def execute(self, state: SchedulerState, scheduled: dict[Request, int], num_steps: int, log: StepLog) -> float:
        return self.step_time


def simulate(
    trace: Trace,
    policy,
    step_time: float = DEFAULT_STEP_TIME,
    on_step: Callable[[StepLog], None] | None = None,
) -> StepLog:
    """Predict how `policy` serves `trace`; `on_step(log)` is called after every step if given."""
    if isinstance(step_time, bool) or not isinstance(step_time, (int, float)) or not step_time > 0:
        raise ValueError(f"step_time = {step_time!r}: must be a number of seconds > 0")
    return drive(trace, policy, FixedStepTime(step_time), on_step)
