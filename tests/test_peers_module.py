"""labkit.engine.peers: transformers' generate in static batches on the engine's weights and
prompts gives the engine's tokens, in the simulator's number of steps."""

import numpy as np
import pytest

import labkit as lk
from labkit.engine import Engine, ModelConfig
from labkit.engine.model import TinyGPT

pytest.importorskip("transformers")
from labkit.engine.peers import GenerateLog, generate_static, transformers_llama  # noqa: E402

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=64)
TRACE = lk.Trace.from_lengths([5, 1, 9, 3, 7, 2, 4], prompt_lengths=[3, 0, 12, 1, 20, 6, 2])
BATCH = 3


@pytest.fixture(scope="module")
def hf():
    return transformers_llama(CONFIG, seed=0)


@pytest.fixture(scope="module")
def engine(hf):
    return Engine(model=TinyGPT.from_hf_llama(hf), device="cpu", threads=1)


@pytest.fixture(scope="module")
def prompts(engine):
    return [engine.prompt_ids(int(rid), int(n)) for rid, n in zip(TRACE.ids, TRACE.prompt_lengths)]


@pytest.fixture(scope="module")
def log(hf, prompts):
    return generate_static(hf, prompts, TRACE, BATCH)


def test_the_llama_has_the_configs_shape_in_fp32(hf):
    assert hf.config.hidden_size == CONFIG.d_model and hf.config.num_hidden_layers == CONFIG.n_layers
    assert next(hf.parameters()).dtype.is_floating_point and str(next(hf.parameters()).dtype) == "torch.float32"
    assert not hf.training


def test_generate_takes_the_simulators_static_steps(log):
    assert isinstance(log, GenerateLog)
    assert log.num_steps == lk.simulate(TRACE, lk.Static(num_slots=BATCH)).num_steps
    batches = [TRACE.output_lengths[i : i + BATCH] for i in range(0, len(TRACE), BATCH)]
    assert log.num_steps == sum(int(b.max()) for b in batches)  # each batch runs to its longest output


def test_generate_gives_the_engines_tokens(log, engine):
    served = engine.run(TRACE, lk.Static(num_slots=BATCH), progress=False)
    assert log.outputs == served.outputs
    assert log.num_steps == served.num_steps


def test_every_request_gets_exactly_its_output_length(log):
    assert [len(log.outputs[int(rid)]) for rid in TRACE.ids] == TRACE.output_lengths.tolist()
    assert [len(t) for t in log.tokens_at] == TRACE.output_lengths.tolist()
    assert log.num_output_tokens == int(TRACE.output_lengths.sum())


def test_times_are_finite_positive_and_grouped_by_request(log):
    for values in (log.ttft, log.latency):
        assert np.isfinite(values).all() and (values > 0).all()
    assert (log.latency >= log.ttft).all()
    assert np.isfinite(log.duration) and log.duration > 0
    assert log.duration == log.latency.max()
    assert log.tokens_per_second == log.num_output_tokens / log.duration
    ids, times = log.token_times()
    assert ids.tolist() == np.repeat(TRACE.ids, TRACE.output_lengths).tolist()
    for rid in TRACE.ids:
        mine = times[ids == rid]
        assert (np.diff(mine) > 0).all()
        assert mine[0] == log.first_token_at[rid] and mine[-1] == log.finished_at[rid]
    # a batch starts when the one before has ended
    for first in range(BATCH, len(TRACE), BATCH):
        assert log.first_token_at[first : first + BATCH].min() > log.finished_at[:first].max()
    gaps = lk.metrics.itl(log)
    assert len(gaps) == int((TRACE.output_lengths - 1).sum())
    assert (gaps > 0).all()
    assert "7 requests" in repr(log) and f"{log.num_steps} steps" in repr(log)


def test_rows_of_one_batch_share_the_step_clock(log):
    """Static batching: every row of a batch gets its k-th token in the same forward pass."""
    shortest = min(len(t) for t in log.tokens_at[:BATCH])
    for row in range(1, BATCH):
        assert log.tokens_at[row][:shortest].tolist() == log.tokens_at[0][:shortest].tolist()


def test_other_weights_give_other_tokens(log, prompts):
    """Negative control of the token comparison."""
    other = generate_static(transformers_llama(CONFIG, seed=1), prompts, TRACE, BATCH)
    assert other.outputs != log.outputs
    assert other.num_steps == log.num_steps
