"""What a decode step costs, measured: the linear layers in one pass or several, and the
operations a step asks for, counted."""

import pytest

from labkit.engine import Engine, ModelConfig
from labkit.engine import timing


@pytest.fixture(scope="module")
def engine():
    return Engine(ModelConfig(d_model=32, d_ff=64, vocab_size=32, n_layers=2), device="cpu", seed=0)


def test_linear_layers_run_every_weight_once_a_pass(engine, monkeypatch):
    calls = []
    monkeypatch.setattr(timing.F, "linear", lambda x, weight: calls.append((x.shape[0], weight.shape)))
    timing.linear_layers_seconds(engine, rows=8, passes=4, repeats=1)
    layers = 4 * engine.config.n_layers + 1  # qkv, o, gate_up, down per layer; the LM head
    assert len(calls) == 2 * 4 * layers  # a warm-up and one timed call, four passes each
    assert {rows for rows, _ in calls} == {2}  # 8 rows in 4 passes of 2
    assert calls[:layers] == calls[layers : 2 * layers]  # each pass reads the same weights


def test_linear_layers_need_passes_that_divide_the_rows(engine):
    with pytest.raises(ValueError, match="passes = 3: must divide rows = 8"):
        engine.time_linear_layers(8, passes=3)
    with pytest.raises(ValueError, match="passes = 0: must be a whole number >= 1"):
        engine.time_linear_layers(8, passes=0)
    assert engine.time_linear_layers(8, passes=8, repeats=1) > 0


def test_a_steps_operations_do_not_grow_with_its_rows(engine):
    one, many = engine.count_step_operations(1), engine.count_step_operations(16)
    assert one == many > 17 * engine.config.n_layers  # many small operations per layer, whatever B
    deeper = Engine(ModelConfig(d_model=32, d_ff=64, vocab_size=32, n_layers=3), device="cpu", seed=0)
    assert deeper.count_step_operations(1) > one  # a layer more, more operations: the count is not a constant


def test_cpu_time_counts_work_not_waiting(engine):
    import time
    assert timing._median_seconds(lambda: time.sleep(0.02), engine.device, repeats=2, cpu_time=True) < 0.01
    assert timing._median_seconds(lambda: time.sleep(0.02), engine.device, repeats=2) >= 0.02
    assert engine.time_decode_step(2, context_len=16, repeats=1, cpu_time=True) > 0


def test_cpu_time_refuses_a_gpu():
    import torch
    with pytest.raises(ValueError, match="cpu_time = True: the engine runs on cuda"):
        timing._median_seconds(lambda: None, torch.device("cuda"), repeats=1, cpu_time=True)


def test_a_step_can_admit_a_prompt(engine, monkeypatch):
    built = []
    build = timing.ModelInputs.build
    monkeypatch.setattr(timing.ModelInputs, "build", lambda *args: built.append(args) or build(*args))
    assert engine.time_decode_step(3, context_len=20, repeats=1, prompt_len=40, cpu_time=True) > 0
    new_tokens, starts, tables, block_size = built[0][:4]
    assert [len(t) for t in new_tokens] == [1, 1, 1, 40] and starts == [19, 19, 19, 0]  # 3 decode rows, 1 prompt
    assert [len(t) for t in tables] == [2, 2, 2, 3] and block_size == 16  # 20 and 40 tokens in blocks of 16
    engine.time_decode_step(3, context_len=20, repeats=1)
    assert [len(t) for t in built[-1][0]] == [1, 1, 1]  # no prompt unless asked


def test_a_prompt_must_fit_the_model(engine):
    with pytest.raises(ValueError, match="prompt_len = -1: must be a whole number >= 0"):
        engine.time_decode_step(2, prompt_len=-1)
    too_long = engine.config.max_seq_len + 1
    with pytest.raises(ValueError, match=f"prompt_len = {too_long}: must be at most the model's max_seq_len"):
        engine.time_decode_step(2, prompt_len=too_long)


def test_step_parts_in_cpu_time_leave_out_waiting(engine, monkeypatch):
    clocks = []
    monkeypatch.setattr(timing, "_median_seconds", lambda call, device, repeats, cpu_time=False: clocks.append(
        cpu_time) or 1.0)
    assert engine.decode_step_parts(2, context_len=16, repeats=1, cpu_time=True)["other"] == -1.0
    assert clocks == [True, True, True]  # the step, the GEMMs and attention, all on the CPU clock
    engine.decode_step_parts(2, context_len=16, repeats=1)
    assert clocks[3:] == [False, False, False]
