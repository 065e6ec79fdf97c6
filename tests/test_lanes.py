"""Two lanes, host and device (labkit.analysis.lanes): the source text's arithmetic, exactly."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.analysis.lanes import Lanes, overlap_speedup, two_lanes


def test_two_ms_of_host_and_five_of_device_idle_the_device_two_sevenths():
    lanes = two_lanes(host=2.0, device=5.0, num_steps=10, overlap=False)
    assert lanes.step_period == 7.0
    assert lanes.device_idle_fraction == pytest.approx(2 / 7, abs=1e-15)


def test_overlap_makes_the_step_five_ms_and_throughput_1_4_times():
    without = two_lanes(2.0, 5.0, 10, overlap=False)
    with_overlap = two_lanes(2.0, 5.0, 10, overlap=True)
    assert with_overlap.step_period == 5.0
    assert without.step_period / with_overlap.step_period == 1.4 == overlap_speedup(2.0, 5.0)
    assert with_overlap.device_idle_fraction == pytest.approx(2 / (2 + 10 * 5))  # only the first step's host work


def test_hand_laid_stretches():
    lanes = two_lanes(2.0, 5.0, 3, overlap=True)
    assert lanes.host.tolist() == [[0, 2], [2, 4], [7, 9]]  # the host is at most one step ahead
    assert lanes.device.tolist() == [[2, 7], [7, 12], [12, 17]]


def test_a_host_bound_loop_runs_at_the_host_pace():
    lanes = two_lanes(5.0, 2.0, 10, overlap=True)
    assert lanes.step_period == 5.0
    assert overlap_speedup(5.0, 2.0) == 1.4


@settings(max_examples=200, deadline=None)
@given(host=st.floats(0.01, 10), device=st.floats(0.01, 10), num_steps=st.integers(2, 30), overlap=st.booleans())
def test_lanes_never_overlap_themselves_and_device_follows_host(host, device, num_steps, overlap):
    lanes = two_lanes(host, device, num_steps, overlap)
    for stretches in (lanes.host, lanes.device):
        assert (stretches[1:, 0] >= stretches[:-1, 1] - 1e-12).all()
    assert (lanes.device[:, 0] >= lanes.host[:, 1] - 1e-12).all()
    assert (lanes.host[1:, 0] >= lanes.device[:-1, 0] - 1e-12).all()  # never two steps ahead
    expected = max(host, device) if overlap else host + device
    assert lanes.step_period == pytest.approx(expected)
    assert overlap_speedup(host, device) <= 2.0


def test_from_log_takes_the_measured_stretches_of_the_steps_asked_for():
    class Log:
        lanes = {"host": [(0, 1), (3, 4), (4, 5), (7, 8)], "device": [(1, 3), (5, 7)]}

    first = Lanes.from_log(Log, num_steps=1)
    assert first.device.tolist() == [[1, 3]] and first.host.tolist() == [[0, 1]]
    assert np.isclose(Lanes.from_log(Log, 2).device_idle_fraction, 1 - 4 / 7)
    second = Lanes.from_log(Log, num_steps=1, first_step=1)  # from the end of step 0, at 3
    assert second.device.tolist() == [[2, 4]] and second.host.tolist() == [[0, 1], [1, 2]]
