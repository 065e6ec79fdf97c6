"""The step simulator: the "predict" back end.

It applies a policy's decisions to a `SchedulerState` and records a `StepLog`.
Every step lasts `step_time` seconds (a cost model can replace this later).

Invariants:

- requests join the queue in arrival order (ties by trace position) at the first
  decision point at or after their arrival;
- a request admitted at step s emits its L tokens at steps s .. s+L-1;
- when nothing runs, the clock jumps to the next arrival or the time the policy
  asked to wake at; if neither exists while requests wait, the run stops with an
  error instead of spinning;
- without `on_step`, a decision is run for all the steps until the next event
  (a request finishes, one arrives, or the policy's wake time), which gives the
  same log as asking the policy before every step, because policies decide only
  on events (see `labkit.sched.policy`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import numpy as np

from labkit.sched.policy import Decision
from labkit.sched.state import Request, SchedulerState
from labkit.sched.steplog import StepLog
from labkit.traffic import Trace

DEFAULT_STEP_TIME = 0.025  # seconds per decode step: a mid-sized model's iteration
_TOLERANCE = 1e-6  # of a step: clock arithmetic slack when comparing times


def simulate(
    trace: Trace,
    policy,
    step_time: float = DEFAULT_STEP_TIME,
    on_step: Callable[[StepLog], None] | None = None,
) -> StepLog:
    """Run `policy` over `trace`; `on_step(log)` is called after every step if given."""
    if isinstance(step_time, bool) or not isinstance(step_time, (int, float)) or not step_time > 0:
        raise ValueError(f"step_time = {step_time!r}: must be a number of seconds > 0")
    requests = _requests(trace)
    state = SchedulerState(policy.num_slots, requests)
    pending = deque(sorted(requests, key=lambda r: (r.arrival, r.index)))
    state.now = pending[0].arrival
    log = StepLog(trace, policy.num_slots, repr(policy))
    eps = _TOLERANCE * step_time
    num_unfinished = len(requests)
    while num_unfinished:
        _arrive(pending, state, eps)
        decision = policy.schedule(state)
        for request in state.apply(decision):
            log.admit_step[request.index] = state.num_steps
        running = state.running()
        if not running:
            state.now = _idle_until(state, pending, decision, policy)
            continue
        count = 1 if on_step else _steps_until_event(state, running, pending, decision, step_time, eps)
        num_unfinished -= _run(state, running, count, log, decision, step_time)
        if on_step:
            on_step(log)
    return log


def _requests(trace: Trace) -> list[Request]:
    return [
        Request(index, int(rid), float(arrival), int(prompt), int(output))
        for index, (rid, arrival, prompt, output) in enumerate(
            zip(trace.ids, trace.arrivals, trace.prompt_lengths, trace.output_lengths)
        )
    ]


def _arrive(pending: deque[Request], state: SchedulerState, eps: float) -> None:
    while pending and pending[0].arrival <= state.now + eps:
        state.waiting.append(pending.popleft())


def _idle_until(state: SchedulerState, pending: deque[Request], decision: Decision, policy) -> float:
    """The next time anything can happen while nothing runs, or an error if never."""
    wakes = [pending[0].arrival] if pending else []
    if decision.wake_at is not None:
        wakes.append(decision.wake_at)
    if not wakes or min(wakes) <= state.now:
        reason = decision.blocked or "the policy admits none of them"
        raise RuntimeError(
            f"{policy!r} can make no progress at t = {state.now:.3f} s: {len(state.waiting)} requests wait "
            f"({reason}), nothing runs, and nothing is due to arrive or wake the policy"
        )
    return min(wakes)


def _steps_until_event(state, running, pending, decision: Decision, step_time: float, eps: float) -> int:
    """Steps the current decision holds for: until a request finishes, arrives, or the policy wakes."""
    count = min([r.output_len - r.num_generated for r in running])
    for moment in (pending[0].arrival if pending else None, decision.wake_at):
        if moment is not None and moment > state.now + eps:
            count = min(count, math.ceil((moment - state.now) / step_time - _TOLERANCE))
    return count


def _run(state: SchedulerState, running: list[Request], count: int, log: StepLog, decision, step_time) -> int:
    """Run `count` decode steps of the running requests; returns how many finished."""
    row = np.full(state.num_slots, -1, np.int64)
    row[[r.slot for r in running]] = [r.id for r in running]
    log.append(row, count, len(state.waiting), decision.blocked, state.now, step_time)
    starting, finishing = [], []
    for request in running:
        if not request.num_generated:
            starting.append(request.index)
        request.num_generated += count
        if request.num_generated == request.output_len:
            finishing.append(request.index)
    log.first_token_step[starting] = state.num_steps
    log.finish_step[finishing] = state.num_steps + count - 1
    state.num_steps += count
    state.now += count * step_time
    return len(finishing)
