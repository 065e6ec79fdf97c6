"""q9, lesson 11's check: the mean TTFT of a queue first come first served and shortest first."""

import numpy as np
import pytest

import labkit as lk


@pytest.mark.parametrize("answer, expected, says", [
    ((3.6, 2.0), True, "3.6 steps first come first served, 2 shortest first: 44% lower. Request A pays: "
                       "its first token comes at step 4 instead of 1, and it finishes at step 9 instead of 6"),
    ([3.62, 1.98], True, "the whole queue takes 9 steps instead of 8"),
    ((2.0, 3.6), False, "swapped"),
    ((2.6, 1.0), False, "add 1 to each"),
    ((18, 10), False, "those are the totals of the 5 TTFTs; the question asks for their mean: divide each by 5"),
    ((5.6, 4.0), False, "end-to-end latency"),
    ((8.8, 4.2), False, "one slot"),
    ((1, 1), False, "is not it. Draw 2 rows"),
    ((3.6, 2.4), False, "first come first served is right; the mean TTFT shortest first is not. Shortest first "
                        "sorts the waiting queue"),
    ((3.0, 2.0), False, "shortest first is right; the mean TTFT first come first served is not. First come "
                        "first served takes the queue in arrival order"),
    ((3.6,), False, "expected (mean TTFT"),
    (("3.6", 2.0), False, "without quotes"),
    ((float("nan"), 2.0), False, "not a finite number"),
    ((None, None), False, "Set the answer"),
    (None, False, "Set the answer"),
])
def test_q9_grades_the_mean_ttfts(answer, expected, says, capsys):
    from labkit.exercises import q9

    verdict = q9.check(answer)
    assert bool(verdict) is expected
    assert says in str(verdict)
    assert capsys.readouterr().out.strip()  # a verdict is always printed


def test_q9_expected_comes_from_the_simulator():
    from labkit.exercises.ordering_question import ShortestFirst

    question = ShortestFirst(output_lengths=(3, 1), num_slots=1)
    trace = lk.Trace.from_lengths([3, 1])
    fcfs = lk.simulate(trace, lk.Continuous(num_slots=1), step_time=1.0)
    shortest = lk.simulate(trace, lk.ShortestPredictedFirst(num_slots=1), step_time=1.0)
    assert question.expected() == (float(np.mean(fcfs.ttft)), float(np.mean(shortest.ttft))) == (2.5, 1.5)
    assert question.check((2.5, 1.5)) and not question.check((1.5, 2.5))
    assert "Request A pays: its first token comes at step 2 instead of 1" in str(question.check((2.5, 1.5)))


def test_q9_hint_and_solution_print(capsys):
    from labkit.exercises import q9

    q9.hint()
    q9.solution()
    out = capsys.readouterr().out
    assert "Draw 2 rows" in out
    assert "first come first served: TTFTs 1, 1, 2, 7, 7 steps, mean 3.6" in out
    assert "shortest first: TTFTs 4, 1, 2, 2, 1 steps, mean 2" in out


def test_a_half_right_pair_is_told_which_half_by_default():
    from labkit.exercises import q7  # OverlapStep gives no half_hint of its own: the hint stands in

    verdict = q7.check((10, 5))
    assert not verdict and "ms without overlap is right; ms with overlap is not. Without overlap" in str(verdict)
