"""Capacity measured by running the backlog, and a trace stretched to a rate."""

import numpy as np
import pytest

import labkit as lk


def test_capacity_is_the_requests_over_the_backlogs_duration():
    toy = lk.Trace.toy()  # 17 steps on 2 slots under continuous batching (lesson 01)
    assert lk.capacity(toy, lk.Continuous(num_slots=2), step_time=0.025) == 8 / (17 * 0.025)
    assert lk.capacity(toy, lk.Static(num_slots=2), step_time=0.025) == 8 / (23 * 0.025)


def test_capacity_ignores_the_traces_own_arrivals():
    spread = lk.Trace.sample(40, output="exponential", mean_output=16, rate=1.0, seed=3)
    policy = lk.Continuous(num_slots=4)
    assert lk.capacity(spread, policy) == lk.capacity(spread.backlogged(), policy)


def test_capacity_runs_any_back_end():
    calls = []

    def run(trace, policy, **options):
        calls.append((trace.arrivals.max(), options))
        return lk.simulate(trace, policy, **options)

    assert lk.capacity(lk.Trace.toy(), lk.Continuous(num_slots=2), run=run, step_time=0.5) == 8 / (17 * 0.5)
    assert calls == [(0.0, {"step_time": 0.5})]


def test_at_rate_stretches_the_clock_and_nothing_else():
    trace = lk.Trace.sample(50, output="exponential", mean_output=16, prompt="uniform", mean_prompt=8, rate=4.0,
                            seed=1)
    faster = trace.at_rate(10.0)
    assert (len(faster) - 1) / (faster.arrivals.max() - faster.arrivals.min()) == pytest.approx(10.0)
    assert np.array_equal(faster.output_lengths, trace.output_lengths)
    assert np.array_equal(faster.prompt_lengths, trace.prompt_lengths)
    assert np.array_equal(np.argsort(faster.arrivals, kind="stable"), np.argsort(trace.arrivals, kind="stable"))
    assert np.allclose(np.diff(faster.arrivals) / np.diff(trace.arrivals).clip(1e-300), np.diff(faster.arrivals)[0]
                       / np.diff(trace.arrivals)[0])  # every gap scaled by one factor


def test_a_sampled_trace_at_another_rate_is_the_same_draw_at_that_rate():
    """Gamma gaps scale with 1/rate, so stretching equals sampling at the new rate."""
    ten = lk.Trace.sample(30, output="exponential", mean_output=8, rate=10.0, seed=2)
    two = lk.Trace.sample(30, output="exponential", mean_output=8, rate=2.0, seed=2)
    realized = (len(two) - 1) / two.arrivals.max()
    assert np.allclose(ten.at_rate(realized).arrivals, two.arrivals)


@pytest.mark.parametrize("rate", [0, -1.0, float("nan"), "fast", True])
def test_a_bad_rate_is_named(rate):
    with pytest.raises(ValueError, match=f"rate = {rate!r}: must be a number of requests per second > 0"):
        lk.Trace.sample(5, rate=1.0, seed=0).at_rate(rate)


def test_a_backlog_has_no_rate_to_stretch():
    with pytest.raises(ValueError, match=r"at_rate\(3\): the 8 requests all arrive at 0 s"):
        lk.Trace.toy().at_rate(3.0)
