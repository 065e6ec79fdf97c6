"""The loop both back ends share: arrivals, the policy's decision, a step, the record.

A back end only executes steps. `drive` takes in a trace's arrivals, then makes three
calls: the `Scheduler` schedules a step (asks the policy, applies its decision),
`backend.execute` runs it, and the scheduler's `postprocess` takes the tokens it sampled
and counts it done; the step's record goes into the `StepLog`. So the simulator and the
engine cannot disagree on who runs when. It asks the
policy before every step; `labkit.sched.fastforward` is the same loop for a back end
that knows its step times in advance, running each decision for as many steps as it holds.

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
from typing import Protocol

import numpy as np

from labkit.sched.blocks import BlockPool
from labkit.sched.policy import check_policy
from labkit.sched.scheduler import Scheduler, StepOutcome, kv_pool
from labkit.sched.state import Batch, Request
from labkit.sched.steplog import TIME_SLACK, StepLog
from labkit.traffic import Trace


class Backend(Protocol):
    """Executes steps."""

    def execute(self, batch: Batch) -> StepOutcome:
        """Run one step in which each request of `batch` processes its number of tokens
        (its KV blocks are allocated already): the tokens it sampled and the seconds it took."""


def drive(trace: Trace, policy, backend: Backend, on_step: Callable[[StepLog], None] | None = None,
          blocks: BlockPool | None = None, prompts: list[list[int]] | None = None) -> StepLog:
    """Serve `trace` with `policy` on `backend`; `on_step(log)` is called after every step if given.

    blocks: the KV pool; by default the policy's (`kv_pool`), or none when that is unlimited.
    prompts: each request's first tokens (begin-of-sequence and prompt ids), by trace position,
    for a back end that samples tokens; the log's `outputs` then holds what each sampled.
    """
    scheduler, pending, log = start_run(trace, policy, blocks, prompts)
    state = scheduler.state
    num_unfinished = len(state.by_id)
    while num_unfinished:
        batch = next_batch(scheduler, pending)  # arrivals, then the policy's decision, applied
        if not batch.size:
            continue  # the clock moved on to the next arrival or wake time
        outcome = backend.execute(batch)  # the step: its tokens and seconds
        record = scheduler.postprocess(batch, outcome.tokens)  # tokens taken in, the step counted done
        record.log_to(log, state.now, outcome)
        state.now += outcome.seconds
        num_unfinished -= len(record.finished)
        if on_step:
            on_step(log)
    return finish_run(scheduler, log)


def start_run(trace: Trace, policy, blocks: BlockPool | None,
              prompts: list[list[int]] | None = None) -> tuple[Scheduler, Pending, StepLog]:
    """Check that `policy` is one and can serve every request; the scheduler, the arrivals
    and the log of a new run."""
    check_policy(policy)
    requests = _requests(trace, prompts)
    for request in requests:
        policy.check_fits(request)
    blocks = blocks if blocks is not None else kv_pool(policy)
    scheduler = Scheduler(policy, requests, blocks)
    pending = Pending(requests)
    scheduler.state.now = pending.next_arrival()
    return scheduler, pending, StepLog(trace, policy.num_slots, repr(policy))


def finish_run(scheduler: Scheduler, log: StepLog) -> StepLog:
    """Free the slots finished requests still hold; the log, with what each request sampled
    (request id -> output ids) when the back end samples tokens."""
    scheduler.release_finished()
    log.outputs = {r.id: r.output_ids for r in scheduler.state.by_id.values() if r.token_ids}
    return log


def next_batch(scheduler: Scheduler, pending: Pending) -> Batch:
    """Take in the arrivals and schedule the next step; when nobody runs, move the clock to
    the next arrival or the time the policy wakes at."""
    state = scheduler.state
    state.arrive(pending.arrived_by(state.now))
    batch = scheduler.schedule()
    if not batch.size:
        state.now = idle_until(scheduler, pending)
    return batch


def _requests(trace: Trace, prompts: list[list[int]] | None) -> list[Request]:
    return [
        Request(index, int(rid), float(arrival), int(prompt), int(output), priority=int(priority),
                token_ids=prompts[index] if prompts else None, client=int(client))
        for index, (rid, arrival, prompt, output, priority, client) in enumerate(
            zip(trace.ids, trace.arrivals, trace.prompt_lengths, trace.output_lengths, trace.priorities, trace.clients)
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


def idle_until(scheduler: Scheduler, pending: Pending) -> float:
    """The next time anything can happen while nothing runs, or an error if never."""
    state, decision = scheduler.state, scheduler.decision
    wakes = [pending.next_arrival()] if pending else []
    if decision.wake_at is not None:
        wakes.append(decision.wake_at)
    if not wakes or min(wakes) <= state.now:
        reason = decision.blocked or "the policy admits none of them"
        raise RuntimeError(
            f"{scheduler.policy!r} can make no progress at t = {state.now:.3f} s: {len(state.waiting)} requests wait "
            f"({reason}), nothing runs, and nothing is due to arrive or wake the policy"
        )
    return min(wakes)
