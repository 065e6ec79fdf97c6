"""The step a student reads is the step that runs: `ModelRunner.run` is called once per step
by `Engine.run`, by the overlapped engine and by the server, and by nothing that computes no
tokens (the simulator: the negative control)."""

import asyncio

import pytest

import labkit as lk
from labkit.engine import Engine, ModelConfig
from labkit.engine.model_runner import ModelRunner
from labkit.serve.online import OnlineEngine

TINY = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=128)
TRACE = lk.Trace.from_lengths([5, 1, 3, 4], prompt_lengths=[3, 0, 7, 2])
POLICY = lk.Continuous(num_slots=2)


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """The batch size of every call of `ModelRunner.run`, from any loop and any subclass."""
    made, run = [], ModelRunner.run

    def counted(self, batch):
        made.append(batch.size)
        return run(self, batch)

    monkeypatch.setattr(ModelRunner, "run", counted)
    return made


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_engine_run_calls_the_model_runner_once_a_step(calls, overlap):
    log = Engine(TINY, device="cpu", seed=0, threads=1, overlap=overlap).run(TRACE, POLICY, progress=False)
    assert len(calls) == log.num_steps
    assert calls == (log.slots >= 0).sum(axis=1).tolist()  # each step's batch is the logged step's


def test_the_server_calls_the_model_runner_once_a_step(calls):
    online = OnlineEngine(Engine(TINY, device="cpu", seed=0, threads=1), POLICY)
    online.start_thread()

    async def one_request() -> list:
        _, stream = online.submit([0, 5, 6], 4)
        return [await asyncio.wait_for(stream.get(), 20) for _ in range(5)]

    try:
        items = asyncio.run(one_request())
    finally:
        online.stop()
    assert items[-1] == "length" and len(items) == 5
    assert calls == online.step_sizes == [1, 1, 1, 1]


def test_the_simulator_never_calls_it(calls):
    """Negative control: a loop that computes no tokens makes no call, so the count can fail."""
    log = lk.simulate(TRACE, POLICY)
    assert log.num_steps > 0 and calls == []
