"""Latency figures draw the metrics' numbers, in the axes' units, and mark the Pareto front right."""

import numpy as np
import plotly.graph_objects as go
import pytest

import labkit as lk
from labkit.analysis.tradeoff import TradeoffPoint, dominates, dominators, pareto_optimal, tradeoff_point
from labkit.viz.latency import goodput_bars, label_positions, latency_tradeoff, step_times

COST = lk.CostModel(overhead=2e-3, per_prefill_token=1e-4, per_decode_token=5e-4, per_kv_token=0.0)
SLOWER = lk.CostModel(overhead=4e-3, per_prefill_token=2e-4, per_decode_token=1e-3, per_kv_token=0.0)  # COST, doubled


@pytest.fixture(scope="module")
def spike_logs():
    """Three chatting requests, then a 600-token prompt at t = 0.01 s: whole, and chunked by 128."""
    trace = lk.Trace.from_lengths([20, 20, 20, 4], prompt_lengths=[4, 4, 4, 600], arrivals=[0, 0, 0, 0.01])
    return {
        "whole": lk.simulate(trace, lk.Continuous(num_slots=4), cost=COST),
        "chunked": lk.simulate(trace, lk.Continuous(num_slots=4, max_tokens_per_step=128, chunked_prefill=True), cost=COST),
    }


# step_times ---------------------------------------------------------------------------------


def drawn_steps(trace) -> list[tuple[float, float, float]]:
    """(from x, to x, height) of each flat stretch of a line drawn with line_shape "hv"."""
    x, y = list(trace.x), list(trace.y)
    return [(x[k], x[k + 1], y[k]) for k in range(len(x) - 1) if x[k] is not None and x[k + 1] is not None]


def test_step_times_draws_each_step_flat_over_its_own_duration(spike_logs):
    fig = step_times(spike_logs)
    assert [trace.name for trace in fig.data] == ["whole", "chunked"]
    for trace, log in zip(fig.data, spike_logs.values()):
        assert trace.line.shape == "hv"
        expected = np.column_stack([log.step_start, log.step_end, 1000 * log.step_seconds])
        np.testing.assert_allclose(drawn_steps(trace), expected)


def test_the_whole_prompt_step_is_the_tallest_and_priced_by_the_cost_model(spike_logs):
    whole, chunked = step_times(spike_logs).data
    # 601 prompt tokens and 3 decodes: 2 ms + 601 * 0.1 ms + 3 * 0.5 ms
    assert max(y for y in whole.y if y is not None) == pytest.approx(2 + 60.1 + 1.5)
    # a chunk: 125 prompt tokens beside 3 decodes, within the 128-token budget
    assert max(y for y in chunked.y if y is not None) == pytest.approx(2 + 12.5 + 1.5)


def test_step_times_measures_from_the_first_arrival():
    trace = lk.Trace.from_lengths([3], arrivals=[5.0])
    fig = step_times({"late": lk.simulate(trace, lk.Continuous(num_slots=1), step_time=0.01)})
    np.testing.assert_allclose(drawn_steps(fig.data[0]), [(0.0, 0.01, 10), (0.01, 0.02, 10), (0.02, 0.03, 10)])


def test_step_times_breaks_the_line_where_the_run_idles():
    """Two requests 1 s apart: no stretch of the line covers the idle second."""
    trace = lk.Trace.from_lengths([2, 2], arrivals=[0.0, 1.0])
    (line,) = step_times({"gap": lk.simulate(trace, lk.Continuous(num_slots=1), step_time=0.01)}).data
    np.testing.assert_allclose(drawn_steps(line), [(0.0, 0.01, 10), (0.01, 0.02, 10), (1.0, 1.01, 10), (1.01, 1.02, 10)])
    assert list(line.x).count(None) == 2 and list(line.customdata).count(None) == 2


# tradeoff_point and pareto_optimal -----------------------------------------------------------


def test_tradeoff_point_reads_the_metrics(spike_logs):
    log = spike_logs["whole"]
    point = tradeoff_point(log, q=90)
    assert point.itl_ms == pytest.approx(1000 * np.percentile(lk.metrics.itl(log), 90))
    assert point.ttft_s == pytest.approx(np.percentile(log.ttft, 90))
    assert point.tokens_per_second == pytest.approx(log.tokens_per_second)


def test_chunking_trades_a_lower_itl_tail_for_nothing_else_here(spike_logs):
    whole, chunked = (tradeoff_point(log, q=100) for log in spike_logs.values())
    assert chunked.itl_ms < whole.itl_ms / 3


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        ([TradeoffPoint(10, 1.0, 100)], [True]),
        ([TradeoffPoint(10, 1.0, 100), TradeoffPoint(20, 2.0, 50)], [True, False]),  # worse on all three
        ([TradeoffPoint(10, 2.0, 100), TradeoffPoint(20, 1.0, 100)], [True, True]),  # a trade-off
        ([TradeoffPoint(10, 1.0, 100), TradeoffPoint(10, 1.0, 90)], [True, False]),  # equal but less throughput
        ([TradeoffPoint(10, 1.0, 100), TradeoffPoint(10, 1.0, 100)], [True, True]),  # ties keep both
        ([TradeoffPoint(10, 1.0, 100), TradeoffPoint(5, 3.0, 100), TradeoffPoint(12, 3.0, 90)], [True, True, False]),
    ],
)
def test_pareto_optimal(points, expected):
    assert pareto_optimal(points).tolist() == expected


def test_differences_within_the_tolerance_are_ties():
    """Lesson 06's sweep: 2,048 beats whole prompts on ITL p99 by 0.0006 ms, and loses on TTFT by 2%."""
    whole, budget_2048 = TradeoffPoint(151.1006, 0.682, 438.0), TradeoffPoint(151.1000, 0.697, 438.0)
    assert pareto_optimal([whole, budget_2048]).tolist() == [True, False]
    assert dominates([whole, budget_2048]).tolist() == [[False, True], [False, False]]
    assert pareto_optimal([whole, budget_2048], rtol=0).tolist() == [True, True]  # without it, a "trade-off"


def test_a_bad_tolerance_is_refused():
    with pytest.raises(ValueError, match="rtol = -0.1"):
        pareto_optimal([TradeoffPoint(10, 1.0, 100)], rtol=-0.1)


def test_dominators_name_the_runs_that_dominate_each_run(spike_logs):
    logs = {**spike_logs, "slower": lk.simulate(spike_logs["whole"].trace, lk.Continuous(num_slots=4), cost=SLOWER)}
    assert dominators(logs) == {"whole": [], "chunked": [], "slower": ["whole", "chunked"]}


def test_pareto_optimal_of_nothing_is_empty():
    assert pareto_optimal([]).tolist() == []


# latency_tradeoff ---------------------------------------------------------------------------


def by_name(fig) -> dict:
    """Each run's (trace name, x, y, throughput, symbol) as the figure draws it."""
    return {text: (trace.name, x, y, throughput, trace.marker.symbol)
            for trace in fig.data for text, x, y, throughput in zip(trace.text, trace.x, trace.y, trace.customdata)}


def test_latency_tradeoff_places_each_run_and_opens_the_dominated(spike_logs):
    logs = {**spike_logs, "slower": lk.simulate(spike_logs["whole"].trace, lk.Continuous(num_slots=4), cost=SLOWER),
            "one slot": lk.simulate(spike_logs["whole"].trace, lk.Continuous(num_slots=1), cost=COST)}
    fig = latency_tradeoff(logs, q=99)
    assert [trace.name for trace in fig.data] == ["Pareto-optimal", "dominated (ties within 1%)"]
    drawn = by_name(fig)
    assert sorted(drawn) == sorted(logs) and drawn["slower"][0].startswith("dominated")
    for (name, log), optimal in zip(logs.items(), pareto_optimal([tradeoff_point(log, 99) for log in logs.values()])):
        point = tradeoff_point(log, 99)
        kind, x, y, throughput, symbol = drawn[name]
        assert (x, y, throughput) == pytest.approx(point)
        assert (kind, symbol) == (("Pareto-optimal", "circle") if optimal else ("dominated (ties within 1%)", "circle-open"))
    assert all(trace.texttemplate == "%{text}<br>%{customdata:,.0f} tokens/s" for trace in fig.data)  # they differ
    assert all(trace.marker.colorbar.title.text is None for trace in fig.data)  # a label, never a colour scale
    assert fig.layout.xaxis.title.text == "ITL p99 (ms)"
    assert fig.layout.yaxis.title.text == "TTFT p99 (s)"


def test_throughput_within_the_tolerance_is_not_labelled_point_by_point():
    """The same schedule 0.5% slower: a throughput per point would present noise as signal."""
    trace = lk.Trace.from_lengths([20, 20, 20, 4], prompt_lengths=[4, 4, 4, 600], arrivals=[0, 0, 0, 0.01])
    logs = {name: lk.simulate(trace, lk.Continuous(num_slots=4), cost=lk.CostModel(overhead=overhead))
            for name, overhead in (("a", 3e-3), ("b", 3.015e-3))}
    fig = latency_tradeoff(logs, title="t")
    assert all(trace.texttemplate == "%{text}" for trace in fig.data)
    assert "every run: " in fig.layout.title.text and "tokens/s (within 1%)" in fig.layout.title.text
    labelled = latency_tradeoff(logs, title="t", rtol=0.001)  # negative control: a finer tolerance labels
    assert labelled.data[0].texttemplate == "%{text}<br>%{customdata:,.0f} tokens/s"
    assert "every run" not in labelled.layout.title.text


def test_nearby_points_get_labels_on_different_sides():
    # lesson 06: whole prompts and a budget of 2,048 nearly coincide; 64 is far from both
    assert label_positions([151.1, 12.4, 151.1], [0.682, 5.05, 0.697]) == ["top center", "top center", "bottom center"]
    assert label_positions([10, 10, 10], [1, 1, 1]) == ["top center", "bottom center", "middle right"]
    assert label_positions([10, 100], [1, 1]) == ["top center", "top center"]


def test_latency_tradeoff_of_no_runs_says_so():
    with pytest.raises(ValueError, match=r"logs = \{\}"):
        latency_tradeoff({})


# goodput_bars -------------------------------------------------------------------------------


def test_goodput_bars_label_each_value_and_draw_the_offered_rate():
    fig = goodput_bars({"none": 6.08, "128": 11.59}, offered=12, slo="TTFT ≤ 1 s")
    assert isinstance(fig, go.Figure)
    assert list(fig.data[0].x) == ["none", "128"]
    assert list(fig.data[0].text) == ["6.08", "11.59"]
    assert [shape.y0 for shape in fig.layout.shapes] == [12]
    assert "TTFT ≤ 1 s" in fig.layout.title.text


def test_goodput_bars_without_an_offered_rate_draw_no_line():
    assert not goodput_bars({"a": 1.0}).layout.shapes


def test_predicted_against_measured_puts_each_request_at_its_two_times():
    trace = lk.Trace.from_lengths([3, 5], arrivals=[0.0, 0.01])
    predicted = lk.simulate(trace, lk.Continuous(num_slots=2))
    measured = lk.simulate(trace, lk.Continuous(num_slots=1))
    fig = lk.viz.predicted_against_measured(predicted, measured)
    points = [trace for trace in fig.data if trace.name == "a request"]
    assert list(points[0].x) == pytest.approx(1000 * predicted.ttft) and list(points[0].y) == pytest.approx(
        1000 * measured.ttft)
    assert list(points[1].y) == pytest.approx(1000 * measured.latency)


def test_predicted_against_measured_refuses_different_requests():
    one = lk.simulate(lk.Trace.from_lengths([3, 5]), lk.Continuous(num_slots=2))
    other = lk.simulate(lk.Trace.from_lengths([3]), lk.Continuous(num_slots=2))
    with pytest.raises(ValueError, match="same requests"):
        lk.viz.predicted_against_measured(one, other)
