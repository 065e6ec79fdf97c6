"""A local Hugging Face Llama directory loaded into TinyGPT: what `labkit serve MODEL_DIR` serves.

A model directory is what `save_pretrained` writes and what `vllm serve DIR` and
`transformers serve DIR` read: config.json, the weights as safetensors (`model.safetensors`,
or the shards `model.safetensors.index.json` lists) and the tokenizer's files. Nothing is
downloaded: every file is read from the directory.

Supported (`LlamaForCausalLM`, model_type "llama"): SiLU, no biases, grouped-query attention
(num_key_value_heads dividing num_attention_heads), tied or untied embeddings
(tie_word_embeddings), any rope_theta, an explicit head_dim, and rope scaling none, "linear"
or "llama3" (Llama 3.2 1B and 3B use llama3), computed as transformers computes them
(`labkit.engine.rope`). Any other model_type, hidden_act, attention_bias or mlp_bias true,
any other rope type (dynamic, yarn, longrope, ...), partial rotary, quantized weights, and a
missing file are refused with a ValueError that names the field (or file) and its value.

Invariants:

- the model holds exactly the directory's weights: every tensor is loaded, none is left over
  (a tied LM head is the embedding, whether or not the file stores it twice);
- every sequence starts with the tokenizer's begin-of-sequence token (config.json's when the
  tokenizer has none): `ModelConfig.bos_token_id`;
- the EOS ids are those of config.json, generation_config.json and the tokenizer together,
  each inside the vocabulary; a model with none never stops early;
- `max_seq_len` may shorten the model's context (vLLM's --max-model-len), never lengthen it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from labkit.engine.config import ModelConfig
from labkit.engine.model import TinyGPT

CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE = "config.json", "model.safetensors.index.json", "model.safetensors"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")  # any one: transformers finds the rest


@dataclass
class Checkpoint:
    """A loaded model directory: the model, its own tokenizer (a transformers tokenizer) and its EOS ids."""

    directory: Path
    model: TinyGPT
    tokenizer: object
    eos_token_ids: tuple[int, ...]


def load_checkpoint(directory, max_seq_len: int | None = None, attention: str = "batched") -> Checkpoint:
    """The Llama model in `directory`, on the CPU in fp32; a ValueError names what is missing or unsupported."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"model directory {str(directory)!r}: not found")
    raw_config = _read_json(directory, CONFIG_FILE)
    hf_config = _hf_config(raw_config)
    tokenizer = _read_tokenizer(directory)
    hf_config.bos_token_id = _bos_token_id(raw_config, tokenizer)
    config = _model_config(hf_config, max_seq_len, attention)
    model = TinyGPT(config)
    try:
        model.load_hf_state(_read_weights(directory))
    except KeyError as missing:  # a tensor the model needs that no file holds
        raise ValueError(f"{directory}: the weights have no tensor {missing.args[0]!r}, which {CONFIG_FILE}'s "
                         "model needs") from None
    except RuntimeError as problem:  # torch's message, on one line
        raise ValueError(f"{directory}: the weights do not fit {CONFIG_FILE}: {' '.join(str(problem).split())}") from None
    return Checkpoint(directory, model.eval(), tokenizer, _eos_token_ids(directory, raw_config, tokenizer, config))


def _hf_config(raw_config: dict):
    """config.json as transformers reads it, once it says llama, unquantized (LlamaConfig would take
    any model_type as llama)."""
    from transformers import LlamaConfig

    if raw_config.get("model_type") != "llama":
        raise ValueError(f"model_type = {raw_config.get('model_type')!r}: TinyGPT supports 'llama'")
    if "quantization_config" in raw_config:
        raise ValueError(f"quantization_config = {raw_config['quantization_config']!r}: TinyGPT loads "
                         f"unquantized weights only")
    try:
        return LlamaConfig.from_dict(raw_config)
    except Exception as problem:  # transformers' own refusal, whatever its class (KeyError, a strict-dataclass error)
        reason = problem.args[0] if isinstance(problem, KeyError) else problem  # a KeyError's str() quotes it
        raise ValueError(f"{CONFIG_FILE}: {reason}") from None


def _bos_token_id(raw_config: dict, tokenizer) -> int | None:
    """The tokenizer's begin-of-sequence id, which `transformers serve` puts first, else config.json's."""
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else raw_config.get("bos_token_id")


def _model_config(hf_config, max_seq_len: int | None, attention: str) -> ModelConfig:
    """The ModelConfig of `hf_config`, at most `max_seq_len` long."""
    config = replace(ModelConfig.from_hf_llama_config(hf_config), attention=attention)
    if max_seq_len is None:
        return config
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or not 1 <= max_seq_len <= config.max_seq_len:
        raise ValueError(f"max_seq_len = {max_seq_len!r}: must be a whole number in 1..{config.max_seq_len}, "
                         f"the model's max_position_embeddings")
    return replace(config, max_seq_len=max_seq_len)


def _read_json(directory: Path, name: str) -> dict:
    path = directory / name
    if not path.is_file():
        raise ValueError(f"{directory}: no {name} (a model directory holds {CONFIG_FILE}, *.safetensors and "
                         f"the tokenizer's files)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as problem:
        raise ValueError(f"{path}: not valid JSON ({problem})") from None


def _read_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{directory}: no tokenizer ({', '.join(TOKENIZER_FILES)})")
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as problem:  # transformers' own refusal, whatever its class
        raise ValueError(f"{directory}: the tokenizer does not load: {problem}") from None


def _read_weights(directory: Path) -> dict:
    """Every tensor of the safetensors file, or of every shard the index lists, by name."""
    from safetensors.torch import load_file

    if (directory / INDEX_FILE).is_file():
        files = sorted(set(_read_json(directory, INDEX_FILE)["weight_map"].values()))
    elif (directory / WEIGHTS_FILE).is_file():
        files = [WEIGHTS_FILE]
    else:
        raise ValueError(f"{directory}: no {WEIGHTS_FILE} and no {INDEX_FILE} (labkit reads safetensors only)")
    state = {}
    for name in files:
        if not (directory / name).is_file():
            raise ValueError(f"{directory}: no {name}, which {INDEX_FILE} lists")
        try:
            state.update(load_file(directory / name))
        except Exception as problem:  # safetensors' own error class (truncated, not safetensors at all, ...)
            reason = str(problem).splitlines()[0] if str(problem) else type(problem).__name__
            raise ValueError(f"{directory / name}: not a whole safetensors file ({reason})") from None
    return state


def _eos_token_ids(directory: Path, raw_config: dict, tokenizer, config: ModelConfig) -> tuple[int, ...]:
    """config.json's, generation_config.json's and the tokenizer's EOS ids, each a token of the vocabulary."""
    generation = (_read_json(directory, GENERATION_CONFIG_FILE)
                  if (directory / GENERATION_CONFIG_FILE).is_file() else {})
    ids = set()
    for value in (raw_config.get("eos_token_id"), generation.get("eos_token_id"), tokenizer.eos_token_id):
        ids.update([value] if isinstance(value, int) else value or [])
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < config.vocab_size:
            raise ValueError(f"eos_token_id = {token_id!r}: must be a token id in 0..{config.vocab_size - 1}")
    return tuple(sorted(ids))
