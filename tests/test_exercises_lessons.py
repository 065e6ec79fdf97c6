"""The check-yourself graders of lessons 01 to 06 and 09: each expects what the library computes, gives a
right answer its verdict, names the likely slip, and reads a stub as not attempted."""

import math

import numpy as np
import pytest

import labkit as lk
from labkit.exercises import lesson01, lesson02, lesson03, lesson04, lesson05, lesson06, lesson09
from labkit.exercises.feedback import CORRECT, INCORRECT, NOT_ATTEMPTED

QUESTIONS = [lesson01.q1, lesson01.q2, lesson02.q1, lesson02.q3, lesson03.q1, lesson04.q1, lesson04.q2, lesson05.q1,
             lesson05.q2, lesson06.q1, lesson09.q1]


def status(question, answer):
    return question.verdict(answer).status


@pytest.mark.parametrize("question", QUESTIONS, ids=lambda q: type(q).__name__)
def test_a_stub_is_not_attempted_and_garbage_gets_a_verdict(question):
    assert status(question, None) == NOT_ATTEMPTED
    for junk in ("x", [1, 2, 3], {"a": 1}, float("nan"), object()):
        assert status(question, junk) == INCORRECT


def test_lesson01_expects_what_the_simulator_counts():
    trace = lk.Trace.from_lengths([1, 1, 1, 9])
    static, continuous = (lk.simulate(trace, policy(num_slots=2)) for policy in (lk.Static, lk.Continuous))
    assert lesson01.q1.expected() == (static.num_steps, continuous.num_steps) == (10, 10)
    assert lesson01.q2.expected() == (static.utilization, continuous.utilization) == (0.6, 0.6)
    assert status(lesson01.q2, (60, 60)) == CORRECT  # percentages read as such
    assert "idle share" in lesson01.q2.verdict((0.4, 0.4)).message
    assert "Static: 0.6 is right" in lesson01.q2.verdict((0.6, 1.0)).message  # each number graded on its own
    assert "draining tail" in lesson01.q2.verdict((0.6, 1.0)).message
    assert "divided the total tokens" in lesson01.q1.verdict((6, 10)).message


def test_lesson01_names_the_off_by_one_and_the_order_that_matters():
    reverse = lk.Trace.from_lengths([9, 1, 1, 1])
    assert [lk.simulate(reverse, policy(num_slots=2)).num_steps for policy in (lk.Static, lk.Continuous)] == [10, 9]
    right = lesson01.q1.verdict((10, 10)).message
    assert "the 9-token request, admitted last, in iteration 1, sets the end under both" in right
    assert "in the order (9, 1, 1, 1), it would run beside the short ones: static 10, continuous 9" in right
    slip = lesson01.q1.verdict((10, 9)).message  # the 9-token request starts in iteration 1, after two 1-token ones
    assert "Continuous: 9 is one short: it is the 9-token request's own length" in slip
    assert "until iteration 1 and ends in iteration 9; numbered from 0, that makes 10 iterations" in slip
    assert "Static: 9 is one short: the last iteration is iteration 9" in lesson01.q1.verdict((9, 10)).message
    assert "11 is not it" in lesson01.q1.verdict((10, 11)).message  # a slip with no name keeps the generic note
    for follows in ((0.6, 0.667), (0.6, 12 / 18), (60, 66.7)):  # 12 tokens / (2 slots × 9 iterations)
        verdict = lesson01.q2.verdict(follows)
        assert verdict.status == INCORRECT
        assert "Continuous: 0.667 is 12/(2 × 9), one iteration short" in verdict.message
    assert "0.7 is not it" in lesson01.q2.verdict((0.6, 0.7)).message


def test_lesson02_q1_computes_the_uniform_gain_and_bounds_it():
    lengths = np.arange(100, 301)
    gain = lk.theory.ideal_gain(lengths, 32)
    assert 1.45 < gain < 1.5 and lesson02.q1.expected() == 1.5
    assert status(lesson02.q1, 1.5) == CORRECT
    assert "at most 300 / 200 = 1.50" in lesson02.q1.verdict(2).message and status(lesson02.q1, 3) == INCORRECT


def test_lesson02_q3_replays_the_sorted_trace():
    azure = lk.Trace.azure_conv().backlogged()
    ordered = azure.select(np.argsort(azure.output_lengths, kind="stable"))
    simulated = lk.simulate(ordered, lk.Static(num_slots=8)).utilization
    assert simulated > lk.theory.static_utilization(azure.output_lengths, 8)
    assert status(lesson02.q3, "above") == CORRECT and status(lesson02.q3, "Below") == INCORRECT


def test_lesson03_uses_the_lessons_own_backlog():
    backlog = lk.Trace.sample(32, output="exponential", mean_output=32, prompt="uniform", mean_prompt=16, seed=0)
    first = backlog.select(np.arange(16))
    expected = tuple(lk.simulate(first, policy(num_slots=4)).num_steps for policy in (lk.Static, lk.Continuous))
    assert lesson03.q1.expected() == expected and status(lesson03.q1, expected) == CORRECT
    assert status(lesson03.q1, expected[::-1]) == INCORRECT


def test_lesson03_names_the_setup_a_wrong_pair_belongs_to():
    backlog = lk.Trace.sample(32, output="exponential", mean_output=32, prompt="uniform", mean_prompt=16, seed=0)
    counts = {(requests, slots): tuple(lk.simulate(trace, policy(num_slots=slots)).num_steps
                                       for policy in (lk.Static, lk.Continuous))
              for requests, trace in {32: backlog, 16: backlog.select(np.arange(16))}.items() for slots in (8, 4)}
    assert counts[32, 8] == (402, 192)  # the whole backlog, as the lesson prints it
    assert "all 32 requests of the backlog on 8 slots" in lesson03.q1.verdict((402, 192)).message
    assert "all 32 requests of the backlog on 4 slots" in lesson03.q1.verdict(counts[32, 4]).message
    assert "the first 16 requests on 8 slots" in lesson03.q1.verdict(counts[16, 8]).message
    assert all(status(lesson03.q1, counts[setup]) == INCORRECT for setup in ((32, 8), (32, 4), (16, 8)))
    assert "is not it" in lesson03.q1.verdict((400, 200)).message  # no setup of the lesson's: the generic note


def test_lesson04_q1_counts_the_wider_models_weights():
    weights = 4 * (4 * 512 * 512 + 3 * 512 * 1536) + 512 * 512  # per layer times 4 layers, then the LM head
    kv_bytes = 2 * 4 * 512 * 4
    assert lesson04.q1.expected() == pytest.approx(4 * weights / (8 * kv_bytes))
    assert status(lesson04.q1, 424) == CORRECT
    assert "divide by 8" in lesson04.q1.verdict(3392).message  # the crossover for one request
    assert "a key *and* a value" in lesson04.q1.verdict(848).message
    head = embedding = 512 * 512  # vocab × d_model each, untied in TinyGPT
    assert 4 * (weights - head) / (8 * kv_bytes) == 416 and 4 * (weights + embedding) / (8 * kv_bytes) == 432
    assert "leaves out the LM head" in lesson04.q1.verdict(416).message
    assert 216 * 512 / 256 == 432  # the lesson's 216 tokens scaled by the width: the likelier way to 432
    scaled = lesson04.q1.verdict(432).message
    assert "scales the lesson's 216 tokens by the width" in scaled and "grows only 2 times" in scaled
    assert "embedding table, which no GEMM reads, gives the same number" in scaled
    assert status(lesson04.q1, 421) == INCORRECT and "is not it" in lesson04.q1.verdict(421).message


def test_lesson04_q2_prices_the_step_on_the_h200():
    weights, kv_token = 2 * 8.03e9 / 4.8e12, 128 * 1024 / 4.8e12  # seconds to read them at the H200's bandwidth
    row = 2 * 8.03e9 / 989e12  # one row's arithmetic, far below the weights' read at 64 rows
    expected = (weights + 64 * 1024 * kv_token) / (weights + 1024 * kv_token)  # memory-bound both
    assert 64 * row < weights
    assert lesson04.q2.expected() == pytest.approx(expected)
    assert status(lesson04.q2, round(expected, 2)) == CORRECT
    assert "leaves out the keys and values" in lesson04.q2.verdict(1.0).message  # the weights alone
    added = (weights + 64 * 1024 * kv_token + 64 * row) / (weights + 1024 * kv_token + row)
    assert "adds the arithmetic" in lesson04.q2.verdict(round(added, 3)).message
    assert "separate steps" in lesson04.q2.verdict(64).message
    from pathlib import Path

    cpu = lk.CostModel.load(Path(lesson04.__file__).parents[2] / "benchmarks/results/engine-cost.json")
    fixed = cpu.overhead + cpu.host_overhead  # this CPU's saved price, which adds every term
    row = cpu.per_decode_token + 1024 * cpu.per_kv_token + cpu.host_per_request + cpu.host_per_token
    assert round((fixed + 64 * row) / (fixed + row), 1) == 33.0
    assert "this CPU's saved price" in lesson04.q2.verdict(33.0).message


def test_lesson05_q1_tells_each_slip_apart():
    assert lesson05.q1.expected() == (math.ceil(49 / 16), math.ceil(144 / 16)) == (4, 9)
    assert status(lesson05.q1, (4, 9)) == CORRECT
    assert "begin-of-sequence" in lesson05.q1.verdict((3, 9)).message  # the slip the old numbers hid
    assert "never cached" in lesson05.q1.verdict((4, 10)).message


def test_lesson05_q2_simulates_both_victims():
    trace = lk.Trace.sample(32, output="uniform", mean_output=64, prompt="uniform", mean_prompt=32, seed=0)
    logs = {v: lk.simulate(trace, lk.Continuous(num_slots=16, num_blocks=64, victim=v)) for v in ("newest", "longest")}
    fewer_preemptions = min(logs, key=lambda v: logs[v].num_preemptions)
    fewer_recomputed = min(logs, key=lambda v: logs[v].recomputed_tokens)
    assert fewer_preemptions != fewer_recomputed  # the question has a trade in it
    assert status(lesson05.q2, (fewer_preemptions, fewer_recomputed)) == CORRECT
    assert status(lesson05.q2, (fewer_recomputed, fewer_preemptions)) == INCORRECT


def test_lesson06_counts_the_chunks_beside_seven_decodes():
    assert lesson06.q1.expected() == (math.ceil(1000 / (256 - 7)), math.ceil(1000 / (256 - 7))) == (5, 5)
    assert status(lesson06.q1, (5, 5)) == CORRECT
    for rounded_down in ((4, 4), (4, 5)):  # 1000 / 256 = 3.9 and 1000 / 249 = 4.02 both invite a 4
        message = lesson06.q1.verdict(rounded_down).message
        assert "take their token each first, so a chunk gets 249 of the 256" in message
        assert "1,000 / 249 = 4.02, so the last 4 tokens need an iteration of their own, number 5" in message
    budget_300 = lesson06.ChunkedPrefill(num_decodes=7, prompt_length=999, budget=300)  # 1000 / 293 = 3.41
    assert budget_300.expected() == (4, 4) == (math.ceil(1000 / 300),) * 2  # the whole budget happens to agree
    rounded_down = budget_300.verdict((3, 3)).message
    assert "1,000 / 293 = 3.41, so the last 121 tokens need an iteration of their own, number 4" in rounded_down
    assert "divided by the whole budget" not in rounded_down
    assert "count the iterations from 1" in lesson06.q1.verdict((5, 4)).message


def test_lesson09_finds_the_first_token_step_of_a_lone_chunked_prompt():
    tokens = 1 + 1024  # the begin-of-sequence token and the prompt
    assert lesson09.q1.expected() == (math.ceil(tokens / 128), math.ceil(tokens / 512)) == (9, 3)
    assert lesson09.q1.chunks(128) == [128] * 8 + [1] and lesson09.q1.chunks(512) == [512, 512, 1]
    for budget, step in zip((128, 512), lesson09.q1.expected()):
        log = lk.simulate(lesson09.q1.trace, lk.Continuous(num_slots=8, max_tokens_per_step=budget,
                                                          chunked_prefill=True))
        assert log.first_token_step[0] + 1 == step  # more slots change nothing for a lone request
    assert status(lesson09.q1, (9, 3)) == CORRECT and status(lesson09.q1, [9.0, 3.0]) == CORRECT
    assert "chunks of 128, 128" in lesson09.q1.verdict((9, 3)).message  # a right answer is shown the work
    assert "swapped" in lesson09.q1.verdict((3, 9)).message


def test_lesson09_names_the_forgotten_begin_of_sequence_token_and_only_hints():
    forgot = lesson09.q1.without_bos()
    assert forgot == (math.ceil(1024 / 128), math.ceil(1024 / 512)) == (8, 2)  # also one step early each
    assert "begin-of-sequence" in lesson09.q1.verdict(forgot).message
    assert "begin-of-sequence" in lesson09.q1.verdict((9, 2)).message  # one budget right, the other without it
    assert "not in the step after it" in lesson09.q1.verdict((10, 4)).message
    for wrong in (forgot, (9, 2), (10, 4), (3, 9), (20, 20)):
        verdict = lesson09.q1.verdict(wrong)
        assert verdict.status == INCORRECT and "chunks of" not in verdict.message  # a hint, not the solution
    assert "with a budget of 128 is right; with 512 it is not" in lesson09.q1.verdict((9, 4)).message
    assert "is not it" in lesson09.q1.verdict((20, 20)).message
    assert status(lesson09.q1, (None, None)) == NOT_ATTEMPTED
