"""Fast-forward: `drive`'s loop for a back end that knows its step times in advance (the
simulator), running each decision for as many steps as it holds.

Asking the policy before every step is what `drive` does, and what a student reads. It
costs one decision per step: the Azure trace is some 65,000 steps. But a decision only
changes on an event, so this loop asks once per event and writes one log segment per run
of identical steps. It relies on three facts the plain core states, and on nothing else:

- a policy decides only on events (`labkit.sched.policy`): a decision made before a
  run of plain decode steps, in which nobody finishes, arrives or runs out of blocks,
  holds for all of them. An arrival is no event while the head of the queue waits for
  a slot, blocks or budget under a policy that `admits_in_order`; under any other
  policy (a sorted queue, or one that does not say) every arrival is one; under a policy
  that `counts_service`, every step is one while anyone waits;
- in a decode step each scheduled request processes its one uncomputed token and emits
  the next (`labkit.sched.state`): after n of them its `num_generated` is n further on,
  its `num_uncomputed` is still 1, and every other known token is computed;
- a request holds exactly the blocks its cached tokens fill, or the whole length it
  reserved (`labkit.sched.state`). So one that grows takes a block every `block_size`
  steps, each at its own phase, and the pool runs dry at a step known in closed form
  (`Growth`).

The back end prices a run of steps in closed form too (`labkit.sched.simulator`).

Invariant: a fast-forwarded run writes the same StepLog (slots, queue depth, blocked
reasons, step times, blocks in use, preemptions, outputs) as `drive` asking the policy
before every step; tests/test_fastforward.py compares them with every knob.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from labkit.sched.blocks import BlockPool
from labkit.sched.driver import Pending, finish_run, next_batch, start_run
from labkit.sched.policy import HEAD_BLOCKED, NO_BUDGET
from labkit.sched.scheduler import Scheduler, StepOutcome, StepRecord
from labkit.sched.state import Batch, Decision, Request, SchedulerState
from labkit.sched.steplog import TIME_SLACK, RunSeconds, StepLog
from labkit.traffic import Trace


class PlannedBackend(Protocol):
    """A back end whose step times are known before the steps run."""

    def execute(self, batch: Batch, num_steps: int = 1) -> StepOutcome:
        """The seconds of each of `num_steps` steps of `batch` (its tokens in the first, one
        decode token each after), or a RunSeconds when they differ; no tokens."""

    def steps_until(self, batch: Batch, max_steps: int, seconds: float) -> int:
        """How many of the next `max_steps` steps of `batch` run, at least one, until `seconds`
        have passed: the step during which they pass counts."""


def fast_forward(trace: Trace, policy, backend: PlannedBackend, blocks: BlockPool | None = None) -> StepLog:
    """Serve `trace` with `policy` as `drive` does, each decision run until the next event."""
    scheduler, pending, log = start_run(trace, policy, blocks)
    state = scheduler.state
    num_unfinished = len(state.by_id)
    while num_unfinished:
        batch = next_batch(scheduler, pending)
        if not batch.size:
            continue
        record = scheduler.record(batch)
        num_steps, growth = plan_run(scheduler, batch, record, pending, backend)
        outcome = backend.execute(batch, num_steps)
        run_steps(state, batch, record, num_steps, growth)
        seconds = outcome.seconds
        end = state.now + (seconds.total if isinstance(seconds, RunSeconds) else num_steps * seconds)
        record.log_to(log, state.now, outcome, pending.times_by(end) if num_steps > 1 else None)
        state.now = end
        num_unfinished -= len(record.finished)
    return finish_run(scheduler, log)


def repeats(decision: Decision, batch: Batch, first: StepRecord) -> bool:
    """Whether the steps after the `first` are scheduled alike until the next event: every
    request emits in it, so it decodes next; nobody was preempted (a preempting step admits
    nobody); the decodes after a step with prefills are not padded to a shape it was not;
    and no waiting request was held back only by budget this step's prefills use."""
    if decision.preempt or first.num_emitted < batch.size:
        return False
    if first.prefills and batch.decode_size > batch.num_rows:
        return False
    return decision.blocked != NO_BUDGET or not first.prefills


def plan_run(scheduler: Scheduler, batch: Batch, first: StepRecord, pending: Pending,
             backend: PlannedBackend) -> tuple[int, Growth | None]:
    """Steps the scheduler's decision holds for, the `first` of which may complete prefills:
    until a request finishes, the free blocks stop covering the growth, one arrives (if that
    matters), or the policy wakes. Also who grows block by block, if anyone."""
    state, decision = scheduler.state, scheduler.decision
    if not repeats(decision, batch, first) or (state.counts_service and state.waiting):
        return 1, None  # (a policy that reads the counters may admit another client's request at any step)
    count = min([request.output_len - request.num_generated for request, _ in batch.rows])
    arrivals_matter = not (getattr(scheduler.policy, "admits_in_order", False) and decision.blocked in HEAD_BLOCKED)
    moments = [m for m in (pending.next_arrival() if arrivals_matter else None, decision.wake_at) if m is not None]
    if moments:
        count = backend.steps_until(batch, count, min(moments) - state.now - TIME_SLACK)
    growth = Growth.of(batch, state.blocks.block_size) if state.blocks is not None and count > 1 else None
    if growth is not None:
        count = min(count, growth.steps_within(state.blocks.num_free_blocks))
    return count, growth


class Growth:
    """The requests of a run that grow block by block, and the step of the run (the first
    is 1, its blocks taken already) in which each takes its next block: its phase. One
    holds ceil(c / b) blocks for the c tokens cached after the first step, so it takes
    the next when its cache passes that many blocks' worth, at step ceil(c / b) * b - c + 2,
    and one more every b steps after. A request that reserved its whole length takes none."""

    def __init__(self, requests: list[Request], phases: list[int], block_size: int):
        self.requests, self.block_size = requests, block_size
        self.phases = np.array(phases, np.int64)  # (growing,), each in 2 .. block_size + 1

    @classmethod
    def of(cls, batch: Batch, block_size: int) -> Growth | None:
        requests, phases = [], []
        for request, _ in batch.rows:
            full = len(request.block_table) * block_size  # tokens its blocks hold
            if full < request.max_context_len:
                cached = request.num_prompt_tokens + request.num_generated  # after the first step, which emits
                requests.append(request)
                phases.append(full - cached + 2)
        return cls(requests, phases, block_size) if requests else None

    def steps_within(self, num_free_blocks: int) -> int:
        """Steps of the run the free blocks cover: see `steps_within`."""
        return steps_within(np.sort(self.phases), num_free_blocks, self.block_size)

    def take_blocks(self, pool: BlockPool, num_steps: int) -> None:
        """Lend each growing request the blocks it takes in `num_steps` steps."""
        for request, phase in zip(self.requests, self.phases.tolist()):
            if num_steps >= phase:
                pool.allocate(request.block_table, (num_steps - phase) // self.block_size + 1)

    def blocks_in_use(self, first: int, num_steps: int) -> BlocksInUse:
        return BlocksInUse(first, self.phases, self.block_size, num_steps)


def steps_within(phases: np.ndarray, num_free_blocks: int, block_size: int) -> int:
    """Steps of a run that `num_free_blocks` cover, given the sorted phases of the growing
    requests. Every block_size steps each takes one block, in the order of their phases,
    so the (free + 1)-th block is needed at step phases[free % n] + (free // n) * block_size,
    and the run ends just before it."""
    cycles, position = divmod(num_free_blocks, len(phases))
    return int(phases[position]) + cycles * block_size - 1


def run_steps(state: SchedulerState, batch: Batch, record: StepRecord, num_steps: int, growth: Growth | None) -> None:
    """Count `num_steps` steps of `batch` done, and fill in `record`, made before the first:
    one step as `Scheduler.postprocess` counts it, or, for a run, each request emits
    `num_steps` tokens and leaves its next one uncomputed, and each growing one takes its blocks."""
    if num_steps == 1:
        record.finished = state.complete(batch)
        return
    for request, num_tokens in batch.rows:
        if state.counts_service:
            state.serve(request, num_tokens, num_outputs=num_steps)
        request.num_generated += num_steps
        request.num_computed, request.num_uncomputed = request.num_prompt_tokens + request.num_generated - 1, 1
        if request.num_generated == request.output_len:
            record.finished.append(request.index)
    state.num_steps += num_steps
    record.count = num_steps
    if growth is not None:
        growth.take_blocks(state.blocks, num_steps)
        record.num_blocks_used = growth.blocks_in_use(record.num_blocks_used, num_steps)


class BlocksInUse:
    """Blocks in use at each step of a run, computed when the log is read: those in use in
    its first step, plus the blocks the growing requests have taken by then (see `Growth`)."""

    def __init__(self, first: int, phases: np.ndarray, block_size: int, num_steps: int):
        self.first, self.phases, self.block_size, self.num_steps = first, phases, block_size, num_steps

    def __call__(self) -> np.ndarray:
        steps = np.arange(1, self.num_steps + 1)[:, None]  # (steps, 1)
        taken = np.maximum(0, (steps - self.phases[None, :]) // self.block_size + 1)  # (steps, growing)
        return self.first + taken.sum(axis=1)
