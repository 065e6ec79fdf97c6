"""The loop both back ends share: arrivals, the policy's decision, a step, the record.

A back end only executes steps. `drive` asks the policy, applies its decision to the
`SchedulerState`, hands the scheduled requests to `backend.execute`, counts the step
done and writes the `StepLog`, so the simulator and the engine cannot disagree on who
runs when. It asks the policy before every step; `labkit.sched.fastforward` is the
same loop for a back end that knows its step times in advance, running each decision
for as many steps as it holds.

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
  instead of spinning.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from labkit.sched.blocks import BlockPool
from labkit.sched.policy import Decision, check_policy
from labkit.sched.state import Batch, Request, SchedulerState
from labkit.sched.steplog import TIME_SLACK, StepLog
from labkit.traffic import Trace


class Backend(Protocol):
    """Executes steps."""

    def execute(self, state: SchedulerState, batch: Batch, log: StepLog) -> float:
        """Run one step in which each request of `batch` processes its number of tokens
        (its KV blocks are allocated already); return the seconds it took."""


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
        decision, batch = next_batch(state, pending, policy, log)  # ask and apply
        if not batch.size:
            wait(state, pending, decision, policy)
            continue
        state.allocate(batch)
        seconds = backend.execute(state, batch, log)  # execute
        steps = complete_step(state, batch, decision)  # count it done
        log_steps(log, steps, state.now, seconds)  # record
        state.now += seconds
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
    state = SchedulerState(policy.num_slots, requests, blocks, getattr(policy, "queue_order", None))
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
    return decision, state.batch(decision, policy.pads_finished)


def wait(state: SchedulerState, pending: Pending, decision: Decision, policy) -> None:
    """Nothing runs: move the clock to the next arrival or wake time, unless the decision
    released or preempted someone (the policy may then decide anew at once)."""
    if not (decision.preempt or decision.release):
        state.now = idle_until(state, pending, decision, policy)


def end_run(state: SchedulerState) -> None:
    """Free every slot a finished request still holds."""
    state.apply(Decision(release=tuple(r.id for r in state.finished_in_slots())))


def _requests(trace: Trace) -> list[Request]:
    return [
        Request(index, int(rid), float(arrival), int(prompt), int(output), priority=int(priority))
        for index, (rid, arrival, prompt, output, priority) in enumerate(
            zip(trace.ids, trace.arrivals, trace.prompt_lengths, trace.output_lengths, trace.priorities)
        )
    ]


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


@dataclass(slots=True)
class Steps:
    """What a run of `count` identical steps did, for the log: who worked in which slot, the
    finished rows computed as padding, the queue, and the requests whose prefill chunks ran,
    whose first token came, or who finished."""

    row: list[int]
    num_padded: int
    count: int
    num_queued: int
    blocked: str
    decided_at: float
    num_emitted: int
    num_blocks_used: object  # a number, or a function giving one per step (`labkit.sched.fastforward`)
    first_step: int
    prefills: list[tuple[int, int]]  # (slot, prompt tokens) of each prompt, chunk or recompute
    first_tokens: list[int]  # trace indices
    finished: list[int]  # trace indices


def complete_step(state: SchedulerState, batch: Batch, decision: Decision) -> Steps:
    """Count one step of `batch` done in `state` (its blocks allocated) and say what it did."""
    steps = describe_step(state, batch, decision)
    steps.finished = state.complete(batch)
    return steps


def describe_step(state: SchedulerState, batch: Batch, decision: Decision) -> Steps:
    """The log's view of the step `batch` is about to run, before its counters move."""
    row = [-1] * state.num_slots
    num_emitted, prefills, first_tokens = 0, [], []
    for request, num_tokens in batch.rows:
        row[request.slot] = request.id
        emits = num_tokens == request.num_uncomputed
        num_emitted += emits
        if not request.is_decoding:
            prefills.append((request.slot, num_tokens))
            if emits and not request.num_generated:
                first_tokens.append(request.index)
    num_blocks_used = state.blocks.num_blocks - state.blocks.num_free_blocks if state.blocks is not None else 0
    return Steps(row, len(batch.padding), 1, len(state.waiting), decision.blocked, state.now, num_emitted, num_blocks_used,
                 state.num_steps, prefills, first_tokens, [])


def log_steps(log: StepLog, steps: Steps, start: float, seconds, arrivals: np.ndarray | None = None) -> None:
    """Write `steps` into the log, starting at `start` and lasting `seconds` each (or a RunSeconds)."""
    log.append(steps.row, steps.count, steps.num_queued, steps.blocked, start, seconds, steps.num_emitted,
               steps.num_blocks_used, arrivals, steps.num_padded)
    if steps.prefills:
        log.mark_prefills(steps.first_step, steps.prefills)
    for index in steps.first_tokens:
        log.first_token_step[index] = steps.first_step
    if steps.finished:
        log.finish_step[steps.finished] = steps.first_step + steps.count - 1
