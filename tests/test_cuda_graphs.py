"""Decode steps replayed from graphs equal the plain forward pass.

On the CPU, `eager_capture` stands in for CUDA's capture: the buckets and the static
buffers are then checked everywhere (rows that pad a step to a graph's size are the
scheduler's, tests/test_shape.py). The tests marked `gpu` capture real CUDA graphs;
they are skipped, with the reason, where no CUDA device is present."""

import numpy as np
import pytest
import torch

import labkit as lk
from labkit.engine import Engine, ModelConfig, PagedKVCache, ModelInputs, TinyGPT
from labkit.engine.cuda_graphs import DecodeGraphs, eager_capture, next_power_of_two
from labkit.sched.blocks import num_blocks_for

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=64)
BLOCK_SIZE = 4
NUM_BLOCKS = 40



def gpu(test):
    """Marked `gpu` (`pytest -m gpu` runs these alone), and skipped with the reason where CUDA is absent."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


def decode_batch(seed, num_requests, device="cpu"):
    """A decode step of `num_requests` requests at random depths, in scattered blocks."""
    rng = np.random.default_rng(seed)
    depths = rng.integers(1, 30, num_requests)  # tokens already cached
    blocks = rng.permutation(NUM_BLOCKS)
    tables, start = [], 0
    for depth in depths:
        count = num_blocks_for(depth + 1, BLOCK_SIZE) + int(rng.integers(0, 2))  # sometimes a block reserved ahead
        tables.append(blocks[start : start + count])
        start += count
    tokens = [[int(t)] for t in rng.integers(0, CONFIG.vocab_size, num_requests)]
    return ModelInputs.build(tokens, depths.tolist(), tables, BLOCK_SIZE, device)


def filled_cache(device="cpu"):
    cache = PagedKVCache(CONFIG, NUM_BLOCKS, BLOCK_SIZE, device)
    generator = torch.Generator(device=device).manual_seed(0)
    cache.k.normal_(generator=generator)
    cache.v.normal_(generator=generator)
    return cache


def compare(model, capture, sizes, device="cpu"):
    """Logits and cache after each decode step, plain against replayed, on two copies of one cache."""
    plain, graphed = filled_cache(device), filled_cache(device)
    graphs = DecodeGraphs(model, graphed, capture=capture)
    with torch.inference_mode():
        for seed, size in enumerate(sizes):
            batch = decode_batch(seed, size, device)
            torch.testing.assert_close(graphs(batch), model(batch, plain), atol=1e-5, rtol=1e-5)
            lendable = slice(0, NUM_BLOCKS)  # the padding block may differ: padding rows write there
            torch.testing.assert_close(graphed.k[:, lendable], plain.k[:, lendable], atol=1e-6, rtol=0)
    return graphs


def record_graph_replays(monkeypatch) -> list[int]:
    """Have the engine's decode graphs capture on the CPU's stand-in and note each replay's
    batch size in the list returned."""
    from labkit.engine import engine as engine_module

    replays = []

    class Recorded(DecodeGraphs):
        def __call__(self, batch):
            replays.append(batch.num_requests)
            return super().__call__(batch)

    monkeypatch.setattr(engine_module, "DecodeGraphs", lambda model, cache: Recorded(model, cache, capture=eager_capture))
    return replays


def test_replayed_decodes_equal_the_plain_forward():
    model = TinyGPT(CONFIG, seed=0).eval()
    graphs = compare(model, eager_capture, sizes=[3, 1, 5, 8, 2, 5, 7])
    assert {batch for batch, _ in graphs.buckets} == {3, 1, 5, 8, 2, 7}  # a graph per batch size met: the scheduler
    # pads a step to the engine's shape before it arrives, so no row is computed unlogged


@pytest.mark.parametrize("policy", [lk.Static(3), lk.Static(3, num_blocks=20, block_size=4),
                                    lk.Continuous(3, num_blocks=9, block_size=4)], ids=repr)
def test_an_engine_that_replays_decodes_gives_the_same_tokens(policy, monkeypatch):
    """The engine's own use of graphs (decodes replayed, prefills eager), on the CPU's stand-in capture."""
    trace = lk.Trace.from_lengths([12, 10, 14, 9, 11], prompt_lengths=[6, 7, 5, 8, 3])
    plain = Engine(CONFIG, device="cpu", seed=0).run(trace, policy, progress=False)
    engine = Engine(CONFIG, device="cpu", seed=0)
    engine.cuda_graphs = True
    replays = record_graph_replays(monkeypatch)
    assert engine.run(trace, policy, progress=False).outputs == plain.outputs
    assert len(replays) == int((plain.prefill_tokens.sum(axis=1) == 0).sum()) > 0  # every pure decode step, no other


def test_only_pure_decode_steps_replay():
    decode = ModelInputs.build([[1], [2]], [3, 5], [[0, 1], [2, 3]], BLOCK_SIZE)
    mixed = ModelInputs.build([[1], [2, 3, 4]], [3, 0], [[0, 1], [2, 3]], BLOCK_SIZE)
    assert DecodeGraphs.can_run(decode) and not DecodeGraphs.can_run(mixed)


def test_context_buckets_are_powers_of_two():
    assert [next_power_of_two(n) for n in (1, 2, 3, 5, 8, 9, 33)] == [1, 2, 4, 8, 8, 16, 64]


# On a CUDA device ------------------------------------------------------------------------


@gpu
def test_cuda_graph_replay_equals_eager():
    model = TinyGPT(CONFIG, seed=0).to("cuda").eval()
    compare(model, None, sizes=[3, 1, 5, 8, 2, 5, 7], device="cuda")


@gpu
@pytest.mark.parametrize("attention", ["batched", "per_request"])
def test_cuda_batched_equals_solo_in_fp32(attention):
    from dataclasses import replace

    engine = Engine(replace(CONFIG, attention=attention), device="cuda", seed=0)
    trace = lk.Trace.from_lengths([5, 1, 9, 3, 7, 2], prompt_lengths=[3, 0, 12, 1, 20, 6])
    solo = {int(rid): engine.run(trace.select([i]), lk.Continuous(1), progress=False).outputs[int(rid)]
            for i, rid in enumerate(trace.ids)}
    for policy in (lk.Static(2), lk.Continuous(3), lk.Continuous(4, num_blocks=9, block_size=4)):
        assert engine.run(trace, policy, progress=False).outputs == solo


@gpu
def test_cuda_graphs_give_the_same_tokens_as_eager_steps():
    trace = lk.Trace.sample(12, output="exponential", mean_output=8, mean_prompt=5, seed=4)
    runs = [Engine(CONFIG, device="cuda", seed=0, cuda_graphs=on).run(trace, lk.Continuous(4), progress=False)
            for on in (True, False)]
    assert runs[0].outputs == runs[1].outputs


@gpu
def test_cuda_engine_replays_graphs_at_the_shape_sizes(monkeypatch):
    trace = lk.Trace.from_lengths([6] * 9, prompt_lengths=[2] * 9)
    engine = Engine(CONFIG, device="cuda", seed=0)
    policy = lk.Continuous(16, shape=engine.execution_shape([8, 16]))
    sizes = []
    record = DecodeGraphs.__call__
    monkeypatch.setattr(DecodeGraphs, "__call__", lambda self, batch: sizes.append(batch.num_requests) or record(self, batch))
    log = engine.run(trace, policy, progress=False)
    assert sizes == [16] * 5 and log.num_rows.tolist() == [9, 16, 16, 16, 16, 16]
    assert log.outputs == engine.run(trace, lk.Continuous(16), progress=False).outputs


@gpu
def test_cuda_engine_twin_of_the_simulator():
    trace = lk.Trace.sample(12, output="exponential", mean_output=6, mean_prompt=5, seed=4)
    engine = Engine(CONFIG, device="cuda", seed=0)
    for policy in (lk.Static(3), lk.Continuous(3), lk.Continuous(3, num_blocks=8, block_size=4)):
        assert engine.run(trace, policy, progress=False).slots.tolist() == lk.simulate(trace, policy).slots.tolist()
