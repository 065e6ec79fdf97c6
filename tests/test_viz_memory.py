"""Memory figures: preemptions are found exactly, and every figure draws the log's own numbers."""

from collections import Counter

import numpy as np
import pytest

import labkit as lk
from labkit.serve.replay import ScrapedSeries
from labkit.viz.memory import (
    idle_beside_queue,
    pool_sweep,
    pool_usage,
    preemption_steps,
    running_requests,
    server_occupancy,
)


@pytest.fixture(scope="module")
def tight():
    """Three requests in a 6-block pool: request 2 is preempted at steps 5 and 9."""
    trace = lk.Trace.from_lengths([10, 8, 8], prompt_lengths=[3, 3, 3])
    return lk.simulate(trace, lk.Continuous(num_slots=3, num_blocks=6, block_size=4), on_step=lambda log: None)


@pytest.fixture(scope="module")
def roomy(tight):
    return lk.simulate(tight.trace, lk.Continuous(num_slots=3, num_blocks=100, block_size=4))


# preemption_steps ----------------------------------------------------------------------------


def test_preemptions_of_the_small_example(tight):
    assert preemption_steps(tight) == [(5, 2), (9, 2)]


def test_no_preemptions_without_pressure(roomy):
    assert preemption_steps(roomy) == []


def test_no_preemptions_without_a_pool():
    assert preemption_steps(lk.simulate(lk.Trace.toy(), lk.Continuous(num_slots=2))) == []


def test_static_finishes_are_not_preemptions():
    trace = lk.Trace.from_lengths([3, 9, 4, 2], prompt_lengths=[5, 5, 5, 5])
    assert preemption_steps(lk.simulate(trace, lk.Static(num_slots=2, num_blocks=4, block_size=8))) == []


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("num_blocks", [16, 24, 40])
@pytest.mark.parametrize(
    "knobs",
    [{}, {"victim": "longest"}, {"max_tokens_per_step": 160}, {"chunked_prefill": True, "max_tokens_per_step": 24}],
    ids=["newest", "longest", "budget", "chunked"],
)
def test_every_counted_preemption_is_found(seed, num_blocks, knobs):
    rate = None if seed == 0 else 30.0
    trace = lk.Trace.sample(40, output="uniform", mean_output=40, prompt="uniform", mean_prompt=24, rate=rate,
                            seed=seed)
    log = lk.simulate(trace, lk.Continuous(num_slots=8, num_blocks=num_blocks, block_size=8, **knobs))
    found = preemption_steps(log)
    assert len(found) == log.num_preemptions > 0
    per_request = Counter(request for _, request in found)
    assert [per_request[i] for i in trace.ids.tolist()] == log.preemptions.tolist()
    for step, request in found:  # held a slot at the step before, none at the step itself
        assert request in log.slots[step - 1] and request not in log.slots[step]


# pool_usage ---------------------------------------------------------------------------------


def test_pool_usage_draws_blocks_per_step(tight):
    fig = pool_usage(tight, num_blocks=6)
    line = fig.data[0]
    assert line.name == tight.policy and line.line.shape == "hv"
    assert list(line.x) == list(range(tight.num_steps + 1))
    assert list(line.y) == [3, 6, 6, 6, 6, 6, 6, 6, 6, 4, 3, 3, 3]


def test_pool_usage_marks_preemptions_where_they_happen(tight):
    marks = pool_usage(tight, num_blocks=6).data[1]
    assert list(marks.x) == [5.5, 9.5]
    assert list(marks.y) == [6, 4]
    assert "(2)" in marks.name


def test_pool_usage_draws_the_pool_line_only_when_given(tight):
    assert [shape.y0 for shape in pool_usage(tight, num_blocks=6).layout.shapes] == [6]
    assert pool_usage(tight).layout.shapes == ()


def test_pool_usage_draws_one_line_per_log_and_marks_only_preempting_logs(tight, roomy):
    fig = pool_usage({"tight": tight, "roomy": roomy})
    assert [trace.name for trace in fig.data] == ["tight", "tight: preemptions (2)", "roomy"]


def test_figures_leave_the_log_alone(tight):
    before = tight.num_blocks_used.copy()
    first, second = pool_usage(tight, num_blocks=6), pool_usage(tight, num_blocks=6)
    assert first.to_plotly_json() == second.to_plotly_json()
    assert np.array_equal(tight.num_blocks_used, before)


# running_requests ---------------------------------------------------------------------------


def test_running_requests_counts_busy_slots(tight, roomy):
    fig = running_requests({"tight": tight, "roomy": roomy})
    assert [trace.name for trace in fig.data] == ["tight", "roomy"]
    assert list(fig.data[0].y) == [3, 3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1]
    assert list(fig.data[1].y)[:-1] == (roomy.slots >= 0).sum(axis=1).tolist()


# idle_beside_queue --------------------------------------------------------------------------


def test_idle_beside_queue_shades_exactly_the_idle_slots_beside_a_queue(tight):
    fig = idle_beside_queue(tight)
    shade, running, waiting = fig.data
    assert list(shade.x) == [5.5, 6.5, 7.5, 9.5]  # steps 10 and 11 idle two slots too, but nobody waits
    assert list(shade.base) == [2, 2, 2, 1] and list(shade.y) == [1, 1, 1, 2]
    assert shade.name == "idle slots beside a queue: no_blocks (5 slot-steps)"
    assert list(running.y)[:-1] == (tight.slots >= 0).sum(axis=1).tolist()
    assert list(waiting.y)[:-1] == tight.num_queued.tolist()
    assert [shape.y0 for shape in fig.layout.shapes] == [3]


def test_idle_beside_queue_shades_one_series_per_reason():
    trace = lk.Trace.from_lengths([6, 6, 6], prompt_lengths=[30, 30, 30])
    log = lk.simulate(trace, lk.Continuous(num_slots=3, num_blocks=9, block_size=8, max_tokens_per_step=40))
    by_reason = {bars.name: list(bars.x) for bars in idle_beside_queue(log).data[:-2]}
    assert by_reason == {"idle slots beside a queue: no_blocks (9 slot-steps)": [2.5, 3.5, 4.5, 5.5, 9.5],
                         "idle slots beside a queue: no_budget (5 slot-steps)": [0.5, 1.5, 6.5]}


def test_idle_beside_queue_shades_nothing_without_a_limit(roomy):
    assert [trace.name for trace in idle_beside_queue(roomy).data] == ["running", "waiting"]


# server_occupancy ---------------------------------------------------------------------------


def test_server_occupancy_draws_the_scraped_gauges_as_steps_over_time():
    series = ScrapedSeries.from_samples([(0.1, 2, 3, 0.25), (0.2, 4, 1, 0.5), (0.3, 0, 0, 0.0)])
    fig = server_occupancy(series)
    running, waiting, kv = fig.data
    assert [running.name, waiting.name, kv.name] == ["running", "waiting", "KV cache in use"]
    assert {trace.line.shape for trace in fig.data} == {"hv"}
    assert list(running.x) == list(kv.x) == [0.1, 0.2, 0.3]
    assert list(running.y) == [2, 4, 0] and list(waiting.y) == [3, 1, 0] and list(kv.y) == [0.25, 0.5, 0.0]
    assert kv.yaxis == "y2" and running.yaxis == waiting.yaxis == "y"  # KV usage in a panel of its own
    assert "nothing scraped" not in fig.layout.title.text


def test_server_occupancy_of_a_server_without_metrics_says_so():
    fig = server_occupancy(ScrapedSeries.from_samples([]), title="replay")
    assert fig.layout.title.text == "replay<br><sup>nothing scraped: the server has no /metrics</sup>"
    assert [len(trace.x) for trace in fig.data] == [0, 0, 0]


# pool_sweep ---------------------------------------------------------------------------------


def test_pool_sweep_draws_each_series():
    throughput = {"paged": [1.0, 2.0, 3.0], "static": [0.5, 1.0, 2.0]}
    fig = pool_sweep([8, 16, 32], throughput, [40, 10, 0], [5, 2, 0], peak=30)
    assert [trace.name for trace in fig.data] == ["paged", "static", "recomputed tokens"]
    assert list(fig.data[0].y) == [1.0, 2.0, 3.0]
    assert list(fig.data[2].x) == [8, 16, 32] and list(fig.data[2].y) == [40, 10, 0]
    assert list(fig.data[2].hovertext) == ["5 preemptions", "2 preemptions", "0 preemptions"]
    assert [shape.x0 for shape in fig.layout.shapes] == [30, 30]  # one line through both panels
    assert [note.text for note in fig.layout.annotations] == ["peak demand 30"]  # labelled once
    assert fig.layout.annotations[0].yref.startswith("y2")  # in the lower panel, clear of the throughput lines


def test_pool_sweep_without_optional_parts():
    fig = pool_sweep([8, 16], {"paged": [1.0, 2.0]}, [3, 0])
    assert fig.data[1].hovertext is None
    assert fig.layout.shapes == ()


@pytest.mark.parametrize(
    "series, recomputed, preemptions",
    [({"paged": [1.0]}, [3, 0], None), ({"paged": [1.0, 2.0]}, [3], None), ({"paged": [1.0, 2.0]}, [3, 0], [1])],
)
def test_pool_sweep_rejects_series_of_the_wrong_length(series, recomputed, preemptions):
    with pytest.raises(ValueError, match="num_blocks has 2"):
        pool_sweep([8, 16], series, recomputed, preemptions)


def test_pool_sweep_pairs_draw_a_color_per_policy_and_a_dash_per_group():
    shares = {("paged", "CPU"): [0.5, 1.0], ("static", "CPU"): [0.2, 0.4],
              ("paged", "GPU"): [0.3, 1.0], ("static", "GPU"): [0.1, 0.3]}
    fig = pool_sweep([8, 16], shares, [3, 0], y_title="share of the best tokens/s")
    lines = fig.data[:4]
    assert [line.name for line in lines] == ["paged, CPU", "static, CPU", "paged, GPU", "static, GPU"]
    assert lines[0].line.color == lines[2].line.color != lines[1].line.color == lines[3].line.color
    assert [line.line.dash for line in lines] == ["solid", "solid", "dash", "dash"]
    assert fig.layout.yaxis.title.text == "share of the best tokens/s"


def test_pool_sweep_names_a_pair_in_its_length_error():
    with pytest.raises(ValueError, match="paged, CPU has 1 values"):
        pool_sweep([8, 16], {("paged", "CPU"): [1.0]}, [3, 0])
