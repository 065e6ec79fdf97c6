"""Closed forms and Monte Carlo for static batching's waste."""

import numpy as np
import pytest

import labkit as lk
from labkit import theory


def test_harmonic_numbers():
    assert theory.harmonic(1) == 1.0
    assert theory.harmonic(8) == pytest.approx(761 / 280)  # 2.717857...
    assert theory.harmonic(np.array([8, 32, 64])) == pytest.approx([2.717857, 4.058495, 4.743891], abs=1e-6)


def test_exponential_utilization_and_gain():
    assert theory.exponential_utilization(8) == pytest.approx(0.3679369, abs=1e-7)
    assert theory.exponential_utilization(32) == pytest.approx(0.2463967, abs=1e-7)
    assert theory.exponential_utilization(64) == pytest.approx(0.2107974, abs=1e-7)
    assert theory.exponential_gain(64) == theory.harmonic(64)


def test_batch_utilization_of_the_lesson_example():
    assert theory.batch_utilization([50, 120, 300, 900]) == 1370 / 3600


def test_expected_max_from_order_statistics():
    # Two fair coin lengths {1, 2}: the max of two draws is 1 only if both are 1.
    assert theory.expected_max([1, 2], 2) == pytest.approx(1 * 0.25 + 2 * 0.75)
    # Uniform on 1..6 (a die), B = 2: E[max] = 161/36.
    assert theory.expected_max([1, 2, 3, 4, 5, 6], 2) == pytest.approx(161 / 36)
    assert theory.expected_max([7, 7, 7], 64) == 7


def test_equal_lengths_waste_nothing():
    assert theory.static_utilization([100] * 5, 32) == 1.0
    assert theory.ideal_gain([100] * 5, 32) == 1.0


def test_geometric_lengths_approach_the_exponential_law():
    lengths = lk.Trace.sample(400_000, output="exponential", mean_output=64, seed=0).output_lengths
    for batch_size in (8, 32, 64):
        assert theory.static_utilization(lengths, batch_size) == pytest.approx(
            theory.exponential_utilization(batch_size), rel=0.02
        )


def test_monte_carlo_pooled_converges_to_the_ratio_of_expectations():
    result = theory.monte_carlo("exponential", 8, num_batches=50_000, seed=1)
    assert result.pooled[-1] == pytest.approx(1 / theory.harmonic(8), abs=0.005)
    # The mean of per-batch ratios converges elsewhere: it is clearly larger.
    assert result.mean_of_ratios[-1] > result.pooled[-1] + 0.02
    assert len(result.pooled) == len(result.mean_of_ratios) == 50_000


def test_share_by_longest_is_the_mean_share_of_each_group_of_batches():
    result = theory.monte_carlo([1, 2, 4], 2, num_batches=2_000, seed=4)
    shares = {longest: [] for longest in (1, 2, 4)}
    for share, longest in zip(result.shares, result.longest):
        shares[longest].append(share)
    assert [np.mean(shares[m]) for m in (1, 2, 4)] == pytest.approx([1.0, 2.5 / 3, 3.75 / 5], abs=0.02)
    groups = result.share_by_longest(3)  # shortest first; over a ninth of the batches have longest 1, 5/9 longest 4
    assert groups[0] > np.mean(shares[2]) > groups[-1] == pytest.approx(np.mean(shares[4]), abs=0.02)
    assert np.all(np.diff(theory.monte_carlo("exponential", 16, seed=0).share_by_longest()) < 0)
    # the pooled share weighs each batch by its longest request
    assert result.pooled[-1] == pytest.approx(np.average(result.shares, weights=result.longest))


def test_monte_carlo_on_an_empirical_distribution_matches_order_statistics():
    lengths = [50, 120, 300, 900]
    result = theory.monte_carlo(lengths, 4, num_batches=100_000, seed=2)
    assert result.pooled[-1] == pytest.approx(theory.static_utilization(lengths, 4), abs=0.005)


def test_simulated_static_utilization_matches_theory_on_a_backlogged_queue():
    trace = lk.Trace.sample(64 * 400, output="exponential", mean_output=64, seed=3)
    log = lk.simulate(trace, lk.Static(num_slots=64))
    assert log.utilization == pytest.approx(theory.static_utilization(trace.output_lengths, 64), rel=0.03)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: theory.harmonic(0), "n = 0"),
        (lambda: theory.harmonic(2.5), "n = 2.5"),
        (lambda: theory.expected_max([1, 2], 0), "batch_size = 0"),
        (lambda: theory.expected_max([], 2), "lengths is empty"),
        (lambda: theory.static_utilization([1, -3], 2), "lengths must be finite and > 0"),
        (lambda: theory.monte_carlo("exponential", 8, num_batches=0), "num_batches = 0"),
        (lambda: theory.monte_carlo("exponential", 8, num_batches=3).share_by_longest(4), "num_groups = 4"),
        (lambda: theory.monte_carlo("exponential", 8).share_by_longest(0), "num_groups = 0"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
