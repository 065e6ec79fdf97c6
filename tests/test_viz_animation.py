"""The kernel-free animation: one frame per step that draws exactly the schedule so far."""

import re

import numpy as np
import pytest

import labkit as lk
from labkit.viz import kernel_free_bundle, schedule_animation, slot_diagram


@pytest.fixture(scope="module")
def toy_logs():
    trace = lk.Trace.toy()
    return lk.simulate(trace, lk.Static(num_slots=2)), lk.simulate(trace, lk.Continuous(num_slots=2))


@pytest.fixture(scope="module")
def animation(toy_logs):
    return schedule_animation(*toy_logs)


def visible_bars(bar, x, text):
    """(slot, label, start, length) per visible bar: positions from `bar`, lengths and texts given."""
    return sorted((int(s), t, int(b), int(n)) for s, t, b, n in zip(bar.y, text, bar.base, x) if n > 0)


def test_one_frame_and_one_slider_step_per_step_from_zero_to_the_longest(animation):
    names = [str(step) for step in range(24)]  # static takes 23 steps, continuous 17
    assert [frame.name for frame in animation.frames] == names
    slider = animation.layout.sliders[0]
    assert [step.label for step in slider.steps] == names
    assert [list(step.args[0]) for step in slider.steps] == [[name] for name in names]
    assert {step.method for step in slider.steps} == {"animate"}
    assert slider.active == 23


def test_frame_five_shows_five_steps_and_their_counters(animation):
    frame = animation.frames[5]
    assert frame.traces == (0, 1)
    static, continuous = (visible_bars(animation.data[i], d.x, d.text) for i, d in enumerate(frame.data))
    assert static == [(0, "A", 0, 2), (1, "B", 0, 5)]
    assert continuous == [(0, "A", 0, 2), (0, "C", 2, 3), (1, "B", 0, 5)]
    assert [annotation.text for annotation in frame.layout.annotations] == [
        "Static(num_slots=2) · step 5 of 23 · 7 tokens · utilization 70.0% · 6 waiting",
        "Continuous(num_slots=2) · step 5 of 17 · 10 tokens · utilization 100.0% · 5 waiting",
    ]


@pytest.mark.parametrize("index", [0, 1])
def test_every_frame_covers_exactly_the_busy_slot_steps_so_far(animation, toy_logs, index):
    log, bar = toy_logs[index], animation.data[index]
    label_to_id = dict(zip(log.trace.labels, log.trace.ids))
    for step, frame in enumerate(animation.frames):
        drawn = np.full_like(log.slots, -1)
        for slot, label, start, length in visible_bars(bar, frame.data[index].x, frame.data[index].text):
            drawn[start : start + length, slot] = label_to_id[label]
        expected = np.where(np.arange(log.num_steps)[:, None] < step, log.slots, -1)
        np.testing.assert_array_equal(drawn, expected, err_msg=f"frame {step}")


def test_the_figure_shows_the_whole_schedules_with_final_counters(animation, toy_logs):
    for bar, log in zip(animation.data, toy_logs):
        assert visible_bars(bar, bar.x, bar.text) == visible_bars(slot_diagram(log).data[0], bar.x, bar.text)
    assert [annotation.text for annotation in animation.layout.annotations] == [
        "Static(num_slots=2) · step 23 of 23 · 32 tokens · utilization 69.6% · 0 waiting",
        "Continuous(num_slots=2) · step 17 of 17 · 32 tokens · utilization 94.1% · 0 waiting",
    ]
    assert tuple(animation.layout.xaxis.range) == tuple(animation.layout.xaxis2.range) == (0, 23)


def test_play_steps_from_the_current_frame_and_pause_stops(animation):
    play, pause = animation.layout.updatemenus[0].buttons
    assert play.method == pause.method == "animate"
    assert play.args[0] is None and play.args[1]["fromcurrent"] and play.args[1]["frame"]["duration"] == 500
    assert list(pause.args[0]) == [None] and pause.args[1]["mode"] == "immediate"


def test_kernel_free_bundle_holds_the_frames_for_jupyterlab_and_for_plain_html(animation):
    bundle = kernel_free_bundle(animation)
    assert len(bundle["application/vnd.plotly.v1+json"]["frames"]) == 24
    html = bundle["text/html"]
    assert re.search(r'<script [^>]*src="https://cdn\.plot\.ly/plotly-[\d.]+\.min\.js"', html)
    assert "Plotly.addFrames" in html and '"sliders"' in html and "step 17 of 17" in html
