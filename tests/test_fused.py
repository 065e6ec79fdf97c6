"""The fast path equals the plain one: `FusedTinyGPT` against `TinyGPT.forward`, on any step.

Each step is drawn: requests whose new tokens are a whole prompt, a chunk of one, a decode
or a finished request's padded row (its last token again), rows that pad the step to a
shape (token 0 in the cache's padding block), contexts in scattered blocks, grouped-query
attention or not, a tied LM head or not, either attention layout, and decode chunks from
one request each to uncut. Both paths run on copies of one cache. Their logits, and every
key and value they write, agree within 1e-5, and their greedy tokens are the same wherever
the top two logits are further apart than that. They need not agree bit for bit: the fast
path multiplies by transposed weights and may run attention on fewer rows a call, and the
CPU's kernels round otherwise for another layout or batch (MKL's GEMM for 1 to 3 rows;
`scaled_dot_product_attention`), as any batched engine's do; a near tie may then go either
way. Whole engine runs are checked step by step the same way, and give the plain path's
tokens on the lessons' traces.
"""

import copy
from dataclasses import replace
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import labkit as lk
from labkit.engine import Engine, ModelConfig, PagedKVCache, ModelInputs, TinyGPT
from labkit.engine.cuda_graphs import DecodeGraphs, eager_capture
from labkit.engine.fused import FusedTinyGPT
from labkit.engine.model_runner import ModelRunner
from labkit.engine.timing import count_step_operations
from labkit.sched.blocks import num_blocks_for
from tests.strategies import knobs, prompted_traces

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=64)
NUM_BLOCKS = 256
CHUNKS = [None, 1, 256, 1 << 20]  # bytes of keys and values a decode chunk gathers: one request each .. uncut


@st.composite
def models(draw):
    config = replace(CONFIG, n_kv_heads=draw(st.sampled_from([None, 2, 1])), tie_embeddings=draw(st.booleans()),
                     attention=draw(st.sampled_from(["batched", "per_request"])))
    return TinyGPT(config, seed=draw(st.integers(0, 3))).eval()


@st.composite
def steps(draw, block_size):
    """(new tokens, start positions, block tables) of a step; the rows of one request share nothing."""
    blocks = iter(draw(st.permutations(range(NUM_BLOCKS))))
    new_tokens, starts, tables = [], [], []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["prompt", "chunk", "decode", "padded", "shape"]))
        start = 0 if kind in ("prompt", "shape") else draw(st.integers(1, 30))
        count = draw(st.integers(2, 8)) if kind in ("prompt", "chunk") else 1
        new_tokens.append(draw(st.lists(st.integers(0, CONFIG.vocab_size - 1), min_size=count, max_size=count))
                          if kind != "shape" else [0])
        starts.append(start - (kind == "padded"))  # a padded row feeds its last computed token again
        lent = num_blocks_for(start + count, block_size) + draw(st.integers(0, 1))  # a block reserved ahead
        tables.append([NUM_BLOCKS] if kind == "shape" else [next(blocks) for _ in range(lent)])
    return new_tokens, starts, tables


def filled_cache(config, block_size, seed=0):
    cache = PagedKVCache(config, NUM_BLOCKS, block_size, "cpu")
    generator = torch.Generator().manual_seed(seed)
    cache.k.normal_(generator=generator)
    cache.v.normal_(generator=generator)
    return cache


def run_both(model, fused, step, block_size):
    """(plain logits, fused logits, plain cache, fused cache) after one step on copies of one cache."""
    batch = ModelInputs.build(*step, block_size)
    plain_cache, fused_cache = filled_cache(model.config, block_size), filled_cache(model.config, block_size)
    with torch.inference_mode():
        return model(batch, plain_cache), fused(batch, fused_cache), plain_cache, fused_cache


TOLERANCE = 1e-5  # float32 logits of one step, fast path against plain


def assert_same_greedy_tokens(fused, plain):
    """Equal argmax on every row whose top two plain logits are more than TOLERANCE apart."""
    top_two = plain.topk(2, dim=-1).values  # (R, 2)
    clear = top_two[:, 0] - top_two[:, 1] > TOLERANCE
    assert torch.equal(fused.argmax(-1)[clear], plain.argmax(-1)[clear])


def assert_same_step(fused, plain, fused_cache, plain_cache):
    torch.testing.assert_close(fused, plain, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(fused_cache.k, plain_cache.k, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(fused_cache.v, plain_cache.v, atol=TOLERANCE, rtol=0)
    assert_same_greedy_tokens(fused, plain)


@settings(max_examples=40, deadline=None)
@given(st.data(), models(), st.sampled_from([1, 4, 16]), st.sampled_from(CHUNKS))
def test_the_fused_step_equals_the_plain_step(data, model, block_size, chunk_bytes):
    step = data.draw(steps(block_size))
    plain, fused, plain_cache, fused_cache = run_both(model, FusedTinyGPT(model, chunk_bytes), step, block_size)
    assert_same_step(fused, plain, fused_cache, plain_cache)


def test_decode_chunks_split_a_group_and_pad_it_as_one():
    model = TinyGPT(CONFIG, seed=0).eval()
    step = ([[5]] * 6, [20, 3, 17, 9, 30, 1], [[i, i + 6, i + 12] for i in range(6)])
    fused = FusedTinyGPT(model, chunk_bytes=2 * 32 * 4 * 32 * 2)  # 32 entries of k and v: two requests a chunk
    batch = ModelInputs.build(*step, 16)
    attention = fused.plan(batch, 16)
    assert [group.rows.tolist() for group in attention.decodes] == [[0, 1], [2, 3], [4, 5]]
    assert {group.key_mask.shape[-1] for group in attention.decodes} == {31}  # the group's longest context
    plain, fused_logits, _, _ = run_both(model, fused, step, 16)
    torch.testing.assert_close(fused_logits, plain, atol=TOLERANCE, rtol=0)


def test_a_perturbed_weight_fails_the_comparison():
    """Negative control: the fast path on a copy whose last o_proj weights are 0.1% larger."""
    model = TinyGPT(CONFIG, seed=0).eval()
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.model.layers[1].self_attn.o_proj.weight.mul_(1.001)
    step = ([[3, 4, 5], [7]], [0, 12], [[0], [1, 2, 3, 4]])
    plain, fused, _, _ = run_both(model, FusedTinyGPT(broken), step, 4)
    assert not torch.allclose(fused, plain, atol=TOLERANCE, rtol=0)


def test_a_wrong_block_in_a_chunk_fails_the_comparison(monkeypatch):
    """Negative control: a block group that reads its requests' first block where the second should be."""
    from labkit.engine import attention

    make = attention.block_decode_group

    def wrong_second_block(rows, block_tables, context_lens, block_size, padded_len):
        tables = block_tables.clone()
        tables[:, 1] = tables[:, 0]
        return make(rows, tables, context_lens, block_size, padded_len)

    monkeypatch.setattr(attention, "block_decode_group", wrong_second_block)
    model = TinyGPT(CONFIG, seed=0).eval()
    plain, fused, _, _ = run_both(model, FusedTinyGPT(model), ([[5], [6]], [9, 6], [[0, 1, 2], [3, 4]]), 4)
    assert not torch.allclose(fused, plain, atol=1e-3)


@settings(max_examples=20, deadline=None)
@given(trace=prompted_traces(), policy=knobs(kinds=(lk.Continuous, lk.Priority)))
def test_every_step_of_an_engine_run_equals_the_plain_step(trace, policy):
    """Whole runs on the fast path (chunked prefill, preemption and its recompute, padded shapes, every
    knob), each step also run on the plain path from a copy of the cache it started from."""
    forward, num_checked = ModelRunner.forward, []

    def shadowed(runner, inputs):
        before = copy.deepcopy(runner.cache)
        logits = forward(runner, inputs)
        with torch.inference_mode():
            assert_same_step(logits, runner.model.model(inputs, before), runner.cache, before)
        num_checked.append(1)
        return logits

    try:
        with mock.patch.object(ModelRunner, "forward", shadowed):
            log = Engine(CONFIG, device="cpu", seed=0, fused=True).run(trace, policy, progress=False)
    except ValueError:  # a request that can never fit this policy is refused up front
        return
    assert len(num_checked) == log.num_steps


@pytest.mark.parametrize("policy", [lk.Static(3), lk.Static(3, drop_finished=True), lk.Continuous(3),
                                    lk.Continuous(2, num_blocks=12, block_size=4, max_tokens_per_step=8,
                                                  chunked_prefill=True)], ids=repr)
def test_an_engine_on_the_fast_path_gives_the_plain_tokens(policy):
    trace = lk.Trace.from_lengths([12, 3, 14, 9, 1], prompt_lengths=[6, 7, 5, 8, 3])
    runs = [Engine(CONFIG, device="cpu", seed=0, fused=fused).run(trace, policy, progress=False)
            for fused in (True, False)]
    assert runs[0].outputs == runs[1].outputs


def test_decode_graphs_capture_the_fast_path():
    """CUDA graphs take whichever model the runner gets; on the CPU's stand-in capture, the fast path's
    replayed decode steps equal the plain forward's."""
    model = TinyGPT(CONFIG, seed=0).eval()
    plain_cache, graphed_cache = filled_cache(CONFIG, 4), filled_cache(CONFIG, 4)
    graphs = DecodeGraphs(FusedTinyGPT(model), graphed_cache, capture=eager_capture)
    batch = ModelInputs.build([[1], [2], [3]], [5, 20, 9], [[0, 1], [2, 3, 4, 5, 6, 7], [8, 9, 10]], 4)
    with torch.inference_mode():  # a graph pads contexts to its bucket's length: rounding may differ
        torch.testing.assert_close(graphs(batch), model(batch, plain_cache), atol=TOLERANCE, rtol=0)


def test_the_fast_path_asks_for_fewer_operations():
    engine = Engine(ModelConfig(), device="cpu", seed=0)
    plain = count_step_operations(engine, batch_size=8)
    engine.model = FusedTinyGPT(engine.model)  # count_step_operations steps engine.model
    assert count_step_operations(engine, batch_size=8) < 0.85 * plain


def test_the_fast_path_takes_the_weights_the_model_has_when_built():
    model = TinyGPT(CONFIG, seed=0).eval()
    with torch.no_grad():
        model.model.layers[0].self_attn.qkv_proj.weight.mul_(2)  # loaded in place, before the fast path is built
    plain, fast, plain_cache, fast_cache = run_both(model, FusedTinyGPT(model), ([[1, 2, 3]], [0], [[0]]), 4)
    assert_same_step(fast, plain, fast_cache, plain_cache)


def test_the_knob_is_checked():
    with pytest.raises(ValueError, match="fused = 'yes'"):
        Engine(CONFIG, device="cpu", fused="yes")
    assert "fused=False" in repr(Engine(CONFIG, device="cpu", fused=False))


def test_labkit_serve_runs_the_fast_path_unless_asked_for_the_plain_one():
    from labkit.cli import build_parser
    from labkit.serve.server import engine_from

    _, commands = build_parser()
    served = [engine_from(commands["serve"].parse_args(flags))[0] for flags in ([], ["--plain-forward"])]
    assert [engine.fused for engine in served] == [True, False]
    assert Engine(CONFIG, device="cpu").fused is False  # Engine.run runs the step a student reads
