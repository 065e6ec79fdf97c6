"""CostModel: step time from the work in a step, and fitting it to measured steps."""

import dataclasses
import json
import math
from pathlib import Path
from dataclasses import fields, replace
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import labkit as lk
from labkit.analysis.cost_fit import CostFit, CostModel
from labkit.sched import cost as sched_cost

TRUTH = CostModel(overhead=2e-3, per_prefill_token=1e-4, per_decode_token=3e-4, per_kv_token=2e-7)


def synthetic_steps(num_steps=120, seed=0, prefill=True):
    """(prefill, decode, kv) token counts of plausible steps: prefill in about a third."""
    rng = np.random.default_rng(seed)
    has_prefill = rng.random(num_steps) < 0.3 if prefill else np.zeros(num_steps, bool)
    num_prefill = rng.integers(1, 256, num_steps) * has_prefill
    num_decode = rng.integers(1, 9, num_steps)
    num_kv = rng.integers(0, 4000, num_steps)
    return num_prefill, num_decode, num_kv


def coefficients(model):
    return [model.overhead, model.per_prefill_token, model.per_decode_token, model.per_kv_token]


# step_seconds


def test_step_seconds_on_hand_numbers():
    model = CostModel(overhead=1.0, per_prefill_token=0.5, per_decode_token=0.25, per_kv_token=0.125)
    assert model.step_seconds(4, 2, 8) == 1.0 + 2.0 + 0.5 + 1.0
    assert model.step_seconds(0, 0, 0) == 1.0
    assert isinstance(model.step_seconds(4, 2, 8), float)


def test_step_seconds_is_vectorised():
    model = CostModel(overhead=1.0, per_prefill_token=0.5, per_decode_token=0.25, per_kv_token=0.125)
    seconds = model.step_seconds(np.array([4, 0, 2]), np.array([2, 4, 0]), np.array([8, 0, 16]))
    assert seconds.shape == (3,)
    assert seconds.tolist() == [4.5, 2.0, 4.0]


def test_default_model_prices_a_decode_step_in_milliseconds():
    assert 1e-3 < CostModel().step_seconds(0, 4, 1000) < 0.1


# validation


@pytest.mark.parametrize("field", ["overhead", "per_prefill_token", "per_decode_token", "per_kv_token"])
@pytest.mark.parametrize("value", [-1e-4, math.nan, math.inf, "0.1", True])
def test_bad_coefficient_is_named(field, value):
    with pytest.raises(ValueError, match=field):
        CostModel(**{field: value})


def test_zero_coefficients_are_allowed():
    assert CostModel(0, 0, 0, 0).step_seconds(10, 10, 10) == 0.0


def test_fit_rejects_mismatched_lengths():
    prefill, decode, kv = synthetic_steps(20)
    with pytest.raises(ValueError, match="differ in length"):
        CostModel.fit_arrays(prefill, decode[:-1], kv, TRUTH.step_seconds(prefill, decode, kv))


def test_fit_rejects_too_few_steps():
    prefill, decode, kv = synthetic_steps(7)
    with pytest.raises(ValueError, match="at least 8"):
        CostModel.fit_arrays(prefill, decode, kv, TRUTH.step_seconds(prefill, decode, kv))


def test_fit_names_the_array_with_nan():
    prefill, decode, kv = synthetic_steps(20)
    seconds = TRUTH.step_seconds(prefill, decode, kv)
    seconds[3] = np.nan
    with pytest.raises(ValueError, match="seconds has NaN"):
        CostModel.fit_arrays(prefill, decode, kv, seconds)


def test_fit_names_the_array_with_negative_values():
    prefill, decode, kv = synthetic_steps(20)
    seconds = TRUTH.step_seconds(prefill, decode, kv)
    with pytest.raises(ValueError, match="num_kv_tokens has negative"):
        CostModel.fit_arrays(prefill, decode, -kv - 1, seconds)


@pytest.mark.parametrize("holdout", [0.0, 1.0, 0.9])
def test_fit_rejects_a_holdout_that_leaves_nothing_to_train_or_test(holdout):
    prefill, decode, kv = synthetic_steps(10)
    with pytest.raises(ValueError, match="holdout"):
        CostModel.fit_arrays(prefill, decode, kv, TRUTH.step_seconds(prefill, decode, kv), holdout=holdout)


# fitting


def test_fit_recovers_known_coefficients_from_noiseless_steps():
    prefill, decode, kv = synthetic_steps()
    fit = CostModel.fit_arrays(prefill, decode, kv, TRUTH.step_seconds(prefill, decode, kv))
    np.testing.assert_allclose(coefficients(fit.model), coefficients(TRUTH), rtol=1e-9)
    assert (fit.num_train, fit.num_test) == (90, 30)
    assert fit.mean_abs_error < 1e-12
    assert fit.relative_error < 1e-9
    assert fit.r2 == pytest.approx(1.0)


def test_fit_recovers_known_coefficients_closely_from_noisy_steps():
    prefill, decode, kv = synthetic_steps(2000)
    noise = np.random.default_rng(1).normal(0, 2e-4, len(kv))
    fit = CostModel.fit_arrays(prefill, decode, kv, TRUTH.step_seconds(prefill, decode, kv) + noise)
    np.testing.assert_allclose(coefficients(fit.model), coefficients(TRUTH), rtol=0.1)
    assert fit.relative_error < 0.1
    assert fit.r2 > 0.95


def test_fit_keeps_coefficients_nonnegative_where_plain_least_squares_goes_negative():
    truth = CostModel(overhead=2e-3, per_prefill_token=1e-4, per_decode_token=0.0, per_kv_token=3e-7)
    prefill, decode, kv = synthetic_steps(40, seed=3)
    seconds = truth.step_seconds(prefill, decode, kv) + np.random.default_rng(3).normal(0, 5e-4, 40)
    plain, *_ = np.linalg.lstsq(np.column_stack([np.ones(40), prefill, decode, kv]), seconds, rcond=None)
    assert plain[2] < 0  # the data really tempt an unconstrained fit below zero
    fit = CostModel.fit_arrays(prefill, decode, kv, seconds)
    assert min(coefficients(fit.model)) >= 0
    assert fit.model.per_decode_token == 0.0
    assert fit.model.per_prefill_token == pytest.approx(1e-4, rel=0.2)


def test_fit_gives_an_all_zero_column_a_zero_coefficient():
    prefill, decode, kv = synthetic_steps(prefill=False)
    fit = CostModel.fit_arrays(prefill, decode, kv, TRUTH.step_seconds(prefill, decode, kv))
    assert fit.model.per_prefill_token == 0.0
    np.testing.assert_allclose(coefficients(fit.model)[2:], coefficients(TRUTH)[2:], rtol=1e-9)
    assert fit.mean_abs_error < 1e-12


def test_fit_split_is_seeded():
    prefill, decode, kv = synthetic_steps(60)
    seconds = TRUTH.step_seconds(prefill, decode, kv) + np.random.default_rng(2).normal(0, 2e-4, 60)
    assert CostModel.fit_arrays(prefill, decode, kv, seconds, seed=5) == CostModel.fit_arrays(
        prefill, decode, kv, seconds, seed=5
    )
    assert CostModel.fit_arrays(prefill, decode, kv, seconds, seed=5) != CostModel.fit_arrays(
        prefill, decode, kv, seconds, seed=6
    )


def test_fit_reads_a_step_log():
    prefill, decode, kv = synthetic_steps(40)
    log = SimpleNamespace(
        num_steps=40, has_host_time=False, num_prefill_tokens=prefill, num_decode_tokens=decode, num_kv_tokens=kv,
        step_seconds=TRUTH.step_seconds(prefill, decode, kv),
    )
    fit = CostModel.fit(log, holdout=0.5, seed=1)
    assert isinstance(fit, CostFit)
    assert (fit.num_train, fit.num_test) == (20, 20)
    np.testing.assert_allclose(coefficients(fit.model), coefficients(TRUTH), rtol=1e-9)


def test_fit_summary_states_the_held_out_error():
    prefill, decode, kv = synthetic_steps(2000)
    noise = np.random.default_rng(1).normal(0, 2e-4, len(kv))
    fit = CostModel.fit_arrays(prefill, decode, kv, TRUTH.step_seconds(prefill, decode, kv) + noise)
    summary = str(fit)
    assert summary.startswith("CostModel fit on 1500 steps, held-out error ")
    assert f"{fit.relative_error:.1%}" in summary
    assert "MAE" in summary and "R²" in summary


# The cost model inside the simulator ------------------------------------------------------


KNOWN = CostModel(overhead=2e-3, per_prefill_token=5e-5, per_decode_token=4e-4, per_kv_token=1e-6)
ARRIVING = lk.Trace.sample(60, output="exponential", mean_output=12, mean_prompt=30, rate=40.0, seed=5)
BUDGETED = lk.Continuous(num_slots=6, num_blocks=40, block_size=8, max_tokens_per_step=48, chunked_prefill=True)


def test_simulated_steps_last_what_the_cost_model_says_for_their_work():
    log = lk.simulate(ARRIVING, BUDGETED, cost=KNOWN)
    predicted = KNOWN.step_seconds(log.num_prefill_tokens, log.num_decode_tokens, log.num_kv_tokens)
    np.testing.assert_allclose(log.step_seconds, predicted)
    processed = (log.num_prefill_tokens + log.num_decode_tokens).sum()
    assert processed == (ARRIVING.prompt_lengths + ARRIVING.output_lengths).sum() + log.recomputed_tokens


def test_cost_model_runs_give_the_same_log_step_by_step():
    jumped = lk.simulate(ARRIVING, lk.Continuous(num_slots=6), cost=KNOWN)
    stepped = lk.simulate(ARRIVING, lk.Continuous(num_slots=6), cost=KNOWN, on_step=lambda log: None)
    assert jumped.slots.tolist() == stepped.slots.tolist()
    np.testing.assert_allclose(jumped.step_start, stepped.step_start)


def test_fit_recovers_the_model_that_timed_a_simulation():
    fit = CostModel.fit(lk.simulate(ARRIVING, BUDGETED, cost=KNOWN))
    for name in ("overhead", "per_prefill_token", "per_decode_token", "per_kv_token"):
        assert getattr(fit.model, name) == pytest.approx(getattr(KNOWN, name), rel=1e-6)
    assert fit.relative_error < 1e-9


def test_fixed_step_logs_have_no_kv_reads_to_fit():
    with pytest.raises(ValueError, match="this log has no KV reads"):
        CostModel.fit(lk.simulate(ARRIVING, lk.Continuous(num_slots=6)))


def test_the_fittable_model_prices_a_simulation_as_sched_s_own_does():
    priced = sched_cost.StepPrice(**dataclasses.asdict(KNOWN))
    assert isinstance(KNOWN, sched_cost.StepPrice) and lk.CostModel is CostModel
    np.testing.assert_array_equal(lk.simulate(ARRIVING, BUDGETED, cost=KNOWN).step_seconds,
                                  lk.simulate(ARRIVING, BUDGETED, cost=priced).step_seconds)
    assert type(CostModel.fit(lk.simulate(ARRIVING, BUDGETED, cost=priced)).model) is CostModel


def test_simulate_refuses_a_cost_that_is_not_a_cost_model():
    with pytest.raises(ValueError, match="cost = 0.01: must be a labkit.CostModel"):
        lk.simulate(ARRIVING, BUDGETED, cost=0.01)


@settings(max_examples=200, deadline=None)
@given(
    num_requests=st.integers(1, 64),
    first_num_kv_tokens=st.integers(0, 10_000),
    seconds=st.floats(-1.0, 50.0),
    max_steps=st.integers(1, 400),
)
def test_a_decode_run_in_closed_form_matches_its_steps_summed(num_requests, first_num_kv_tokens, seconds, max_steps):
    per_step = KNOWN.decode_run_seconds(num_requests, first_num_kv_tokens, max_steps)
    assert KNOWN.decode_run_total(num_requests, first_num_kv_tokens, max_steps) == pytest.approx(per_step.sum())
    elapsed = np.cumsum(per_step)
    expected = min(max_steps, int(np.searchsorted(elapsed, seconds)) + 1)  # the step during which they pass
    assert KNOWN.decode_run_length(num_requests, first_num_kv_tokens, seconds, max_steps) == expected


# Host time, and overlap ------------------------------------------------------------------

HOSTED = CostModel(overhead=1e-3, per_prefill_token=5e-5, per_decode_token=2e-4, per_kv_token=1e-6,
                   host_overhead=5e-4, host_per_request=1e-4, host_per_token=2e-6)
OVERLAPPED = replace(HOSTED, overlap=True, overlap_exposed=1e-4)


def test_host_and_device_take_turns_or_overlap_on_hand_numbers():
    model = CostModel(overhead=5.0, per_prefill_token=0, per_decode_token=0, per_kv_token=0,
                      host_overhead=1.0, host_per_request=0.5, host_per_token=0.25)
    assert model.host_seconds(2, 4) == 1.0 + 1.0 + 1.0
    assert model.step_seconds(0, 4, 0, num_requests=2) == 3.0 + 5.0
    assert replace(model, overlap=True).step_seconds(0, 4, 0, num_requests=2) == 5.0
    assert replace(model, overlap=True, overlap_exposed=0.5, overhead=1.0).step_seconds(0, 4, 0, 2) == 3.5


def test_two_ms_of_host_and_five_of_device_make_a_seven_ms_step_or_a_five_ms_one():
    model = CostModel(overhead=5e-3, per_prefill_token=0, per_decode_token=0, per_kv_token=0, host_overhead=2e-3)
    assert model.step_seconds(0, 8, 0) == pytest.approx(7e-3)
    assert replace(model, overlap=True).step_seconds(0, 8, 0) == pytest.approx(5e-3)


def test_a_roofline_takes_the_larger_of_memory_and_arithmetic_on_hand_numbers():
    model = CostModel(overhead=4.0, per_prefill_token=0.5, per_decode_token=1.0, per_kv_token=0.25, roofline=True)
    assert model.step_seconds(0, 2, 4) == 5.0  # memory 4 + 1 beats arithmetic 2
    assert model.step_seconds(4, 3, 4) == 5.0  # arithmetic 2 + 3 ties memory 5
    assert model.step_seconds(6, 3, 0) == 6.0  # arithmetic 3 + 3 beats memory 4
    assert replace(model, roofline=False).step_seconds(0, 2, 4) == 7.0  # added
    np.testing.assert_allclose(model.device_seconds([0, 6], [2, 3], [4, 0]), [5.0, 6.0])


def test_roofline_must_be_true_or_false():
    with pytest.raises(ValueError, match="roofline = 'yes': must be True or False"):
        CostModel(roofline="yes")


def test_a_price_per_request_needs_the_requests():
    with pytest.raises(ValueError, match="num_requests = None: host_per_request is set"):
        HOSTED.step_seconds(0, 4, 100)


def test_the_repr_shows_host_terms_only_when_set():
    assert repr(CostModel()) == "CostModel(overhead=0.003, per_prefill_token=0.0001, per_decode_token=0.0003, per_kv_token=2e-07)"
    assert repr(sched_cost.StepPrice()).startswith("StepPrice(overhead=0.003, ")  # each class by its own name
    assert "host_per_request=0.0001" in repr(HOSTED) and "overlap" not in repr(HOSTED)
    assert "overlap=True" in repr(OVERLAPPED)


@pytest.mark.parametrize("field", ["host_overhead", "host_per_request", "host_per_token", "overlap_exposed"])
def test_bad_host_term_is_named(field):
    with pytest.raises(ValueError, match=field):
        CostModel(**{field: -1.0})


def test_overlap_must_be_true_or_false():
    with pytest.raises(ValueError, match="overlap = 1: must be True or False"):
        CostModel(overlap=1)


@settings(max_examples=200, deadline=None)
@given(
    model=st.sampled_from([HOSTED, OVERLAPPED, replace(OVERLAPPED, host_overhead=0.05), replace(KNOWN, overlap=True),
                           replace(KNOWN, roofline=True), replace(HOSTED, roofline=True),
                           replace(OVERLAPPED, roofline=True), replace(OVERLAPPED, roofline=True, host_overhead=0.05)]),
    num_requests=st.integers(1, 1024),
    first_num_kv_tokens=st.integers(0, 100_000),
    seconds=st.floats(-1.0, 50.0),
    max_steps=st.integers(1, 400),
)
def test_a_decode_run_with_host_terms_in_closed_form_matches_its_steps(model, num_requests, first_num_kv_tokens,
                                                                        seconds, max_steps):
    per_step = model.decode_run_seconds(num_requests, first_num_kv_tokens, max_steps)
    kv = first_num_kv_tokens + num_requests * np.arange(max_steps)
    np.testing.assert_allclose(per_step, model.step_seconds(0, num_requests, kv, num_requests))
    assert model.decode_run_total(num_requests, first_num_kv_tokens, max_steps) == pytest.approx(per_step.sum())
    expected = min(max_steps, int(np.searchsorted(np.cumsum(per_step), seconds)) + 1)
    assert model.decode_run_length(num_requests, first_num_kv_tokens, seconds, max_steps) == expected


@pytest.mark.parametrize("model", [HOSTED, OVERLAPPED], ids=["turns", "overlap"])
def test_a_simulation_splits_steps_as_its_cost_model_prices_them(model):
    log = lk.simulate(ARRIVING, BUDGETED, cost=model)
    assert log.has_host_time and log.overlap == model.overlap
    work = (log.num_prefill_tokens, log.num_decode_tokens, log.num_kv_tokens)
    np.testing.assert_allclose(log.host_seconds, model.host_seconds(log.num_rows, work[0] + work[1]))
    np.testing.assert_allclose(log.device_seconds, model.device_seconds(*work))
    np.testing.assert_allclose(log.step_seconds, model.step_seconds(*work, log.num_rows))
    idle = 1 - log.device_seconds.sum() / log.step_seconds.sum()
    assert log.device_idle_fraction == pytest.approx(idle) and 0 < idle < 1


@pytest.mark.parametrize("model", [HOSTED, OVERLAPPED], ids=["turns", "overlap"])
def test_fit_recovers_host_and_device_terms(model):
    fit = CostModel.fit(lk.simulate(ARRIVING, BUDGETED, cost=model))
    for field in fields(CostModel):
        assert getattr(fit.model, field.name) == pytest.approx(getattr(model, field.name), rel=1e-6, abs=1e-12)
    assert fit.relative_error < 1e-9


def test_fitting_host_terms_can_fail():
    """Negative control: the same steps, priced with host time per request doubled, are not the fit's."""
    fit = CostModel.fit(lk.simulate(ARRIVING, BUDGETED, cost=HOSTED))
    doubled = lk.simulate(ARRIVING, BUDGETED, cost=replace(HOSTED, host_per_request=2e-4))
    predicted = fit.model.step_seconds(doubled.num_prefill_tokens, doubled.num_decode_tokens, doubled.num_kv_tokens,
                                       doubled.num_rows)
    assert np.abs(predicted - doubled.step_seconds).mean() / doubled.step_seconds.mean() > 0.05


def test_a_log_without_host_time_says_so():
    log = lk.simulate(ARRIVING, lk.Continuous(num_slots=6))
    assert not log.has_host_time
    with pytest.raises(ValueError, match="this log has no host and device time"):
        log.host_seconds


def test_str_gives_readable_units():
    assert str(CostModel()) == ("CostModel: device 3 ms/step + 100 µs/prompt token + 300 µs/decode token "
                                "+ 0.2 µs/KV token read")
    lines = str(OVERLAPPED).splitlines()
    assert lines[1].strip() == "host 500 µs/step + 100 µs/request + 2 µs/token;"
    assert lines[2].strip() == "overlapped: max(host, device) + 100 µs"


# scaled: the same work on a slower implementation


@pytest.mark.parametrize("model", [TRUTH, HOSTED, OVERLAPPED], ids=["device", "turns", "overlap"])
@pytest.mark.parametrize("factor", [0.5, 2, 3.0])
def test_scaled_multiplies_every_coefficient(model, factor):
    scaled = model.scaled(factor)
    assert isinstance(scaled, CostModel)
    for field in fields(CostModel):
        if field.name == "overlap":
            assert scaled.overlap is model.overlap
        else:
            assert getattr(scaled, field.name) == getattr(model, field.name) * factor
    assert model.scaled(1) == model


@pytest.mark.parametrize("model", [TRUTH, HOSTED, OVERLAPPED], ids=["device", "turns", "overlap"])
def test_scaled_steps_take_factor_times_as_long(model):
    prefill, decode, kv = synthetic_steps(50, seed=4)
    requests = decode + (prefill > 0)
    seconds = model.step_seconds(prefill, decode, kv, requests)
    # a power of two scales every sum and max without rounding
    assert model.scaled(4).step_seconds(prefill, decode, kv, requests).tolist() == (4 * seconds).tolist()
    np.testing.assert_allclose(model.scaled(3).step_seconds(prefill, decode, kv, requests), 3 * seconds, rtol=1e-12)
    # a backlog runs the same steps, each four times as long
    base = lk.simulate(ARRIVING.backlogged(), BUDGETED, cost=model)
    slow = lk.simulate(ARRIVING.backlogged(), BUDGETED, cost=model.scaled(4))
    assert slow.slots.tolist() == base.slots.tolist()
    assert slow.step_seconds.tolist() == (4 * base.step_seconds).tolist()
    assert slow.duration == 4 * base.duration


def test_scaling_changes_the_price():
    """Negative control: a scaled model is not the model it came from."""
    assert TRUTH.scaled(3) != TRUTH
    assert TRUTH.scaled(3).step_seconds(0, 4, 100) != TRUTH.step_seconds(0, 4, 100)


@pytest.mark.parametrize("factor", [0, -1, math.nan, math.inf, True, "2"])
def test_a_bad_factor_is_named(factor):
    with pytest.raises(ValueError, match=r"factor = .*must be a number > 0"):
        TRUTH.scaled(factor)


def test_a_saved_model_loads_as_it_was(tmp_path):
    model = lk.CostModel(overhead=1e-3, per_kv_token=2e-6, host_per_request=3e-5)
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"model": dataclasses.asdict(model), "fit": "anything else is ignored"}))
    assert lk.CostModel.load(path) == model


def test_loading_names_a_coefficient_it_does_not_know(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"model": {"overhead": 1e-3, "per_token": 2e-4}}))
    with pytest.raises(ValueError, match="must map coefficient names"):
        lk.CostModel.load(path)


def test_the_engine_price_the_lessons_load_is_a_cost_model():
    model = lk.CostModel.load(Path(__file__).parents[1] / "benchmarks" / "results" / "engine-cost.json")
    assert model.per_decode_token > 0 and model.per_kv_token > 0
