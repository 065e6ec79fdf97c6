"""Stateful property test of the scheduling core: the real `Scheduler` under every policy.

A Hypothesis state machine drives `labkit.sched.scheduler.Scheduler` as the online server
does: requests arrive at any moment (`SchedulerState.add`), clients leave
(`SchedulerState.abort`) or a request samples an end-of-sequence token, and a step is
`Scheduler.schedule()`, then `Scheduler.postprocess(batch, tokens)` (one token per emitting
row: the EOS for a request that is to end there), its record logged; when nothing runs, the clock moves to
the time the policy wakes at, as `drive` moves it. A run ends with `release_finished()`.
The policy is drawn with its knobs (tests/strategies.py): Static (finished rows padded or
dropped) and Dynamic, Continuous, Priority, ShortestPredictedFirst and Fair (its clients the
requests' priorities), each with or without
a KV pool (the policy's, or one an engine sizes for every slot), a token budget, chunked
prefill, whole-length reservation, an execution shape and `min_shape_fill`.

After every rule it checks what labkit/sched/state.py, scheduler.py and policy.py state:

- every request is in one place: waiting, in a slot, released once finished, or aborted
  (and then forgotten);
- slot k's holder says slot k, `seated` lists the holders in admission order, and at most
  `num_slots` hold slots;
- `num_computed + num_uncomputed == num_prompt_tokens + num_generated`, with
  `1 <= num_uncomputed` and `num_generated <= output_len`; a waiting request has nothing
  cached; a step moves the counters of its rows only: each processes its tokens, and one
  that leaves none uncomputed emits one token, which is then the one left uncomputed;
- with a pool, every block id is free or in one block table; a request holds blocks only
  in a slot: exactly those its cached tokens fill (and, during a step, those its tokens
  are written to), or its whole length when the policy `reserves_whole_length`;
- the queue is first come, first served, a preempted request going back to its head, or
  sorted by the policy's `queue_order`; decisions admit from its head (under Fair, from the
  head of each client's part of it) into the lowest free slots; a decision that only releases or preempts is made again at once;
- a step keeps to the token budget, schedules slot holders that have not finished, pads
  finished rows only for a policy that pads them, and a pure decode step to its shape;
  Static holds a finished request's slot until its batch ends, Continuous releases it at once;
- the log counts every emitted token, every preemption, and each admission at the step
  it precedes;
- a drained run, its finished requests released, has every slot and KV block free, and
  every request that was not aborted has exactly its output length.

Negative controls run the same machine on a state that breaks one rule and on a policy
that ignores its token budget, and show that it fails.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

import labkit as lk
from labkit.sched import Request, SchedulerState
from labkit.sched.blocks import num_blocks_for
from labkit.sched.scheduler import Scheduler, StepOutcome, kv_pool
from labkit.sched.steplog import StepLog
from strategies import KINDS, knobs, policies_of

CAPACITY = 40  # most requests one run may add: the StepLog's per-request arrays are this long
MAX_PROMPT, MAX_OUTPUT = 12, 16
TIGHT_POOLS = st.one_of(st.none(), st.integers(4, 24))  # blocks; small enough that running requests run out
LONGEST = MAX_PROMPT + MAX_OUTPUT  # the most tokens a request caches: begin-of-sequence, prompt, outputs but the last
EOS = 7  # the end-of-sequence id every request stops at
ID_OFFSET = 100  # request ids differ from trace positions, so a mix-up of the two shows
MAX_DRAIN_STEPS = 2000


def guarded(method):
    """Mark the machine unhealthy while `method` runs, so a failure is not followed by teardown's."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        self.healthy = False
        method(self, *args, **kwargs)
        self.healthy = True

    return run


class SchedulerMachine(RuleBasedStateMachine):
    """One policy and its `Scheduler`; requests arrive, leave and stop early while it runs.
    `machine(policies)`, below, says which policies."""

    def policies(self):
        raise NotImplementedError

    def make_scheduler(self, blocks) -> Scheduler:
        return Scheduler(self.policy, [], blocks)

    @initialize(data=st.data(), engine_pool=st.booleans())
    def setup(self, data, engine_pool):
        self.policy = data.draw(self.policies(), label="policy")
        self.pool = kv_pool(self.policy, LONGEST if engine_pool else None)
        self.log = StepLog(lk.Trace.from_lengths([1] * CAPACITY), self.policy.num_slots, repr(self.policy))
        self.scheduler = self.make_scheduler(self.pool)
        self.state = self.scheduler.state
        self.added: dict[int, Request] = {}  # by id, aborted ones included
        self.whole_len: dict[int, int] = {}  # id -> the tokens it would cache, as it arrived (before any stop)
        self.ends_at_next_output: set[int] = set()  # ids of requests to sample an EOS at their next output
        self.aborted: set[int] = set()
        self.queue: list[int] = []  # ids, in the order the docstrings give the waiting queue
        self.num_preempted = 0
        self.healthy = True  # False once a rule or invariant fails, so teardown does not pile on

    # Rules

    @precondition(lambda self: len(self.added) < CAPACITY)
    @rule(arrivals=st.lists(st.tuples(st.integers(0, MAX_PROMPT), st.integers(1, MAX_OUTPUT), st.integers(0, 2)),
                            min_size=1, max_size=4))
    @guarded
    def add(self, arrivals):
        """Requests (prompt, output length, priority) arrive now; one the policy can never serve is
        refused before any work."""
        for prompt_len, output_len, priority in arrivals[: CAPACITY - len(self.added)]:
            index = len(self.added)
            request = Request(index, ID_OFFSET + index, self.state.now, prompt_len, output_len, priority=priority,
                              token_ids=[0] * (1 + prompt_len), eos_token_ids=(EOS,), client=priority)
            try:
                self.policy.check_fits(request)
            except ValueError:
                continue
            self.added[request.id] = request
            self.whole_len[request.id] = request.max_context_len
            self.state.add(request)
            self.queue.append(request.id)
            self._sort_queue()

    @rule(num_steps=st.integers(1, 4))
    @guarded
    def step(self, num_steps):
        for _ in range(num_steps):
            self._step()
            self._check_invariants()

    @precondition(lambda self: (self.state.waiting or self.state.running()) and 4 * len(self.aborted) < len(self.added))
    @rule(data=st.data())
    @guarded
    def abort(self, data):
        """A client goes away (one in four at most, so the rest keep the pool busy): its request
        leaves the queue or its slot, with its blocks."""
        request = data.draw(st.sampled_from([*self.state.waiting, *self.state.running()]), label="abort")
        self.state.abort(request.id)
        self.aborted.add(request.id)
        self.ends_at_next_output.discard(request.id)
        if request.id in self.queue:
            self.queue.remove(request.id)

    @precondition(lambda self: self.state.running())
    @rule(data=st.data())
    @guarded
    def stop(self, data):
        """A running request will sample an end-of-sequence token at its next output, and end there."""
        request = data.draw(st.sampled_from(self.state.running()), label="stop")
        self.ends_at_next_output.add(request.id)

    # A step, as a loop runs it

    def _step(self) -> None:
        slots = [r.id if r else None for r in self.state.slots]
        batch = self.scheduler.schedule()
        self._check_decisions(slots, batch.size)
        if not batch.size:
            self._idle()
            return
        self._check_batch(batch)
        before = {i: self._counters(r) for i, r in self.added.items()}
        emitting = [request for request, num_tokens in batch.rows if num_tokens == request.num_uncomputed]
        tokens = [EOS if request.id in self.ends_at_next_output else 1 for request in emitting]
        record = self.scheduler.postprocess(batch, tokens)
        self._check_counted(batch, before, record)
        self._check_stopped(emitting)
        record.log_to(self.log, self.state.now, StepOutcome(None, 1.0))
        assert (self.log.admit_step[record.admitted] == record.first_step).all(), "admissions logged at their step"
        self.state.now += 1.0

    def _check_stopped(self, emitting: list[Request]) -> None:
        """A request that sampled an EOS ended there, that token its last; one that did not, did not."""
        for request in emitting:
            if request.id in self.ends_at_next_output:
                self.ends_at_next_output.remove(request.id)
                assert request.is_stopped and request.output_len == request.num_generated, request
                assert request.token_ids[-1] == EOS and request.finish_reason == "stop"
            else:
                assert not request.is_stopped, request

    def _idle(self) -> None:
        """Nothing runs: the clock moves to the time the policy wakes at; with none, nobody may wait."""
        wake_at = self.scheduler.decision.wake_at
        if wake_at is None:
            assert not self.state.waiting, f"{self.policy!r} is stuck: {len(self.state.waiting)} wait, nothing runs"
            return
        assert wake_at > self.state.now, f"{self.policy!r} wakes at {wake_at}, not after now = {self.state.now}"
        self.state.now = wake_at

    def _check_decisions(self, slots: list[int | None], num_scheduled: int) -> None:
        """Replay the decisions `schedule` applied on the slots and queue as the docstrings place
        requests, and compare; check which decisions were made again, and the log's admissions."""
        decisions = self.scheduler.decisions
        for decision in decisions[:-1]:
            assert decision.release or decision.preempt, f"{decision} was made again though it freed nothing"
        if not num_scheduled:
            assert not (decisions[-1].release or decisions[-1].preempt), f"{decisions[-1]} freed room, not used"
        for decision in decisions:
            self._replay(decision, slots)
        assert [r.id if r else None for r in self.state.slots] == slots, f"slots {self.state.slots}, not {slots}"
        admitted = [self.added[request_id].index for decision in decisions for request_id in decision.admit]
        assert self.scheduler.admitted[-len(admitted):] == admitted if admitted else True, "admissions noted"
        if isinstance(self.policy, lk.Continuous):
            assert not self.state.finished_in_slots(), "Continuous holds a finished request's slot"
        elif self.state.finished_in_slots():
            assert self.state.running(), "Static holds a finished request's slot after its batch ended"

    def _replay(self, decision, slots: list[int | None]) -> None:
        """Releases and preemptions free slots; the preempted go back to the head of the queue (or
        their sorted place); admissions take the head of the queue into the lowest free slots."""
        for request_id in decision.release:
            assert self.added[request_id].is_finished, f"{decision} releases an unfinished request"
            slots[slots.index(request_id)] = None
        for request_id in decision.preempt:
            assert not self.added[request_id].is_finished, f"{decision} preempts a finished request"
            slots[slots.index(request_id)] = None
        self.queue[:0] = decision.preempt
        self.num_preempted += len(decision.preempt)
        self._sort_queue()
        admitted = list(decision.admit)
        if getattr(self.policy, "counts_service", False):  # Fair: first come within each client
            for client in {self.added[request_id].client for request_id in admitted}:
                theirs = [i for i in self.queue if self.added[i].client == client]
                chosen = [i for i in admitted if self.added[i].client == client]
                assert chosen == theirs[: len(chosen)], f"{decision} does not admit client {client}'s head"
        else:
            assert admitted == self.queue[: len(admitted)], f"{decision} does not admit the head of {self.queue}"
        if isinstance(self.policy, lk.Static) and admitted:
            assert slots.count(None) == len(slots), f"{decision} admits while a static batch runs"
        for request_id in admitted:
            self.queue.remove(request_id)
        for request_id in admitted:
            slots[slots.index(None)] = request_id

    def _sort_queue(self) -> None:
        order = self.policy.queue_order
        if order is not None:
            self.queue.sort(key=lambda i: (order(self.added[i]), self.added[i].arrival, self.added[i].index))

    def _check_batch(self, batch) -> None:
        """Unfinished slot holders in slot order, each with 1..num_uncomputed tokens and the blocks
        they are written to, within the budget; finished rows padded if the policy pads them; a
        pure decode step padded to the shape's size."""
        assert [r.slot for r, _ in batch.rows] == sorted(r.slot for r, _ in batch.rows), "rows not in slot order"
        for request, num_tokens in batch.rows:
            assert request.slot >= 0 and not request.is_finished, f"{request} works without a running slot"
            assert 1 <= num_tokens <= request.num_uncomputed, f"{request} processes {num_tokens} tokens"
            self._check_blocks(request, request.num_computed + num_tokens)
        num_tokens, budget = sum(n for _, n in batch.rows), self._budget()
        assert budget is None or num_tokens <= budget, f"{num_tokens} tokens in a step, over the budget of {budget}"
        padding = self.state.finished_in_slots() if self.policy.pads_finished else []
        assert batch.padding == padding, f"padded rows {batch.padding}, not {padding}"
        num_rows = batch.size + len(padding)
        if all(r.num_generated and r.num_uncomputed == 1 for r, _ in batch.rows):
            num_rows = self.policy.shape.decode_size(num_rows)
        assert batch.num_rows == num_rows, f"{batch.num_rows} rows, not {num_rows}"

    def _budget(self) -> int | None:
        limits = (getattr(self.policy, "max_tokens_per_step", None), self.policy.shape.max_num_tokens)
        return min((n for n in limits if n is not None), default=None)

    @staticmethod
    def _counters(request: Request) -> tuple[int, int, int]:
        return request.num_computed, request.num_uncomputed, request.num_generated

    def _check_counted(self, batch, before: dict[int, tuple[int, int, int]], record) -> None:
        """Each row processed its tokens and emitted one if it left none uncomputed; nobody else moved."""
        expected, num_emitted, finished = dict(before), 0, []
        for request, num_tokens in batch.rows:
            computed, uncomputed, generated = before[request.id]
            emits = num_tokens == uncomputed
            expected[request.id] = (computed + num_tokens, 1 if emits else uncomputed - num_tokens, generated + emits)
            num_emitted += emits
            if emits and generated + 1 == request.output_len:
                finished.append(request.index)
        assert {i: self._counters(r) for i, r in self.added.items()} == expected, "a step moved the wrong counters"
        assert (record.num_emitted, record.finished) == (num_emitted, finished), record

    def _check_blocks(self, request: Request, num_tokens: int) -> None:
        """A slot holder holds the blocks `num_tokens` fill, or its whole length's if the policy reserves it."""
        if self.pool is None:
            assert not request.block_table, f"{request} holds blocks without a pool"
            return
        what = f"{num_tokens} tokens"
        if self.policy.reserves_whole_length:
            num_tokens = self.whole_len[request.id]
            what = f"its whole length, {num_tokens} tokens,"
        need = self.pool.num_blocks_for(num_tokens)
        assert request.num_blocks_held == need, f"{request} holds {request.num_blocks_held} blocks, not the {need} {what} fill"

    # Invariants

    @invariant()
    @guarded
    def invariants(self):
        self._check_invariants()

    def _check_invariants(self) -> None:
        self._check_places()
        self._check_counters()
        self._check_pool()

    def _check_places(self) -> None:
        state = self.state
        holders = [r for r in state.slots if r is not None]
        for k, request in enumerate(state.slots):
            assert request is None or request.slot == k, f"slot {k} holds {request}"
        assert state.seated == sorted(holders, key=lambda r: r.admitted_order), "seated is not the holders, in order"
        assert len(holders) == len({r.id for r in holders}) <= state.num_slots == len(state.slots)
        assert [r.id for r in state.waiting] == self.queue, f"the waiting queue is {list(state.waiting)}, not {self.queue}"
        waiting, seated = set(self.queue), {r.id for r in holders}
        for request_id, request in self.added.items():
            places = (request_id in waiting) + (request_id in seated) + (request_id in self.aborted)
            assert places == 1 or (places == 0 and request.is_finished and request.slot == -1), f"{request}: {places}"
            assert (request_id in state.by_id) == (request_id not in self.aborted), f"{request} known or forgotten"
        for request in state.waiting:
            assert request.slot == -1 and request.num_computed == 0, f"waiting {request} holds a slot or cache"

    def _check_counters(self) -> None:
        for request_id, request in self.added.items():
            if request_id not in self.aborted:
                known = request.num_prompt_tokens + request.num_generated
                assert request.num_computed + request.num_uncomputed == known, request
                assert request.num_uncomputed >= 1 and request.num_generated <= request.output_len, request
        assert self.log.num_output_tokens == sum(r.num_generated for r in self.added.values()), "tokens not logged"
        noted = len(self.scheduler.preempted)  # for the step they precede, which has not run yet
        assert self.log.num_preemptions + noted == self.num_preempted, "preemptions not logged"

    def _check_pool(self) -> None:
        if self.pool is None:
            assert not any(r.block_table for r in self.added.values()), "blocks without a pool"
            return
        owned = [block for r in self.added.values() for block in r.block_table]
        assert sorted(owned + self.pool.free_ids) == list(range(self.pool.num_blocks)), "a KV block is lost or owned twice"
        for request in self.added.values():
            if request.slot >= 0:
                self._check_blocks(request, request.num_computed)
            else:
                assert not request.block_table, f"{request} holds blocks without a slot"

    def teardown(self):
        if not self.healthy or not hasattr(self, "scheduler"):
            return
        for _ in range(MAX_DRAIN_STEPS):
            if not (self.state.waiting or self.state.running()):
                break
            self._step()
            self._check_invariants()
        else:
            raise AssertionError(f"{self.policy!r} did not drain in {MAX_DRAIN_STEPS} steps")
        self.scheduler.release_finished()
        assert self.state.slots == [None] * self.state.num_slots and not self.state.seated, "slots held after the run"
        for request_id, request in self.added.items():
            assert request_id in self.aborted or request.num_generated == request.output_len, request
        if self.pool is not None:
            assert self.pool.num_free_blocks == self.pool.num_blocks, "a drained run did not free every KV block"


# Negative controls: the machine catches a state or policy that breaks one rule


class SkipsReservation(SchedulerState):
    """Takes blocks as the tokens come, though the policy reserves each request's whole length."""

    def reserve(self, request):
        pass


class ArrivalsJumpTheQueue(SchedulerState):
    """Puts an arrival at the head of the queue, not behind those who came first."""

    def add(self, request):
        super().add(request)
        self.waiting.remove(request)
        self.waiting.appendleft(request)


class AbortLosesBlocks(SchedulerState):
    """Forgets to return an aborted request's KV blocks to the pool."""

    def abort(self, request_id):
        self.by_id[request_id].block_table.clear()
        super().abort(request_id)


@dataclass(frozen=True, repr=False)
class IgnoresBudget(lk.Continuous):
    """Continuous batching that forgets its `max_tokens_per_step`."""

    @property
    def token_budget(self):
        return None


def machine(policies, state_class: type[SchedulerState] = SchedulerState) -> type[SchedulerMachine]:
    """The machine for policies drawn from `policies`, on a state of `state_class`."""

    class Machine(SchedulerMachine):
        def policies(self):
            return policies

        def make_scheduler(self, blocks):
            scheduler = super().make_scheduler(blocks)
            scheduler.state.__class__ = state_class
            return scheduler

    return Machine


def paging_one_longest(policy):
    """`policy` taking blocks on demand from a pool that holds the longest request and one block more."""
    return replace(policy, reserve="on_demand", num_blocks=num_blocks_for(LONGEST, policy.block_size) + 1)


def ignores_budget(policy):
    return IgnoresBudget(**{f.name: getattr(policy, f.name) for f in fields(policy)})


POLICIES = {  # every kind, with every knob drawn; and pools so tight that running requests are preempted
    **{kind.__name__: policies_of(kind, TIGHT_POOLS) for kind in KINDS},
    "preempting": knobs(kinds=(lk.Continuous, lk.Priority)).map(paging_one_longest),
}
SETTINGS = settings(max_examples=15, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CONTROL_SETTINGS = settings(
    max_examples=200, stateful_step_count=40, deadline=None, derandomize=True, database=None,
    phases=[Phase.generate], report_multiple_bugs=False, suppress_health_check=list(HealthCheck),
)


@pytest.mark.parametrize("policies", POLICIES.values(), ids=POLICIES.keys())
def test_the_scheduler_keeps_its_invariants_under_every_policy(policies):
    run_state_machine_as_test(machine(policies), settings=SETTINGS)


@pytest.mark.parametrize("broken, message", [
    (machine(POLICIES["Static"], SkipsReservation), "not the [0-9]+ its whole length"),
    (machine(POLICIES["Continuous"], ArrivalsJumpTheQueue), "the waiting queue is"),
    (machine(POLICIES["Continuous"], AbortLosesBlocks), "a KV block is lost or owned twice"),
    (machine(knobs(num_blocks=TIGHT_POOLS).map(ignores_budget)), "over the budget"),
], ids=["reservation", "queue order", "lost blocks", "token budget"])
def test_the_machine_catches_a_broken_rule(broken, message):
    with pytest.raises(AssertionError, match=message):
        run_state_machine_as_test(broken, settings=CONTROL_SETTINGS)
