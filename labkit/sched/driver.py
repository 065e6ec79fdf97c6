"""The loop both back ends share: arrivals, the policy's decision, a step, the record.

A back end only executes steps. `drive` asks the policy, applies its decision to the
`SchedulerState`, hands the running requests to `backend.execute`, and writes the
`StepLog`, so the simulator and the engine cannot disagree on who runs when.

Invariants:

- requests join the queue in arrival order (ties by trace position) at the first
  decision point at or after their arrival;
- a scheduled request processes its tokens in the step; it emits an output token when
  the step leaves none of its known tokens uncomputed (a whole prefill, the last chunk of
  one, a recompute, or a decode); a request whose prefill fits one step and which is never
  preempted emits its L tokens at steps s .. s+L-1 after admission at step s;
- every request that fits the policy's limits (`policy.check_fits`, checked before any
  work) finishes with exactly its output length;
- a run ends when every request has finished, with every slot (and KV block) released;
- when nothing runs, the clock jumps to the next arrival or the time the policy asked
  to wake at; if neither exists while requests wait, the run stops with an error
  instead of spinning;
- a back end that plans step durations ahead may run a decision of plain decode steps
  for every step until the next event (a finish, an arrival, the policy's wake time, or
  the step the free blocks no longer cover the requests' growth) at once; this gives the
  same log as asking the policy before every step, because policies decide only on events (see
  `labkit.sched.policy`). An arrival is no event while the head of the queue is blocked
  under a policy that `admits_in_order`; it still counts in the log's queue depth from
  the step it arrives. With `on_step`, the policy is asked before every step.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from labkit.sched.blocks import BlockPool
from labkit.sched.policy import HEAD_BLOCKED, NO_BUDGET, Decision, check_policy
from labkit.sched.state import Batch, Request, SchedulerState
from labkit.sched.steplog import TIME_SLACK, RunSeconds, StepLog
from labkit.traffic import Trace


class Backend(Protocol):
    """Executes steps. One that `plans_ahead` knows their durations in advance, and may
    be given many steps at once; one that does not (the engine) measures them, one by one."""

    plans_ahead: bool

    def steps_until(self, batch: Batch, max_steps: int, seconds: float) -> int:
        """How many of the next `max_steps` steps of `batch` run, at least one, until `seconds`
        have passed: the step during which they pass counts."""

    def execute(self, state: SchedulerState, batch: Batch, num_steps: int, log: StepLog) -> float | RunSeconds:
        """Run `num_steps` steps in which each request of `batch` processes its number of
        tokens; return the seconds each step took, or a `RunSeconds` when they differ."""


def drive(
    trace: Trace,
    policy,
    backend: Backend,
    on_step: Callable[[StepLog], None] | None = None,
    blocks: BlockPool | None = None,
) -> StepLog:
    """Serve `trace` with `policy` on `backend`; `on_step(log)` is called after every step if given.

    blocks: the KV pool; by default the policy's (`num_blocks`), or none when that is unlimited.
    """
    state, pending, log = start_run(trace, policy, blocks)
    num_unfinished = len(state.by_id)
    while num_unfinished:
        decision, batch = next_batch(state, pending, policy, log)
        if not batch.size:
            if not (decision.preempt or decision.release):  # else the policy may decide anew at once
                state.now = idle_until(state, pending, decision, policy)
            continue
        if on_step or not backend.plans_ahead or not _repeats(decision, batch):
            num_steps = 1
        else:
            num_steps = _steps_until_event(state, batch, pending, decision, backend, policy)
        growth = state.grow(batch, num_steps)
        seconds = backend.execute(state, batch, num_steps, log)
        steps = run_steps(state, batch, num_steps, decision, 0 if growth is None else growth.blocks_used())
        end = state.now + (seconds.total if isinstance(seconds, RunSeconds) else num_steps * seconds)
        log_steps(log, steps, state.now, seconds, pending.times_by(end) if num_steps > 1 else None)
        state.now = end
        num_unfinished -= len(steps.finished)
        if on_step:
            on_step(log)
    end_run(state)
    return log


def start_run(trace: Trace, policy, blocks: BlockPool | None) -> tuple[SchedulerState, Pending, StepLog]:
    """Check that `policy` is one and can serve every request; the state, arrivals and log of a new run."""
    check_policy(policy)
    requests = _requests(trace)
    for request in requests:
        policy.check_fits(request)
    if blocks is None and policy.num_blocks is not None:
        blocks = BlockPool(policy.num_blocks, policy.block_size)
    state = SchedulerState(policy.num_slots, requests, blocks)
    pending = Pending(requests)
    state.now = pending.next_arrival()
    return state, pending, StepLog(trace, policy.num_slots, repr(policy))


def next_batch(state: SchedulerState, pending: Pending, policy, log: StepLog) -> tuple[Decision, Batch]:
    """Take in the arrivals, ask the policy, apply its decision; who works in the next step."""
    state.waiting.extend(pending.arrived_by(state.now))
    decision = policy.schedule(state)
    if decision.preempt:
        log.count_preemptions(state.num_steps, [state.by_id[i] for i in decision.preempt])
    for request in state.apply(decision):
        log.admit_step[request.index] = state.num_steps
        if policy.reserves_whole_length:
            state.reserve(request)
    return decision, state.batch(decision)


def end_run(state: SchedulerState) -> None:
    """Free every slot a finished request still holds."""
    state.apply(Decision(release=tuple(r.id for r in state.finished_in_slots())))


def _requests(trace: Trace) -> list[Request]:
    return [
        Request(index, int(rid), float(arrival), int(prompt), int(output))
        for index, (rid, arrival, prompt, output) in enumerate(
            zip(trace.ids, trace.arrivals, trace.prompt_lengths, trace.output_lengths)
        )
    ]


def _repeats(decision: Decision, batch: Batch) -> bool:
    """Whether the steps after this one will be scheduled alike until the next event: every
    request emits now, so it decodes next; nobody was preempted (a preempting step admits
    nobody); and no waiting request was held back only by budget this step's prefills use."""
    if decision.preempt or not batch.emits:
        return False
    return decision.blocked != NO_BUDGET or batch.is_decoding


class Pending:
    """The requests that have not arrived yet, in arrival order (ties by trace position)."""

    def __init__(self, requests: list[Request]):
        self._requests = sorted(requests, key=lambda r: (r.arrival, r.index))
        self._times = [r.arrival for r in self._requests]  # ascending
        self._num_arrived = 0

    def __bool__(self) -> bool:
        return self._num_arrived < len(self._requests)

    def next_arrival(self) -> float | None:
        return self._requests[self._num_arrived].arrival if self else None

    def arrived_by(self, moment: float) -> list[Request]:
        """The requests that arrive by `moment`, taken out."""
        first, self._num_arrived = self._num_arrived, self._end_by(moment)
        return self._requests[first : self._num_arrived]

    def times_by(self, moment: float) -> np.ndarray | None:
        """Arrival times of the requests that arrive by `moment`, left in; None if none do."""
        end = self._end_by(moment)
        return np.array(self._times[self._num_arrived : end]) if end > self._num_arrived else None

    def _end_by(self, moment: float) -> int:
        return bisect.bisect_right(self._times, moment + TIME_SLACK, lo=self._num_arrived)


def idle_until(state: SchedulerState, pending: Pending, decision: Decision, policy) -> float:
    """The next time anything can happen while nothing runs, or an error if never."""
    wakes = [pending.next_arrival()] if pending else []
    if decision.wake_at is not None:
        wakes.append(decision.wake_at)
    if not wakes or min(wakes) <= state.now:
        reason = decision.blocked or "the policy admits none of them"
        raise RuntimeError(
            f"{policy!r} can make no progress at t = {state.now:.3f} s: {len(state.waiting)} requests wait "
            f"({reason}), nothing runs, and nothing is due to arrive or wake the policy"
        )
    return min(wakes)


def _steps_until_event(state, batch: Batch, pending: Pending, decision: Decision, backend: Backend, policy) -> int:
    """Plain decode steps the decision holds for: until a request finishes, one arrives (if
    that matters), the policy wakes, or the free blocks stop covering the requests' growth.
    The first of them may complete prefills."""
    count = state.steps_until_a_finish(batch)
    if state.blocks is not None:
        count = state.steps_within_free_blocks(batch, count)
    arrivals_matter = not (getattr(policy, "admits_in_order", False) and decision.blocked in HEAD_BLOCKED)
    next_arrival = pending.next_arrival() if arrivals_matter else None
    moments = [m for m in (next_arrival, decision.wake_at) if m is not None]
    if not moments:
        return count
    return backend.steps_until(batch, count, min(moments) - state.now - TIME_SLACK)


@dataclass(slots=True)
class Steps:
    """What a run of `count` identical steps did, for the log: who worked in which slot, the
    queue, and the requests whose prefill chunks ran, whose first token came, or who finished."""

    row: np.ndarray
    count: int
    num_queued: int
    blocked: str
    decided_at: float
    num_emitted: int
    num_blocks_used: object
    first_step: int
    prefills: list[tuple[int, int]]  # (slot, prompt tokens) of each prompt, chunk or recompute
    first_tokens: list[int]  # trace indices
    finished: list[int]  # trace indices


def run_steps(state: SchedulerState, batch: Batch, count: int, decision: Decision, num_blocks_used) -> Steps:
    """Count `count` steps of `batch` done in `state` and say what they did.

    With count > 1, every request emits every step: its tokens in the first, one token after.
    """
    first_step = state.num_steps
    row = state.row(batch)
    prefills = [(r.slot, n) for r, n in batch.irregular if not r.is_decoding]
    first_tokens = [r.index for r, n in batch.irregular if n == r.num_uncomputed and not r.num_generated]
    num_queued = len(state.waiting)
    finished = state.advance(batch, count)
    return Steps(row, count, num_queued, decision.blocked, state.now, batch.num_emitted, num_blocks_used, first_step,
                 prefills, first_tokens, finished)


def log_steps(log: StepLog, steps: Steps, start: float, seconds, arrivals: np.ndarray | None = None) -> None:
    """Write `steps` into the log, starting at `start` and lasting `seconds` each (or a RunSeconds)."""
    log.append(steps.row, steps.count, steps.num_queued, steps.blocked, start, seconds, steps.num_emitted,
               steps.num_blocks_used, arrivals)
    if steps.prefills:
        log.mark_prefills(steps.first_step, steps.prefills)
    for index in steps.first_tokens:
        log.first_token_step[index] = steps.first_step
    if steps.finished:
        log.finish_step[steps.finished] = steps.first_step + steps.count - 1
