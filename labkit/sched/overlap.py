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

Invariants, beyond those of `labkit.sched.driver` and `labkit.sched.scheduler`:

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
from labkit.sched.driver import Pending, finish_run, idle_until, start_run
from labkit.sched.scheduler import Scheduler, StepOutcome, StepRecord
from labkit.sched.state import Batch
from labkit.sched.steplog import StepLog
from labkit.traffic import Trace


class OverlappedBackend(Protocol):
    """Launches a step and returns at once; lands it (waits for its outputs) later."""

    def launch(self, batch: Batch) -> tuple[object, list[int] | None]:
        """Start one step in which each request of `batch` processes its tokens: a handle for
        `land`, and what stands in for each emitting row's token until it lands (None for a
        back end that samples none)."""

    def land(self, launched: object) -> StepOutcome:
        """Wait for a launched step and put its tokens in place of their placeholders; its
        seconds run from the previous landing."""


class FixedLanding:
    """An overlapped back end without a device: every step lands `step_time` seconds after
    the previous one, to show the loop's schedule on its own."""

    def __init__(self, step_time: float):
        self.step_time = step_time

    def launch(self, batch: Batch) -> tuple[None, None]:
        return None, None

    def land(self, launched: None) -> StepOutcome:
        return StepOutcome(None, self.step_time)


class _InFlight(NamedTuple):
    launched: object
    record: StepRecord


def drive_overlapped(
    trace: Trace,
    policy,
    backend: OverlappedBackend,
    on_step: Callable[[StepLog], None] | None = None,
    blocks: BlockPool | None = None,
    prompts: list[list[int]] | None = None,
) -> StepLog:
    """Serve `trace` with `policy`, one step ahead; `on_step(log)` is called as each step lands.
    `prompts`: as `drive`'s."""
    scheduler, pending, log = start_run(trace, policy, blocks, prompts)
    state = scheduler.state
    log.overlap = True
    num_unfinished = len(state.by_id)
    in_flight, last_end = None, state.now
    while num_unfinished or in_flight:
        launched = _launch(scheduler, pending, backend) if num_unfinished else None
        if launched:
            num_unfinished -= len(launched.record.finished)
        if in_flight:
            last_end = state.now = _land(in_flight, backend, log, last_end)
            if on_step:
                on_step(log)
        elif not launched:
            state.now = idle_until(scheduler, pending)
        in_flight = launched
    return finish_run(scheduler, log)


def _launch(scheduler: Scheduler, pending: Pending, backend: OverlappedBackend) -> _InFlight | None:
    """Take in the arrivals, schedule the next step and launch it, counted done at once with
    placeholders for its tokens: who emits and who finishes is known before it lands. None if
    nobody can run now."""
    state = scheduler.state
    state.arrive(pending.arrived_by(state.now))
    batch = scheduler.schedule()
    if not batch.size:
        return None
    handle, placeholders = backend.launch(batch)
    return _InFlight(handle, scheduler.postprocess(batch, placeholders))


def _land(in_flight: _InFlight, backend: OverlappedBackend, log: StepLog, last_end: float) -> float:
    """Wait for the step in flight and log it; returns when it ended."""
    outcome = backend.land(in_flight.launched)
    start = max(in_flight.record.decided_at, last_end)
    in_flight.record.log_to(log, start, outcome)
    return start + outcome.seconds
