"""TinyGPT against Hugging Face's LlamaForCausalLM with the same weights: logits and greedy tokens."""

import pytest
import torch

import labkit as lk
from labkit.engine import Engine
from labkit.engine.attention import ATTENTION_LAYOUTS
from labkit.engine.config import ModelConfig
from labkit.engine.kv import PagedKVCache
from labkit.engine.model import ModelInputs, TinyGPT
from labkit.sched.blocks import num_blocks_for

transformers = pytest.importorskip("transformers")

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=64)
BLOCK_SIZE = 4
PROMPT_LENS = [1, 5, 12, 17]
NUM_OUT = 8


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(CONFIG.to_hf_llama_config()).float().eval()


@pytest.fixture(scope="module", params=ATTENTION_LAYOUTS)
def model(hf_model, request):
    return TinyGPT.from_hf_llama(hf_model, attention=request.param).eval()


def prompt(length, seed):
    return torch.randint(0, CONFIG.vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy_paged(model, prompts, num_out):
    """All prompts in one prefill step, then one decode step per token, every request in every step."""
    num_blocks_each = num_blocks_for(max(map(len, prompts)) + num_out, BLOCK_SIZE)
    cache = PagedKVCache(CONFIG, num_blocks_each * len(prompts), BLOCK_SIZE, "cpu")
    block_ids = torch.randperm(cache.num_blocks, generator=torch.Generator().manual_seed(0))
    tables = block_ids.view(len(prompts), num_blocks_each)  # (num_requests, num_blocks_each), scattered
    seqs, new = [list(p) for p in prompts], [list(p) for p in prompts]
    for _ in range(num_out):
        starts = [len(s) - len(n) for s, n in zip(seqs, new)]
        logits = model(ModelInputs.build(new, starts, list(tables), BLOCK_SIZE), cache)
        new = [[t] for t in logits.argmax(-1).tolist()]
        for s, n in zip(seqs, new):
            s += n
    return [s[len(p) :] for s, p in zip(seqs, prompts)]


def test_config_round_trip():
    assert ModelConfig.from_hf_llama_config(CONFIG.to_hf_llama_config()) == CONFIG
    assert ModelConfig.from_hf_llama_config(ModelConfig().to_hf_llama_config()) == ModelConfig()


def test_copied_weights_are_hf_weights(model, hf_model):
    hf_weights = hf_model.state_dict()
    assert model.num_parameters() == hf_model.num_parameters()
    stacked = {f"{layer}.{name}" for layer in ("self_attn", "mlp") for name in ("qkv_proj", "gate_up_proj")}
    for name, p in model.state_dict().items():
        if not any(s in name for s in stacked):
            assert torch.equal(p, hf_weights[name]), name
    for i, layer in enumerate(model.model.layers):
        hf = hf_model.model.layers[i]
        for stacked_weight, parts in ((layer.self_attn.qkv_proj.weight, (hf.self_attn.q_proj, hf.self_attn.k_proj,
                                                                          hf.self_attn.v_proj)),
                                      (layer.mlp.gate_up_proj.weight, (hf.mlp.gate_proj, hf.mlp.up_proj))):
            assert torch.equal(stacked_weight, torch.cat([part.weight for part in parts])), i


@pytest.mark.parametrize("length", PROMPT_LENS)
def test_last_logits_match_hf(model, hf_model, length):
    ids = prompt(length, seed=length)
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0, -1]  # (vocab,)
    cache = PagedKVCache(CONFIG, 8, BLOCK_SIZE, "cpu")
    got = model(ModelInputs.build([ids], [0], [torch.tensor([6, 1, 4, 7, 0])], BLOCK_SIZE), cache)[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def hf_greedy(hf_model, ids: list[int], num_out: int) -> list[int]:
    """transformers' own greedy `generate`, forced to emit exactly `num_out` tokens."""
    out = hf_model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False, max_new_tokens=num_out, min_new_tokens=num_out, eos_token_id=None, pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def test_greedy_tokens_match_hf_generate(model, hf_model):
    prompts = [prompt(length, seed=length) for length in PROMPT_LENS]
    expected = [hf_greedy(hf_model, ids, NUM_OUT) for ids in prompts]
    assert all(len(tokens) == NUM_OUT for tokens in expected)
    assert greedy_paged(model, prompts, NUM_OUT) == expected


@pytest.mark.parametrize("attention", ATTENTION_LAYOUTS)
def test_engine_under_continuous_batching_matches_hf_generate(hf_model, attention):
    """The whole engine (scheduler, block pool, paged cache, TinyGPT) against transformers."""
    engine = Engine(model=TinyGPT.from_hf_llama(hf_model, attention=attention), device="cpu", seed=3)
    trace = lk.Trace.from_lengths([6, 3, 9, 5, 2], prompt_lengths=[0, 4, 11, 7, 20])
    log = engine.run(trace, lk.Continuous(num_slots=2, block_size=BLOCK_SIZE), progress=False)
    expected = {
        int(rid): hf_greedy(hf_model, engine.prompt_ids(int(rid), int(prompt_len)), int(length))
        for rid, prompt_len, length in zip(trace.ids, trace.prompt_lengths, trace.output_lengths)
    }
    assert log.outputs == expected


def test_load_rejects_other_sizes(hf_model):
    with pytest.raises(ValueError, match="hf_model has config"):
        TinyGPT(ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=2, d_ff=64, max_seq_len=64)).load_hf_llama(
            hf_model
        )


def test_rejects_an_activation_other_than_silu():
    hf_config = CONFIG.to_hf_llama_config()
    hf_config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act = 'gelu': TinyGPT supports 'silu'"):
        ModelConfig.from_hf_llama_config(hf_config)
