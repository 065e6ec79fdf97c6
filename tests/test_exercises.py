"""Exercises: right answers pass, typical mistakes get their own hint, stubs read as not
attempted, and no answer, however odd, makes a check raise. Expected values come from
the library; the write-a-policy grader is checked with the reference and negative controls,
in the simulator and on the engine."""

import math
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import labkit as lk
from labkit.exercises import PolicyError, as_policy, q1, q2, q3, q4, q5, q6
from labkit.exercises.feedback import CORRECT, INCORRECT, NOT_ATTEMPTED, WIDTH, Verdict, wrap
from labkit.exercises.policy_question import admit_newest_first, grading_cases, refill_a_step_late
from labkit.sched.policy import Continuous
from labkit.exercises.predict import IterationCounts

QUESTIONS = [q1, q2, q3, q4, q5, q6]


def reference_refill(state):
    finished = state.finished_in_slots()
    admit = state.waiting_head(state.num_free_slots() + len(finished))
    return lk.Decision(release=tuple(r.id for r in finished), admit=tuple(r.id for r in admit))


def refill_stub(state):
    """A student's cell before they write the body."""


def never_releases(state):
    return lk.Decision(admit=tuple(r.id for r in state.waiting_head(state.num_free_slots())))


def one_at_a_time(state):
    """Negative control for the generic diagnosis: admits at most one request per decision."""
    finished = state.finished_in_slots()
    admit = state.waiting_head(min(1, state.num_free_slots() + len(finished)))
    return lk.Decision(release=tuple(r.id for r in finished), admit=tuple(r.id for r in admit))


def _steps(trace, policy):
    return lk.simulate(trace, policy).num_steps


# Expected answers, from the library


def test_the_toy_counts_are_lesson_01s():
    assert IterationCounts(lengths=tuple(lk.Trace.toy().output_lengths), num_slots=2).expected() == (23, 17)


def test_q1_expects_what_the_simulator_counts():
    trace = lk.Trace.from_lengths(q1.lengths)
    assert q1.expected() == (_steps(trace, lk.Static(num_slots=3)), _steps(trace, lk.Continuous(num_slots=3)))
    assert q1.expected() == (18, 12)


def test_q2_expects_one_over_h16():
    assert q2.expected() == pytest.approx(1 / sum(1 / k for k in range(1, 17)))


def test_q3_expects_the_trace_whose_simulated_gain_is_larger():
    gains = q3.gains()
    for name, trace in q3.traces.items():
        assert gains[name] == _steps(trace, lk.Static(num_slots=8)) / _steps(trace, lk.Continuous(num_slots=8))
    assert gains["Q"] > gains["P"]


def test_q3s_counterexample_has_more_std_over_mean_than_p_and_gains_less():
    lengths = q3.counterexample.output_lengths
    rng = np.random.default_rng(0)
    assert np.array_equal(lengths, np.where(rng.random(300) < 0.7, 191, 1))
    p = q3.traces["P"].output_lengths
    assert lengths.std() / lengths.mean() > p.std() / p.mean()
    trace = lk.Trace.from_lengths(lengths)
    gain = _steps(trace, lk.Static(num_slots=8)) / _steps(trace, lk.Continuous(num_slots=8))
    assert gain < q3.gains()["P"] and round(gain, 2) == 1.58
    # E[max of 8] / E[L] from the two values: all 8 are 1 with probability (share of 1s)^8, else the longest is 191
    ones = np.mean(lengths == 1)
    ideal = (191 * (1 - ones**8) + ones**8) / lengths.mean()
    assert lk.theory.ideal_gain(lengths, 8) == pytest.approx(ideal)


def test_q3s_feedback_on_the_longest_request_holds_doubling_every_length_keeps_the_gain():
    def steps(lengths):
        trace = lk.Trace.from_lengths(lengths)
        return _steps(trace, lk.Static(num_slots=8)), _steps(trace, lk.Continuous(num_slots=8))

    once, doubled = steps(q3.traces["Q"].output_lengths), steps(2 * q3.traces["Q"].output_lengths)
    assert doubled == (2 * once[0], 2 * once[1])


def test_q3_offers_a_wrong_reason_for_each_trace():
    """Not answerable by elimination: reasons 3 and 4 hold for Q, the winner, and are not why."""
    p, q = (q3.traces[name].output_lengths for name in "PQ")
    assert q.max() < p.max()  # reason 3: Q's longest is shorter
    assert q.std() / q.mean() > p.std() / p.mean()  # reason 4: Q's std / mean is larger
    assert "longer tail" in q3.reasons[5] and len(q3.reasons) == 6


def test_q4_expects_the_smallest_pool_without_preemption():
    smallest = q4.expected()
    assert lk.simulate(q4.trace, q4.policy(smallest)).num_preemptions == 0
    assert lk.simulate(q4.trace, q4.policy(smallest - 1)).num_preemptions > 0
    for num_blocks in range(q4.fewest_that_fit(), smallest):
        assert q4.num_preemptions(num_blocks) > 0
    with pytest.raises(ValueError, match="more than the whole pool"):
        lk.simulate(q4.trace, q4.policy(q4.fewest_that_fit() - 1))


def test_q5_expects_the_fastest_budget_within_the_itl_target():
    def measured(budget):
        log = lk.simulate(q5.trace, q5.policy(budget), cost=lk.CostModel())
        return 1000 * np.percentile(lk.metrics.itl(log), 99), log.tokens_per_second

    results = {budget: measured(budget) for budget in q5.budgets}
    meeting = [b for b in q5.budgets if results[b][0] <= q5.itl_p99_target_ms]
    fastest = max(meeting, key=lambda b: results[b][1])
    assert q5.expected() == fastest == 256
    assert all(results[b][1] < 0.99 * results[fastest][1] for b in meeting if b != fastest)  # no tie decides it
    assert min(meeting) < q5.expected() < max(q5.budgets)  # neither end of the list: the question has a trade-off


def _row(itl, throughput):
    return {"ITL p99 (ms)": itl, "tokens/s": throughput}


@pytest.mark.parametrize("sweep, picked", [
    ({64: _row(10, 100), 128: _row(20, 200), 256: _row(30, 201), 512: _row(50, 300)}, 128),  # 0.5%: a tie
    ({64: _row(10, 100), 128: _row(20, 200), 256: _row(30, 203), 512: _row(50, 300)}, 256),  # 1.5%: no tie
    ({64: _row(10, 100), 128: _row(20, 199), 256: _row(30, 200), 512: _row(50, 300)}, 128),
    ({64: _row(41, 100), 128: _row(50, 200)}, None),  # nothing meets 40 ms
])
def test_q5_picks_the_most_tokens_per_second_ties_to_the_smaller_budget(sweep, picked):
    assert q5.pick(sweep) == picked


def test_q5s_trace_can_be_made_longer_at_the_same_rate():
    from dataclasses import replace

    longer = replace(q5, num_requests=480).trace
    assert len(q5.trace) == 120 and len(longer) == 480
    rate = (len(longer) - 1) / np.ptp(longer.arrivals)
    assert 18 < rate < 22  # about 20 requests/s, as q5.trace


def test_q5_measures_its_load_against_what_the_budget_serves():
    row = q5.measure(512)
    trace = q5.trace
    rate = (len(trace) - 1) / (trace.arrivals.max() - trace.arrivals.min())
    backlog = lk.simulate(trace.backlogged(), q5.policy(512), cost=lk.CostModel())
    assert row["load"] == pytest.approx(rate * backlog.duration / len(trace))
    assert row["load"] > 1.2  # the trace arrives faster than the server serves it
    log = lk.simulate(trace, q5.policy(512), cost=lk.CostModel())
    assert row["TTFT p50 (s)"] == pytest.approx(np.median(log.ttft))
    assert row["ITL p50 (ms)"] == pytest.approx(1000 * np.median(lk.metrics.itl(log)))
    assert row["steps with prompt"] == pytest.approx((log.num_prefill_tokens > 0).mean())


# Verdicts


RIGHT_ANSWERS = [
    (q1, lambda: q1.expected()),
    (q1, lambda: list(map(float, q1.expected()))),
    (q2, lambda: q2.expected()),
    (q2, lambda: round(q2.expected(), 3)),
    (q2, lambda: 29.6),
    (q2, lambda: 100 * q2.expected()),
    (q3, lambda: ("Q", 5)),
    (q3, lambda: ("q", "5")),
    (q4, lambda: q4.expected()),
    (q5, lambda: q5.expected()),
    (q6, lambda: reference_refill),
]


@pytest.mark.parametrize("question, answer", RIGHT_ANSWERS)
def test_right_answers_pass(question, answer):
    verdict = question.verdict(answer())
    assert verdict.status == CORRECT and verdict, verdict.message


def _wrong_answers():
    static, continuous = q1.expected()
    lower_bound = math.ceil(sum(q1.lengths) / q1.num_slots)
    gain = lk.theory.harmonic(16)
    meeting_but_slower = min(q5.budgets)
    too_slow = max(q5.budgets)
    return [
        (q1, (continuous, static), "swapped"),
        (q1, (lower_bound, continuous), "divided the total tokens by the slots"),
        (q1, (static, lower_bound), "draining tail"),
        (q1, (sum(q1.lengths), continuous), "one slot"),
        (q1, (static, lower_bound - 1), "no schedule can beat"),
        (q1, (static + 1, continuous), "add up the longest of each batch"),
        (q2, gain, "ideal gain"),
        (q2, 1 - 1 / gain, "idle"),
        (q2, 1.0, "counted the idle slot-steps as useful"),
        (q2, 1 / 16, "one request did all the work"),
        (q2, lk.theory.exponential_utilization(8), "batches of 8"),
        (q2, 0.5, "E[max of B] = H_B"),
        (q2, 1 / math.log(16), "that is 1/ln 16"),
        (q2, 100 / math.log(16), "that is 1/ln 16"),
        (q2, 1 / (math.log(16) + 0.5772156649), "from H_B ≈ ln B + γ"),
        (q2, 0.3, "give three decimals"),
        (q2, 0.29, "is not it"),
        (q2, 30, "give three decimals"),
        (q2, -0.3, "between 0 and 1"),
        (q3, ("P", 5), "right idea"),
        (q3, ("P", 1), "not what the gain depends on"),
        (q3, ("P", 3), "P's longest request is 191 tokens"),
        (q3, ("Q", 2), "can't be why"),
        (q3, ("Q", 6), "200 requests"),
        (q3, ("Q", 3), "169 tokens against 191"),
        (q3, ("Q", 3), "double every length"),
        (q3, ("Q", 4), "std / mean 0.77, more than P's, and gains 1.58×, less than P's 1.70×"),
        (q3, ("P", 4), "does not set the gain"),
        (q3, ("Q", 7), "choose one of 1, 2, 3, 4, 5, 6"),
        (q4, q4.fewest_that_fit(), "largest request needs alone"),
        (q4, q4.expected() - 1, "preempts"),
        (q4, q4.expected() + 5, "a smaller pool does too"),
        (q4, 10**12, "a smaller pool does too"),
        (q4, q4.fewest_that_fit() - 1, "can't serve this trace at all"),
        (q4, 0, "at least 1 block"),
        (q5, too_slow, "above the 40 ms target"),
        (q5, meeting_but_slower, "another budget on the list"),
        (q5, 100, "choose one of"),
    ]


@pytest.mark.parametrize("question, answer, hint", _wrong_answers())
def test_typical_mistakes_get_their_own_hint(question, answer, hint):
    verdict = question.verdict(answer)
    assert verdict.status == INCORRECT and not verdict
    assert hint in verdict.message


JUNK = [
    "18, 12",
    "0.3",
    float("nan"),
    float("inf"),
    True,
    np.bool_(False),
    3 + 4j,
    [1, 2, 3],
    ("a", "b"),
    (1.5, 2),
    (float("nan"), 12),
    {"static": 18},
    object(),
    np.array([[18, 12]]),
    np.float64(0.3),
    b"bytes",
    print,
]


@pytest.mark.parametrize("answer", JUNK, ids=repr)
@pytest.mark.parametrize("question", QUESTIONS[:5], ids=["q1", "q2", "q3", "q4", "q5"])
def test_junk_gets_a_message_that_shows_it(question, answer):
    verdict = question.verdict(answer)
    assert verdict.status in (INCORRECT, CORRECT)
    if verdict.status == INCORRECT:
        assert verdict.message


@pytest.mark.parametrize("answer, shown", [("18, 12", "'18, 12' (a str)"), ((True, 1), "True (a bool)"),
                                           ((18, float("nan")), "nan is not a finite number"),
                                           ((18, 12.5), "12.5 is not a whole number")])
def test_unreadable_answers_name_the_value(answer, shown):
    assert shown in q1.verdict(answer).message


def test_a_string_number_is_told_to_drop_its_quotes():
    assert "without quotes" in q2.verdict("0.3").message


class Hostile:
    """An object whose every dunder raises."""

    def __repr__(self):
        raise RuntimeError("no repr")

    def __len__(self):
        raise RuntimeError("no len")

    def __eq__(self, other):
        raise RuntimeError("no eq")

    def __float__(self):
        raise RuntimeError("no float")

    __hash__ = None


@pytest.mark.parametrize("question", QUESTIONS, ids=["q1", "q2", "q3", "q4", "q5", "q6"])
def test_a_hostile_object_gets_a_verdict(question):
    assert question.verdict(Hostile()).status == INCORRECT


ANYTHING = st.recursive(
    st.one_of(st.none(), st.just(...), st.booleans(), st.integers(), st.floats(), st.text(max_size=4),
              st.binary(max_size=4), st.complex_numbers(), st.decimals(), st.fractions(), st.builds(object)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner, inner),
                            st.dictionaries(st.text(max_size=2), inner, max_size=2)),
    max_leaves=6,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(answer=ANYTHING)
def test_no_answer_makes_a_check_raise(answer):
    for question in QUESTIONS:
        assert isinstance(question.verdict(answer), Verdict)


@settings(max_examples=40, deadline=None)
@given(refill=st.functions(like=lambda state: None, returns=ANYTHING | st.builds(lk.Decision, admit=st.tuples(
    st.integers(-2, 20)), release=st.tuples(st.integers(-2, 20)), blocked=st.text(max_size=3))))
def test_no_refill_function_makes_the_grader_raise(refill):
    assert not q6.verdict(refill)


def test_check_prints_the_verdict_and_returns_it(capsys):
    verdict = q1.check(q1.expected())
    assert capsys.readouterr().out == f"{wrap(str(verdict))}\n"
    assert str(verdict).startswith("✅ Correct.")


def test_long_verdicts_and_hints_print_within_the_width(capsys):
    verdict = q6.check(admit_newest_first)
    assert len(str(verdict)) > 2 * WIDTH  # negative control: unwrapped, it would not fit
    q6.hint()
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) > 4 and max(map(len, printed)) <= WIDTH
    assert " ".join(printed).startswith(f"{verdict} 💡 ")  # wrapping breaks lines, loses no word


def test_wrap_keeps_lines_and_never_splits_a_word():
    long_name = "lk.metrics.percentile(lk.metrics.itl(lk.simulate(q5.trace,q5.policy(budget))),99)" * 2
    assert wrap(f"a\n{long_name} b") == f"a\n{long_name}\nb"


@pytest.mark.parametrize("stub", [None, ..., (None, None), [..., ...]], ids=repr)
@pytest.mark.parametrize("question", QUESTIONS, ids=["q1", "q2", "q3", "q4", "q5", "q6"])
def test_stubs_are_not_attempted(question, stub, capsys):
    verdict = question.check(stub)
    assert verdict.status == NOT_ATTEMPTED and not verdict
    assert "Not attempted yet" in capsys.readouterr().out


def raises_not_implemented(state):
    raise NotImplementedError


@pytest.mark.parametrize("stub", [refill_stub, raises_not_implemented])
def test_a_refill_without_a_body_is_not_attempted(stub):
    assert q6.verdict(stub).status == NOT_ATTEMPTED


def test_hints_and_solutions_quote_the_library(capsys):
    for question in QUESTIONS:
        question.hint()
        assert capsys.readouterr().out.startswith("💡 ")
    q1.solution()
    assert f"answer = {q1.expected()}" in capsys.readouterr().out
    q4.solution()
    printed = capsys.readouterr().out
    assert f"answer = {q4.expected()}" in printed
    assert "Pools under 9 blocks cannot hold the largest request; pools of 9 to 18 hold it but preempt" in printed
    q3.solution()
    assert "answer = ('Q', 5)" in capsys.readouterr().out
    q5.solution()
    assert f"answer = {q5.expected()}" in capsys.readouterr().out


def test_exercises_load_no_heavy_library():
    code = "import sys, labkit.exercises; print(sorted({'torch', 'plotly', 'ipywidgets'} & set(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


# Write-a-policy: the wrapper and the grader


def test_a_refill_function_drives_the_simulator_as_continuous_does():
    toy = lk.Trace.toy()
    mine = lk.simulate(toy, as_policy(reference_refill, num_slots=2))
    assert mine.num_steps == 17
    assert np.array_equal(mine.slots, lk.simulate(toy, lk.Continuous(num_slots=2)).slots)


@pytest.mark.parametrize("refill, num_slots, message", [
    (3, 2, "refill = 3 (an int)"), (reference_refill, 0, "num_slots = 0"), (reference_refill, 1.5, "num_slots = 1.5")])
def test_as_policy_refuses_bad_arguments(refill, num_slots, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        as_policy(refill, num_slots)


def _decides(decision):
    return lambda state: decision


@pytest.mark.parametrize("refill, message", [
    (_decides(lk.Decision(admit=(0,), num_tokens={0: 1})), "leave them at their defaults"),
    (_decides(lk.Decision(admit=[99])), "request 99, which is not waiting"),
    (_decides(lk.Decision(admit=(0, 0))), "names a request twice"),
    (_decides(lk.Decision(admit=0)), "must be a tuple of request ids"),
    (_decides(lk.Decision(admit=("0",))), "takes request ids"),
    (_decides(lk.Decision(release=(0,))), "request 0, which holds no slot"),
    (_decides(lk.Decision(admit=(0, 1, 2))), "only 2 slots free"),
    (_decides(lk.Decision(blocked=None)), "Decision.blocked = None"),
    (_decides(lk.Decision()), "releases and admits nobody while nothing runs and the queue holds 8 requests"),
    (lambda state: lk.Decision(admit=tuple(state.waiting)[:2]), "holds Request objects"),
    (lambda state: "admit everyone", "not a lk.Decision"),
])
def test_a_refill_breaking_the_rules_stops_the_run_with_a_clear_error(refill, message):
    with pytest.raises(PolicyError, match=re.escape(message)):
        lk.simulate(lk.Trace.toy(), as_policy(refill, num_slots=2))


def test_releasing_a_running_request_is_refused():
    def releases_everyone(state):
        return lk.Decision(release=tuple(r.id for r in state.slots if r is not None),
                           admit=tuple(r.id for r in state.waiting_head(state.num_free_slots())))

    with pytest.raises(PolicyError, match="has not finished"):
        lk.simulate(lk.Trace.toy(), as_policy(releases_everyone, num_slots=2))


def test_grading_cases_are_seeded_and_varied():
    cases = grading_cases()
    again = grading_cases()
    assert all(np.array_equal(t.output_lengths, u.output_lengths) and n == m for (t, n), (u, m) in zip(cases, again))
    assert any(t.arrivals.max() > 0 for t, _ in cases) and any(t.arrivals.max() == 0 for t, _ in cases)
    assert all(len(t) > n for t, n in cases)  # a queue forms in every case: admission order matters


@pytest.mark.parametrize("mistake, hint", [
    (admit_newest_first, "newest waiting request first"),
    (refill_a_step_late, "A freed slot stays idle for one step"),
    (never_releases, "release the finished requests"),
    (one_at_a_time, "oldest first, into every free slot"),
])
def test_wrong_refill_steps_fail_in_the_simulator_with_their_hint(mistake, hint):
    verdict = q6.on_simulator(mistake)
    assert verdict.status == INCORRECT and hint in verdict.message


def test_the_reference_passes_in_the_simulator():
    assert q6.on_simulator(reference_refill)


def delegates_to_the_reference(state):
    """A spy that passes lk.Continuous's own decision on: it would copy the answer it is graded against."""
    decision = lk.Continuous(num_slots=state.num_slots).schedule(state)
    return lk.Decision(release=decision.release, admit=decision.admit)


def test_a_refill_that_asks_the_reference_fails_with_a_clear_message():
    # negative control: outside grading, the spy schedules every case exactly as lk.Continuous does
    for trace, num_slots in grading_cases():
        assert np.array_equal(lk.simulate(trace, as_policy(delegates_to_the_reference, num_slots)).slots,
                              lk.simulate(trace, lk.Continuous(num_slots=num_slots)).slots)
    schedule, fill = Continuous.schedule, Continuous.fill
    for verdict in (q6.verdict(delegates_to_the_reference), q6.on_engine(delegates_to_the_reference)):
        assert verdict.status == INCORRECT and "withheld while grading" in verdict.message
    assert Continuous.schedule is schedule and Continuous.fill is fill  # restored after grading
    assert lk.simulate(lk.Trace.toy(), lk.Continuous(num_slots=2)).num_steps == 17


def test_a_refill_that_asks_a_policy_built_on_the_reference_fails_too():
    from labkit.sched.ordered import Priority

    def asks_priority(state):
        decision = Priority(num_slots=state.num_slots, preempt_for_waiting=False).schedule(state)
        return lk.Decision(release=decision.release, admit=decision.admit)

    assert "withheld while grading" in q6.on_simulator(asks_priority).message


def test_the_reference_passes_on_the_engine_and_a_wrong_one_fails():
    passed = q6.on_engine(reference_refill)
    assert passed and "the same slots and the same" in passed.message
    failed = q6.on_engine(admit_newest_first)
    assert not failed and failed.message.startswith("On the engine")
    assert "newest waiting request first" in failed.message


# q7: a step's length with and without overlap


@pytest.mark.parametrize("answer, expected, says", [
    ((10, 6), True, "10 ms without overlap, 6 ms with it: the slower lane, the host, sets the pace, 1.67×"),
    ((10.0, 6.02), True, "1.67×"),
    ((6, 10), False, "swapped"),
    ((10, 4), False, "the device cannot start a step before its 6 ms of host work is done"),
    ((10, 10), False, "overlap hides the shorter lane"),
    ((9, 5), False, "is not it. Without overlap the lanes take turns"),
    ((0.01, 0.006), False, "(0.01, 0.006): right in seconds, but the question asks for milliseconds"),
    ((0.0, 0.0), False, "is not it. Without overlap the lanes take turns"),
    (("ten", 6), False, "ms without overlap"),
    ((None, None), False, ""),
])
def test_q7_grades_the_step_lengths(answer, expected, says, capsys):
    from labkit.exercises import q7

    verdict = q7.check(answer)
    assert bool(verdict) is expected
    assert says in str(verdict)


def test_q7_expected_comes_from_the_lanes():
    from labkit.exercises.lanes_question import OverlapStep

    assert OverlapStep(host=2.0, device=5.0).expected() == (7.0, 5.0)
    assert "faster" not in str(OverlapStep(host=2.0, device=5.0).check((7, 2)))  # the host is the faster lane
    assert "2 ms is the host's" in str(OverlapStep(host=2.0, device=5.0).check((7, 2)))


# q8: the factor a headline leaves to the implementation


@pytest.mark.parametrize("answer, expected, says", [
    (24 / (2.2 * 6.0 * 0.5), True, "3.64×: 2.2 × 6 × 0.5 × 3.64 = 24"),
    (3.6, True, "3.64×"),
    (24 - 2.2 - 6.0 - 0.5, False, "factors multiply, they do not add"),
    (24 / (2.2 * 6.0), False, "the fuller steps cost something too"),
    (24 * 0.5 / (2.2 * 6.0), False, "divide by it"),
    (2.0, False, "is not it. The headline is the product of every factor"),
    ("3.64", False, "without quotes"),
    (float("nan"), False, "not a finite number"),
    (None, False, "Set the answer"),
])
def test_q8_grades_the_missing_factor(answer, expected, says, capsys):
    from labkit.exercises import q8

    verdict = q8.check(answer)
    assert bool(verdict) is expected
    assert says in str(verdict)


def test_q8_expected_is_the_claim_divided_by_the_other_factors():
    from labkit.exercises.multiplier_question import MissingFactor

    question = MissingFactor(total=20.0, refill=2.0, memory=5.0, step_cost=0.5)
    assert question.expected() == 4.0
    assert question.check(4.0) and not question.check(2.0)  # 2.0 ignores the step cost: a named mistake
    assert "fuller steps" in str(question.check(2.0))


def at_most_four(state):
    """A refill that admits at most 4 requests a decision: right on 1 to 4 slots, wrong beyond."""
    finished = state.finished_in_slots()
    admit = state.waiting_head(min(4, state.num_free_slots() + len(finished)))
    return lk.Decision(release=tuple(r.id for r in finished), admit=tuple(r.id for r in admit))


def test_grading_reaches_8_and_16_slots():
    assert {n for _, n in grading_cases()} >= {8, 16}


def test_a_refill_capped_at_four_admissions_fails():
    verdict = q6.on_simulator(at_most_four)
    assert verdict.status == INCORRECT and "16 slots" in verdict.message


def test_the_cap_passes_where_every_case_has_at_most_four_slots():
    """Negative control: on the small cases alone the cap is indistinguishable from the reference."""
    small = [(trace, n) for trace, n in grading_cases() if n <= 4]
    assert all(np.array_equal(lk.simulate(t, as_policy(at_most_four, n)).slots,
                              lk.simulate(t, lk.Continuous(num_slots=n)).slots) for t, n in small)


def forgets_return(state):
    finished = state.finished_in_slots()
    admit = state.waiting_head(state.num_free_slots() + len(finished))
    lk.Decision(release=tuple(r.id for r in finished), admit=tuple(r.id for r in admit))


def test_a_missing_return_is_told_from_an_empty_body():
    forgot = q6.verdict(forgets_return)
    assert forgot.status == INCORRECT and "forget `return`" in forgot.message
    assert q6.verdict(refill_stub).status == NOT_ATTEMPTED  # the empty body: not attempted, as before


def test_q2_is_graded_to_the_third_decimal():
    exact = 1 / sum(1 / k for k in range(1, 17))  # 0.29579...
    assert q2.verdict(exact + 0.0015) and q2.verdict(exact - 0.0015)
    assert not q2.verdict(exact + 0.0025) and not q2.verdict(exact - 0.0025)
    assert not q2.verdict(0.3) and not q2.verdict(0.29)


def test_q2_names_the_expectation_of_the_ratio():
    ratio = lk.theory.monte_carlo("exponential", 16, num_batches=100_000, seed=0).mean_of_ratios[-1]
    assert abs(ratio - 0.315) < 0.002  # the mistake the lesson's readers made
    verdict = q2.verdict(round(ratio, 3))
    assert verdict.status == INCORRECT and "expectation of the ratio" in verdict.message
