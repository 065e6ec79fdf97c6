"""The engine's plain back end for `labkit.sched.driver.drive`: a runner's step, timed.

`TimedSteps.execute` calls `ModelRunner.run` (`labkit.engine.model_runner`) and returns its
tokens with what the `StepTimer` measured: the runner tells the timer when each of its
phases starts and ends, so the step that is timed is the step a student reads, with no
second copy of it. The host waits for the device in every step; `labkit.engine.overlap` is
the back end that does not.

Invariants:

- the tokens are `ModelRunner.run`'s: the timer reads the clock and changes nothing;
- a step's seconds run from the end of the previous step to the end of this one, and split
  into its phases: schedule (from the previous step's end to this one's start: taking in the
  previous step's tokens, the policy, bookkeeping and logging), prepare, forward (the forward
  pass) and sample (picking the tokens and bringing them to the host, which waits for the
  device);
- they also split into device time (the forward and the sampling: their wall time on the
  CPU, CUDA events on a GPU) and host time (the rest), so the two sum to the step;
- the lanes record host and device stretches on the wall clock, from the run's start.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from labkit.engine.model_runner import ModelRunner
from labkit.engine.timing import DeviceTimer
from labkit.sched.scheduler import Measured, StepOutcome
from labkit.sched.state import Batch

PHASES = ("prepare", "forward", "sample")  # what ModelRunner.run tells its timer, in order


class StepTimer:
    """Marks the moments a runner's phases start, and the moment the last one ends, on the
    wall clock and on the device."""

    def __init__(self, is_cuda: bool):
        self.device = DeviceTimer(is_cuda)
        self.run_start = time.perf_counter()
        self.last_end: float | None = None
        self.wall: dict[str, float] = {}  # phase -> the moment it started; "end" -> the step's end
        self.marks: dict[str, object] = {}  # the same moments on the device

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.wall[name], self.marks[name] = time.perf_counter(), self.device.mark()
        yield
        if name == PHASES[-1]:
            self.wall["end"], self.marks["end"] = time.perf_counter(), self.device.mark()

    def measured(self) -> tuple[float, Measured]:
        """The seconds of the step just run, and where they went."""
        wall, (prepare, forward, sample) = self.wall, PHASES
        step_start = self.last_end if self.last_end is not None else wall[prepare]
        self.last_end = end = wall["end"]
        device = self.device.seconds(self.marks[forward], self.marks["end"])
        phases = {"schedule": wall[prepare] - step_start, prepare: wall[forward] - wall[prepare],
                  forward: wall[sample] - wall[forward], sample: end - wall[sample]}
        lanes = [(lane, start - self.run_start, stop - self.run_start)
                 for lane, start, stop in (("host", step_start, wall[forward]), ("device", wall[forward], end))]
        return end - step_start, Measured(phases, end - step_start - device, device, lanes)


class TimedSteps:
    """A runner's steps, each timed by the `StepTimer` it calls; `progress` counts the tokens sampled."""

    def __init__(self, runner: ModelRunner, timer: StepTimer, progress):
        self.runner, self.timer, self.progress = runner, timer, progress

    def execute(self, batch: Batch) -> StepOutcome:
        tokens = self.runner.run(batch)
        self.progress.update(len(tokens))
        seconds, measured = self.timer.measured()
        return StepOutcome(tokens, seconds, (batch.work().num_kv_tokens, 1, 0), measured)
