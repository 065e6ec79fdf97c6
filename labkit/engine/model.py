"""TinyGPT: a small Llama-architecture decoder with selective batching over a paged KV cache.

The architecture is Hugging Face's `LlamaForCausalLM`, module for module and name for
name: RMSNorm, rotary positions (rotate_half convention), SwiGLU MLP, no biases. The
seeded TinyGPT has an untied LM head and as many key/value heads as query heads; a
checkpoint's config may also ask for grouped-query attention (`n_kv_heads` < `n_heads`:
each key/value head serves n_heads / n_kv_heads query heads, and the KV cache keeps only
the n_kv_heads), an LM head tied to the embedding, a head size other than
d_model / n_heads, and scaled rotary frequencies (`labkit.engine.rope`). Two things
differ, as in vLLM and nano-vllm: the q, k and v projections are stacked into one
`qkv_proj`, and gate and up into one `gate_up_proj`, so each is one matrix multiply, not
three or two. `TinyGPT.from_hf_llama` stacks an HF model's weights so and loads them;
`labkit.engine.checkpoint` loads a model directory.

One forward call is one engine step (Orca's selective batching):

- the new tokens of every scheduled request, prefill or decode, are concatenated into
  one (T, d_model) matrix with no padding, and every linear layer runs on it at once;
- attention alone sees requests: each request's queries attend to its own keys and
  values, read from the paged KV cache through its block table, either in one batched
  pass per layer (`attention="batched"`, the default) or one call per request
  (`attention="per_request"`, Orca's loop); see `labkit.engine.attention`.

Invariants:

- a token at position p sees exactly the cache positions 0..p of its own request;
- the result for a request does not depend on which other requests share the step,
  nor on the attention layout;
- the K/V this step writes land at `write_entries` before any request reads the cache.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.engine.attention import GatherScratch, plan_attention
from labkit.engine.config import ModelConfig
from labkit.engine.kv import PagedKVCache


# TinyGPT's stacked projections, and HF's projections each one stacks, in order
STACKED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def stack_hf_projections(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An HF Llama state dict with each layer's q/k/v and gate/up weights stacked as TinyGPT keeps them."""
    state = dict(hf_state)
    for stacked, parts in STACKED_PROJECTIONS.items():
        for name in [n for n in state if n.endswith(f".{parts[0]}.weight")]:
            prefix = name.removesuffix(f"{parts[0]}.weight")  # e.g. "model.layers.0.self_attn."
            state[f"{prefix}{stacked}.weight"] = torch.cat([state.pop(f"{prefix}{part}.weight") for part in parts])
    return state


@dataclass
class ModelInputs:
    """What one engine step feeds the model. Tokens are concatenated request by request.

    input_ids, positions, write_entries: long (T,) on the model's device; write_entries[t] is the
    cache entry token t's keys and values go to (`labkit.engine.kv`).
    last_rows: long (R,), the row of each request's last new token (its logits are returned).
    block_tables: long (R, max_blocks), request i's block ids in row i, padded with 0.
    num_new[i]: how many of the T tokens belong to request i (prefill: many, decode: 1).
    context_lens[i]: tokens in request i's KV after this step's writes (= last position + 1).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    write_entries: torch.Tensor
    last_rows: torch.Tensor
    block_tables: torch.Tensor
    num_new: list[int]
    context_lens: list[int]

    def __post_init__(self):
        num_tokens, num_requests = self.input_ids.shape[0], len(self.num_new)
        assert self.positions.shape == self.write_entries.shape == (num_tokens,)
        assert self.last_rows.shape == (num_requests,) == self.block_tables.shape[:1]
        assert len(self.context_lens) == num_requests
        assert sum(self.num_new) == num_tokens and min(self.num_new, default=1) >= 1

    @classmethod
    def build(cls, new_tokens: list[list[int]], start_positions: list[int], block_tables: list, block_size: int,
              device: torch.device | str = "cpu") -> ModelInputs:
        """Request i contributes tokens new_tokens[i] at positions start_positions[i], ... ;
        block_tables[i] lists its block ids (a list, an array or a CPU tensor).

        Built with numpy on the host, then moved to `device` once per field."""
        num_new = [len(t) for t in new_tokens]
        num_tokens = sum(num_new)
        request_of_row = np.repeat(np.arange(len(num_new)), num_new)  # (T,)
        first_row = np.cumsum(num_new) - num_new  # (R,)
        positions = np.repeat(start_positions, num_new) + np.arange(num_tokens) - first_row[request_of_row]  # (T,)
        tables = np.zeros((len(num_new), max(len(t) for t in block_tables)), dtype=np.int64)  # (R, max_blocks)
        for row, table in zip(tables, block_tables):
            row[: len(table)] = table
        write_entries = tables[request_of_row, positions // block_size] * block_size + positions % block_size  # (T,)
        input_ids = np.fromiter(itertools.chain.from_iterable(new_tokens), dtype=np.int64, count=num_tokens)

        def to_device(array):
            return torch.from_numpy(array).to(device)

        return cls(
            input_ids=to_device(input_ids),
            positions=to_device(positions),
            write_entries=to_device(write_entries),
            last_rows=to_device(first_row + np.array(num_new) - 1),
            block_tables=to_device(tables),
            num_new=num_new,
            context_lens=[p + n for p, n in zip(start_positions, num_new)],
        )

    @property
    def num_requests(self) -> int:
        return len(self.num_new)


class RMSNorm(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(config.d_model))
        self.eps = config.norm_eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary(nn.Module):
    """Rotary positions in HF's rotate_half convention: x * cos + rotate_half(x) * sin, where
    rotate_half(x) = [-x2, x1] for the halves x1, x2 of a head, and cos = [cos(pf), cos(pf)] for
    the frequencies f of position p.

    cos and sin are tabled once for every position up to max_seq_len. A step looks its tokens'
    rows up instead of computing them, and applies rotate_half(x) * sin as
    roll(x, hs/2) * [-sin, sin] = [x2, x1] * [-sin, sin]: the same numbers in two ops, not four.
    The tables are buffers, so they follow the model's device and dtype, but not its state dict.
    A checkpoint may scale the frequencies f (`config.rope_scaling`, `labkit.engine.rope`)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float) / config.head_dim
        inv_freq = 1.0 / (config.rope_theta**exponents)  # (hs/2,)
        if config.rope_scaling is not None:
            inv_freq = config.rope_scaling.scale(inv_freq)  # (hs/2,)
        freqs = torch.arange(config.max_seq_len, dtype=torch.float)[:, None] * inv_freq[None, :]  # (max_len, hs/2)
        self.register_buffer("cos", torch.cat((freqs.cos(), freqs.cos()), dim=-1), persistent=False)  # (max_len, hs)
        self.register_buffer("signed_sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions):
        """(T,) positions -> cos, signed_sin: (T, hs) each."""
        return self.cos.index_select(0, positions), self.signed_sin.index_select(0, positions)


def rotate(x, cos, signed_sin):
    """x: queries or keys, (T, ..., hs); cos, signed_sin: shaped to broadcast over x. x rotated by its positions."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    """nh query heads and nkv key/value heads (nkv = nh, or fewer: grouped-query attention)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_dim
        q_size, kv_size = config.n_heads * config.head_dim, config.kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.d_model, q_size + 2 * kv_size, bias=False)  # HF's q_proj, k_proj, v_proj
        self.o_proj = nn.Linear(q_size, config.d_model, bias=False)

    def forward(self, x, cos, signed_sin, write_entries, k_cache, v_cache, attention):
        T, _ = x.shape
        nh, nkv, hs = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(T, nh + 2 * nkv, hs)  # (T, nh + 2 nkv, hs): one GEMM, the heads of q, k, v
        qk = rotate(qkv[:, : nh + nkv], cos[:, None], signed_sin[:, None])  # (T, nh + nkv, hs): q and k at once
        q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :]  # (T, nh, hs), (T, nkv, hs), (T, nkv, hs)
        # write this step's keys and values, then let each request read its whole context
        k_cache.index_copy_(0, write_entries, k)
        v_cache.index_copy_(0, write_entries, v)
        y = attention(q, k_cache, v_cache)  # (T, nh, hs)
        return self.o_proj(y.reshape(T, nh * hs))  # (T, C)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.d_model, 2 * config.d_ff, bias=False)  # HF's gate_proj, up_proj
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (T, d_ff) each, from one GEMM
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """One transformer layer, HF's `LlamaDecoderLayer`: attention, then the MLP, each on a normed
    input and added back to the residual stream."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config)
        self.mlp = MLP(config)

    def forward(self, x, cos, signed_sin, write_entries, k_cache, v_cache, attention):
        x = x + self.self_attn(self.input_layernorm(x), cos, signed_sin, write_entries, k_cache, v_cache, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    """Embedding, decoder layers and final norm: HF's `LlamaModel`, the `model.` of its state dict."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config)


class TinyGPT(nn.Module):
    def __init__(self, config: ModelConfig, seed: int = 0):
        super().__init__()
        self.config = config
        self.model = Body(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # one matrix: embedding in, logits out
        self.rotary = Rotary(config)
        self.gather_scratch = GatherScratch()
        self._init_weights(seed)

    def _init_weights(self, seed: int):
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=generator)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def forward(self, inputs: ModelInputs, cache: PagedKVCache) -> torch.Tensor:
        """One step: write the new tokens' K/V; return (num_requests, vocab) logits of each last new token."""
        attention = plan_attention(self.config.attention, inputs.num_new, inputs.context_lens, inputs.block_tables,
                                   cache.block_size, self.gather_scratch)
        return self.logits(inputs.input_ids, inputs.positions, inputs.write_entries, inputs.last_rows, cache, attention)

    @torch.no_grad()
    def logits(self, input_ids, positions, write_entries, last_rows, cache: PagedKVCache, attention) -> torch.Tensor:
        """The layers on (T,) tokens with an attention plan already made; (R, vocab) logits at `last_rows`.
        Tensors only, so a CUDA graph can capture it (labkit.engine.cuda_graphs)."""
        x = self.model.embed_tokens(input_ids)  # (T, C)
        cos, signed_sin = self.rotary(positions)  # (T, hs) each
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, signed_sin, write_entries, *cache.layer(i), attention)
        return self.lm_head(self.model.norm(x.index_select(0, last_rows)))  # (R, vocab)

    def load_hf_llama(self, hf_model) -> TinyGPT:
        """Copy the weights of an HF `LlamaForCausalLM` of the same size into this model."""
        expected = replace(ModelConfig.from_hf_llama_config(hf_model.config), attention=self.config.attention)
        if expected != self.config:
            raise ValueError(f"hf_model has config {expected}, this TinyGPT has {self.config}")
        return self.load_hf_state(hf_model.state_dict())

    def load_hf_state(self, hf_state: dict[str, torch.Tensor]) -> TinyGPT:
        """Copy an HF Llama state dict of this model's size into it: every weight, none left over.
        A tied LM head may be missing from it (checkpoints store the shared matrix once)."""
        state = stack_hf_projections(hf_state)
        if self.config.tie_embeddings and "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]  # the one matrix, as HF ties it
        self.load_state_dict(state, strict=True)
        return self

    @classmethod
    def from_hf_llama(cls, hf_model, attention: str = "batched") -> TinyGPT:
        """A TinyGPT with an HF `LlamaForCausalLM`'s config and weights, on its device and dtype."""
        param = next(hf_model.parameters())
        model = cls(replace(ModelConfig.from_hf_llama_config(hf_model.config), attention=attention))
        return model.to(device=param.device, dtype=param.dtype).load_hf_llama(hf_model)
