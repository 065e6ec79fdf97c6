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
