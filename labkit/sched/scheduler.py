"""The scheduler: a step's `schedule` and `postprocess`, written once for every loop.

`Scheduler.schedule` asks the policy, applies its decision to the `SchedulerState` and
returns the step's `Batch`, its KV blocks allocated; `Scheduler.postprocess(batch, tokens)`
takes the tokens the step sampled into their requests, counts the step done (who emitted,
who finished, who stopped at an end-of-sequence id) and returns its `StepRecord`, all the
log keeps of it. Every loop (`drive`, the overlapped loop, the online server) is these two
calls around a back end's step, and the fast-forward calls `schedule` (it counts a run of
steps done in closed form), so the rules at a step's edges are kept here and nowhere else:

- preemptions and admissions are recorded with the step they precede (a `StepRecord`,
  which `StepRecord.log_to`, the one writer of a step into the log, writes);
- a request admitted by a policy that `reserves_whole_length` takes every block of its
  whole length at once;
- a decision that only releases or preempts, and schedules nobody, is made again at
  once: slots or blocks came free, so the policy may now admit someone;
- a run ends with `release_finished`: every finished request leaves its slot, and a
  drained run has every KV block back in the pool;
- the KV pool is the policy's `num_blocks`, or, when that is unlimited, enough for every
  slot to hold the longest request (`kv_pool`); the simulator, which holds no tensors,
  runs without a pool then.

What a loop keeps to itself is where requests come from (a trace, or clients), how a
step runs (the back end), and the clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from labkit.sched.blocks import BlockPool, num_blocks_for
from labkit.sched.policy import shape_of
from labkit.sched.state import Batch, Decision, Request, SchedulerState
from labkit.sched.steplog import RunSeconds, StepLog


def kv_pool(policy, max_context_len: int | None = None) -> BlockPool | None:
    """The KV pool a run of `policy` lends blocks from: the policy's `num_blocks`, or, when that
    is unlimited, enough for every slot to hold `max_context_len` tokens (an engine's cache,
    whose tensors need a size); without `max_context_len`, no pool (None: unlimited)."""
    if policy.num_blocks is not None:
        return BlockPool(policy.num_blocks, policy.block_size)
    if max_context_len is None:
        return None
    return BlockPool(policy.num_slots * num_blocks_for(max_context_len, policy.block_size), policy.block_size)


class Scheduler:
    """A policy's decisions applied to one `SchedulerState`, a step at a time. The caller has
    checked the policy (`labkit.sched.policy.check_policy`) and that each request fits it.

    requests: those the state knows from the start (a trace's; an online server adds its own).
    forgets_released: the state drops the requests decisions release (an online server's).
    """

    def __init__(self, policy, requests: list[Request] = (), blocks: BlockPool | None = None,
                 forgets_released: bool = False):
        self.policy = policy
        self.state = SchedulerState(policy.num_slots, list(requests), blocks, getattr(policy, "queue_order", None),
                                    forgets_released, getattr(policy, "counts_service", False))
        self.decisions: list[Decision] = [Decision()]  # those the latest `schedule` applied, in order
        self.admitted: list[int] = []  # trace indices of the requests admitted since the last record
        self.preempted: list[Preempted] = []  # and of those preempted, before their caches were dropped

    @property
    def decision(self) -> Decision:
        """The latest decision: why the head of the queue waits, and when to ask again."""
        return self.decisions[-1]

    def schedule(self) -> Batch:
        """The next step's batch, its KV blocks allocated; empty when nobody can run now."""
        self.decisions = []
        while True:
            decision = self.policy.schedule(self.state)
            self._apply(decision)
            self.decisions.append(decision)
            batch = self.state.batch(decision, self.policy.pads_finished, shape_of(self.policy))
            if batch.size or not (decision.release or decision.preempt):
                break  # else slots or blocks came free: decide again at once
        self.state.allocate(batch)
        return batch

    def _apply(self, decision: Decision) -> None:
        """Apply `decision`, noting its preemptions (before their caches are dropped) and admissions."""
        self.preempted += [Preempted.of(self.state.by_id[i]) for i in decision.preempt]
        for request in self.state.apply(decision):
            if self.policy.reserves_whole_length:
                self.state.reserve(request)
            self.admitted.append(request.index)

    def postprocess(self, batch: Batch, tokens: list[int] | None = None) -> StepRecord:
        """Count a step of `batch` done, `tokens` (one per emitting row, in row order; None from
        a back end that samples none) taken into their requests; its record for the log."""
        record = self.record(batch)
        record.finished = self.state.complete(batch, tokens)
        return record

    def record(self, batch: Batch) -> StepRecord:
        """The record of the step `batch` is about to run, with the admissions and preemptions
        since the last record."""
        record = StepRecord.of(self.state, batch, self.decision.blocked, self.admitted, self.preempted)
        self.admitted, self.preempted = [], []
        return record

    def release_finished(self) -> None:
        """Free every slot a finished request still holds, and its KV blocks."""
        self.state.apply(Decision(release=tuple(r.id for r in self.state.finished_in_slots())))


class Preempted(NamedTuple):
    """A preempted request, as the log counts it: its ids, and the cached tokens it lost."""

    id: int
    index: int
    num_computed: int

    @classmethod
    def of(cls, request: Request) -> Preempted:
        return cls(request.id, request.index, request.num_computed)


class Measured(NamedTuple):
    """What an engine measured of one step: where its seconds went (phase -> seconds; empty if
    it did not split them), its host and device seconds, and its lanes' stretches ("host" or
    "device", start, end, in seconds since the run began)."""

    phases: dict[str, float]
    host: float
    device: float
    lanes: list[tuple[str, float, float]]


class StepOutcome(NamedTuple):
    """What a back end returns for a step, or for a run of identical steps: the token each
    emitting row sampled, in row order (None from a back end that samples none); the seconds
    (a RunSeconds when a run's steps differ); the KV tokens attention reads (the first step's,
    the steps, and their growth per step; None when the back end does not count them); and
    what an engine measured."""

    tokens: list[int] | None
    seconds: float | RunSeconds
    kv_tokens: tuple[int, int, int] | None = None
    measured: Measured | None = None


@dataclass(slots=True)
class StepRecord:
    """What a run of `count` identical steps did, for the log: who worked in which slot, the
    finished rows computed as padding, the rows that padded it to a shape the engine runs,
    the queue, who was admitted or preempted before it, and the requests whose prefill chunks
    ran, whose first token came, or who finished."""

    row: list[int]
    num_padded: int
    num_shape_padded: int
    count: int
    num_queued: int
    blocked: str
    decided_at: float
    num_emitted: int
    num_blocks_used: object  # a number, or a function giving one per step (`labkit.sched.fastforward`)
    first_step: int
    admitted: list[int]  # trace indices
    preempted: list[Preempted]
    prefills: list[tuple[int, int]]  # (slot, prompt tokens) of each prompt, chunk or recompute
    first_tokens: list[int]  # trace indices
    finished: list[int]  # trace indices

    @classmethod
    def of(cls, state: SchedulerState, batch: Batch, blocked: str, admitted: list[int],
           preempted: list[Preempted]) -> StepRecord:
        """The record of the step `batch` is about to run (its blocks allocated), before its
        counters move; `blocked`: why the head of the queue waits."""
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
        return cls(row, len(batch.padding), batch.num_shape_padding, 1, len(state.waiting), blocked, state.now,
                   num_emitted, num_blocks_used, state.num_steps, admitted, preempted, prefills, first_tokens, [])

    def log_to(self, log: StepLog, start: float, outcome: StepOutcome, arrivals: np.ndarray | None = None) -> None:
        """Write the record into `log`, its steps starting at `start`, with what the back end
        said of them; `arrivals`: times of requests that join the queue during them."""
        if self.preempted:
            log.count_preemptions(self.first_step, self.preempted)
        if self.admitted:
            log.admit_step[self.admitted] = self.first_step
        log.append(self.row, self.count, self.num_queued, self.blocked, start, outcome.seconds, self.num_emitted,
                   self.num_blocks_used, arrivals, self.num_padded, self.num_shape_padded)
        if outcome.kv_tokens is not None:
            log.record_kv_tokens(*outcome.kv_tokens)
        if outcome.measured is not None:
            log.record_measured(outcome.measured)
        if self.prefills:
            log.mark_prefills(self.first_step, self.prefills)
        if self.first_tokens:
            log.first_token_step[self.first_tokens] = self.first_step
        if self.finished:
            log.finish_step[self.finished] = self.first_step + self.count - 1
