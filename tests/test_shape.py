"""Execution shapes: decode batch sizes, a most tokens per step and a longest sequence, as an
admission limit the scheduler, the simulator and the engine all read (`labkit.sched.shape`)."""


import numpy as np
import pytest
import torch
from tqdm.auto import tqdm
from hypothesis import given, settings
from hypothesis import strategies as st

import labkit as lk
from labkit.engine import Engine, ModelConfig
from labkit.engine.engine import sequence_lengths
from labkit.engine.model_runner import ModelRunner
from labkit.engine.steps import StepTimer, TimedSteps
from labkit.sched.driver import drive
from labkit.sched.scheduler import kv_pool
from labkit.sched.policy import NO_SHAPE
from labkit.sched.state import Request

TINY = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=128)
SIZES_8_16 = lk.ExecutionShape(decode_sizes=[8, 16])
NINE = lk.Trace.from_lengths([6] * 9, prompt_lengths=[2] * 9)  # nine requests that decode together


@pytest.fixture(scope="module")
def engine():
    return Engine(TINY, device="cpu", seed=0)


def rows_computed(engine, monkeypatch) -> list[int]:
    """The rows each forward of `engine`'s model runner computes (either path), appended as it runs."""
    rows, forward = [], ModelRunner.forward
    monkeypatch.setattr(ModelRunner, "forward", lambda self, inputs: rows.append(inputs.num_requests) or forward(self, inputs))
    return rows


# The shape itself

def test_a_batch_runs_at_the_smallest_size_that_holds_it():
    shape = lk.ExecutionShape(decode_sizes=[16, 8, 8, 1])
    assert shape.decode_sizes == (1, 8, 16)  # sorted, without repeats
    assert [shape.decode_size(n) for n in (1, 2, 8, 9, 16, 17)] == [1, 8, 8, 16, 16, 17]  # past 16: eager, unpadded
    assert [lk.ExecutionShape().decode_size(n) for n in (1, 9)] == [1, 9]


def test_vllms_default_sizes_are_1_2_4_then_multiples_of_8_then_of_16():
    assert lk.vllm_capture_sizes(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert lk.vllm_capture_sizes(3) == (1, 2)
    assert lk.vllm_capture_sizes(300)[-4:] == (248, 256, 272, 288)  # from 256, multiples of 16


@pytest.mark.parametrize("running, wanted, fill, expected", [
    (8, 9, 0.0, 9),  # growing is always allowed without a fill rule
    (8, 9, 0.75, 8),  # 9 of 16 is too empty: stay at 8
    (8, 12, 0.75, 12),  # 12 of 16 fills three quarters
    (3, 6, 1.0, 6),  # within the size the running ones use
    (0, 9, 0.75, 8),  # nothing runs: fill the size 8
    (0, 3, 1.0, 3),  # nothing runs, and 3 stay within the smallest size
    (8, 20, 0.5, 20),  # past the largest size a batch runs unpadded
])
def test_rows_to_run_never_grows_into_a_mostly_padded_size(running, wanted, fill, expected):
    assert SIZES_8_16.rows_to_run(running, wanted, fill) == expected


@pytest.mark.parametrize("make, message", [
    (lambda: lk.ExecutionShape(decode_sizes=[8, 0]), "decode_sizes = 0: must be a whole number >= 1"),
    (lambda: lk.ExecutionShape(decode_sizes=[]), r"decode_sizes = \[\]: give at least one batch size"),
    (lambda: lk.ExecutionShape(decode_sizes="8,16"), "decode_sizes = '8,16': must be a list of batch sizes"),
    (lambda: lk.ExecutionShape(max_seq_len=0), "max_seq_len = 0: must be a whole number >= 1"),
    (lambda: lk.Continuous(num_slots=8, shape=lk.ExecutionShape(max_num_tokens=4)),
     "shape.max_num_tokens = 4 is smaller than num_slots = 8"),
    (lambda: lk.Continuous(num_slots=8, shape=[8, 16]), r"shape = \[8, 16\]: must be a labkit.ExecutionShape"),
    (lambda: lk.Continuous(num_slots=8, min_shape_fill=1.5), "min_shape_fill = 1.5: must be a share"),
    (lambda: lk.Continuous(num_slots=8, min_shape_fill=-0.1), "min_shape_fill = -0.1: must be a number >= 0"),
])
def test_bad_shapes_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# The ninth request: a decode batch of 9 under sizes [8, 16]

def test_the_ninth_request_costs_sixteen_rows_in_the_simulator():
    log = lk.simulate(NINE, lk.Continuous(num_slots=16, shape=SIZES_8_16), cost=lk.CostModel())
    assert log.num_rows.tolist() == [9, 16, 16, 16, 16, 16]  # the prefill step runs eagerly, unpadded
    assert log.num_shape_padded_rows.tolist() == [0, 7, 7, 7, 7, 7]
    assert log.num_kv_tokens.tolist() == [27, 9 * 4 + 7, 9 * 5 + 7, 9 * 6 + 7, 9 * 7 + 7, 9 * 8 + 7]
    assert log.utilization == lk.simulate(NINE, lk.Continuous(num_slots=16)).utilization  # padding is no slot's use


def test_the_ninth_request_runs_sixteen_rows_on_the_engine(engine, monkeypatch):
    rows = rows_computed(engine, monkeypatch)
    shaped = engine.run(NINE, lk.Continuous(num_slots=16, shape=engine.execution_shape([8, 16])), progress=False)
    assert rows == [9, 16, 16, 16, 16, 16]
    assert shaped.num_rows.tolist() == rows
    rows.clear()
    plain = engine.run(NINE, lk.Continuous(num_slots=16), progress=False)
    assert rows == [9] * 6  # negative control: without the shape, nothing is padded
    assert shaped.outputs == plain.outputs  # the padded rows change no request's tokens


def test_a_shape_padded_row_writes_only_the_padding_block(engine):
    """After a padded run, every real block holds what an unpadded run wrote (to float rounding:
    a GEMM over 16 rows may round differently from one over 9), and only the padded run wrote
    the padding block."""
    caches = []
    for shape in (SIZES_8_16, lk.ExecutionShape()):
        policy = lk.Continuous(num_slots=16, shape=shape)
        blocks = kv_pool(policy, int(sequence_lengths(NINE).max()))
        timer = StepTimer(is_cuda=False)
        runner = engine.model_runner(blocks, timer=timer)
        prompts = [engine.prompt(NINE, index) for index in range(len(NINE))]
        with torch.inference_mode():
            drive(NINE, policy, TimedSteps(runner, timer, tqdm(disable=True)), blocks=blocks, prompts=prompts)
        caches.append(runner.cache.k.clone())  # (layers, blocks + 1, block_size, nkv, hs), the padding block last
    padded, plain = caches
    torch.testing.assert_close(padded[:, :-1], plain[:, :-1])
    assert padded[:, -1].abs().sum() > 0 and plain[:, -1].abs().sum() == 0


# The twin holds, padded rows included

@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       lengths=st.lists(st.integers(1, 6), min_size=1, max_size=7),
       prompts=st.lists(st.integers(0, 5), min_size=7, max_size=7),
       num_slots=st.integers(1, 5), fill=st.sampled_from([0.0, 0.5, 1.0]), static=st.booleans())
def test_the_engine_log_equals_the_simulator_log_under_any_shape(engine, sizes, lengths, prompts, num_slots, fill,
                                                                 static):
    trace = lk.Trace.from_lengths(lengths, prompt_lengths=prompts[: len(lengths)])
    shape = engine.execution_shape(sizes)
    policy = (lk.Static(num_slots=num_slots, shape=shape) if static
              else lk.Continuous(num_slots=num_slots, shape=shape, min_shape_fill=fill))
    ran = engine.run(trace, policy, progress=False)
    priced = lk.simulate(trace, policy, cost=lk.CostModel())
    for work in ("slots", "blocked", "num_prefill_tokens", "num_decode_tokens", "num_kv_tokens", "num_rows",
                 "num_padded_rows", "num_shape_padded_rows"):
        assert getattr(ran, work).tolist() == getattr(priced, work).tolist(), work
    assert all(rows in shape.decode_sizes or rows > max(sizes)
               for rows in ran.num_rows[ran.num_prefill_tokens == 0].tolist())


def test_the_twin_comparison_can_fail(engine):
    """Negative control: the simulator priced without the shape disagrees with the engine run with it."""
    ran = engine.run(NINE, lk.Continuous(num_slots=16, shape=SIZES_8_16), progress=False)
    priced = lk.simulate(NINE, lk.Continuous(num_slots=16), cost=lk.CostModel())
    assert ran.num_rows.tolist() != priced.num_rows.tolist()


# Admission knows the shape

def test_a_queue_waits_beside_free_slots_because_of_the_shape():
    """Eight run at size 8; one more would run 9 rows in a graph of 16, so with min_shape_fill
    the ninth waits, beside eight free slots, until a size-8 batch has room."""
    trace = lk.Trace.from_lengths([10] * 8 + [3], arrivals=[0.0] * 8 + [0.05])
    policy = lk.Continuous(num_slots=16, shape=SIZES_8_16, min_shape_fill=0.75)
    log = lk.simulate(trace, policy, step_time=0.1)
    assert log.blocked.tolist() == [""] + [NO_SHAPE] * 9 + [""] * 3
    assert log.num_queued.tolist() == [0] + [1] * 9 + [0] * 3
    assert (log.slots >= 0).sum(axis=1).tolist() == [8] * 10 + [1] * 3
    assert log.num_shape_padded_rows.tolist() == [0] * 11 + [7, 7]  # nothing padded to 16; the ninth alone pads to 8
    eager = lk.simulate(trace, lk.Continuous(num_slots=16, shape=SIZES_8_16), step_time=0.1)
    assert eager.num_shape_padded_rows.sum() == 7 * 2  # negative control: the ninth joins at once, padded to 16


def test_a_shape_wait_is_told_apart_from_no_traffic():
    idle = lk.simulate(lk.Trace.from_lengths([4] * 3), lk.Continuous(num_slots=16, shape=SIZES_8_16, min_shape_fill=1))
    assert set(idle.blocked.tolist()) == {""}  # free slots and nobody waiting: no traffic, no reason


def test_a_budget_from_the_shape_limits_static_batches_and_continuous_steps():
    trace = lk.Trace.from_lengths([2] * 4, prompt_lengths=[5] * 4)  # 6 prompt tokens each, BOS included
    shape = lk.ExecutionShape(max_num_tokens=12)
    static = lk.simulate(trace, lk.Static(num_slots=4, shape=shape))
    assert static.num_prefill_tokens.tolist() == [12, 0, 12, 0]  # two prompts per batch, not four
    assert static.blocked.tolist()[0] == "no_budget"
    continuous = lk.simulate(trace, lk.Continuous(num_slots=4, shape=shape, max_tokens_per_step=40))
    assert continuous.num_prefill_tokens.max() <= 12
    assert lk.Continuous(num_slots=4, shape=shape, max_tokens_per_step=40).token_budget == 12


# A request that can never fit

def test_a_sequence_longer_than_max_seq_len_is_refused_by_the_library():
    trace = lk.Trace.from_lengths([4, 30, 4], prompt_lengths=[2, 100, 2])
    policy = lk.Continuous(num_slots=4, shape=lk.ExecutionShape(max_seq_len=64))
    with pytest.raises(ValueError, match=r"request 1: its sequence holds up to 130 tokens .* more than the "
                                         r"engine's max_seq_len = 64; it can never run"):
        lk.simulate(trace, policy)
    assert lk.simulate(trace.select([0, 2]), policy).num_output_tokens == 8  # the others run


def test_the_engine_refuses_a_too_long_request_and_a_shape_longer_than_its_model(engine):
    with pytest.raises(ValueError, match="request 1: prompt 100 \\+ output 30 tokens exceed max_seq_len 128"):
        engine.run(lk.Trace.from_lengths([4, 30], prompt_lengths=[2, 100]), lk.Continuous(num_slots=2), progress=False)
    with pytest.raises(ValueError, match="policy.shape.max_seq_len = 512 is more than this model's max_seq_len 128"):
        engine.run(NINE, lk.Continuous(num_slots=2, shape=lk.ExecutionShape(max_seq_len=512)), progress=False)
    assert engine.execution_shape([8]).max_seq_len == 128


def test_a_request_checked_against_the_shape_names_the_limit():
    request = Request(0, 7, 0.0, prompt_len=60, output_len=10)
    with pytest.raises(ValueError, match="request 7: its sequence holds up to 70 tokens"):
        lk.ExecutionShape(max_seq_len=64).check_fits(request)
    lk.ExecutionShape(max_seq_len=70).check_fits(request)  # exactly the limit fits
    assert np.isclose(lk.ExecutionShape(max_seq_len=70).max_seq_len, 70)
