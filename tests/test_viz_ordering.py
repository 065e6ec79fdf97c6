"""Queue-order figures and tables draw what the logs hold: TTFT shares, groups by length,
ratios to a reference, in the axes' units."""

import numpy as np
import pytest

import labkit as lk
from labkit.analysis.ordering import gain_table, group_row, group_table, length_bins, policy_row, policy_table, statistic
from labkit.viz.ordering_figures import WAITING_SHARES, noise_sweep, ttft_by_length, ttft_waiting

LENGTHS = np.random.default_rng(0).permutation(np.arange(1, 21))  # outputs of 1..20 tokens, shuffled


@pytest.fixture(scope="module")
def logs():
    """20 requests waiting at t = 0 on 2 slots, a step a second: first come, and shortest first."""
    trace = lk.Trace.from_lengths(LENGTHS).with_priorities(LENGTHS % 2)
    return {name: lk.simulate(trace, policy, step_time=1.0) for name, policy in (
        ("FCFS", lk.Continuous(num_slots=2)), ("SPF", lk.ShortestPredictedFirst(num_slots=2)),
        ("SPF, noise 1", lk.ShortestPredictedFirst(num_slots=2, noise=1.0)))}


# statistic, policy_row, group_row ----------------------------------------------------------


def test_statistic_reads_mean_percentiles_and_max_and_skips_nan():
    values = np.array([1.0, 2.0, 3.0, 10.0, np.nan])
    assert statistic(values, "mean") == 4.0
    assert statistic(values, "p50") == 2.5
    assert statistic(values, "max") == 10.0
    assert statistic(values, "p100") == 10.0
    with pytest.raises(ValueError, match="stat = 'median'"):
        statistic(values, "median")


def test_policy_row_agrees_with_the_metrics_summary(logs):
    for log in logs.values():
        row, summary = policy_row(log), lk.metrics.summary(log)
        assert row["TTFT mean"] == pytest.approx(np.mean(log.ttft))
        for ours, theirs in (("TTFT p50", "TTFT p50 (s)"), ("TTFT p99", "TTFT p99 (s)"), ("ITL p50", "ITL p50 (ms)"),
                             ("ITL p99", "ITL p99 (ms)"), ("e2e p50", "latency p50 (s)"),
                             ("e2e p99", "latency p99 (s)"), ("tokens/s", "tokens/s")):
            assert row[ours] == pytest.approx(summary[theirs])


def test_shortest_first_cuts_the_mean_ttft_of_a_backlog_and_keeps_the_tokens(logs):
    fcfs, spf = policy_row(logs["FCFS"]), policy_row(logs["SPF"])
    assert spf["TTFT mean"] < fcfs["TTFT mean"]
    assert logs["SPF"].num_output_tokens == logs["FCFS"].num_output_tokens == LENGTHS.sum()


def test_policy_table_prints_a_row_per_run(logs):
    lines = policy_table(logs).splitlines()
    assert lines[0].split()[:3] == ["run", "TTFT", "mean"]
    assert [line.split()[0] for line in lines[1:4]] == ["FCFS", "SPF", "SPF,"]
    fcfs = policy_row(logs["FCFS"])
    assert lines[1].split()[1:] == [f"{fcfs['TTFT mean']:,.2f}", f"{fcfs['TTFT p50']:,.2f}", f"{fcfs['TTFT p99']:,.2f}",
                                    f"{fcfs['ITL p50']:,.1f}", f"{fcfs['ITL p99']:,.1f}", f"{fcfs['e2e p50']:,.2f}",
                                    f"{fcfs['e2e p99']:,.2f}", f"{fcfs['tokens/s']:,.0f}"]
    assert lines[-1] == "(TTFT and e2e in s, ITL in ms)"
    assert max(len(line) for line in lines) <= 100
    with pytest.raises(ValueError, match="at least one run"):
        policy_table({})


def test_group_row_reads_only_the_chosen_requests(logs):
    log = logs["FCFS"]
    odd = log.trace.priorities == 1
    row = group_row(log, odd)
    assert row["requests"] == 10
    assert row["TTFT mean"] == pytest.approx(log.ttft[odd].mean())
    assert row["TTFT max"] == log.ttft[odd].max()
    assert row["e2e p99"] == pytest.approx(np.percentile(log.latency[odd], 99))
    with pytest.raises(ValueError, match="one bool per request"):
        group_row(log, np.flatnonzero(odd))


def test_group_table_prints_a_row_per_run_and_group(logs):
    odd = logs["FCFS"].trace.priorities == 1
    lines = group_table({"FCFS": logs["FCFS"], "SPF": logs["SPF"]}, {"odd": odd, "even": ~odd}).splitlines()
    assert [line.split("  ")[0] for line in lines[1:5]] == ["FCFS, odd", "FCFS, even", "SPF, odd", "SPF, even"]
    assert lines[1].split()[2] == "10"
    assert lines[-1] == "(times in s)"


def test_gain_table_gives_the_share_of_the_first_runs_gain_each_run_keeps(logs):
    runs = {"0": logs["SPF"], "1": logs["SPF, noise 1"]}
    lines = gain_table(runs, logs["FCFS"]).splitlines()
    assert [line.split()[0] for line in lines[1:4]] == ["FCFS", "0", "1"]
    fcfs, perfect, noisy = (np.mean(logs[name].ttft) for name in ("FCFS", "SPF", "SPF, noise 1"))
    assert lines[1].split()[1:] == [f"{fcfs:,.2f}", f"{np.percentile(logs['FCFS'].ttft, 50):,.2f}",
                                    f"{np.percentile(logs['FCFS'].ttft, 99):,.2f}", "0%"]
    assert lines[2].split()[-1] == "100%"
    assert lines[3].split()[-1] == f"{(fcfs - noisy) / (fcfs - perfect):.0%}"
    assert lines[-1] == "(TTFT in s; mean gain kept: (FCFS - the run) / (FCFS - the first run), in mean TTFT)"
    assert gain_table({"same": logs["FCFS"]}, logs["FCFS"]).splitlines()[2].split()[-1] == "-"  # no gain to share
    with pytest.raises(ValueError, match="at least one run"):
        gain_table({}, logs["FCFS"])


def test_gain_table_gives_a_range_over_several_runs_of_one_name(logs):
    noisy = [lk.simulate(logs["SPF"].trace, lk.ShortestPredictedFirst(num_slots=2, noise=1.0, seed=seed),
                         step_time=1.0) for seed in (0, 1, 2)]
    lines = gain_table({"0": logs["SPF"], "1": noisy}, logs["FCFS"]).splitlines()
    fcfs, perfect = np.mean(logs["FCFS"].ttft), np.mean(logs["SPF"].ttft)
    means = [np.mean(log.ttft) for log in noisy]
    kept = [(fcfs - mean) / (fcfs - perfect) for mean in means]
    assert len(set(means)) > 1  # the seeds differ, so each cell is a range
    assert lines[3].split()[1] == f"{min(means):,.2f}–{max(means):,.2f}"
    assert lines[3].split()[-1] == f"{min(kept):.0%}–{max(kept):.0%}"
    assert lines[2].split()[1:] == gain_table({"0": [logs["SPF"]]}, logs["FCFS"]).splitlines()[2].split()[1:]
    with pytest.raises(ValueError, match="runs\\['1'\\] = \\[\\]"):
        gain_table({"0": logs["SPF"], "1": []}, logs["FCFS"])


# ttft_waiting -------------------------------------------------------------------------------


def test_ttft_waiting_draws_the_share_still_waiting_at_each_time(logs):
    odd = logs["FCFS"].trace.priorities == 1
    fig = ttft_waiting({"FCFS": logs["FCFS"], "SPF, odd": (logs["SPF"], odd)})
    assert [trace.name for trace in fig.data] == ["FCFS", "SPF, odd"]
    for trace, ttft in zip(fig.data, (logs["FCFS"].ttft, logs["SPF"].ttft[odd])):
        np.testing.assert_allclose(trace.y, WAITING_SHARES)
        np.testing.assert_allclose(trace.x, np.quantile(ttft, 1 - WAITING_SHARES))
        assert trace.x[0] == ttft.min() and trace.x[-1] <= ttft.max()
        assert (np.diff(trace.x) >= 0).all() and (np.diff(trace.y) < 0).all()  # later, fewer still wait
    assert fig.layout.xaxis.type == fig.layout.yaxis.type == "log"


def test_ttft_waiting_refuses_nothing_and_bad_groups(logs):
    with pytest.raises(ValueError, match="at least one run"):
        ttft_waiting({})
    with pytest.raises(ValueError, match="one bool per request"):
        ttft_waiting({"x": (logs["FCFS"], np.ones(3, bool))})


# ttft_by_length -----------------------------------------------------------------------------


def test_length_bins_make_groups_of_equal_size_shortest_first():
    bins = length_bins(LENGTHS, 4)
    for b in range(4):
        assert sorted(LENGTHS[bins == b]) == list(range(5 * b + 1, 5 * b + 6))
    assert length_bins(np.array([3, 3, 3, 3]), 4).tolist() == [0, 0, 0, 0]  # ties make one group
    with pytest.raises(ValueError, match="num_bins = 0"):
        length_bins(LENGTHS, 0)


def test_ttft_by_length_draws_each_groups_mean_ttft(logs):
    fig = ttft_by_length(logs, num_bins=4)
    assert [trace.name for trace in fig.data] == list(logs)
    for trace, log in zip(fig.data, logs.values()):
        assert list(trace.x) == ["1–5", "6–10", "11–15", "16–20"]
        expected = [log.ttft[(LENGTHS >= lo) & (LENGTHS <= lo + 4)].mean() for lo in (1, 6, 11, 16)]
        np.testing.assert_allclose(trace.y, expected)
        assert list(trace.customdata) == [5, 5, 5, 5]
    fcfs, spf = fig.data[0].y, fig.data[1].y
    assert spf[0] < fcfs[0] and spf[-1] > fcfs[-1]  # shortest first: the short wait less, the long pay


def test_ttft_by_length_needs_the_same_requests(logs):
    other = lk.simulate(lk.Trace.from_lengths([1, 2]), lk.Continuous(num_slots=1))
    with pytest.raises(ValueError, match="same requests"):
        ttft_by_length({"a": logs["FCFS"], "b": other})


# noise_sweep --------------------------------------------------------------------------------


def test_noise_sweep_draws_each_statistic_as_a_share_of_the_reference(logs):
    runs = {"0": logs["SPF"], "1": logs["SPF, noise 1"], "FCFS itself": logs["FCFS"]}
    fig = noise_sweep(runs, logs["FCFS"])
    assert [trace.name for trace in fig.data] == ["TTFT mean", "TTFT median", "TTFT p99"]
    for trace, stat in zip(fig.data, ("mean", "p50", "p99")):
        assert list(trace.x) == list(runs)
        base = statistic(logs["FCFS"].ttft, stat)
        np.testing.assert_allclose(trace.y, [statistic(log.ttft, stat) / base for log in runs.values()])
        np.testing.assert_allclose([c[0] for c in trace.customdata], [statistic(log.ttft, stat) for log in runs.values()])
        assert trace.y[-1] == pytest.approx(1.0)  # the reference against itself
    assert fig.layout.yaxis.type == "log"
    assert [shape.y0 for shape in fig.layout.shapes] == [1]
    assert [a.text for a in fig.layout.annotations] == ["FCFS = 1"] and fig.layout.annotations[0].y == 0  # log10(1)
    with pytest.raises(ValueError, match="at least one run"):
        noise_sweep({}, logs["FCFS"])
