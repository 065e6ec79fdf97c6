"""The viz layer: slot diagrams draw runs exactly, the stepper counts right and survives bad input."""

import numpy as np
import plotly.graph_objects as go
import pytest

import labkit as lk
from labkit.viz.stepper import MAX_OUTPUT_LENGTH, MAX_REQUESTS, MAX_SLOTS
from labkit.viz import (
    ScheduleStepper,
    harmonic_curves,
    progress_text,
    request_color,
    show_steps,
    slot_diagram,
    utilization_bars,
)


@pytest.fixture(scope="module")
def toy_logs():
    trace = lk.Trace.toy()
    return {
        "static": lk.simulate(trace, lk.Static(num_slots=2)),
        "continuous": lk.simulate(trace, lk.Continuous(num_slots=2)),
    }


@pytest.fixture
def stepper():
    return ScheduleStepper()


def bars(fig):
    """(slot, label, start, length) per visible bar, sorted by slot then start."""
    bar = fig.data[0]
    rows = zip(bar.y, bar.text, bar.base, bar.x)
    return sorted((int(s), t, int(b), int(x)) for s, t, b, x in rows if x > 0)


# Slot diagram -----------------------------------------------------------------------------


def test_static_toy_diagram_has_one_bar_per_run(toy_logs):
    assert bars(slot_diagram(toy_logs["static"])) == [
        (0, "A", 0, 2), (0, "C", 6, 3), (0, "E", 14, 2), (0, "G", 18, 5),
        (1, "B", 0, 6), (1, "D", 6, 8), (1, "F", 14, 4), (1, "H", 18, 2),
    ]  # fmt: skip


def test_continuous_toy_diagram_has_one_bar_per_run(toy_logs):
    assert bars(slot_diagram(toy_logs["continuous"])) == [
        (0, "A", 0, 2), (0, "C", 2, 3), (0, "D", 5, 8), (0, "H", 13, 2),
        (1, "B", 0, 6), (1, "E", 6, 2), (1, "F", 8, 4), (1, "G", 12, 5),
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["static", "continuous"])
def test_bars_cover_exactly_the_busy_slot_steps(toy_logs, name):
    log = toy_logs[name]
    drawn = np.full_like(log.slots, -1)
    label_to_id = dict(zip(log.trace.labels, log.trace.ids))
    for slot, label, start, length in bars(slot_diagram(log)):
        assert (drawn[start : start + length, slot] == -1).all(), "bars overlap"
        drawn[start : start + length, slot] = label_to_id[label]
    np.testing.assert_array_equal(drawn, log.slots)


def test_a_request_has_the_same_colour_in_both_diagrams(toy_logs):
    colours = {}
    for log in toy_logs.values():
        bar = slot_diagram(log).data[0]
        for label, colour in zip(bar.text, bar.marker.color):
            assert colours.setdefault(label, colour) == colour
    assert len(colours) == 8 and len(set(colours.values())) == 8
    assert colours["A"] == request_color(0)


def test_slot_diagram_axes_and_default_title(toy_logs):
    fig = slot_diagram(toy_logs["static"])
    assert fig.layout.xaxis.title.text == "step" and fig.layout.yaxis.title.text == "slot"
    assert tuple(fig.layout.xaxis.range) == (0, 23)
    assert fig.layout.yaxis.range[0] > fig.layout.yaxis.range[1], "slot 0 must be on top"
    assert fig.layout.title.text == "Static(num_slots=2): 23 steps, utilization 69.6%"
    assert slot_diagram(toy_logs["static"], title="mine").layout.title.text == "mine"


def test_diagrams_of_different_lengths_can_share_a_step_axis(toy_logs):
    continuous = toy_logs["continuous"]
    assert tuple(slot_diagram(continuous).layout.xaxis.range) == (0, 17)
    shared = slot_diagram(continuous, num_steps=23)
    assert tuple(shared.layout.xaxis.range) == (0, 23)
    assert bars(shared) == bars(slot_diagram(continuous))


@pytest.mark.parametrize("num_steps", [16, 2.5, True])
def test_a_step_axis_shorter_than_the_log_or_not_whole_is_refused(toy_logs, num_steps):
    with pytest.raises(ValueError, match=rf"num_steps = {num_steps!r}: must be a whole number >= the log's 17 steps"):
        slot_diagram(toy_logs["continuous"], num_steps=num_steps)


def test_long_logs_draw_runs_not_cells():
    log = lk.simulate(lk.Trace.sample(500, mean_output=32, seed=0), lk.Continuous(num_slots=16))
    assert log.num_steps > 500
    assert len(slot_diagram(log).data[0].x) == 500  # one run per request: continuous never re-slots


def test_show_steps_clips_bars_and_hides_their_labels(toy_logs):
    log = toy_logs["static"]
    fig = go.FigureWidget(slot_diagram(log))
    show_steps(fig, log, 5)
    assert bars(fig) == [(0, "A", 0, 2), (1, "B", 0, 5)]
    assert [t for t, x in zip(fig.data[0].text, fig.data[0].x) if x == 0] == [""] * 6
    show_steps(fig, log, log.num_steps)
    assert bars(fig) == bars(slot_diagram(log))


# Other figures -------------------------------------------------------------------------------


def test_utilization_bars_print_percent(toy_logs):
    bar = utilization_bars(toy_logs).data[0]
    assert list(bar.x) == ["static", "continuous"]
    np.testing.assert_allclose(bar.y, [32 / 46, 32 / 34])
    assert list(bar.text) == ["69.6%", "94.1%"]


def test_harmonic_curves_theory_line_and_seed_points():
    fig = harmonic_curves()
    line, seeds = fig.data[0], fig.data[-1]
    np.testing.assert_allclose(line.y, [1 / sum(1 / k for k in range(1, b + 1)) for b in range(1, 65)])
    np.testing.assert_allclose(seeds.y, lk.theory.exponential_utilization(np.array([8, 32, 64])))
    assert list(seeds.text) == ["B=8: 36.8%", "B=32: 24.6%", "B=64: 21.1%"]


def test_harmonic_curves_optional_traces_with_the_simulated_points_on_top():
    simulated = {b: lk.simulate(lk.Trace.sample(b * 200, mean_output=64, seed=b), lk.Static(num_slots=b)).utilization
                 for b in (4, 16)}
    fig = harmonic_curves(simulated=simulated, curves={"uniform": {1: 1.0, 4: 0.6}})
    assert [trace.name for trace in fig.data] == [
        "exponential: 1/H_B", "uniform", "1/H_B at B = 8, 32, 64", "simulated static batching, exponential"
    ]
    np.testing.assert_allclose(fig.data[-1].y, lk.theory.exponential_utilization(np.array([4, 16])), rtol=0.05)
    assert fig.data[2].marker.symbol == "circle-open", "a filled seed marker would hide a simulated point"


def test_harmonic_curves_use_a_log_axis_ticked_at_powers_of_two():
    assert harmonic_curves().layout.xaxis.type == "log"
    assert list(harmonic_curves().layout.xaxis.tickvals) == [1, 2, 4, 8, 16, 32, 64]
    assert list(harmonic_curves(batch_sizes=range(3, 20)).layout.xaxis.tickvals) == [4, 8, 16]


# Stepper ---------------------------------------------------------------------------------------


def counters(stepper):
    return {name: label.value for name, label in stepper.counters.items()}


def test_stepper_starts_at_the_end_with_final_counters(stepper):
    assert stepper.step == 23
    assert counters(stepper) == {
        "static": "Static: step 23 of 23 · 32 tokens · utilization 69.6% · 0 waiting",
        "continuous": "Continuous: step 17 of 17 · 32 tokens · utilization 94.1% · 0 waiting",
    }
    assert stepper.logs["static"].num_steps == 23 and stepper.logs["continuous"].num_steps == 17


def test_play_and_slider_agree_before_a_front_end_links_them(stepper):
    assert stepper.play.value == stepper.slider.value == stepper.play.max == 23
    stepper.num_slots_box.value = 3
    assert stepper.play.value == stepper.slider.value == stepper.play.max == 19


def test_stepper_go_to_clips_figures_and_counts_so_far(stepper):
    stepper.go_to(5)
    assert stepper.step == 5
    assert bars(stepper.figures["static"]) == [(0, "A", 0, 2), (1, "B", 0, 5)]
    assert bars(stepper.figures["continuous"]) == [(0, "A", 0, 2), (0, "C", 2, 3), (1, "B", 0, 5)]
    assert counters(stepper) == {
        "static": "Static: step 5 of 23 · 7 tokens · utilization 70.0% · 6 waiting",
        "continuous": "Continuous: step 5 of 17 · 10 tokens · utilization 100.0% · 5 waiting",
    }


def test_stepper_go_to_clamps_and_step_zero_shows_the_queue(stepper):
    stepper.go_to(-3)
    assert stepper.step == 0 and bars(stepper.figures["static"]) == []
    assert counters(stepper)["static"] == "Static: step 0 of 23 · 0 tokens · utilization – · 8 waiting"
    stepper.go_to(99)
    assert stepper.step == 23


def test_stepping_sends_one_message_per_figure(stepper, monkeypatch):
    sent = []
    for figure in stepper.figures.values():
        for kind in ("restyle", "relayout", "update"):
            monkeypatch.setattr(figure, f"_send_{kind}_msg", lambda *args, kind=kind, **kwargs: sent.append(kind))
    stepper.go_to(3)
    assert sent == ["update", "update"]


def test_progress_text_past_the_end_stays_at_the_end(toy_logs):
    assert progress_text(toy_logs["continuous"], 23) == progress_text(toy_logs["continuous"], 17)


@pytest.mark.parametrize(
    "lengths, num_slots, message",
    [
        ("2, x, 3", 2, "'x' is not a number"),
        ("0", 2, "output_lengths[0] = 0: each entry must be a whole number >= 1"),
        ("2.5, 3", 2, "whole number"),
        ("", 2, "output_lengths is empty"),
        ("2, 6, 3, 8, 2, 4, 5, 2", 0, "num_slots = 0: must be a whole number >= 1"),
        (", ".join(["3"] * 201), 2, "201 requests is more than the stepper draws (at most 200)"),
        ("1e9, 1", 2, "output_lengths[0] = 1,000,000,000: more tokens than the stepper draws for one request "
                      "(at most 1,000)"),
        ("2, 1001", 2, "output_lengths[1] = 1,001"),
        ("inf", 2, "output_lengths[0] = inf"),
        ("2, 6, 3, 8, 2, 4, 5, 2", 10**9, "num_slots = 1,000,000,000: more slots than the stepper draws (at most 200)"),
    ],
)
def test_invalid_input_shows_a_message_and_keeps_the_last_view(stepper, lengths, num_slots, message):
    stepper.go_to(5)
    logs, figures = stepper.logs, stepper.figures.copy()
    stepper.lengths_box.value = lengths
    stepper.num_slots_box.value = num_slots
    assert message in stepper.error.value
    assert stepper.logs is logs and stepper.figures == figures and stepper.step == 5
    assert repr(stepper) == "ScheduleStepper(lengths=[2, 6, 3, 8, 2, 4, 5, 2], num_slots=2)"


def test_valid_input_clears_the_error_and_redraws(stepper):
    stepper.lengths_box.value = "2, x"
    stepper.lengths_box.value = "1 2 3"
    stepper.num_slots_box.value = 3
    assert stepper.error.value == ""
    assert repr(stepper) == "ScheduleStepper(lengths=[1, 2, 3], num_slots=3)"
    assert bars(stepper.figures["static"]) == [(0, "A", 0, 1), (1, "B", 0, 2), (2, "C", 0, 3)]
    assert stepper.step == 3 and stepper.slider.max == stepper.play.max == 3


def test_equal_lengths_remove_the_advantage(stepper):
    stepper.equal_toggle.value = True
    steps = {name: log.num_steps for name, log in stepper.logs.items()}
    assert steps == {"static": 16, "continuous": 16}
    assert set(stepper.logs["static"].trace.output_lengths.tolist()) == {4}
    assert "utilization 100.0%" in counters(stepper)["static"]
    assert repr(stepper).endswith("equal_lengths=True)")


def test_many_requests_are_labelled_by_id():
    stepper = ScheduleStepper(lengths=[1] * 27, num_slots=27)
    assert sorted(stepper.figures["static"].data[0].text, key=int) == [str(i) for i in range(27)]


def test_stepper_repr_is_stable_and_dom_classes_are_set(stepper):
    assert repr(stepper) == repr(ScheduleStepper()) == "ScheduleStepper(lengths=[2, 6, 3, 8, 2, 4, 5, 2], num_slots=2)"
    assert stepper._repr_mimebundle_()["text/plain"] == repr(stepper)
    for widget, name in [
        (stepper.counters["static"], "labkit-counter-static"),
        (stepper.counters["continuous"], "labkit-counter-continuous"),
        (stepper.play, "labkit-play"),
        (stepper.error, "labkit-error"),
    ]:
        assert name in widget._dom_classes


def test_constructor_rejects_invalid_arguments():
    with pytest.raises(ValueError, match="num_slots"):
        ScheduleStepper(num_slots=0)
    with pytest.raises(ValueError, match=r"output_lengths\[0\] = 10,000,000"):
        ScheduleStepper(lengths=[10**7, 1])


def test_the_largest_input_the_stepper_takes_costs_a_run_and_a_bar_per_request_not_per_step():
    stepper = ScheduleStepper(lengths=[MAX_OUTPUT_LENGTH] * MAX_REQUESTS, num_slots=1)  # 200,000 steps
    for name, log in stepper.logs.items():
        assert (log.num_steps, log.num_runs) == (MAX_OUTPUT_LENGTH * MAX_REQUESTS, MAX_REQUESTS)
        assert len(stepper.figures[name].data[0].x) == MAX_REQUESTS
    stepper = ScheduleStepper(lengths=[MAX_OUTPUT_LENGTH, 1], num_slots=MAX_SLOTS)
    for name, log in stepper.logs.items():
        assert (log.num_steps, log.num_runs) == (MAX_OUTPUT_LENGTH, 2)
        assert len(stepper.figures[name].data[0].x) == 2


def test_a_log_with_no_steps_yet_draws_an_empty_diagram():
    log = lk.StepLog(lk.Trace.toy(), num_slots=2, policy="Static(num_slots=2)")
    fig = slot_diagram(log)
    assert bars(fig) == [] and tuple(fig.layout.xaxis.range) == (0, 1)
