"""Traces: construction, sampling, CSV loading and bad input."""

import gzip

import numpy as np
import pytest

import labkit as lk


def test_toy_trace():
    toy = lk.Trace.toy()
    assert toy.output_lengths.tolist() == [2, 6, 3, 8, 2, 4, 5, 2]
    assert toy.prompt_lengths.tolist() == [0] * 8
    assert toy.arrivals.tolist() == [0.0] * 8
    assert toy.labels == tuple("ABCDEFGH")


def test_from_lengths_defaults_and_columns():
    trace = lk.Trace.from_lengths([5, 9, 2], prompt_lengths=[1, 2, 3], arrivals=[0, 0.5, 0.25])
    assert len(trace) == 3
    assert trace.ids.tolist() == [0, 1, 2]
    assert trace.prompt_lengths.tolist() == [1, 2, 3]
    assert trace.arrivals.tolist() == [0, 0.5, 0.25]
    assert trace.output_lengths.dtype == np.int64


def test_select_keeps_ids_and_backlogged_zeroes_arrivals():
    trace = lk.Trace.from_lengths([5, 9, 2, 7, 1, 4], arrivals=[0, 1, 2, 3, 4, 5])
    sub = trace.select([3, 5])
    assert sub.ids.tolist() == [3, 5]
    assert sub.output_lengths.tolist() == [7, 4]
    assert sub.arrivals.tolist() == [3, 5]
    assert sub.backlogged().arrivals.tolist() == [0, 0]
    assert sub.backlogged().ids.tolist() == [3, 5]


def test_capped_cuts_outputs_and_first_that_fit_keeps_the_first_that_fit_in_order():
    trace = lk.Trace.from_lengths([3, 5, 2, 3, 5, 3], prompt_lengths=[4, 9, 2, 8, 1, 3], arrivals=[0, 1, 2, 3, 4, 5])
    assert trace.capped(4).output_lengths.tolist() == [3, 4, 2, 3, 4, 3]
    fitted, left_out = trace.first_that_fit(3, 10)  # sequences 7, 14, 4, 11, 6, 6
    assert fitted.ids.tolist() == [0, 2, 4] and fitted.arrivals.tolist() == [0, 2, 4] and left_out == 2
    assert trace.first_that_fit(2, 10)[1] == 1  # only those before the last one kept count
    assert trace.first_that_fit(4, None)[0].ids.tolist() == [0, 1, 2, 3]  # no limit: the first four
    assert trace.capped(3).first_that_fit(3, 12)[0].ids.tolist() == [0, 1, 2]  # cut first, then fit: 7, 12, 4


def test_prompt_tokens_travel_with_their_requests():
    trace = lk.Trace.from_lengths([3, 4, 5], prompt_tokens=[[5, 6], [], [7, 8, 9]])
    assert trace.prompt_lengths.tolist() == [2, 0, 3]
    assert [p.tolist() for p in trace.select([2, 0]).prompt_tokens] == [[7, 8, 9], [5, 6]]
    assert [p.tolist() for p in trace.backlogged().prompt_tokens] == [[5, 6], [], [7, 8, 9]]
    assert lk.Trace.toy().prompt_tokens == ()


def test_trace_columns_are_read_only():
    trace = lk.Trace.toy()
    with pytest.raises(ValueError):
        trace.output_lengths[0] = 99


@pytest.mark.parametrize("output", ["exponential", "uniform", "equal", "lognormal"])
def test_sample_hits_the_mean(output):
    trace = lk.Trace.sample(50_000, output=output, mean_output=64, seed=1)
    assert trace.output_lengths.min() >= 1
    assert trace.output_lengths.mean() == pytest.approx(64, rel=0.03)


def test_sample_is_seeded_and_equal_is_constant():
    a = lk.Trace.sample(100, seed=7)
    b = lk.Trace.sample(100, seed=7)
    c = lk.Trace.sample(100, seed=8)
    assert a.output_lengths.tolist() == b.output_lengths.tolist()
    assert a.output_lengths.tolist() != c.output_lengths.tolist()
    assert set(lk.Trace.sample(20, output="equal", mean_output=12).output_lengths.tolist()) == {12}


def test_sample_empirical_draws_from_the_source_trace():
    source = lk.Trace.from_lengths([3, 11, 40], prompt_lengths=[5, 6, 7])
    trace = lk.Trace.sample(500, output=source, prompt=source, seed=0)
    assert set(trace.output_lengths.tolist()) == {3, 11, 40}
    assert set(trace.prompt_lengths.tolist()) == {5, 6, 7}


def test_sample_arrivals_poisson_rate():
    trace = lk.Trace.sample(20_000, rate=4.0, seed=3)
    gaps = np.diff(trace.arrivals)
    assert trace.arrivals[0] == 0
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential gaps: CV 1


def test_burstiness_below_one_raises_the_spread_of_gaps():
    bursty = np.diff(lk.Trace.sample(20_000, rate=4.0, burstiness=0.25, seed=3).arrivals)
    assert bursty.mean() == pytest.approx(0.25, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)  # gamma CV = 1/sqrt(shape)


def test_from_csv_reads_the_azure_format(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
    )
    trace = lk.Trace.from_csv(path)
    assert trace.prompt_lengths.tolist() == [374, 396]
    assert trace.output_lengths.tolist() == [44, 109]
    assert trace.arrivals.tolist() == pytest.approx([0.0, 4.314579])


def test_azure_trace_ships_with_the_package():
    trace = lk.Trace.azure_conv()
    assert len(trace) == 19_366
    assert trace.arrivals[0] == 0
    assert int(trace.output_lengths.sum()) == 4_088_665


def test_from_csv_reads_gzip(tmp_path):
    path = tmp_path / "t.csv.gz"
    with gzip.open(path, "wt") as handle:
        handle.write("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,3\n")
    assert lk.Trace.from_csv(path).output_lengths.tolist() == [3]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: lk.Trace.from_lengths([]), "output_lengths is empty"),
        (lambda: lk.Trace.from_lengths([3, 0]), r"output_lengths\[1\] = 0"),
        (lambda: lk.Trace.from_lengths([3, -2]), r"output_lengths\[1\] = -2"),
        (lambda: lk.Trace.from_lengths([3, 2.5]), r"output_lengths\[1\] = 2.5"),
        (lambda: lk.Trace.from_lengths([float("nan")]), r"output_lengths\[0\] = nan"),
        (lambda: lk.Trace.from_lengths(["a", "b"]), "output_lengths must hold numbers"),
        (lambda: lk.Trace.from_lengths([3, 4], prompt_lengths=[1]), "prompt_lengths has 1 entries"),
        (lambda: lk.Trace.from_lengths([3, 4], arrivals=[0, 1, 2]), "arrivals has 3 entries"),
        (lambda: lk.Trace.from_lengths([3, 4], arrivals=[0, -1]), r"arrivals\[1\] = -1"),
        (lambda: lk.Trace.from_lengths([3], prompt_lengths=[-1]), r"prompt_lengths\[0\] = -1"),
        (lambda: lk.Trace.sample(10, output="pareto"), "output = 'pareto'"),
        (lambda: lk.Trace.sample(10, prompt="zipf"), "prompt = 'zipf'"),
        (lambda: lk.Trace.sample(0), "num_requests = 0"),
        (lambda: lk.Trace.sample(10, mean_output=0), "mean_output = 0"),
        (lambda: lk.Trace.sample(10, rate=-1.0), "rate = -1.0"),
        (lambda: lk.Trace.sample(10, rate=1.0, burstiness=0), "burstiness = 0"),
        (lambda: lk.Trace.sample(10, output="lognormal", sigma=0), "sigma = 0"),
        (lambda: lk.Trace.toy().select([8]), r"select\(\[8\]\)"),
        (lambda: lk.Trace.from_lengths([3], prompt_lengths=[2], prompt_tokens=[[1]]), r"prompt_tokens\[0\] has 1 ids"),
        (lambda: lk.Trace.from_lengths([3], prompt_tokens=[[1, -2]]), r"prompt_tokens\[0\]\[1\] = -2"),
        (lambda: lk.Trace.from_lengths([3, 4], prompt_tokens=[[1]]), "prompt_tokens has 1 entries"),
        (lambda: lk.Trace.toy().capped(0), "max_output = 0"),
        (lambda: lk.Trace.toy().first_that_fit(0, 10), "num_requests = 0"),
        (lambda: lk.Trace.toy().first_that_fit(2, 1.5), "max_len = 1.5"),
        (lambda: lk.Trace.toy().first_that_fit(2, 1), r"max_len = 1: no request has prompt \+ output <= 1 tokens "
                                                      r"\(the shortest has 2\)"),
    ],
)
def test_bad_input_names_the_field_and_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "body, message",
    [
        ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,1\n", r"missing column\(s\) \['GeneratedTokens'\]"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,2\nyesterday,1,2\n", "bad row at line 3"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,two\n", "bad row at line 2"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1\n", "bad row at line 2"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,0\n", r"output_lengths\[0\] = 0"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no rows"),
    ],
)
def test_bad_csv_says_which_column_or_row(tmp_path, body, message):
    path = tmp_path / "bad.csv"
    path.write_text(body)
    with pytest.raises(ValueError, match=message):
        lk.Trace.from_csv(path)


# max_output: a cap by rejection


def test_a_cap_no_draw_reaches_leaves_the_trace_as_it_was():
    plain = lk.Trace.sample(200, mean_output=16, mean_prompt=8, rate=2.0, seed=4)
    capped = lk.Trace.sample(200, mean_output=16, mean_prompt=8, rate=2.0, seed=4,
                             max_output=int(plain.output_lengths.max()))
    assert capped.output_lengths.tolist() == plain.output_lengths.tolist()
    assert capped.prompt_lengths.tolist() == plain.prompt_lengths.tolist()
    assert capped.arrivals.tolist() == plain.arrivals.tolist()


def test_a_cap_below_some_draws_redraws_them():
    """Negative control of the comparison above: a cap one below the longest draw changes the trace."""
    plain = lk.Trace.sample(200, mean_output=16, seed=4)
    cap = int(plain.output_lengths.max()) - 1
    capped = lk.Trace.sample(200, mean_output=16, seed=4, max_output=cap)
    assert capped.output_lengths.max() <= cap
    assert capped.output_lengths.tolist() != plain.output_lengths.tolist()
    kept = plain.output_lengths <= cap
    assert capped.output_lengths[kept].tolist() == plain.output_lengths[kept].tolist()  # only the long ones redrawn


def test_a_capped_exponential_is_the_truncated_geometric():
    cap, mean = 32, 128
    plain = lk.Trace.sample(20_000, mean_output=mean, seed=2)
    capped = lk.Trace.sample(20_000, mean_output=mean, seed=2, max_output=cap)
    assert capped.output_lengths.max() == cap and capped.output_lengths.min() >= 1
    assert capped.output_lengths.mean() < plain.output_lengths.mean()
    # rejection keeps the shape below the cap: P(k) ∝ (1 - p)^(k - 1) for k <= cap
    k = np.arange(1, cap + 1)
    weights = (1 - 1 / mean) ** (k - 1)
    assert capped.output_lengths.mean() == pytest.approx((k * weights).sum() / weights.sum(), rel=0.02)
    counts = np.bincount(capped.output_lengths, minlength=cap + 1)[1:]
    np.testing.assert_allclose(counts / counts.sum(), weights / weights.sum(), atol=0.005)


@pytest.mark.parametrize("output", ["exponential", "uniform", "lognormal"])
def test_every_capped_output_is_at_most_the_cap(output):
    trace = lk.Trace.sample(2_000, output=output, mean_output=40, seed=3, max_output=np.int64(25))
    assert 1 <= trace.output_lengths.min() and trace.output_lengths.max() <= 25


def test_an_empirical_source_can_be_capped():
    source = lk.Trace.from_lengths([3, 11, 40])
    assert set(lk.Trace.sample(300, output=source, max_output=11, seed=0).output_lengths.tolist()) == {3, 11}


@pytest.mark.parametrize("cap", [0, -1, 2.5, True, "8"])
def test_a_bad_cap_is_named(cap):
    with pytest.raises(ValueError, match=f"max_output = {cap!r}: must be a whole number >= 1"):
        lk.Trace.sample(10, max_output=cap)


def test_a_cap_nothing_can_meet_fails_rather_than_hangs():
    with pytest.raises(ValueError, match="max_output = 10: after .* rounds of redrawing, 5 outputs of 5"):
        lk.Trace.sample(5, output="equal", mean_output=50, max_output=10)
