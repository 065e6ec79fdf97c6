"""Latency figures draw the metrics' numbers, in the axes' units, and mark the Pareto front right."""

import numpy as np
import plotly.graph_objects as go
import pytest

import labkit as lk
from labkit.viz.latency import (
    TradeoffPoint,
    goodput_bars,
    latency_tradeoff,
    pareto_optimal,
    step_times,
    tradeoff_point,
)

COST = lk.CostModel(overhead=2e-3, per_prefill_token=1e-4, per_decode_token=5e-4, per_kv_token=0.0)


@pytest.fixture(scope="module")
def spike_logs():
    """Three chatting requests, then a 600-token prompt at t = 0.01 s: whole, and chunked by 128."""
    trace = lk.Trace.from_lengths([20, 20, 20, 4], prompt_lengths=[4, 4, 4, 600], arrivals=[0, 0, 0, 0.01])
    return {
        "whole": lk.simulate(trace, lk.Continuous(num_slots=4), cost=COST),
        "chunked": lk.simulate(trace, lk.Continuous(num_slots=4, max_tokens_per_step=128, chunked_prefill=True), cost=COST),
    }


# step_times ---------------------------------------------------------------------------------


def test_step_times_draws_every_step_in_milliseconds(spike_logs):
    fig = step_times(spike_logs)
    assert [trace.name for trace in fig.data] == ["whole", "chunked"]
    for trace, log in zip(fig.data, spike_logs.values()):
        assert len(trace.y) == log.num_steps
        np.testing.assert_allclose(trace.y, 1000 * log.step_seconds)
        np.testing.assert_allclose(trace.x, log.step_start)
        assert list(trace.customdata) == log.num_prefill_tokens.tolist()


def test_the_whole_prompt_step_is_the_tallest_and_priced_by_the_cost_model(spike_logs):
    whole, chunked = step_times(spike_logs).data
    # 601 prompt tokens and 3 decodes: 2 ms + 601 * 0.1 ms + 3 * 0.5 ms
    assert max(whole.y) == pytest.approx(2 + 60.1 + 1.5)
    # a chunk: 125 prompt tokens beside 3 decodes, within the 128-token budget
    assert max(chunked.y) == pytest.approx(2 + 12.5 + 1.5)


def test_step_times_measures_from_the_first_arrival():
    trace = lk.Trace.from_lengths([3], arrivals=[5.0])
    fig = step_times({"late": lk.simulate(trace, lk.Continuous(num_slots=1), step_time=0.01)})
    np.testing.assert_allclose(fig.data[0].x, [0.0, 0.01, 0.02])


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


def test_pareto_optimal_of_nothing_is_empty():
    assert pareto_optimal([]).tolist() == []


# latency_tradeoff ---------------------------------------------------------------------------


def test_latency_tradeoff_places_each_run_and_opens_the_dominated(spike_logs):
    logs = {**spike_logs, "slow": lk.simulate(spike_logs["whole"].trace, lk.Continuous(num_slots=1), cost=COST)}
    fig = latency_tradeoff(logs, q=99)
    (scatter,) = fig.data
    assert list(scatter.text) == ["whole", "chunked", "slow"]
    points = [tradeoff_point(log, 99) for log in logs.values()]
    np.testing.assert_allclose(scatter.x, [p.itl_ms for p in points])
    np.testing.assert_allclose(scatter.y, [p.ttft_s for p in points])
    np.testing.assert_allclose(scatter.marker.color, [p.tokens_per_second for p in points])
    expected = ["circle" if optimal else "circle-open" for optimal in pareto_optimal(points)]
    assert list(scatter.marker.symbol) == expected
    assert fig.layout.xaxis.title.text == "ITL p99 (ms)"
    assert fig.layout.yaxis.title.text == "TTFT p99 (s)"


def test_the_same_schedule_on_a_slower_machine_is_dominated(spike_logs):
    slower = lk.CostModel(overhead=4e-3, per_prefill_token=2e-4, per_decode_token=1e-3, per_kv_token=0.0)
    logs = {**spike_logs, "slower": lk.simulate(spike_logs["whole"].trace, lk.Continuous(num_slots=4), cost=slower)}
    assert list(latency_tradeoff(logs).data[0].marker.symbol)[2] == "circle-open"


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
