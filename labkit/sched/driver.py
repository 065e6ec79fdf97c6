"""The loop both back ends share: arrivals, the policy's decision, a step, the record.

A back end only executes steps. `drive` asks the policy, applies its decision to the
`SchedulerState`, hands the running requests to `backend.execute`, and writes the
`StepLog`, so the simulator and the engine cannot disagree on who runs when.

Invariants:

- requests join the queue in arrival order (ties by trace position) at the first
  decision point at or after their arrival;
- a request admitted at step s does its prefill and emits its first token at step s,
  then one token per step: its L tokens come at steps s .. s+L-1;
- a run ends when every request has finished, with every slot (and KV block) released;
- when nothing runs, the clock jumps to the next arrival or the time the policy asked
  to wake at; if neither exists while requests wait, the run stops with an error
  instead of spinning;
- a back end with a fixed `step_time` may run a decision for every step until the next
  event (a finish, an arrival, the policy's wake time) at once; this gives the same log
  as asking the policy before every step, because policies decide only on events (see
  `labkit.sched.policy`). With `on_step`, the policy is asked before every step.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Protocol

import numpy as np

from labkit.sched.blocks import BlockPool
from labkit.sched.policy import Decision
from labkit.sched.state import Request, SchedulerState
from labkit.sched.steplog import StepLog
from labkit.traffic import Trace

_TOLERANCE = 1e-6  # of a step: clock arithmetic slack when comparing times


class Backend(Protocol):
    """Executes steps. `step_time` is the fixed duration of a step, or None if measured."""

    step_time: float | None

    def execute(self, state: SchedulerState, running: list[Request], num_steps: int, log: StepLog) -> float:
        """Run `num_steps` steps of `running` (in slot order); return the seconds each took."""


def drive(
    trace: Trace,
    policy,
    backend: Backend,
    on_step: Callable[[StepLog], None] | None = None,
    blocks: BlockPool | None = None,
) -> StepLog:
    """Serve `trace` with `policy` on `backend`; `on_step(log)` is called after every step if given."""
    requests = _requests(trace)
    state = SchedulerState(policy.num_slots, requests, blocks)
    pending = deque(sorted(requests, key=lambda r: (r.arrival, r.index)))
    state.now = pending[0].arrival
    log = StepLog(trace, policy.num_slots, repr(policy))
    eps = _TOLERANCE * (backend.step_time or 0.0)
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
        if on_step or backend.step_time is None:
            num_steps = 1
        else:
            num_steps = _steps_until_event(state, running, pending, decision, backend.step_time)
        state.grow(running, num_steps)
        seconds = backend.execute(state, running, num_steps, log)
        num_unfinished -= _record(state, running, num_steps, seconds, log, decision)
        if on_step:
            on_step(log)
    state.apply(Decision(release=tuple(r.id for r in state.finished_in_slots())))  # drain: free every slot
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


def _steps_until_event(state, running, pending, decision: Decision, step_time: float) -> int:
    """Steps the current decision holds for: until a request finishes, arrives, or the policy wakes."""
    count = min([r.output_len - r.num_generated for r in running])
    for moment in (pending[0].arrival if pending else None, decision.wake_at):
        if moment is not None and moment > state.now + _TOLERANCE * step_time:
            count = min(count, math.ceil((moment - state.now) / step_time - _TOLERANCE))
    return count


def _record(state: SchedulerState, running: list[Request], count: int, seconds: float, log: StepLog, decision) -> int:
    """Log `count` steps of the running requests and advance them; returns how many finished."""
    row = [-1] * state.num_slots
    starting, finishing = [], []
    for request in running:
        row[request.slot] = request.id
        if not request.num_generated:
            starting.append(request)
        request.num_generated += count
        if request.num_generated == request.output_len:
            finishing.append(request.index)
    log.append(np.array(row), count, len(state.waiting), decision.blocked, state.now, seconds)
    if starting:
        log.mark_prefills(state.num_steps, [r.slot for r in starting], [r.num_prompt_tokens for r in starting])
        log.first_token_step[[r.index for r in starting]] = state.num_steps
    log.finish_step[finishing] = state.num_steps + count - 1
    state.num_steps += count
    state.now += count * seconds
    return len(finishing)
