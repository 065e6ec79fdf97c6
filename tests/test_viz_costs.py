"""Figures of a step's cost: one curve per name, per-token curves against batch size, stacked parts."""

import pytest

import labkit as lk

SECONDS = {"batched": {1: 0.002, 8: 0.004, 32: 0.010}, "per_request": {1: 0.002, 8: 0.005, 32: 0.016}}


def test_step_time_curve_against_batch_size_adds_time_per_token():
    fig = lk.viz.step_time_curve(SECONDS)
    assert [t.name for t in fig.data] == ["batched: ms per step", "batched: ms per token",
                                          "per_request: ms per step", "per_request: ms per token"]
    assert list(fig.data[0].y) == pytest.approx([2, 4, 10])
    assert list(fig.data[3].y) == pytest.approx([2, 5 / 8, 16 / 32])
    assert fig.data[0].line.color == fig.data[1].line.color != fig.data[2].line.color
    assert [t.yaxis for t in fig.data] == ["y", "y2", "y", "y2"]  # per token in a panel of its own, below
    assert fig.layout.xaxis2.title.text.startswith("batch size") and fig.layout.yaxis2.title.text == "ms per token"
    assert fig.layout.xaxis.type == fig.layout.xaxis2.type == "log"


def test_step_time_curve_against_context_has_no_per_token_curve():
    fig = lk.viz.step_time_curve({"B = 8": {128: 0.004, 1024: 0.013}}, against="context")
    assert [t.name for t in fig.data] == ["B = 8: ms per step"]
    assert "yaxis2" not in fig.layout
    assert fig.layout.xaxis.type != "log"  # proportional growth draws as a straight line
    assert fig.layout.xaxis.title.text.startswith("context")


def test_step_time_curve_refuses_another_axis():
    with pytest.raises(ValueError, match="against = 'seconds': must be one of batch size, context"):
        lk.viz.step_time_curve(SECONDS, against="seconds")


def test_step_breakdown_stacks_the_three_parts():
    parts = {1: {"step": 0.002, "GEMMs": 0.0005, "attention": 0.0003, "other": 0.0012},
             8: {"step": 0.004, "GEMMs": 0.001, "attention": 0.0014, "other": 0.0016}}
    fig = lk.viz.step_breakdown(parts)
    assert [t.name for t in fig.data] == ["GEMMs", "attention", "other"]
    assert list(fig.data[1].x) == ["B = 1", "B = 8"] and list(fig.data[1].y) == pytest.approx([0.3, 1.4])
    assert fig.layout.barmode == "stack"


def test_step_time_curve_compares_time_per_token_as_a_share_and_marks_a_point():
    seconds = {"context 1,024": {1: 0.003, 16: 0.024}, "context 128": {1: 0.002, 16: 0.006}}
    fig = lk.viz.step_time_curve(seconds, relative=True, title="Two contexts")
    assert list(fig.data[1].y) == pytest.approx([1, 0.5])  # 24/16 ms a token against 3
    assert list(fig.data[3].y) == pytest.approx([1, 0.1875])  # 6/16 against 2
    assert fig.layout.yaxis2.title.text.startswith("per token, share") and fig.layout.title.text == "Two contexts"
    assert fig.data[1].name == "context 1,024: per token, share of the smallest batch's"  # one line in the legend
    marked = lk.viz.step_time_curve({"B = 8": {64: 0.003, 2048: 0.025}}, against="context",
                                    marks={"bytes: 216": 216, "time: 306": 306})
    lines = marked.data[1:]  # one legend entry each, no label on the plot to overlap another
    assert [(t.name, list(t.x), t.line.dash) for t in lines] == [("bytes: 216", [216, 216], "dot"),
                                                                  ("time: 306", [306, 306], "dash")]
    assert all(list(t.y) == pytest.approx([0, 1.05 * 25]) for t in lines)  # across the curve, in ms
    assert not marked.layout.annotations
    with pytest.raises(ValueError, match="relative = True: needs against = 'batch size'"):
        lk.viz.step_time_curve({"B = 8": {64: 0.003}}, against="context", relative=True)
