"""The scheduling core: exact schedules, policy decisions, invariants and bad input."""

import gc
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import labkit as lk
from labkit.sched.blocks import num_blocks_for
from labkit.sched import Decision, Request, SchedulerState
from strategies import knobs, prompted_traces, traces
from test_fastforward import assert_same_log

# Exact schedules ------------------------------------------------------------------------

_ = -1
TOY_STATIC = [
    # A  B     C  D     E  F     G  H
    [0, 1], [0, 1], [_, 1], [_, 1], [_, 1], [_, 1],
    [2, 3], [2, 3], [2, 3], [_, 3], [_, 3], [_, 3], [_, 3], [_, 3],
    [4, 5], [4, 5], [_, 5], [_, 5],
    [6, 7], [6, 7], [6, _], [6, _], [6, _],
]
TOY_CONTINUOUS = [
    [0, 1], [0, 1], [2, 1], [2, 1], [2, 1], [3, 1], [3, 4], [3, 4], [3, 5],
    [3, 5], [3, 5], [3, 5], [3, 6], [7, 6], [7, 6], [_, 6], [_, 6],
]


def test_toy_static_schedule():
    log = lk.simulate(lk.Trace.toy(), lk.Static(num_slots=2))
    assert log.slots.tolist() == TOY_STATIC
    assert (log.num_steps, log.num_output_tokens) == (23, 32)
    assert log.utilization == 32 / 46


def test_toy_continuous_schedule():
    log = lk.simulate(lk.Trace.toy(), lk.Continuous(num_slots=2))
    assert log.slots.tolist() == TOY_CONTINUOUS
    assert (log.num_steps, log.num_output_tokens) == (17, 32)
    assert log.utilization == 32 / 34
    # one run per decision, and a decision only where someone finished and the rows change
    assert log.num_runs == 1 + sum(before != after for before, after in zip(TOY_CONTINUOUS, TOY_CONTINUOUS[1:]))


def test_toy_queue_depth_and_milestones():
    log = lk.simulate(lk.Trace.toy(), lk.Continuous(num_slots=2), step_time=1.0)
    assert log.num_queued.tolist() == [6, 6, 5, 5, 5, 4, 3, 3, 2, 2, 2, 2, 1, 0, 0, 0, 0]
    assert log.admit_step.tolist() == [0, 0, 2, 5, 6, 8, 12, 13]
    assert log.first_token_step.tolist() == [0, 0, 2, 5, 6, 8, 12, 13]
    assert log.finish_step.tolist() == [1, 5, 4, 12, 7, 11, 16, 14]
    assert log.latency.tolist() == [2, 6, 5, 13, 8, 12, 17, 15]
    assert log.ttft.tolist() == [1, 1, 3, 6, 7, 9, 13, 14]
    assert log.waiting_time.tolist() == [0, 0, 2, 5, 6, 8, 12, 13]
    assert log.blocked.tolist()[:13] == ["no_slot"] * 13
    assert log.blocked.tolist()[13:] == [""] * 4


SPREAD = lk.Trace.from_lengths([3, 2, 4, 1], arrivals=[0, 0.01, 0.2, 0.5])


def test_dynamic_waits_to_fill_or_time_out():
    log = lk.simulate(SPREAD, lk.Dynamic(num_slots=2, timeout=0.15), step_time=0.1)
    # B fills the batch at 0.01; C then waits for its timeout (0.35); D waits behind C's batch.
    assert log.slots.tolist() == [[0, 1], [0, 1], [0, _], [2, _], [2, _], [2, _], [2, _], [3, _]]
    assert log.step_start.tolist() == pytest.approx([0.01, 0.11, 0.21, 0.35, 0.45, 0.55, 0.65, 0.75])
    assert log.num_queued.tolist() == [0, 0, 1, 0, 0, 1, 1, 0]
    assert log.blocked.tolist() == ["", "", "no_slot", "", "", "no_slot", "no_slot", ""]


def test_static_starts_at_once_on_spread_arrivals():
    log = lk.simulate(SPREAD, lk.Static(num_slots=2), step_time=0.1)
    assert log.slots.tolist() == [[0, _], [0, _], [0, _], [1, 2], [1, 2], [_, 2], [_, 2], [3, _]]
    assert log.step_start.tolist() == pytest.approx(np.arange(8) * 0.1)


def test_continuous_admits_arrivals_at_the_next_step():
    log = lk.simulate(SPREAD, lk.Continuous(num_slots=2), step_time=0.1)
    assert log.slots.tolist() == [[0, _], [0, 1], [0, 1], [2, _], [2, _], [2, 3], [2, _]]
    assert log.admit_step.tolist() == [0, 1, 3, 5]


def test_dynamic_with_zero_timeout_is_static():
    trace = lk.Trace.sample(40, rate=5.0, seed=2)
    static = lk.simulate(trace, lk.Static(num_slots=3))
    dynamic = lk.simulate(trace, lk.Dynamic(num_slots=3, timeout=0))
    assert static.slots.tolist() == dynamic.slots.tolist()


def test_clock_jumps_over_idle_time():
    trace = lk.Trace.from_lengths([2, 2], arrivals=[0, 10])
    log = lk.simulate(trace, lk.Continuous(num_slots=1), step_time=1.0)
    assert log.step_start.tolist() == [0, 1, 10, 11]
    assert log.duration == 12
    assert log.tokens_per_second == 4 / 12


# Policies decide on hand-made states ----------------------------------------------------


def _state(num_slots, in_slots, waiting):
    """in_slots: (id, output_len, num_generated) per held slot; waiting: ids with length 5."""
    requests = [Request(i, rid, 0.0, 0, length, done) for i, (rid, length, done) in enumerate(in_slots)]
    for request in requests:
        if request.num_generated:  # decoding: every known token but the last is cached
            request.num_computed, request.num_uncomputed = request.num_prompt_tokens + request.num_generated - 1, 1
    queued = [Request(len(requests) + i, rid, 0.0, 0, 5) for i, rid in enumerate(waiting)]
    state = SchedulerState(num_slots, requests + queued)
    for slot, request in enumerate(requests):
        state.place(request, slot)
    state.waiting.extend(queued)
    return state


def test_continuous_replaces_finished_requests_fcfs():
    state = _state(3, [(10, 4, 4), (11, 4, 2), (12, 3, 3)], waiting=[20, 21, 22])
    decision = lk.Continuous(num_slots=3).schedule(state)
    assert decision == Decision(release=(10, 12), admit=(20, 21), num_tokens={11: 1, 20: 1, 21: 1}, blocked="no_slot")
    state.apply(decision)
    assert [r.id for r in state.slots] == [20, 11, 21]
    assert [r.id for r in state.waiting] == [22]


def test_static_holds_slots_until_the_batch_ends():
    running = _state(2, [(10, 4, 4), (11, 4, 2)], waiting=[20, 21, 22])
    assert lk.Static(num_slots=2).schedule(running) == Decision(blocked="no_slot")
    done = _state(2, [(10, 4, 4), (11, 4, 4)], waiting=[20, 21, 22])
    assert lk.Static(num_slots=2).schedule(done) == Decision(release=(10, 11), admit=(20, 21), blocked="no_slot")


def test_dynamic_asks_to_wake_at_the_timeout():
    state = _state(4, [], waiting=[20])
    state.waiting[0].arrival, state.now = 1.0, 1.2
    assert lk.Dynamic(num_slots=4, timeout=0.5).schedule(state) == Decision(blocked="batch_forming", wake_at=1.5)


def test_bad_decisions_are_refused():
    state = _state(1, [(10, 4, 1)], waiting=[20])
    with pytest.raises(ValueError, match="admits 1 requests but only 0 slots are free"):
        state.apply(Decision(admit=(20,)))
    with pytest.raises(ValueError, match="request 99, which is not in the trace"):
        state.apply(Decision(release=(99,)))
    with pytest.raises(ValueError, match="releases request 20, which holds no slot"):
        state.apply(Decision(release=(20,)))


def test_a_policy_that_never_admits_stops_with_a_reason():
    class Lazy(lk.Continuous):
        def schedule(self, state):
            return Decision(blocked="lazy")

    with pytest.raises(RuntimeError, match=r"can make no progress .* 3 requests wait \(lazy\)"):
        lk.simulate(lk.Trace.from_lengths([1, 2, 3]), Lazy(num_slots=2))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: lk.Static(num_slots=0), "num_slots = 0"),
        (lambda: lk.Continuous(num_slots=2.5), "num_slots = 2.5"),
        (lambda: lk.Dynamic(num_slots=True), "num_slots = True"),
        (lambda: lk.Dynamic(num_slots=2, timeout=-1), "timeout = -1"),
        (lambda: lk.Dynamic(num_slots=2, timeout=float("nan")), "timeout = nan"),
        (lambda: lk.simulate(lk.Trace.toy(), lk.Static(2), step_time=0), "step_time = 0"),
    ],
)
def test_bad_policy_input(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# Invariants over random traces ---------------------------------------------------------

POLICIES = [lk.Static, lk.Continuous, lambda n: lk.Dynamic(n, timeout=0.3)]


@settings(max_examples=60, deadline=None)
@given(trace=traces(), num_slots=st.integers(1, 6), make=st.sampled_from(POLICIES))
def test_every_request_runs_exactly_its_length_once(trace, num_slots, make):
    log = lk.simulate(trace, make(num_slots), step_time=0.1)
    assert log.slots.shape == (log.num_steps, num_slots)
    assert log.num_output_tokens == trace.output_lengths.sum() == (log.slots >= 0).sum()
    for position, rid in enumerate(trace.ids):
        steps = np.nonzero((log.slots == rid).any(axis=1))[0]
        assert len(steps) == trace.output_lengths[position]  # finishes exactly once, one token per step
        assert steps.tolist() == list(range(steps[0], steps[0] + len(steps)))  # never interrupted
        assert (log.admit_step[position], log.finish_step[position]) == (steps[0], steps[-1])
        assert log.admitted_at[position] >= trace.arrivals[position] - 1e-9


@settings(max_examples=60, deadline=None)
@given(trace=traces(), num_slots=st.integers(1, 6), make=st.sampled_from(POLICIES))
def test_slots_hold_one_request_each_and_admission_is_fcfs(trace, num_slots, make):
    log = lk.simulate(trace, make(num_slots), step_time=0.1)
    for row in log.slots:
        busy = row[row >= 0]
        assert len(set(busy.tolist())) == len(busy) <= num_slots
    fcfs = np.lexsort((np.arange(len(trace)), trace.arrivals))
    assert np.all(np.diff(log.admit_step[fcfs]) >= 0)


@settings(max_examples=60, deadline=None)
@given(trace=traces(spread=False), num_slots=st.integers(1, 6))
def test_backlogged_continuous_finishes_nothing_later_than_static(trace, num_slots):
    static = lk.simulate(trace, lk.Static(num_slots))
    continuous = lk.simulate(trace, lk.Continuous(num_slots))
    assert np.all(continuous.finish_step <= static.finish_step)
    batches = [trace.output_lengths[i : i + num_slots] for i in range(0, len(trace), num_slots)]
    assert static.num_steps == sum(batch.max() for batch in batches)


@settings(max_examples=60, deadline=None)
@given(trace=traces(), num_slots=st.integers(1, 6))
def test_continuous_never_idles_a_slot_while_requests_wait(trace, num_slots):
    log = lk.simulate(trace, lk.Continuous(num_slots), step_time=0.1)
    assert np.all((log.slots >= 0).all(axis=1)[log.num_queued > 0])


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 30), num_requests=st.integers(1, 30), num_slots=st.integers(1, 6))
def test_equal_lengths_give_static_and_continuous_the_same_steps(length, num_requests, num_slots):
    trace = lk.Trace.from_lengths([length] * num_requests)
    static = lk.simulate(trace, lk.Static(num_slots))
    continuous = lk.simulate(trace, lk.Continuous(num_slots))
    assert static.num_steps == continuous.num_steps == length * -(-num_requests // num_slots)


# Admission beyond slots: blocks, budget, chunking, preemption ------------------------------

LONG_PROMPTS = lk.Trace.from_lengths([4, 4, 4, 4], prompt_lengths=[9, 2, 30, 2])


def test_admission_waits_for_blocks_and_says_so():
    # 2 free slots, but request 2's prompt needs 3 of the 4 blocks of 8 tokens.
    log = lk.simulate(LONG_PROMPTS, lk.Continuous(num_slots=4, num_blocks=5, block_size=8))
    assert log.admit_step.tolist()[:3] == [0, 0, 4]
    assert log.blocked.tolist()[0] == "no_blocks"
    assert (log.slots[:4] >= 0).sum(axis=1).tolist() == [2, 2, 2, 2]  # idle slots while the queue waits


def test_admission_waits_for_token_budget_and_says_so():
    log = lk.simulate(LONG_PROMPTS, lk.Continuous(num_slots=4, max_tokens_per_step=32))
    assert log.blocked.tolist()[0] == "no_budget"
    assert log.prefill_tokens[0].tolist() == [10, 3, 0, 0]  # 13 tokens; request 2's 31 do not fit beside them
    # Two decodes leave 30: request 2 waits until both finish, and request 3, which would fit, waits behind it.
    assert log.admit_step.tolist() == [0, 0, 4, 5]


def test_chunked_prefill_splits_a_long_prompt_and_emits_only_when_it_completes():
    log = lk.simulate(lk.Trace.from_lengths([3], prompt_lengths=[9]), lk.Continuous(1, max_tokens_per_step=4,
                                                                                  chunked_prefill=True))
    assert log.prefill_tokens[:, 0].tolist() == [4, 4, 2, 0, 0]
    assert log.num_emitted.tolist() == [0, 0, 1, 1, 1]
    assert log.first_token_step.tolist() == [2]


def test_preemption_puts_the_newest_back_and_recomputes_it():
    trace = lk.Trace.from_lengths([6, 6], prompt_lengths=[3, 3])
    log = lk.simulate(trace, lk.Continuous(num_slots=2, num_blocks=4, block_size=4))
    # Both hold 1 block after prefill (4 tokens) and a second from their first decode; at
    # step 5 request 0 needs a third. The newest, 1, yields its 8 cached tokens; it returns
    # at step 6 and recomputes them plus its 5th output (9 tokens), which emits its 6th.
    assert log.num_preemptions == 1 and log.preemptions.tolist() == [0, 1]
    assert log.preempted_at == [(5, 1)]
    assert log.num_blocks_used.tolist() == [2, 4, 4, 4, 4, 3, 3]
    assert log.recomputed_tokens == 8
    assert log.finish_step.tolist() == [5, 6]
    assert log.prefill_tokens[6].tolist() == [9, 0]
    assert (log.num_emitted.sum(), log.num_output_tokens) == (12, 12)


def test_static_computes_finished_rows_and_the_simulator_prices_them():
    # Prompts of 2 (3 tokens with BOS); outputs 1 and 3. Step 0 prefills both (6 tokens, 6 cached)
    # and request 0 is done. Steps 1 and 2: request 1 decodes at contexts 4 and 5, and request 0
    # still computes one token at its frozen context of 3 unless its row is dropped.
    trace = lk.Trace.from_lengths([1, 3], prompt_lengths=[2, 2])
    cost = lk.CostModel(overhead=1e-3, per_prefill_token=1e-4, per_decode_token=1e-2, per_kv_token=1e-6)
    padded = lk.simulate(trace, lk.Static(num_slots=2), cost=cost)
    dropped = lk.simulate(trace, lk.Static(num_slots=2, drop_finished=True), cost=cost)
    assert padded.num_padded_rows.tolist() == [0, 1, 1] and dropped.num_padded_rows.tolist() == [0, 0, 0]
    assert padded.num_decode_tokens.tolist() == [0, 2, 2] and dropped.num_decode_tokens.tolist() == [0, 1, 1]
    assert padded.num_kv_tokens.tolist() == [6, 4 + 3, 5 + 3] and dropped.num_kv_tokens.tolist() == [6, 4, 5]
    np.testing.assert_allclose(padded.step_seconds, [1e-3 + 6e-4 + 6e-6, 1e-3 + 2e-2 + 7e-6, 1e-3 + 2e-2 + 8e-6])
    np.testing.assert_allclose(dropped.step_seconds, [1e-3 + 6e-4 + 6e-6, 1e-3 + 1e-2 + 4e-6, 1e-3 + 1e-2 + 5e-6])
    # a padded row is no useful slot-step: occupancy and utilization are the same
    assert padded.slots.tolist() == dropped.slots.tolist() == [[0, 1], [-1, 1], [-1, 1]]
    assert padded.utilization == dropped.utilization == 4 / 6


def test_continuous_with_whole_length_reservations_refills_but_fits_fewer():
    # Blocks of 8, a pool of 8. Request 0 (10 outputs) reserves 2 blocks for its 11 tokens;
    # the others (30 outputs) 4 each for 31 tokens.
    trace = lk.Trace.from_lengths([10, 30, 30, 30], prompt_lengths=[1] * 4)
    pool = {"num_blocks": 8, "block_size": 8}
    static = lk.simulate(trace, lk.Static(num_slots=4, **pool))
    reserved = lk.simulate(trace, lk.Continuous(num_slots=4, reserve="whole", **pool))
    paged = lk.simulate(trace, lk.Continuous(num_slots=4, **pool))
    # 0 and 1 fit (6 blocks); 2 waits for 0's blocks: until its batch ends under static
    # batching (step 30), until 0 itself ends under continuous batching (step 10).
    assert static.admit_step.tolist() == [0, 0, 30, 30]
    assert reserved.admit_step.tolist() == [0, 0, 10, 30]
    assert reserved.blocked[1] == "no_blocks" and reserved.num_preemptions == 0
    assert reserved.num_blocks_used.tolist()[:10] == [6] * 10 and reserved.num_blocks_used.max() == 8
    # Paging admits all four on one block each; at step 15 three need a third block, two are
    # free, and the newest, 3, is preempted with its 16 cached tokens, back when 1 and 2 end.
    assert (paged.slots[0] >= 0).sum() == 4
    assert paged.preempted_at == [(15, 3)] and paged.recomputed_tokens == 16
    # Request 3 waits for a 30-output request's blocks in the first two arms: both end at step 59.
    assert (static.num_steps, reserved.num_steps, paged.num_steps) == (60, 60, 45)


def test_reserve_must_be_a_known_scheme():
    with pytest.raises(ValueError, match=r"reserve = 'all': choose one of \('on_demand', 'whole'\)"):
        lk.Continuous(2, reserve="all")


def test_drop_finished_must_be_true_or_false():
    with pytest.raises(ValueError, match="drop_finished = 1: must be True or False"):
        lk.Static(2, drop_finished=1)


def test_static_reserves_whole_lengths_so_fewer_requests_fit():
    trace = lk.Trace.from_lengths([30] * 4, prompt_lengths=[1] * 4)  # 31 tokens each at most: 4 blocks of 8
    static = lk.simulate(trace, lk.Static(num_slots=4, num_blocks=8, block_size=8))
    paged = lk.simulate(trace, lk.Continuous(num_slots=4, num_blocks=8, block_size=8))
    assert (static.slots[0] >= 0).sum() == 2  # two whole-length reservations fill the pool
    assert (paged.slots[0] >= 0).sum() == 4  # paging admits all four, growing block by block


@pytest.mark.parametrize(
    "policy, message",
    [
        (lk.Continuous(2, num_blocks=3, block_size=4), "request 0: prompt 10 \\+ output 5 tokens need 4 blocks of 4"),
        (lk.Continuous(2, max_tokens_per_step=8), "request 0: its prompt can take 11 tokens in one step"),
        (lk.Continuous(2, num_blocks=20, max_tokens_per_step=12),
         "request 0: its prompt plus outputs to recompute after a preemption can take 15 tokens"),
        (lk.Priority(2, max_tokens_per_step=12),  # preempts for a waiting request even without a pool
         "request 0: its prompt plus outputs to recompute after a preemption can take 15 tokens"),
        (lk.Static(2, num_blocks=3, block_size=4), "more than the whole pool of num_blocks = 3"),
    ],
)
def test_requests_that_can_never_fit_are_refused_before_any_work(policy, message):
    with pytest.raises(ValueError, match=message):
        lk.simulate(lk.Trace.from_lengths([5], prompt_lengths=[10]), policy)


def test_a_priority_policy_that_never_preempts_needs_only_the_prompt_in_one_step():
    trace = lk.Trace.from_lengths([5], prompt_lengths=[10])
    log = lk.simulate(trace, lk.Priority(2, max_tokens_per_step=12, preempt_for_waiting=False))
    assert log.num_steps == 5  # the 10-token prompt and its first token, then four decodes


def test_a_preempted_request_never_waits_for_a_budget_it_cannot_get():
    """Found by Hypothesis: a request preempted for a more urgent one used to come back
    with 4 tokens to recompute in one step and a budget of 1, and wait for ever."""
    trace = lk.Trace.from_lengths([1] * 9 + [4, 1], arrivals=[0.0] * 10 + [0.3]).with_priorities([0] * 9 + [1, 0])
    with pytest.raises(ValueError, match="request 9: its prompt plus outputs to recompute after a preemption"):
        lk.simulate(trace, lk.Priority(num_slots=1, block_size=1, max_tokens_per_step=1))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: lk.Continuous(2, num_blocks=0), "num_blocks = 0: must be a whole number >= 1, or None"),
        (lambda: lk.Continuous(2, block_size=2.5), "block_size = 2.5"),
        (lambda: lk.Continuous(2, max_tokens_per_step=0), "max_tokens_per_step = 0"),
        (lambda: lk.Continuous(2, chunked_prefill="yes"), "chunked_prefill = 'yes': must be True or False"),
        (lambda: lk.Continuous(2, victim="oldest"), "victim = 'oldest': choose one of"),
    ],
)
def test_bad_knobs_name_the_field_and_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@settings(max_examples=40, deadline=None)
@given(trace=prompted_traces(), num_slots=st.integers(1, 5))
def test_limits_that_never_bind_change_nothing(trace, num_slots):
    plain = lk.simulate(trace, lk.Continuous(num_slots), step_time=0.1)
    roomy = lk.Continuous(num_slots, num_blocks=10_000, max_tokens_per_step=10_000)
    assert lk.simulate(trace, roomy, step_time=0.1).slots.tolist() == plain.slots.tolist()


class _RecordsCollector(lk.Continuous):
    """Continuous, noting whether the cyclic garbage collector was on at each decision."""

    def schedule(self, state):
        self.__dict__.setdefault("collector_on", set()).add(gc.isenabled())
        return super().schedule(state)


def test_simulate_pauses_the_cyclic_collector_only_without_on_step_and_restores_it():
    policy = _RecordsCollector(2)
    lk.simulate(lk.Trace.toy(), policy)
    assert policy.collector_on == {False} and gc.isenabled()
    stepped = _RecordsCollector(2)
    lk.simulate(lk.Trace.toy(), stepped, on_step=lambda log: None)
    assert stepped.collector_on == {True}
    gc.disable()
    try:
        lk.simulate(lk.Trace.toy(), lk.Continuous(2))
        assert not gc.isenabled(), "a collector the caller switched off stays off"
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="can make no progress"):
        lk.simulate(lk.Trace.from_lengths([1, 2]), _NeverAdmits(num_slots=1))
    assert gc.isenabled(), "an error inside the run switches the collector back on"


class _NeverAdmits(lk.Continuous):
    def schedule(self, state):
        return Decision(blocked="lazy")


@pytest.mark.parametrize("policy", [lk.Static(2, num_blocks=12, block_size=4), lk.Continuous(
    2, num_blocks=6, block_size=2, max_tokens_per_step=5, chunked_prefill=True)])
def test_a_simulation_leaves_no_reference_cycles_behind(policy):
    trace = lk.Trace.from_lengths([6, 2, 5, 4], prompt_lengths=[3, 7, 1, 4])
    gc.collect()
    gc.disable()
    try:
        log = lk.simulate(trace, policy)
        assert gc.collect() == 0, "the run made garbage only the cyclic collector frees"
    finally:
        gc.enable()
    assert log.num_output_tokens == trace.output_lengths.sum()


# Admission out of arrival order: Priority and ShortestPredictedFirst ------------------------


def test_a_higher_priority_arrival_preempts_the_running_request_and_runs_first():
    trace = lk.Trace.from_lengths([6, 2], arrivals=[0.0, 0.05]).with_priorities([1, 0])  # B arrives at step 2
    log = lk.simulate(trace, lk.Priority(num_slots=1))
    assert log.slots[:, 0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert log.preempted_at == [(2, 0)] and log.recomputed_tokens == 2  # A's BOS and first output
    assert log.blocked.tolist()[2:4] == ["no_slot", "no_slot"]
    assert lk.simulate(trace, lk.Continuous(num_slots=1)).slots[:, 0].tolist() == [0] * 6 + [1] * 2  # FCFS


def test_priority_never_preempts_its_equals_and_is_fcfs_among_them():
    trace = lk.Trace.from_lengths([6, 2, 3], arrivals=[0.0, 0.05, 0.0])
    assert lk.simulate(trace, lk.Priority(num_slots=1)).slots.tolist() == lk.simulate(
        trace, lk.Continuous(num_slots=1)).slots.tolist()


def test_when_blocks_run_out_priority_preempts_the_lowest_priority_not_the_newest():
    trace = lk.Trace.from_lengths([8, 8, 8], prompt_lengths=[3, 3, 3]).with_priorities([0, 2, 1])
    pool = {"num_blocks": 6, "block_size": 4}
    assert lk.simulate(trace, lk.Priority(3, **pool)).preempted_at == [(5, 1)]
    assert lk.simulate(trace, lk.Continuous(3, **pool)).preempted_at == [(5, 2)]
    assert lk.simulate(trace, lk.Priority(3, **pool, preempt_for_waiting=False)).preempted_at == [(5, 1)]


def test_without_preempt_for_waiting_a_higher_priority_arrival_waits_for_a_free_slot_then_goes_first():
    # vLLM V1: a waiting request never pushes a running one out; it only jumps the queue
    trace = lk.Trace.from_lengths([4, 2, 2], arrivals=[0.0, 0.025, 0.05]).with_priorities([1, 1, 0])
    v1 = lk.simulate(trace, lk.Priority(num_slots=1, preempt_for_waiting=False))
    assert v1.slots[:, 0].tolist() == [0, 0, 0, 0, 2, 2, 1, 1] and v1.num_preemptions == 0
    v0 = lk.simulate(trace, lk.Priority(num_slots=1))  # negative control: the default pushes A out for C
    assert v0.slots[:, 0].tolist() == [0, 0, 2, 2, 0, 0, 1, 1] and v0.preempted_at == [(2, 0)]
    assert lk.simulate(trace, lk.Continuous(num_slots=1)).slots[:, 0].tolist() == [0, 0, 0, 0, 1, 1, 2, 2]


@settings(max_examples=100, deadline=None)
@given(trace=prompted_traces(with_priorities=True), policy=knobs(kinds=(lk.Priority,)))
def test_without_preempt_for_waiting_only_running_out_of_blocks_preempts_and_it_fast_forwards(trace, policy):
    policy = replace(policy, preempt_for_waiting=False)
    try:
        jumped = lk.simulate(trace, policy, step_time=0.1)
    except ValueError:  # a request that can never fit this policy is refused up front
        return
    assert_same_log(jumped, lk.simulate(trace, policy, step_time=0.1, fast_forward=False))
    if policy.num_blocks is None or policy.reserve == "whole":
        assert jumped.num_preemptions == 0
    assert jumped.num_output_tokens == trace.output_lengths.sum()


def test_preempt_for_waiting_must_be_true_or_false():
    with pytest.raises(ValueError, match="preempt_for_waiting = 1: must be True or False"):
        lk.Priority(2, preempt_for_waiting=1)


@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_shortest_predicted_first_admits_in_order_of_prediction(noise):
    trace = lk.Trace.from_lengths([5, 3, 9, 1, 3])
    policy = lk.ShortestPredictedFirst(num_slots=1, noise=noise, seed=3)
    log = lk.simulate(trace, policy)
    predicted = [length * np.exp(noise * np.random.default_rng([3, rid]).standard_normal())
                 for rid, length in zip(trace.ids, trace.output_lengths)]
    assert policy.predicted_lengths(trace).tolist() == pytest.approx(predicted)  # what the queue is sorted by
    by_prediction = sorted(range(len(trace)), key=lambda i: (predicted[i], i))  # ties: first come
    assert np.argsort(log.admit_step).tolist() == by_prediction
    assert by_prediction == ([3, 1, 4, 0, 2] if noise == 0 else [3, 4, 1, 2, 0])


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: lk.ShortestPredictedFirst(2, noise=-1), "noise = -1: must be a number >= 0"),
        (lambda: lk.ShortestPredictedFirst(2, noise=float("inf")), "noise = inf"),
        (lambda: lk.ShortestPredictedFirst(2, seed=1.5), "seed = 1.5: must be a whole number >= 0"),
        (lambda: lk.Trace.from_lengths([1, 2]).with_priorities([0, 0.5]), "priorities\\[1\\] = 0.5"),
        (lambda: lk.Trace.from_lengths([1, 2]).with_priorities([0]), "priorities has 1 entries"),
    ],
)
def test_bad_ordering_knobs_name_the_field_and_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_selected_trace_keeps_its_priorities():
    trace = lk.Trace.from_lengths([1, 2, 3]).with_priorities([5, -1, 2])
    assert trace.select([2, 1]).priorities.tolist() == [2, -1]
    assert lk.Trace.from_lengths([1, 2]).priorities.tolist() == [0, 0]


def test_lesson_04s_three_arms_separate_refill_from_paging():
    # lesson 05's trace and pool: each arm changes one thing, and each change helps
    trace = lk.Trace.sample(32, output="uniform", mean_output=64, prompt="uniform", mean_prompt=32, seed=0)
    pool = {"num_slots": 16, "num_blocks": 64}
    static = lk.simulate(trace, lk.Static(**pool))
    reserved = lk.simulate(trace, lk.Continuous(**pool, reserve="whole"))
    paged = lk.simulate(trace, lk.Continuous(**pool))
    assert static.num_steps > reserved.num_steps > paged.num_steps  # refill, then paging, each saves steps
    assert static.num_preemptions == reserved.num_preemptions == 0 < paged.num_preemptions
    # whole-length reservations: the first step seats the same requests under both reserving arms
    assert static.slots[0].tolist() == reserved.slots[0].tolist()
    assert (paged.slots[0] >= 0).sum() > (reserved.slots[0] >= 0).sum()


@settings(max_examples=60, deadline=None)
@given(trace=prompted_traces(), num_slots=st.integers(1, 5), num_blocks=st.integers(4, 40),
       block_size=st.integers(1, 6))
def test_whole_length_reservations_never_preempt_and_hold_every_block_from_admission(trace, num_slots, num_blocks,
                                                                                  block_size):
    policy = lk.Continuous(num_slots, num_blocks=num_blocks, block_size=block_size, reserve="whole")
    try:
        log = lk.simulate(trace, policy)
    except ValueError:  # a request whose whole length the pool cannot hold is refused up front
        return
    assert log.num_preemptions == 0
    reservation = num_blocks_for(trace.prompt_lengths + trace.output_lengths, block_size)  # blocks of BOS + prompt + L - 1
    for step in range(log.num_steps):
        seated = (log.admit_step <= step) & ((log.finish_step >= step) | (log.finish_step < 0))
        assert log.num_blocks_used[step] == reservation[seated].sum()
