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
from labkit.sched.state import Request, SchedulerState
from labkit.sched.steplog import StepLog
from labkit.traffic import Trace

_TIME_SLACK = 1e-9  # seconds: clock arithmetic slack when comparing times


class Backend(Protocol):
    """Executes steps. One that `plans_ahead` knows their durations in advance, and may
    be given many steps at once; one that does not (the engine) measures them, one by one."""

    plans_ahead: bool

    def plan_seconds(self, scheduled: dict[Request, int], num_steps: int):
        """The seconds of the next `num_steps` steps: a number if all are equal, else one per step."""

    def execute(self, state: SchedulerState, scheduled: dict[Request, int], num_steps: int, log: StepLog):
        """Run `num_steps` steps in which each scheduled request processes its number of
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
        scheduled = _scheduled(state, decision)
        if not scheduled:
            if not (decision.preempt or decision.release):  # else the policy may decide anew at once
                state.now = _idle_until(state, pending, decision, policy)
            continue
        if on_step or not backend.plans_ahead or not _repeats(decision, scheduled):
            num_steps = 1
        else:
            num_steps = _steps_until_event(state, scheduled, pending, decision, backend)
        held_before = _blocks_held(state, scheduled) if state.blocks is not None and num_steps > 1 else None
        state.grow(scheduled, num_steps)
        seconds = backend.execute(state, scheduled, num_steps, log)
        num_blocks_used = 0 if state.blocks is None else _blocks_used_per_step(state, scheduled, num_steps, held_before)
        num_unfinished -= _record(state, scheduled, num_steps, seconds, log, decision, num_blocks_used)
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


def _scheduled(state: SchedulerState, decision: Decision) -> dict[Request, int]:
    """Who processes how many tokens this step, in slot order."""
    if decision.num_tokens is None:
        return {r: r.num_uncomputed for r in state.slots if r is not None and r.num_generated < r.output_len}
    return {r: decision.num_tokens[r.id] for r in state.running() if r.id in decision.num_tokens}


def _repeats(decision: Decision, scheduled: dict[Request, int]) -> bool:
    """Whether the steps after this one will be scheduled alike until the next event: every
    request emits now, so it decodes next; nobody was preempted (a preempting step admits
    nobody); and no waiting request was held back only by budget this step's prefills use."""
    if decision.num_tokens is None:
        return True
    if decision.preempt or not all(n == r.num_uncomputed for r, n in scheduled.items()):
        return False
    return decision.blocked != NO_BUDGET or all(r.is_decoding for r in scheduled)


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


def _steps_until_event(state, scheduled: dict[Request, int], pending, decision: Decision, backend: Backend) -> int:
    """Plain decode steps the decision holds for: until a request finishes, one arrives, the
    policy wakes, or the free blocks might not cover the requests' growth. The first of them
    may complete prefills."""
    count = min([r.output_len - r.num_generated for r in scheduled])
    if state.blocks is not None:
        count = min(count, _steps_within_free_blocks(state.blocks, scheduled))
    moments = [m for m in (pending[0].arrival if pending else None, decision.wake_at) if m is not None]
    if not moments:
        return count
    planned = backend.plan_seconds(scheduled, count)
    wait = min(moments) - state.now - _TIME_SLACK
    if np.ndim(planned) == 0:
        return max(1, min(count, math.ceil(wait / planned)))
    return max(1, min(count, int(np.searchsorted(np.cumsum(planned), wait)) + 1))


def _steps_within_free_blocks(blocks: BlockPool, scheduled: dict[Request, int]) -> int:
    """Steps that surely need no more blocks than are free: none before the first request
    fills its last block, then at most one block per request every `block_size` steps."""
    after_first = {r: r.num_computed + n for r, n in scheduled.items()}  # tokens cached after the first step
    free = blocks.num_free_blocks - sum(blocks.num_blocks_for(c) - len(r.block_table) for r, c in after_first.items())
    room = min(blocks.block_size * blocks.num_blocks_for(c) - c for c in after_first.values())
    return 1 + room + blocks.block_size * (free // len(scheduled))


def _blocks_held(state: SchedulerState, scheduled: dict[Request, int]) -> np.ndarray:
    """Blocks each scheduled request holds before a run of steps."""
    return np.array([len(r.block_table) for r in scheduled])


def _blocks_used_per_step(state: SchedulerState, scheduled: dict[Request, int], count: int, held_before):
    """KV blocks in use at each of the next `count` steps. `grow` took the blocks for all of
    them up front; a request needs its last ones only from the step that writes to them."""
    used = state.blocks.num_blocks - state.blocks.num_free_blocks
    if count == 1:
        return used
    block_size = state.blocks.block_size
    held_after = np.array([len(r.block_table) for r in scheduled])  # (R,)
    cached_after_first = np.array([r.num_computed + n for r, n in scheduled.items()])  # (R,)
    needed = -(-(cached_after_first[None, :] + np.arange(count)[:, None]) // block_size)  # (count, R)
    return used - (held_after - np.maximum(held_before, needed)).sum(axis=1)  # (count,)


def _record(state: SchedulerState, scheduled: dict[Request, int], count: int, seconds, log: StepLog, decision,
            num_blocks_used) -> int:
    """Log `count` steps of the scheduled requests and advance them; returns how many finished.

    With count > 1, every request emits every step: its tokens in the first, one token after.
    """
    row = [r.id if r in scheduled else -1 for r in state.slots]
    prefills, starting, finishing = [], [], []
    num_chunks = 0
    for request, num_tokens in scheduled.items():
        generated = request.num_generated
        if request.num_uncomputed > 1 or not generated:  # a prefill (or its chunk, or a recompute)
            prefills.append((request.slot, num_tokens))
            if num_tokens < request.num_uncomputed:  # a chunk: nothing to emit yet
                request.num_uncomputed -= num_tokens
                num_chunks += 1
                continue
            request.num_uncomputed = 1  # the new output token
            if not generated:
                starting.append(request.index)
        generated += count
        request.num_generated = generated
        if generated == request.output_len:
            finishing.append(request.index)
    num_emitted = len(scheduled) - num_chunks
    log.append(row, count, len(state.waiting), decision.blocked, state.now, seconds, num_emitted, num_blocks_used)
    if prefills:
        log.mark_prefills(state.num_steps, prefills)
    for index in starting:
        log.first_token_step[index] = state.num_steps
    for index in finishing:
        log.finish_step[index] = state.num_steps + count - 1
    state.num_steps += count
    state.now += count * seconds if isinstance(seconds, float) else float(np.sum(seconds))
    return len(finishing)
