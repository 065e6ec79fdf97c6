"""The fast-forward (`labkit.sched.fastforward`) against the plain loop (`labkit.sched.driver.drive`).

`simulate(fast_forward=False)` asks the policy before every step; the default runs each
decision until the next event. Both must write the same StepLog, with every policy and
every knob: slots, queue depth, blocked reasons, step times, KV blocks in use,
preemptions, and each request's output milestones. Negative controls show the
comparison fails for a policy that breaks the rules the fast-forward relies on.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import labkit as lk
from labkit.sched import Decision
from labkit.sched.fastforward import steps_within
from strategies import TIMINGS, knobs, prompted_traces, traces

EVERY_POLICY = [
    lk.Static,
    lambda n: lk.Static(n, drop_finished=True),
    lk.Continuous,
    lambda n: lk.Dynamic(n, timeout=0.3),
    lk.Priority,
    lambda n: lk.ShortestPredictedFirst(n, noise=1.0),
    lk.Fair,
]


def both_ways(trace, policy, **timing) -> tuple[lk.StepLog, lk.StepLog]:
    """(fast-forwarded, plain) logs of one run."""
    return lk.simulate(trace, policy, **timing), lk.simulate(trace, policy, fast_forward=False, **timing)


def assert_same_log(jumped: lk.StepLog, stepped: lk.StepLog) -> None:
    assert stepped.num_runs == stepped.num_steps >= jumped.num_runs
    assert jumped.slots.tolist() == stepped.slots.tolist()
    assert jumped.num_queued.tolist() == stepped.num_queued.tolist()
    assert jumped.blocked.tolist() == stepped.blocked.tolist()
    np.testing.assert_allclose(jumped.step_seconds, stepped.step_seconds)
    np.testing.assert_allclose(jumped.step_start, stepped.step_start)
    assert jumped.num_blocks_used.tolist() == stepped.num_blocks_used.tolist()
    assert jumped.prefill_tokens.tolist() == stepped.prefill_tokens.tolist()
    assert jumped.num_shape_padded_rows.tolist() == stepped.num_shape_padded_rows.tolist()
    assert jumped.num_emitted.tolist() == stepped.num_emitted.tolist()
    assert jumped.preempted_at == stepped.preempted_at
    assert (jumped.num_preemptions, jumped.recomputed_tokens) == (stepped.num_preemptions, stepped.recomputed_tokens)
    for milestone in ("admit_step", "first_token_step", "finish_step", "preemptions"):
        assert getattr(jumped, milestone).tolist() == getattr(stepped, milestone).tolist(), milestone
    if jumped.cost is not None:
        assert jumped.num_kv_tokens.tolist() == stepped.num_kv_tokens.tolist()
        np.testing.assert_allclose(jumped.host_seconds, stepped.host_seconds)
        np.testing.assert_allclose(jumped.device_seconds, stepped.device_seconds)


@settings(max_examples=60, deadline=None)
@given(trace=traces(), num_slots=st.integers(1, 6), make=st.sampled_from(EVERY_POLICY))
def test_fast_forward_equals_the_plain_loop_for_every_policy(trace, num_slots, make):
    jumped, stepped = both_ways(trace, make(num_slots), step_time=0.1)
    assert_same_log(jumped, stepped)


@settings(max_examples=150, deadline=None)
@given(trace=prompted_traces(with_priorities=True, with_clients=True), timing=st.sampled_from(TIMINGS),
       policy=knobs(kinds=(lk.Continuous, lk.Priority, lk.ShortestPredictedFirst, lk.Fair)))
def test_with_every_knob_the_fast_forward_equals_the_plain_loop(trace, policy, timing):
    try:
        jumped, stepped = both_ways(trace, policy, **timing)
    except ValueError:  # a request that can never fit this policy is refused up front
        return
    assert_same_log(jumped, stepped)
    if policy.num_blocks is not None:
        assert jumped.num_blocks_used.max() <= policy.num_blocks
    assert jumped.num_output_tokens == trace.output_lengths.sum() and (jumped.finish_step >= 0).all()
    # every prompt once, every output but the last fed back once, and the thrown-away cache again
    # (rows that pad a decode step to the engine's shape are work, but feed no request's token)
    processed = jumped.num_prefill_tokens + jumped.num_decode_tokens - jumped.num_shape_padded_rows
    assert processed.sum() == (1 + trace.prompt_lengths + trace.output_lengths - 1).sum() + jumped.recomputed_tokens
    if policy.token_budget is not None:
        assert processed.max() <= policy.token_budget
    sizes = policy.shape.decode_sizes
    pure_decodes = jumped.num_prefill_tokens == 0
    if sizes is not None:  # every pure decode step runs at a size the engine has, or past the largest
        assert all(rows in sizes or rows > sizes[-1] for rows in jumped.num_rows[pure_decodes].tolist())


@settings(max_examples=80, deadline=None)
@given(trace=prompted_traces(), num_slots=st.integers(1, 5), num_blocks=st.integers(4, 40),
       block_size=st.integers(1, 6), timing=st.sampled_from(TIMINGS), dynamic=st.booleans())
def test_static_batches_that_reserve_blocks_fast_forward_as_they_step(trace, num_slots, num_blocks, block_size,
                                                                      timing, dynamic):
    pool = {"num_blocks": num_blocks, "block_size": block_size}
    policy = lk.Dynamic(num_slots, timeout=0.2, **pool) if dynamic else lk.Static(num_slots, **pool)
    try:
        jumped, stepped = both_ways(trace, policy, **timing)
    except ValueError:  # a request whose whole length the pool cannot hold is refused up front
        return
    assert_same_log(jumped, stepped)


@settings(max_examples=30, deadline=None)
@given(trace=prompted_traces(with_priorities=True), policy=knobs(kinds=(lk.Continuous, lk.Priority)))
def test_on_step_runs_the_plain_loop(trace, policy):
    seen = []
    try:
        watched = lk.simulate(trace, policy, on_step=lambda log: seen.append(log.num_steps))
    except ValueError:
        return
    plain = lk.simulate(trace, policy, fast_forward=False)
    assert seen == list(range(1, plain.num_steps + 1))
    assert_same_log(watched, plain)


def test_the_fast_forward_runs_each_decision_until_the_next_event():
    log = lk.simulate(lk.Trace.toy(), lk.Continuous(num_slots=2))
    assert (log.num_steps, log.num_runs) == (17, 8)  # one run per finish: A, B, ... H's slot changes
    assert lk.simulate(lk.Trace.toy(), lk.Continuous(num_slots=2), fast_forward=False).num_runs == 17


def test_fast_forward_must_be_true_or_false():
    with pytest.raises(ValueError, match="fast_forward = 'yes': must be True or False"):
        lk.simulate(lk.Trace.toy(), lk.Continuous(2), fast_forward="yes")


# Negative controls: policies that break the rules the fast-forward relies on ----------------


class EvenStepsOnly(lk.Continuous):
    """Looks at the step counter, so it decides between events."""

    def schedule(self, state):
        decision = super().schedule(state)
        return decision if state.num_steps % 2 == 0 else Decision(release=decision.release)


class ClaimsFirstComeFirstServed(lk.ShortestPredictedFirst):
    """Sorts its queue by predicted length but claims to admit in arrival order."""

    admits_in_order = True


def test_the_comparison_fails_for_a_policy_that_decides_between_events():
    trace = lk.Trace.from_lengths([3, 2, 4, 1])  # A ends at odd step 3: only stepping retries at 4
    jumped, stepped = both_ways(trace, EvenStepsOnly(num_slots=2))
    assert jumped.slots.tolist() != stepped.slots.tolist()


def test_the_comparison_fails_for_a_policy_that_misdeclares_its_order():
    # The head (request 1, a 20-token prefill) waits for budget while request 0 decodes; request 2
    # arrives at step 20, short, goes to the head of the sorted queue and fits at once. Only a
    # fast-forward that treats its arrival as an event admits it then, not when request 0 ends.
    trace = lk.Trace.from_lengths([30, 40, 2], prompt_lengths=[0, 19, 1], arrivals=[0.0, 0.0, 0.5])
    knobs_ = {"max_tokens_per_step": 20}
    honest = lk.ShortestPredictedFirst(num_slots=3, **knobs_)
    assert_same_log(*both_ways(trace, honest))
    assert lk.simulate(trace, honest).admit_step.tolist() == [0, 30, 20]
    jumped, stepped = both_ways(trace, ClaimsFirstComeFirstServed(num_slots=3, **knobs_))
    assert (jumped.admit_step.tolist(), stepped.admit_step.tolist()) == ([0, 32, 30], [0, 30, 20])


# The closed form of block growth ---------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(block_size=st.integers(1, 8), phases=st.lists(st.integers(0, 7), min_size=1, max_size=8),
       num_free_blocks=st.integers(0, 60))
def test_steps_within_free_blocks_counts_what_each_request_takes(block_size, phases, num_free_blocks):
    phases = np.sort(np.array([2 + p % block_size for p in phases]))  # each in 2 .. block_size + 1

    def taken_by(step):  # blocks taken in steps 2 .. step, request by request
        return sum(len(range(phase, step + 1, block_size)) for phase in phases)

    last = steps_within(phases, num_free_blocks, block_size)
    assert taken_by(last) <= num_free_blocks < taken_by(last + 1)
