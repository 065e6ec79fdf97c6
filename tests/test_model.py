"""TinyGPT over a paged KV cache: paged == dense, batched == solo, seeds, bad input."""

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from labkit.engine.attention import ATTENTION_LAYOUTS
from labkit.engine.config import ModelConfig
from labkit.engine.device import resolve_device
from labkit.engine.kv import PagedKVCache
from labkit.engine.model import ModelInputs, TinyGPT

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=64)
BLOCK_SIZE = 4
NUM_BLOCKS = 16


@pytest.fixture(scope="module", params=ATTENTION_LAYOUTS)
def model(request):
    return TinyGPT(replace(CONFIG, attention=request.param), seed=0).eval()


def noisy_cache(seed=1):
    """A cache full of noise, so that reading an entry never written shows up in the logits."""
    cache = PagedKVCache(CONFIG, NUM_BLOCKS, BLOCK_SIZE, "cpu")
    generator = torch.Generator().manual_seed(seed)
    cache.k.normal_(generator=generator)
    cache.v.normal_(generator=generator)
    return cache


def prompt(length, seed):
    return torch.randint(0, CONFIG.vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def table(*block_ids):
    return torch.tensor(block_ids, dtype=torch.long)


# A dense reference, written independently of the model's forward -----------------------


def dense_logits(model, ids):
    """Logits at every position of one sequence: the textbook full causal forward."""
    cfg, body = model.config, model.model
    L, nh, hs = len(ids), cfg.n_heads, cfg.head_dim

    def norm(x, weight):
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps)

    def rope(x):  # (L, nh, hs): rotate the pairs (x[j], x[j + hs/2]) by angle pos * theta^(-2j/hs)
        angle = torch.arange(L)[:, None] * cfg.rope_theta ** (-torch.arange(hs // 2) * 2 / hs)  # (L, hs/2)
        cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]  # (L, 1, hs/2)
        x1, x2 = x[..., : hs // 2], x[..., hs // 2 :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    x = body.embed_tokens.weight[torch.tensor(ids)]  # (L, C)
    future = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)  # (L, L)
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        wq, wk, wv = attn.qkv_proj.weight.chunk(3)  # (C, C) each
        h = norm(x, layer.input_layernorm.weight)
        q = rope((h @ wq.T).view(L, nh, hs)).transpose(0, 1)  # (nh, L, hs)
        k = rope((h @ wk.T).view(L, nh, hs)).transpose(0, 1)  # (nh, L, hs)
        v = (h @ wv.T).view(L, nh, hs).transpose(0, 1)  # (nh, L, hs)
        scores = (q @ k.transpose(1, 2) / hs**0.5).masked_fill(future, float("-inf"))  # (nh, L, L)
        y = (scores.softmax(-1) @ v).transpose(0, 1).reshape(L, -1)  # (L, C)
        x = x + y @ attn.o_proj.weight.T
        h = norm(x, layer.post_attention_layernorm.weight)
        w_gate, w_up = mlp.gate_up_proj.weight.chunk(2)  # (d_ff, C) each
        gate, up = h @ w_gate.T, h @ w_up.T
        x = x + (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.T
    return norm(x, body.norm.weight) @ model.lm_head.weight.T  # (L, vocab)


# A tiny greedy engine loop --------------------------------------------------------------


def run_greedy(model, cache, prompts, tables, num_out, join_steps=None, prefill_chunk=None):
    """Greedy-decode every prompt; request i joins at step join_steps[i]. A prompt is
    prefilled prefill_chunk tokens per step (all at once by default). Returns each request's
    generated tokens and the (num_out, vocab) logits that chose them."""
    n = len(prompts)
    join_steps = join_steps or [0] * n
    seqs, num_cached, logits = [list(p) for p in prompts], [0] * n, [[] for _ in prompts]
    step = 0
    while any(len(logits[i]) < num_out for i in range(n)):
        active = [i for i in range(n) if join_steps[i] <= step and len(logits[i]) < num_out]
        if active:
            new = [seqs[i][num_cached[i] :][:prefill_chunk] for i in active]
            batch = ModelInputs.build(new, [num_cached[i] for i in active], [tables[i] for i in active], BLOCK_SIZE)
            out = model(batch, cache)
            for row, i, tokens in zip(out, active, new):
                num_cached[i] += len(tokens)
                if num_cached[i] == len(seqs[i]):  # the last new token was the sequence's last: sample
                    seqs[i].append(int(row.argmax()))
                    logits[i].append(row)
        step += 1
    return [s[len(p) :] for s, p in zip(seqs, prompts)], [torch.stack(rows) for rows in logits]


# Paged == dense -------------------------------------------------------------------------


@pytest.mark.parametrize("prefill_chunk", [None, 3])
def test_paged_equals_dense(model, prefill_chunk):
    ids, num_out = prompt(7, seed=0), 6
    scattered = table(9, 2, 14, 5)  # 13 positions in 4 blocks, far apart and out of order
    tokens, logits = run_greedy(model, noisy_cache(), [ids], [scattered], num_out, prefill_chunk=prefill_chunk)
    reference = dense_logits(model, ids + tokens[0][:-1])[len(ids) - 1 :]  # (num_out, vocab)
    torch.testing.assert_close(logits[0], reference, atol=1e-5, rtol=1e-5)
    assert tokens[0] == reference.argmax(-1).tolist()


def decode_with_table(model, read_table):
    """Prefill two requests, A in blocks (9, 2) and B in (5, 11); decode token 5 for A at
    position 7, written where A's table says, but read through read_table."""
    cache = noisy_cache()
    model(ModelInputs.build([prompt(7, seed=0), prompt(8, seed=4)], [0, 0], [table(9, 2), table(5, 11)], BLOCK_SIZE),
          cache)
    batch = ModelInputs.build([[5]], [7], [read_table], BLOCK_SIZE)
    batch.write_entries = ModelInputs.build([[5]], [7], [table(9, 2)], BLOCK_SIZE).write_entries
    return model(batch, cache)[0]


def test_wrong_block_table_changes_logits(model):
    """Negative control: read A's context through a table with B's block in it and the comparison fails."""
    right = dense_logits(model, prompt(7, seed=0) + [5])[-1]
    torch.testing.assert_close(decode_with_table(model, table(9, 2)), right, atol=1e-5, rtol=1e-5)
    assert (decode_with_table(model, table(9, 5)) - right).abs().max() > 1e-3


def test_decode_sees_its_context_as_a_set(model):
    """Swapping A's own two blocks leaves a decode step unchanged: the keys carry their positions
    (rotary was applied before they were written) and attention sums over them in any order.
    So a negative control must read a wrong block, not reorder the right ones."""
    torch.testing.assert_close(decode_with_table(model, table(2, 9)), decode_with_table(model, table(9, 2)))


# Batched == solo ------------------------------------------------------------------------


def test_batched_equals_solo(model):
    prompts = [prompt(6, seed=1), prompt(11, seed=2), prompt(1, seed=3)]
    tables = [table(3, 0, 12), table(7, 1, 15, 10), table(4, 8, 11)]
    num_out = 5
    solo = [run_greedy(model, noisy_cache(), [p], [t], num_out) for p, t in zip(prompts, tables)]
    # all three together, the third joining late: its prefill shares steps with the others' decodes
    tokens, logits = run_greedy(model, noisy_cache(), prompts, tables, num_out, join_steps=[0, 0, 2])
    for i, (solo_tokens, solo_logits) in enumerate(solo):
        assert tokens[i] == solo_tokens[0]
        torch.testing.assert_close(logits[i], solo_logits[0], atol=1e-5, rtol=1e-5)


def test_step_returns_one_row_per_request(model):
    batch = ModelInputs.build([[1, 2, 3], [4]], [0, 5], [table(0, 1), table(2, 3)], BLOCK_SIZE)
    assert batch.num_requests == 2 and batch.context_lens == [3, 6]
    assert batch.write_entries.tolist() == [0, 1, 2, 13]
    assert model(batch, PagedKVCache(CONFIG, NUM_BLOCKS, BLOCK_SIZE, "cpu")).shape == (2, CONFIG.vocab_size)


# Seeded weights -------------------------------------------------------------------------


def test_seeded_weights_are_deterministic():
    a, b, c = TinyGPT(CONFIG, seed=0), TinyGPT(CONFIG, seed=0), TinyGPT(CONFIG, seed=1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert name.endswith("norm.weight") or not torch.equal(pa, pc), name
    assert a.num_parameters() == 2 * 64 * 32 + 2 * (4 * 32 * 32 + 3 * 32 * 64 + 2 * 32) + 32


def test_default_config():
    config = ModelConfig()
    assert (config.vocab_size, config.d_model, config.n_layers, config.n_heads, config.d_ff) == (512, 256, 4, 4, 768)
    assert (config.max_seq_len, config.rope_theta, config.norm_eps, config.head_dim) == (2048, 10000.0, 1e-5, 64)


@pytest.mark.integration  # starts a process that imports torch
def test_importing_the_model_does_not_import_transformers():
    code = "import sys, labkit.engine.config, labkit.engine.model, labkit.engine.kv; print('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


# Bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("vocab_size", 0), ("d_model", -8), ("n_layers", 1.5), ("n_heads", True), ("d_ff", 0),
     ("max_seq_len", 0), ("rope_theta", 0.0), ("norm_eps", -1e-5)],
)
def test_config_rejects_bad_sizes(field, value):
    with pytest.raises(ValueError, match=f"{field} = {value!r}"):
        ModelConfig(**{field: value})


def test_config_rejects_indivisible_heads():
    with pytest.raises(ValueError, match="d_model = 30: must be divisible by n_heads = 4"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="d_model = 30.*even"):
        ModelConfig(d_model=30, n_heads=2)


@pytest.mark.parametrize(("field", "value"), [("num_blocks", 0), ("block_size", 2.0)])
def test_cache_rejects_bad_sizes(field, value):
    sizes = {"num_blocks": 4, "block_size": 4, field: value}
    with pytest.raises(ValueError, match=f"{field} = {value!r}"):
        PagedKVCache(CONFIG, device="cpu", **sizes)


def test_cache_shape():
    cache = PagedKVCache(CONFIG, num_blocks=5, block_size=3, device="cpu")
    assert cache.k.shape == cache.v.shape == (2, 6, 3, 2, 16)  # five blocks to lend, and the padding block
    assert cache.padding_block == 5 and cache.num_entries == 18
    assert cache.num_bytes == 2 * 2 * 6 * 3 * 32 * 4
    k, _ = cache.layer(1)
    k[7] = 1.0
    assert cache.k[1, 2, 1].eq(1.0).all()  # entry 7 = block 2, offset 1


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


def test_resolve_device(cpu_only, monkeypatch):
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda")


@pytest.mark.parametrize(
    ("name", "message"),
    [("gpu", "device = 'gpu': must be one of auto, cpu, cuda, mps; available on this machine: cpu"),
     ("cuda", "device = 'cuda' is not present; available on this machine: cpu"),
     ("mps", "device = 'mps' is not present; available on this machine: cpu")],
)
def test_resolve_device_errors(cpu_only, name, message):
    with pytest.raises(ValueError, match=message):
        resolve_device(name)
