"""Two-lane timelines: every stretch drawn, idle device time shaded, the explorer in step with its sliders."""

import numpy as np
import pytest

import labkit as lk
from labkit.analysis.lanes import Lanes, idle_stretches, layout_summary, two_lanes


def traces_by(fig, name, row):
    return [t for t in fig.data if t.name == name and set(t.y) == {row}]


def test_the_timeline_draws_host_device_and_idle_stretches():
    fig = lk.viz.lane_timeline({"without overlap": two_lanes(2.0, 5.0, 3, overlap=False)})
    host, = traces_by(fig, "host work", "without overlap: host")
    device, = traces_by(fig, "device work", "without overlap: device")
    idle, = traces_by(fig, "device idle", "without overlap: device")
    assert list(host.base) == [0, 7, 14] and list(host.x) == [2, 2, 2]
    assert list(device.base) == [2, 9, 16] and list(device.x) == [5, 5, 5]
    assert list(idle.base) == [0, 7, 14] and list(idle.x) == [2, 2, 2]  # the device waits for each step's host work
    assert list(device.customdata) == [7, 14, 21]  # each bar's end, for its hover
    assert "%{base:.2f} to %{customdata:.2f} ms (%{x:.2f} ms)" in device.hovertemplate


def test_each_device_row_is_labelled_with_its_idle_share():
    fig = lk.viz.lane_timeline({"turns": two_lanes(2.0, 5.0, 5, overlap=False),
                                "ahead": two_lanes(2.0, 5.0, 5, overlap=True)})
    labels = {label.y: label.text for label in fig.layout.annotations}
    assert labels == {"turns: device": "device idle 29%", "ahead: device": "device idle 7%"}  # 10/35, 2/27


def test_overlap_leaves_only_the_first_gap():
    lanes = two_lanes(2.0, 5.0, 4, overlap=True)
    assert idle_stretches(lanes).tolist() == [[0, 2]]


def test_a_log_scale_turns_seconds_into_ms():
    lanes = Lanes(np.array([[0.0, 0.001]]), np.array([[0.001, 0.004]]))
    fig = lk.viz.lane_timeline({"run": lanes}, scale=1000)
    device, = traces_by(fig, "device work", "run: device")
    assert list(device.base) == pytest.approx([1.0]) and list(device.x) == pytest.approx([3.0])


def test_the_summary_states_the_source_arithmetic():
    assert layout_summary(2.0, 5.0) == ("without overlap a step takes 7.0 ms and the device idles 28.6% of the time; "
                                        "with overlap a step takes 5.0 ms: 1.40x the throughput")


def test_the_explorer_follows_its_sliders():
    explorer = lk.viz.LaneExplorer(host=2.0, device=5.0, num_steps=3)
    assert "7.0 ms" in explorer.summary.value
    explorer.host.value = 5.0
    assert explorer.summary.value.startswith("without overlap a step takes 10.0 ms")
    device, = traces_by(explorer.figure, "device work", "with overlap: device")
    assert list(device.base) == [5, 10, 15]  # host-bound: the device starts as each step's host work ends
    assert list(device.customdata) == [10, 15, 20]
    assert [label.text for label in explorer.figure.layout.annotations] == ["device idle 50%", "device idle 25%"]  # 15/30, 5/20


def test_the_speedup_curve_peaks_at_two_where_host_equals_device():
    fig = lk.viz.overlap_speedup_curve(device=5.0, max_host=20.0)
    curve = fig.data[0]
    peak = int(np.argmax(curve.y))
    assert curve.y[peak] == pytest.approx(2.0) and curve.x[peak] == pytest.approx(5.0)
    assert curve.y[0] == pytest.approx(1.0) and curve.y[-1] == pytest.approx(25 / 20)
