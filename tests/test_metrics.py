"""Serving metrics derived from a StepLog."""

import numpy as np
import pytest

import labkit as lk
from labkit import metrics


@pytest.fixture(scope="module")
def toy_continuous():
    return lk.simulate(lk.Trace.toy(), lk.Continuous(num_slots=2), step_time=1.0)


def test_token_times_group_tokens_by_request(toy_continuous):
    ids, times = metrics.token_times(toy_continuous)
    assert ids.tolist() == sorted(np.repeat(np.arange(8), [2, 6, 3, 8, 2, 4, 5, 2]).tolist())
    assert times[ids == 3].tolist() == [6, 7, 8, 9, 10, 11, 12, 13]  # D runs steps 5..12


def test_itl_pools_every_gap_within_a_request(toy_continuous):
    gaps = metrics.itl(toy_continuous)
    assert len(gaps) == 32 - 8
    assert set(gaps.tolist()) == {1.0}


def test_itl_includes_idle_time_inside_a_request_but_not_across_requests():
    trace = lk.Trace.from_lengths([2, 2], arrivals=[0, 10])
    log = lk.simulate(trace, lk.Continuous(num_slots=1), step_time=1.0)
    assert metrics.itl(log).tolist() == [1.0, 1.0]


def test_tpot_is_decode_time_per_token():
    log = lk.simulate(lk.Trace.from_lengths([1, 3, 5]), lk.Static(num_slots=3), step_time=0.5)
    assert metrics.tpot(log).tolist() == [0.5, 0.5]  # the 1-token request has no decode gap


def test_summary_and_table(toy_continuous):
    row = metrics.summary(toy_continuous)
    assert (row["steps"], row["tokens"], row["wasted slot-steps"]) == (17, 32, 2)
    assert row["utilization (%)"] == pytest.approx(100 * 32 / 34)
    assert row["mean wait (s)"] == pytest.approx(np.mean([0, 0, 2, 5, 6, 8, 12, 13]))
    text = metrics.table({"continuous": toy_continuous})
    assert text.splitlines()[1].split() == ["steps", "17"]
    assert "94.118" in text


def test_latency_table_has_one_row_per_run_with_the_summary_s_numbers():
    toy = lk.Trace.toy()
    logs = {policy: lk.simulate(toy, cls(num_slots=2), step_time=0.01)
            for policy, cls in (("continuous", lk.Continuous), ("static", lk.Static))}
    # continuous: TTFT [1, 1, 3, 6, 7, 9, 13, 14] steps, every gap one 10 ms step, 32 tokens in 17 steps
    assert metrics.latency_table(logs, label="policy").splitlines() == [
        "policy      TTFT p50 (s)  TTFT p99 (s)  ITL p50 (ms)  ITL p99 (ms)  TPOT mean (ms)  tokens/s",
        "continuous         0.065         0.139          10.0          10.0            10.0       188",
        "static             0.110         0.190          10.0          10.0            10.0       139",
    ]


def test_latency_table_of_no_runs_says_so():
    with pytest.raises(ValueError, match=r"logs = \{\}"):
        metrics.latency_table({})


def test_goodput_counts_requests_that_meet_every_slo(toy_continuous):
    # step_time 1: TTFT [1, 1, 3, 6, 7, 9, 13, 14], latency [2, 6, 5, 13, 8, 12, 17, 15], TPOT 1 each
    assert metrics.meets_slos(toy_continuous, ttft=6).tolist() == [True] * 4 + [False] * 4
    assert metrics.meets_slos(toy_continuous, ttft=6, e2e=5).tolist() == [True, False, True] + [False] * 5
    assert metrics.meets_slos(toy_continuous, tpot=0.5).sum() == 0
    assert metrics.goodput(toy_continuous, ttft=6) == 4 / 17
    assert metrics.goodput(toy_continuous) == 8 / 17


# Logs that are not StepLogs: a replay's ----------------------------------------------------------


@pytest.fixture(scope="module")
def replayed():
    """A replay log by hand: request 0 streams at 0.5 and 0.75 s, request 1 at 0.25, 0.5 and 1.5 s,
    request 2 (arriving at 1 s) fails."""
    from labkit.serve.replay import ReplayLog, ScrapedSeries

    trace = lk.Trace.from_lengths([2, 3, 1], arrivals=[0, 0, 1])
    tokens_at = [np.array([0.5, 0.75]), np.array([0.25, 0.5, 1.5]), np.array([])]
    return ReplayLog(trace, "http://h", np.array([0.0, 0.0, 1.0]), tokens_at, {0: [4, 5], 1: [6, 7, 8]},
                     [(2, "http://h: request 2: HTTP 500: boom")], ScrapedSeries.from_samples([]))


def test_a_log_s_own_token_times_are_used_and_a_failed_request_s_are_not(replayed):
    ids, times = metrics.token_times(replayed)
    assert ids.tolist() == [0, 0, 1, 1, 1] and times.tolist() == [0.5, 0.75, 0.25, 0.5, 1.5]
    assert metrics.itl(replayed).tolist() == [0.25, 0.25, 1.0]
    assert metrics.tpot(replayed).tolist() == [0.25, 0.625]  # (0.75 - 0.5) / 1, (1.5 - 0.25) / 2


def test_percentile_skips_nan_where_numpy_would_return_it():
    values = np.array([1.0, np.nan, 3.0])
    assert np.isnan(np.percentile(values, 50))  # why the skip is explicit
    assert metrics.percentile(values, 50) == 2.0
    assert np.isnan(metrics.percentile(np.array([np.nan]), 50)) and np.isnan(metrics.percentile([], 50))


def test_a_failed_request_meets_no_slo(replayed):
    assert metrics.meets_slos(replayed).tolist() == [True, True, False]
    assert metrics.meets_slos(replayed, ttft=0.3).tolist() == [False, True, False]
    assert metrics.goodput(replayed, ttft=0.3) == 1 / 1.5  # 1.5 s from the first send to the last token


def test_summary_of_a_replay_has_no_step_fields_and_counts_failures(replayed):
    assert metrics.summary(replayed) == {
        "tokens": 5, "tokens/s": 5 / 1.5, "TTFT p50 (s)": 0.375, "TTFT p99 (s)": pytest.approx(0.25 + 0.99 * 0.25),
        "ITL p50 (ms)": 250.0, "ITL p99 (ms)": pytest.approx(250 + 0.98 * 750), "TPOT mean (ms)": 437.5,
        "latency p50 (s)": 1.125, "latency p99 (s)": pytest.approx(0.75 + 0.99 * 0.75), "failed requests": 1,
    }


def test_table_puts_a_dash_where_a_run_has_no_value_and_keeps_the_steplog_s_order(replayed):
    simulated = lk.simulate(replayed.trace, lk.Continuous(num_slots=2), step_time=0.25)
    expected = [
        "                    replay      sim",
        "steps                    -        4",
        "tokens                   5        6",
        "utilization (%)          -   75.000",
        "wasted slot-steps        -        2",
        "tokens/step              -    1.500",
        "tokens/s             3.333    4.800",
        "mean wait (s)            -    0.000",
        "p99 wait (s)             -    0.000",
        "TTFT p50 (s)         0.375    0.250",
        "TTFT p99 (s)         0.497    0.250",
        "ITL p50 (ms)       250.000  250.000",
        "ITL p99 (ms)       985.000  250.000",
        "TPOT mean (ms)     437.500  250.000",
        "latency p50 (s)      1.125    0.500",
        "latency p99 (s)      1.492    0.745",
        "failed requests          1        -",
    ]
    assert metrics.table({"replay": replayed, "sim": simulated}).splitlines() == expected
    swapped = metrics.table({"sim": simulated, "replay": replayed}).splitlines()
    assert [line.split("  ")[0] for line in swapped] == [line.split("  ")[0] for line in expected]
