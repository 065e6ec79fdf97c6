"""`labkit.engine.checkpoint`: Llama model directories loaded into TinyGPT, against transformers on the same files.

Each directory is written by `save_llama_dir` with weights large enough (std 0.2) that
attention, and so positions and key/value heads, decide the tokens; the negative controls
show that a wrong rope factor or a swapped key/value head changes them."""

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

import labkit as lk
from labkit.engine import Engine, ModelConfig, PagedKVCache, TinyGPT
from labkit.engine.attention import ATTENTION_LAYOUTS
from labkit.engine.checkpoint import load_checkpoint
from labkit.engine.peers import save_llama_dir
from labkit.engine.rope import RopeScaling

transformers = pytest.importorskip("transformers")

BASE = ModelConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=128)
CONFIGS = {
    "gqa, head_dim 32": replace(BASE, n_kv_heads=2, explicit_head_dim=32, rope_theta=5000.0),
    "one kv head, tied": replace(BASE, n_kv_heads=1, tie_embeddings=True),
    "linear": replace(BASE, n_kv_heads=2, rope_theta=20000.0, rope_scaling=RopeScaling("linear", 2.0)),
    # wavelengths 6.3 (kept), 19.9 (smoothed) and 62.8 up (divided): every branch of llama3
    "llama3": replace(BASE, n_kv_heads=2, tie_embeddings=True, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 32)),
}
WEIGHT_STD = 0.2
PROMPTS = [[5, 9, 33], list(range(40, 61)), [7], list(range(100, 140, 3))]
NUM_OUT = 10
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    """name -> a saved model directory; "llama3" in the Llama 3.2 layout (rope_scaling, rope_theta on top)."""
    saved = {}
    for name, config in CONFIGS.items():
        saved[name] = tmp_path_factory.mktemp(name.replace(" ", "").replace(",", "-"))
        save_llama_dir(saved[name], config, seed=1, initializer_range=WEIGHT_STD)
    raw = json.loads((saved["llama3"] / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    (saved["llama3"] / "config.json").write_text(json.dumps({**raw, "rope_scaling": rope}))
    return saved


def hf_greedy(directory, prompts: list[list[int]], num_out: int, **generate) -> list[list[int]]:
    """transformers' own greedy `generate` on the directory's model, each prompt after BOS 0."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).float().eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([[0, *prompt]])
        generate = {"eos_token_id": None, "min_new_tokens": num_out, **generate}
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=num_out,
                             pad_token_id=0, **generate)
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


def engine_greedy(model: TinyGPT, prompts: list[list[int]], num_out: int, cuda_graphs: bool = False) -> list[list[int]]:
    """The engine's tokens, the prompts batched by continuous batching over a paged cache."""
    trace = lk.Trace.from_lengths([num_out] * len(prompts), prompt_tokens=[np.array(p) for p in prompts])
    engine = Engine(model=model, device="cpu", threads=1)
    engine.cuda_graphs = cuda_graphs  # on the CPU: with engine.DecodeGraphs patched to the stand-in capture
    log = engine.run(trace, lk.Continuous(num_slots=3, block_size=BLOCK_SIZE), progress=False)
    return [log.outputs[int(request_id)] for request_id in trace.ids]


@pytest.fixture(scope="module")
def expected(directories):
    return {name: hf_greedy(directory, PROMPTS, NUM_OUT) for name, directory in directories.items()}


@pytest.mark.parametrize("attention", ATTENTION_LAYOUTS)
@pytest.mark.parametrize("name", CONFIGS)
def test_loaded_checkpoints_give_transformers_greedy_tokens(directories, expected, name, attention):
    checkpoint = load_checkpoint(directories[name], attention=attention)
    assert checkpoint.model.config == replace(CONFIGS[name], attention=attention)
    assert engine_greedy(checkpoint.model, PROMPTS, NUM_OUT) == expected[name]


def test_decodes_replayed_as_cuda_graphs_give_the_same_tokens(directories, expected, monkeypatch):
    """Grouped-query decode steps through `DecodeGraphs`' buckets and static buffers (the CPU's
    stand-in capture; `labkit.engine.cuda_graphs`)."""
    from tests.test_cuda_graphs import record_graph_replays

    replays = record_graph_replays(monkeypatch)
    model = load_checkpoint(directories["gqa, head_dim 32"]).model
    assert engine_greedy(model, PROMPTS, NUM_OUT, cuda_graphs=True) == expected["gqa, head_dim 32"]
    assert sum(replays) > len(PROMPTS)  # decode steps replayed, several requests each


def test_rotary_tables_are_transformers_own(directories):
    for name, directory in directories.items():
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
        positions = torch.arange(BASE.max_seq_len)[None]  # (1, max_len)
        cos, sin = hf_model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)  # (1, max_len, hs) each
        rotary = load_checkpoint(directory).model.rotary
        assert torch.equal(rotary.cos, cos[0]), name
        assert torch.equal(rotary.signed_sin[:, rotary.cos.shape[1] // 2 :], sin[0, :, sin.shape[2] // 2 :]), name


@pytest.mark.parametrize("name, wrong", [
    ("linear", RopeScaling("linear", 2.5)),
    ("llama3", RopeScaling("llama3", 6.0, 1.0, 4.0, 32)),
    ("llama3", None),
])
def test_a_wrong_rope_scaling_changes_the_tokens(directories, expected, name, wrong):
    """Negative control: the comparison sees the rope scaling."""
    checkpoint = load_checkpoint(directories[name])
    model = TinyGPT(replace(checkpoint.model.config, rope_scaling=wrong)).load_hf_state(checkpoint.model.state_dict())
    assert engine_greedy(model, PROMPTS, NUM_OUT) != expected[name]


def test_a_swapped_key_value_head_changes_the_tokens(directories, expected):
    """Negative control: query heads 0-1 read kv head 0 and heads 2-3 kv head 1; swapping the two
    kv heads (in k_proj and v_proj alike) must show."""
    checkpoint = load_checkpoint(directories["linear"])
    state = checkpoint.model.state_dict()
    config = checkpoint.model.config
    q_size, kv_size, hs = config.n_heads * config.head_dim, config.kv_heads * config.head_dim, config.head_dim
    for layer in range(config.n_layers):
        qkv = state[f"model.layers.{layer}.self_attn.qkv_proj.weight"]  # (q_size + 2 kv_size, C)
        for start in (q_size, q_size + kv_size):  # k's rows, then v's
            head_0, head_1 = qkv[start : start + hs].clone(), qkv[start + hs : start + 2 * hs].clone()
            qkv[start : start + hs], qkv[start + hs : start + 2 * hs] = head_1, head_0
    model = TinyGPT(config).load_hf_state(state)
    assert engine_greedy(model, PROMPTS, NUM_OUT) != expected["linear"]


def test_the_cache_keeps_only_the_key_value_heads():
    config = CONFIGS["gqa, head_dim 32"]
    cache = PagedKVCache(config, num_blocks=3, block_size=4, device="cpu")
    assert cache.k.shape == (2, 4, 4, 2, 32)  # layers, blocks + padding, block size, kv heads, head_dim


def test_eos_and_bos_come_from_the_directory(directories, tmp_path):
    directory = tmp_path / "with-eos"
    shutil.copytree(directories["gqa, head_dim 32"], directory)
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "eos_token_id": [7, 9], "bos_token_id": 5}))
    checkpoint = load_checkpoint(directory)
    assert checkpoint.eos_token_ids == (7, 9)
    assert checkpoint.model.config.bos_token_id == 0  # the tokenizer's "<s>" wins over config.json's 5
    assert load_checkpoint(directories["linear"], max_seq_len=64).model.config.max_seq_len == 64


def rewritten(directory, tmp_path, change):
    """A copy of `directory` whose config.json is `change(config dict)`."""
    copy = tmp_path / "changed"
    shutil.copytree(directory, copy)
    raw = json.loads((copy / "config.json").read_text())
    change(raw)
    (copy / "config.json").write_text(json.dumps(raw))
    return copy


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(model_type="mistral"), "model_type = 'mistral': TinyGPT supports 'llama'"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act = 'gelu': TinyGPT supports 'silu'"),
    (lambda c: c.update(attention_bias=True), "attention_bias = True: TinyGPT supports False"),
    (lambda c: c.update(mlp_bias=True), "mlp_bias = True: TinyGPT supports False"),
    (lambda c: c["rope_parameters"].update(rope_type="dynamic", factor=2.0),
     "rope_type = 'dynamic': TinyGPT supports 'default' or 'linear' or 'llama3'"),
    (lambda c: c["rope_parameters"].update(rope_type="yarn", factor=2.0),
     "rope_type = 'yarn': TinyGPT supports 'default' or 'linear' or 'llama3'"),
    (lambda c: c["rope_parameters"].update(rope_type="linear", factor=0.5), "factor = 0.5: must be a number >= 1"),
    (lambda c: c["rope_parameters"].update(rope_type="llama3", factor=8.0, high_freq_factor=4.0),
     "config.json: Missing required keys in `rope_parameters` for 'rope_type'='llama3': {'low_freq_factor'}"),
    (lambda c: c.update(hidden_size="wide"), "config.json: Validation error for field 'hidden_size'"),
    (lambda c: c["rope_parameters"].update(partial_rotary_factor=0.5),
     "partial_rotary_factor = 0.5: TinyGPT supports 1.0"),
    (lambda c: c.update(quantization_config={"quant_method": "bitsandbytes"}),
     "quantization_config = {'quant_method': 'bitsandbytes'}: TinyGPT loads unquantized weights only"),
])
def test_unsupported_configurations_are_refused_by_name(directories, tmp_path, change, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        load_checkpoint(rewritten(directories["linear"], tmp_path, change))


@pytest.mark.parametrize("missing, message", [
    ("config.json", "no config.json"),
    ("model.safetensors", "no model.safetensors and no model.safetensors.index.json"),
    ("tokenizer.json", "no tokenizer"),
])
def test_missing_files_are_refused_by_name(directories, tmp_path, missing, message):
    copy = tmp_path / "partial"
    shutil.copytree(directories["linear"], copy)
    for name in [missing, "tokenizer_config.json"] if missing == "tokenizer.json" else [missing]:
        (copy / name).unlink()
    with pytest.raises(ValueError, match=message):
        load_checkpoint(copy)


def test_weights_that_do_not_fit_the_config_are_refused(directories, tmp_path):
    directory = rewritten(directories["linear"], tmp_path, lambda c: c.update(num_hidden_layers=3))
    with pytest.raises(ValueError, match="(?s)the weights do not fit config.json: .*Missing key.*model.layers.2"):
        load_checkpoint(directory)


def test_a_truncated_weights_file_is_one_line_naming_it(directories, tmp_path):
    copy = tmp_path / "truncated"
    shutil.copytree(directories["linear"], copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError) as refused:
        load_checkpoint(copy)
    message = str(refused.value)
    assert message.startswith(f"{weights}: not a whole safetensors file (") and "\n" not in message


@pytest.mark.parametrize("tensor, message", [
    ("model.layers.1.self_attn.k_proj.weight", "the weights have no tensor 'model.layers.1.self_attn.k_proj.weight', "
                                                "which config.json's model needs"),
    ("model.layers.1.self_attn.q_proj.weight", 'the weights do not fit config.json: Error(s) in loading state_dict for '
                                                'TinyGPT: Missing key(s) in state_dict: '
                                                '"model.layers.1.self_attn.qkv_proj.weight". Unexpected key(s) in '
                                                'state_dict: "model.layers.1.self_attn.k_proj.weight", '
                                                '"model.layers.1.self_attn.v_proj.weight".'),  # k and v, unstacked
])
def test_a_missing_tensor_is_one_line_naming_it(directories, tmp_path, tensor, message):
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "missing"
    shutil.copytree(directories["linear"], copy)
    state = load_file(copy / "model.safetensors")
    del state[tensor]
    save_file(state, copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as refused:
        load_checkpoint(copy)
    assert str(refused.value) == f"{copy}: {message}"


def test_a_sharded_directory_loads_the_same_weights(directories, tmp_path):
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directories["linear"], local_files_only=True)
    hf_model.save_pretrained(tmp_path, max_shard_size="50KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(directories["linear"] / name, tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    sharded = load_checkpoint(tmp_path).model.state_dict()
    whole = load_checkpoint(directories["linear"]).model.state_dict()
    assert sharded.keys() == whole.keys() and all(torch.equal(sharded[k], whole[k]) for k in whole)


def test_bad_arguments_are_refused_by_name(directories, tmp_path):
    with pytest.raises(ValueError, match="model directory .*nowhere.*: not found"):
        load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="max_seq_len = 129: must be a whole number in 1..128"):
        load_checkpoint(directories["linear"], max_seq_len=129)
