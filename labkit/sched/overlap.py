"""The overlapped loop: decide and launch step t+1 while the device runs step t.

`drive` takes turns: it asks the policy, runs a step, waits for its outputs, and only
then asks again, so the device idles while the host schedules. `drive_overlapped` is the
loop of SGLang's overlap scheduler and vLLM's async scheduling, as mini-sglang's
`overlap_loop` writes it: decide step t+1, launch it, then land step t (wait for its
outputs and log it).

It can decide step t+1 before step t's outputs exist because scheduling needs only how
far each request has got, never the token it sampled: every request's output length is
known, so who finishes at step t is known when step t is launched. The back end stands
a placeholder for each token still being sampled and resolves it on the device.

Invariants, beyond `labkit.sched.driver`'s:

- at most one step is in flight; steps land in order;
- the decision for step t+1 is made at the start of step t: it sees the arrivals up to
  then, so a request that arrives while step t runs joins one step later than `drive`
  would let it;
- a step starts when the previous one lands, or at its decision if the device was idle,
  and lasts what the back end measured from the previous landing to its own;
- with every request arrived at the start, the slots and tokens are those of `drive`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

from labkit.sched.blocks import BlockPool
from labkit.sched.driver import Steps, complete_step, end_run, idle_until, log_steps, next_batch, start_run
from labkit.sched.state import Batch, SchedulerState
from labkit.sched.steplog import StepLog
from labkit.traffic import Trace


class OverlappedBackend(Protocol):
    """Launches a step and returns at once; lands it (waits for its outputs) later."""

    def launch(self, state: SchedulerState, batch: Batch, log: StepLog) -> object:
        """Start one step in which each request of `batch` processes its tokens; a handle for `land`."""

    def land(self, launched: object, log: StepLog) -> float:
        """Wait for a launched step and take its outputs; the seconds since the previous step landed."""


class FixedLanding:
    """An overlapped back end without a device: every step lands `step_time` seconds after
    the previous one, to show the loop's schedule on its own."""

    def __init__(self, step_time: float):
        self.step_time = step_time

    def launch(self, state: SchedulerState, batch: Batch, log: StepLog) -> None:
        return None

    def land(self, launched: None, log: StepLog) -> float:
        return self.step_time


class _InFlight(NamedTuple):
    launched: object
    steps: Steps


def drive_overlapped(
    trace: Trace,
    policy,
    backend: OverlappedBackend,
    on_step: Callable[[StepLog], None] | None = None,
    blocks: BlockPool | None = None,
) -> StepLog:
    """Serve `trace` with `policy`, one step ahead; `on_step(log)` is called as each step lands."""
    state, pending, log = start_run(trace, policy, blocks)
    log.overlap = True
    num_unfinished = len(state.by_id)
    in_flight, last_end = None, state.now
    while num_unfinished or in_flight:
        launched = None
        if num_unfinished:
            decision, batch = next_batch(state, pending, policy, log)
            if batch.size:
                state.allocate(batch)
                handle = backend.launch(state, batch, log)
                steps = complete_step(state, batch, decision)
                launched, num_unfinished = _InFlight(handle, steps), num_unfinished - len(steps.finished)
            elif decision.preempt or decision.release:  # the policy may decide anew at once
                continue
        if in_flight:
            last_end = state.now = _land(in_flight, backend, log, last_end)
            if on_step:
                on_step(log)
        elif not launched:
            state.now = idle_until(state, pending, decision, policy)
        in_flight = launched
    end_run(state)
    return log


def _land(in_flight: _InFlight, backend: OverlappedBackend, log: StepLog, last_end: float) -> float:
    """Wait for the step in flight and log it; returns when it ended."""
    seconds = backend.land(in_flight.launched, log)
    start = max(in_flight.steps.decided_at, last_end)
    log_steps(log, in_flight.steps, start, seconds)
    return start + seconds
