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
- a back end with a fixed `step_time` may run a decision of plain decode steps for
  every step until the next event (a finish, an arrival, the policy's wake time, or
  the point where the free blocks might not cover growth) at once; this gives the same log
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
from labkit.sched.policy import NO_BUDGET, Decision
from labkit.sched.state import Batch, Request, SchedulerState
from labkit.sched.steplog import StepLog
from labkit.traffic import Trace

_TIME_SLACK = 1e-9  # seconds: clock arithmetic slack when comparing times


class Backend(Protocol):
    """Executes steps. One that `plans_ahead` knows their durations in advance, and may
    be given many steps at once; one that does not (the engine) measures them, one by one."""

    plans_ahead: bool

    def plan_seconds(self, batch: Batch, num_steps: int):
        """The seconds of the next `num_steps` steps: a number if all are equal, else one per step."""

    def execute(self, state: SchedulerState, batch: Batch, num_steps: int, log: StepLog):
        """Run `num_steps` steps in which each request of `batch` processes its number of
        tokens; return the seconds each step took (a number, or one per step)."""


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
    requests = _requests(trace)
    for request in requests:
        policy.check_fits(request)
    if blocks is None and policy.num_blocks is not None:
        blocks = BlockPool(policy.num_blocks, policy.block_size)
    state = SchedulerState(policy.num_slots, requests, blocks)
    pending = deque(sorted(requests, key=lambda r: (r.arrival, r.index)))
    state.now = pending[0].arrival
    log = StepLog(trace, policy.num_slots, repr(policy))
    num_unfinished = len(requests)
    while num_unfinished:
        _arrive(pending, state)
        decision = policy.schedule(state)
        if decision.preempt:
            log.count_preemptions(state.num_steps, [state.by_id[i] for i in decision.preempt])
        for request in state.apply(decision):
            log.admit_step[request.index] = state.num_steps
            if policy.reserves_whole_length:
                state.reserve(request)
        batch = state.batch(decision)
        if not batch.size:
            if not (decision.preempt or decision.release):  # else the policy may decide anew at once
                state.now = _idle_until(state, pending, decision, policy)
            continue
        if on_step or not backend.plans_ahead or not _repeats(decision, batch):
            num_steps = 1
        else:
            num_steps = _steps_until_event(state, batch, pending, decision, backend)
        state.grow(batch, num_steps)
        seconds = backend.execute(state, batch, num_steps, log)
        num_blocks_used = 0 if state.blocks is None else _blocks_used_per_step(state, batch, num_steps)
        num_unfinished -= _record(state, batch, num_steps, seconds, log, decision, num_blocks_used)
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


def _repeats(decision: Decision, batch: Batch) -> bool:
    """Whether the steps after this one will be scheduled alike until the next event: every
    request emits now, so it decodes next; nobody was preempted (a preempting step admits
    nobody); and no waiting request was held back only by budget this step's prefills use."""
    if decision.preempt or not batch.emits.all():
        return False
    return decision.blocked != NO_BUDGET or bool(batch.is_decoding.all())


def _arrive(pending: deque[Request], state: SchedulerState) -> None:
    while pending and pending[0].arrival <= state.now + _TIME_SLACK:
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


def _steps_until_event(state, batch: Batch, pending, decision: Decision, backend: Backend) -> int:
    """Plain decode steps the decision holds for: until a request finishes, one arrives, the
    policy wakes, or the free blocks might not cover the requests' growth. The first of them
    may complete prefills."""
    count = int((batch.output_len - batch.num_generated).min())
    if state.blocks is not None:
        count = min(count, _steps_within_free_blocks(state.blocks, batch))
    moments = [m for m in (pending[0].arrival if pending else None, decision.wake_at) if m is not None]
    if not moments:
        return count
    planned = backend.plan_seconds(batch, count)
    wait = min(moments) - state.now - _TIME_SLACK
    if np.ndim(planned) == 0:
        return max(1, min(count, math.ceil(wait / planned)))
    return max(1, min(count, int(np.searchsorted(np.cumsum(planned), wait)) + 1))


def _steps_within_free_blocks(blocks: BlockPool, batch: Batch) -> int:
    """Steps that surely need no more blocks than are free: none before the first request
    fills its last block, then at most one block per request every `block_size` steps."""
    cached_after_first = batch.num_cached_after
    blocks_after_first = -(-cached_after_first // blocks.block_size)
    free = blocks.num_free_blocks - int((blocks_after_first - batch.num_blocks_held).sum())
    room = int((blocks.block_size * blocks_after_first - cached_after_first).min())
    return 1 + room + blocks.block_size * (free // batch.size)


def _blocks_used_per_step(state: SchedulerState, batch: Batch, count: int):
    """KV blocks in use at each of the next `count` steps. `grow` took the blocks for all of
    them up front; a request needs its last ones only from the step that writes to them."""
    used = state.blocks.num_blocks - state.blocks.num_free_blocks
    if count == 1:
        return used
    held_after = state.counters.num_blocks_held[batch.slots]  # (R,)
    needed = -(-(batch.num_cached_after[None, :] + np.arange(count)[:, None]) // state.blocks.block_size)  # (count, R)
    return used - (held_after - np.maximum(batch.num_blocks_held, needed)).sum(axis=1)  # (count,)


def _record(state: SchedulerState, batch: Batch, count: int, seconds, log: StepLog, decision, num_blocks_used) -> int:
    """Log `count` steps of `batch` and advance its requests; returns how many finished.

    With count > 1, every request emits every step: its tokens in the first, one token after.
    """
    row = np.full(state.num_slots, -1, np.int64)
    row[batch.slots] = batch.id
    emits = batch.emits
    prefills = ~batch.is_decoding  # a prefill, its chunk, or a recompute
    starting = emits & (batch.num_generated == 0)
    finishing = emits & (batch.num_generated + count == batch.output_len)
    state.advance(batch, count)
    log.append(row, count, len(state.waiting), decision.blocked, state.now, seconds, int(emits.sum()), num_blocks_used)
    if prefills.any():
        log.mark_prefills(state.num_steps, list(zip(batch.slots[prefills].tolist(), batch.num_tokens[prefills].tolist())))
    log.first_token_step[batch.index[starting]] = state.num_steps
    log.finish_step[batch.index[finishing]] = state.num_steps + count - 1
    state.num_steps += count
    state.now += count * seconds if isinstance(seconds, float) else float(np.sum(seconds))
    return int(finishing.sum())
