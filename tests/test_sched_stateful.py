"""Stateful property test of the scheduling core: `Continuous` + `SchedulerState` + `BlockPool`.

A Hypothesis state machine adds requests, steps the scheduler one decision at a time and
aborts requests at random, the way `labkit.sched.driver.drive` runs its loop (arrivals,
`policy.schedule`, `state.apply`, `state.allocate`, then what `Scheduler.postprocess` does:
`StepRecord.of` and `state.complete`; then `StepRecord.log_to`). The policy is `Continuous`
or `Priority`, with every knob. After every rule it checks the invariants the sched
modules' docstrings state:

- every added request is in exactly one place: waiting, in a slot (running or finished,
  not yet released), released after finishing, or aborted; none is lost;
- the slots and requests agree (`slots[k].slot == k`), at most `num_slots` are held, and
  `seated` lists the holders in admission order;
- allocated blocks + free blocks == num_blocks, no block id has two owners, a request
  holds blocks only while it holds a slot, and exactly those its `num_computed` tokens fill;
- a step processes at most `max_tokens_per_step` tokens, each scheduled request between
  1 and its `num_uncomputed`;
- `num_generated` never decreases (a preempted request keeps its outputs), grows by at
  most one per step, never passes `output_len`, and an unfinished request has
  `1 <= num_uncomputed <= num_prompt_tokens + num_generated`, the rest computed;
- the StepLog counts every emitted token.

Teardown drains the queue (no more arrivals) and checks liveness: every non-aborted
request finishes with exactly its output length and the pool ends full.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import labkit as lk
from labkit.sched import Decision, Request, SchedulerState
from labkit.sched.blocks import BlockPool
from labkit.sched.scheduler import StepOutcome, StepRecord
from labkit.sched.steplog import StepLog

CAPACITY = 64  # most requests one run may add: the StepLog's per-request arrays are this long
MAX_DRAIN_STEPS = 2000
MAX_DECISIONS_PER_STEP = 8  # decisions that release or preempt without scheduling, before a step


class SchedulerMachine(RuleBasedStateMachine):
    """One policy, one state, one pool, one log; requests arrive while it runs."""

    @initialize(
        num_slots=st.integers(1, 4),
        block_size=st.integers(1, 4),
        num_blocks=st.one_of(st.none(), st.integers(4, 16), st.integers(4, 16)),
        max_tokens_per_step=st.one_of(st.none(), st.integers(1, 12)),
        chunked_prefill=st.booleans(),
        victim=st.sampled_from(["newest", "longest"]),
        kind=st.sampled_from([lk.Continuous, lk.Priority]),
    )
    def setup(self, num_slots, block_size, num_blocks, max_tokens_per_step, chunked_prefill, victim, kind):
        self.policy = kind(
            num_slots,
            num_blocks=num_blocks,
            block_size=block_size,
            max_tokens_per_step=max_tokens_per_step,
            chunked_prefill=chunked_prefill,
            victim=victim,
        )
        self.pool = BlockPool(num_blocks, block_size) if num_blocks is not None else None
        self.state = SchedulerState(num_slots, [], self.pool, self.policy.queue_order)
        self.log = StepLog(lk.Trace.from_lengths([1] * CAPACITY), num_slots, repr(self.policy))
        self.added: dict[int, Request] = {}
        self.aborted: set[int] = set()
        self.released: set[int] = set()
        self.last_generated: dict[int, int] = {}
        self.last_step_tokens: dict[int, int] = {}
        self.healthy = True  # False once a rule or invariant fails, so teardown does not pile on

    # Driving, as `drive` does with num_steps = 1

    def _check_decision(self, decision: Decision) -> None:
        finished = {r.id for r in self.state.finished_in_slots()}
        running = {r.id for r in self.state.running()}
        waiting = {r.id for r in self.state.waiting}
        assert set(decision.release) <= finished, f"{decision} releases a request that has not finished"
        assert set(decision.preempt) <= running, f"{decision} preempts a request that is not running"
        assert set(decision.admit) <= waiting | set(decision.preempt), f"{decision} admits one not waiting"
        assert len(set(decision.admit)) == len(decision.admit), f"{decision} admits a request twice"
        if decision.num_tokens is not None:
            given = set(decision.num_tokens)
            assert not given & set(decision.preempt), f"{decision} gives tokens to a request it preempts"
            may_run = (running - set(decision.preempt)) | set(decision.admit)
            assert given <= may_run, f"{decision} gives tokens to a request that will not run"
            assert set(decision.admit) <= given, f"{decision} admits a request without giving it tokens"

    def _step_once(self) -> bool:
        """One pass of the driver's loop up to a step; returns whether a step ran."""
        self.last_step_tokens = {}
        for _ in range(MAX_DECISIONS_PER_STEP):
            decision = self.policy.schedule(self.state)
            self._check_decision(decision)
            preempted = [self.state.by_id[i] for i in decision.preempt]
            if preempted:
                self.log.count_preemptions(self.state.num_steps, preempted)
            self.released.update(decision.release)
            for request in self.state.apply(decision):
                self.log.admit_step[request.index] = self.state.num_steps
            for request in preempted:  # back at the head of the queue, cache dropped, outputs kept
                assert request.slot == -1 and not request.block_table
                assert request.num_uncomputed == request.num_prompt_tokens + request.num_generated
            batch = self.state.batch(decision)
            if batch.size:
                break
            if not (decision.preempt or decision.release):
                # Everyone has arrived, so drive would raise "can make no progress" here.
                assert not self.state.waiting, (
                    f"{self.policy!r} is stuck: {len(self.state.waiting)} requests wait "
                    f"({decision.blocked or 'no reason given'}) and nothing runs"
                )
                return False
        else:
            raise AssertionError(f"{self.policy!r}: {MAX_DECISIONS_PER_STEP} decisions in a row schedule nothing")
        scheduled = batch.rows
        for request, num_tokens in scheduled:
            assert request.slot >= 0 and not request.is_finished
            assert 1 <= num_tokens <= request.num_uncomputed, (request, num_tokens)
        self.last_step_tokens = {r.id: n for r, n in scheduled}
        self.state.allocate(batch)
        record = StepRecord.of(self.state, batch, decision.blocked, [], [])
        record.finished = self.state.complete(batch)
        record.log_to(self.log, self.state.now, StepOutcome(None, 1.0))  # requests arrive by rule, not from the trace
        self.state.now += 1.0
        return True

    def _guard(self, action, *args):
        self.healthy = False
        result = action(*args)
        self.healthy = True
        return result

    # Rules

    @precondition(lambda self: len(self.added) < CAPACITY)
    @rule(prompt_len=st.integers(0, 10), output_len=st.integers(1, 10), priority=st.integers(0, 2))
    def add(self, prompt_len, output_len, priority):
        index = len(self.added)
        request = Request(index, index, self.state.now, prompt_len, output_len, priority=priority)
        try:
            self.policy.check_fits(request)
        except ValueError:
            return  # a request the policy can never serve is refused before any work
        self.added[request.id] = request
        self.last_generated[request.id] = 0
        self.state.add(request)

    @rule()
    def step(self):
        self._guard(self._step_once)

    @precondition(lambda self: self.state.waiting or self.state.running())
    @rule(data=st.data())
    def abort(self, data):
        """A client goes away: the request leaves the queue or its slot, and its blocks are freed."""
        candidates = sorted([*self.state.waiting, *self.state.running()], key=lambda r: r.id)
        request = data.draw(st.sampled_from(candidates), label="abort")
        self.state.abort(request.id)  # frees its slot and blocks, and forgets it
        self.aborted.add(request.id)

    # Invariants

    @invariant()
    def invariants(self):
        self._guard(self._check_invariants)

    def _check_invariants(self):
        state = self.state
        waiting = [r.id for r in state.waiting]
        in_slots = [r.id for r in state.slots if r is not None]
        assert len(state.slots) == state.num_slots and len(in_slots) <= state.num_slots
        for k, request in enumerate(state.slots):
            assert request is None or request.slot == k, f"slot {k} holds {request} whose slot is {request.slot}"
        assert sorted(r.id for r in state.seated) == sorted(in_slots), "seated and slots disagree"
        orders = [r.admitted_order for r in state.seated]
        assert orders == sorted(orders), f"seated is not in admission order: {orders}"
        assert state.num_free_slots() == state.slots.count(None)
        assert state.running() == [r for r in state.seated if not r.is_finished]
        assert state.finished_in_slots() == [r for r in state.seated if r.is_finished]
        for request in state.waiting:
            assert request.slot == -1 and not request.block_table, f"waiting {request} holds a slot or blocks"
        # exactly one place each
        places = waiting + in_slots + sorted(self.released) + sorted(self.aborted)
        assert len(places) == len(set(places)), f"a request is in two places: {places}"
        assert set(places) == set(self.added), f"lost: {set(self.added) - set(places)}"
        for request_id in self.released:
            request = self.added[request_id]
            assert request.is_finished and request.slot == -1 and not request.block_table
        # tokens
        if self.policy.max_tokens_per_step is not None:
            assert sum(self.last_step_tokens.values()) <= self.policy.max_tokens_per_step, self.last_step_tokens
        for request_id, request in self.added.items():
            before, now = self.last_generated[request_id], request.num_generated
            assert before <= now <= before + 1, f"request {request_id}: num_generated went {before} -> {now}"
            assert now <= request.output_len
            self.last_generated[request_id] = now
            if request_id not in self.aborted and not request.is_finished:
                assert 1 <= request.num_uncomputed <= request.num_prompt_tokens + now, request
                assert request.num_computed + request.num_uncomputed == request.num_prompt_tokens + now, request
        assert self.log.num_output_tokens == sum(r.num_generated for r in self.added.values())
        # blocks
        if self.pool is not None:
            owned = [b for r in self.added.values() for b in r.block_table]
            free = list(self.pool.free_ids)
            assert len(owned) == sum(r.num_blocks_held for r in self.added.values()), "a table misses ids"
            assert len(owned) + self.pool.num_free_blocks == self.pool.num_blocks, "blocks lost or invented"
            assert len(owned) == len(set(owned)), f"a block has two owners: {sorted(owned)}"
            assert not set(owned) & set(free), "a block is both free and owned"
            assert sorted(owned + free) == list(range(self.pool.num_blocks)), "a block id is lost or invented"
            for request in self.added.values():
                if request.slot >= 0:
                    assert len(request.block_table) == self.pool.num_blocks_for(request.num_computed), request
                else:
                    assert not request.block_table, f"{request} holds blocks without a slot"

    def teardown(self):
        if not self.healthy or not hasattr(self, "state"):
            return
        for _ in range(MAX_DRAIN_STEPS):
            if all(r.is_finished for r in self.added.values() if r.id not in self.aborted):
                break
            self._step_once()
            self._check_invariants()
        else:
            unfinished = [r for r in self.added.values() if r.id not in self.aborted and not r.is_finished]
            raise AssertionError(f"{self.policy!r} did not drain in {MAX_DRAIN_STEPS} steps: {unfinished}")
        for request_id, request in self.added.items():
            if request_id not in self.aborted:
                assert request.num_generated == request.output_len, request
        self.state.apply(Decision(release=tuple(r.id for r in self.state.finished_in_slots())))
        assert self.state.num_free_slots() == self.state.num_slots and not self.state.waiting
        if self.pool is not None:
            assert self.pool.num_free_blocks == self.pool.num_blocks, "KV blocks leaked"


SchedulerMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase
