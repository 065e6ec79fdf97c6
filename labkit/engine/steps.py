"""The engine's plain back end for `labkit.sched.driver.drive`: a runner's step, timed and logged.

`TimedRunner.execute` runs the phases of `ModelRunner.run` (`labkit.engine.model_runner`)
with a clock between them, records what it measured in the `StepLog` and returns the step's
seconds. The host waits for the device in every step; `labkit.engine.overlap` is the back
end that does not.

Invariants:

- the tokens are `ModelRunner.run`'s: the clock reads the phases and changes none of them;
- a step's seconds run from the end of the previous step to the end of this one, and split
  into its phases: schedule (from the previous step's end to this one's start: the policy,
  bookkeeping and logging), prepare, forward (the device work, waited for) and sample
  (taking the tokens into the sequences);
- they also split into device time (the forward and the sampling kernels: their wall time
  on the CPU, CUDA events on a GPU) and host time (the rest), so the two sum to the step;
- the lanes record host and device stretches on the wall clock, from the run's start.
"""

from __future__ import annotations

import time

from labkit.engine.model_runner import ModelRunner
from labkit.engine.timing import DeviceTimer
from labkit.sched import SchedulerState, StepLog
from labkit.sched.state import Batch


class TimedRunner:
    """A runner's steps with a clock around each phase; `progress` counts the tokens sampled."""

    def __init__(self, runner: ModelRunner, progress):
        self.runner, self.progress = runner, progress
        self.timer = DeviceTimer(runner.device.type == "cuda")
        self.run_start = time.perf_counter()
        self._last_step_end: float | None = None

    def execute(self, state: SchedulerState, batch: Batch, log: StepLog) -> float:
        start = time.perf_counter()
        step_start = self._last_step_end or start
        step = self.runner.prepare(batch)
        prepared = time.perf_counter()
        device_start = self.timer.mark()
        logits = self.runner.forward(step.inputs)[step.emitting]  # (E, vocab)
        sampled = self.runner.sample(logits, step.requests)  # (E,)
        device_end = self.timer.mark()
        tokens = sampled.tolist()  # waits for the device
        computed = time.perf_counter()
        self.runner.take(step, tokens)
        end = self._last_step_end = time.perf_counter()
        self._record(log, (step_start, start, prepared, computed, end), self.timer.seconds(device_start, device_end))
        log.record_kv_tokens(step.num_kv_tokens)
        self.progress.update(len(tokens))
        return end - step_start

    def _record(self, log: StepLog, moments: tuple[float, ...], device: float) -> None:
        """Log a step's phases, its host and device seconds, and its lanes, from the moments it
        began, started work, had its inputs, had its tokens, and ended."""
        step_start, start, prepared, computed, end = moments
        log.record_phases(schedule=start - step_start, prepare=prepared - start, forward=computed - prepared,
                          sample=end - computed)
        log.record_host_device(end - step_start - device, device)
        for lane, stretch in (("host", (step_start, prepared)), ("device", (prepared, computed)), ("host", (computed, end))):
            log.record_lane(lane, *(moment - self.run_start for moment in stretch))
