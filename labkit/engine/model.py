"""TinyGPT: a small Llama-architecture decoder with selective batching over a paged KV cache.

The architecture is Hugging Face's `LlamaForCausalLM`, module for module and name for
name: RMSNorm, rotary positions (rotate_half convention), SwiGLU MLP, no biases, an
untied LM head, and as many key/value heads as query heads. `TinyGPT.from_hf_llama`
therefore copies an HF model's weights with one `load_state_dict`.

One forward call is one engine step (Orca's selective batching):

- the new tokens of every scheduled request, prefill or decode, are concatenated into
  one (T, d_model) matrix with no padding, and every linear layer runs on it at once;
- attention alone runs per request: each request's queries attend to its own keys and
  values, gathered from the paged KV cache through its block table.

Invariants:

- a token at position p sees exactly the cache positions 0..p of its own request;
- the result for a request does not depend on which other requests share the step;
- the K/V this step writes land at `write_slots` before any request reads the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.engine.kv import PagedKVCache, slot_ids


# ModelConfig field -> the same field in Hugging Face's LlamaConfig
_HF_NAMES = (
    ("vocab_size", "vocab_size"),
    ("d_model", "hidden_size"),
    ("n_layers", "num_hidden_layers"),
    ("n_heads", "num_attention_heads"),
    ("d_ff", "intermediate_size"),
    ("max_seq_len", "max_position_embeddings"),
    ("norm_eps", "rms_norm_eps"),
)


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of TinyGPT. `max_seq_len` is the longest sequence (prompt + output) it accepts."""

    vocab_size: int = 512
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 768
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r}: must be a whole number >= 1")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} = {value!r}: must be a number > 0")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model = {self.d_model}: must be divisible by n_heads = {self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"d_model = {self.d_model}: d_model / n_heads must be even for rotary positions")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_hf_llama_config(self):
        """The matching `transformers.LlamaConfig` (fp32, eager attention, no EOS/BOS)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            **{hf_name: getattr(self, name) for name, hf_name in _HF_NAMES},
            num_key_value_heads=self.n_heads,
            rope_theta=self.rope_theta,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
            attn_implementation="eager",
        )

    @classmethod
    def from_hf_llama_config(cls, hf_config) -> ModelConfig:
        """The ModelConfig of an HF `LlamaConfig`; ValueError if TinyGPT cannot express it."""
        rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        checks = {
            "num_key_value_heads": (hf_config.num_key_value_heads, hf_config.num_attention_heads),
            "head_dim": (head_dim, hf_config.hidden_size // hf_config.num_attention_heads),
            "hidden_act": (hf_config.hidden_act, "silu"),
            "attention_bias": (hf_config.attention_bias, False),
            "mlp_bias": (getattr(hf_config, "mlp_bias", False), False),
            "tie_word_embeddings": (hf_config.tie_word_embeddings, False),
            "rope_type": (rope_type, "default"),
        }
        for name, (value, expected) in checks.items():
            if value != expected:
                raise ValueError(f"{name} = {value!r}: TinyGPT needs {expected!r}")
        return cls(
            **{name: getattr(hf_config, hf_name) for name, hf_name in _HF_NAMES},
            rope_theta=float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))),
        )


@dataclass
class StepBatch:
    """What one engine step feeds the model. Tokens are concatenated request by request.

    input_ids, positions, write_slots: long (T,) on the model's device.
    num_new[i]: how many of the T tokens belong to request i (prefill: many, decode: 1).
    block_tables[i]: long (num_blocks_i,) block ids covering request i's context.
    context_lens[i]: tokens in request i's KV after this step's writes (= last position + 1).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    num_new: list[int]
    block_tables: list[torch.Tensor]
    context_lens: list[int]

    def __post_init__(self):
        num_tokens = self.input_ids.shape[0]
        assert self.positions.shape == self.write_slots.shape == (num_tokens,)
        assert len(self.num_new) == len(self.block_tables) == len(self.context_lens)
        assert sum(self.num_new) == num_tokens and min(self.num_new, default=1) >= 1

    @classmethod
    def build(cls, new_tokens: list[list[int]], start_positions: list[int], block_tables: list[torch.Tensor],
              block_size: int) -> StepBatch:
        """Request i contributes tokens new_tokens[i] at positions start_positions[i], ... ."""
        device = block_tables[0].device
        positions = [torch.arange(p, p + len(t), device=device) for t, p in zip(new_tokens, start_positions)]
        return cls(
            input_ids=torch.tensor([tok for t in new_tokens for tok in t], dtype=torch.long, device=device),
            positions=torch.cat(positions),
            write_slots=torch.cat([slot_ids(bt, pos, block_size) for bt, pos in zip(block_tables, positions)]),
            num_new=[len(t) for t in new_tokens],
            block_tables=list(block_tables),
            context_lens=[p + len(t) for t, p in zip(new_tokens, start_positions)],
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


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary(positions, config: ModelConfig, dtype):
    """cos and sin of each token's position, (T, hs) each, in HF's layout: [freqs, freqs]."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float, device=positions.device) / config.head_dim
    inv_freq = 1.0 / (config.rope_theta**exponents)  # (hs/2,)
    freqs = positions[:, None].float() * inv_freq[None, :]  # (T, hs/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@dataclass
class _RequestView:
    """Where one request sits in a step: its rows of T, its cache slots, its causal mask."""

    rows: slice
    context_slots: torch.Tensor  # (L,)
    mask: torch.Tensor  # (n, L) bool, True = may attend


def _request_views(batch: StepBatch, block_size: int) -> list[_RequestView]:
    views, start = [], 0
    for n, block_table, context_len in zip(batch.num_new, batch.block_tables, batch.context_lens):
        cache_positions = torch.arange(context_len, device=batch.positions.device)  # (L,)
        query_positions = batch.positions[start : start + n]  # (n,)
        mask = query_positions[:, None] >= cache_positions[None, :]  # (n, L)
        views.append(_RequestView(slice(start, start + n), slot_ids(block_table, cache_positions, block_size), mask))
        start += n
    return views


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.v_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.o_proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x, cos, sin, write_slots, k_cache, v_cache, views):
        T, C = x.shape
        nh, hs = self.n_heads, self.head_dim
        q = self.q_proj(x).view(T, nh, hs)  # (T, nh, hs)
        k = self.k_proj(x).view(T, nh, hs)  # (T, nh, hs)
        v = self.v_proj(x).view(T, nh, hs)  # (T, nh, hs)
        cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, hs)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # write this step's keys and values, then read each request's whole context
        k_cache[write_slots] = k
        v_cache[write_slots] = v
        outs = []
        for view in views:
            q_i = q[view.rows].transpose(0, 1)  # (nh, n, hs)
            k_i = k_cache[view.context_slots].transpose(0, 1)  # (nh, L, hs)
            v_i = v_cache[view.context_slots].transpose(0, 1)  # (nh, L, hs)
            y_i = F.scaled_dot_product_attention(q_i, k_i, v_i, attn_mask=view.mask)  # (nh, n, hs)
            outs.append(y_i.transpose(0, 1).reshape(-1, C))  # (n, C)
        return self.o_proj(torch.cat(outs))  # (T, C)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, write_slots, k_cache, v_cache, views):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, write_slots, k_cache, v_cache, views)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    """Embedding, blocks and final norm: HF's `LlamaModel`, the `model.` of its state dict."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config)


class TinyGPT(nn.Module):
    def __init__(self, config: ModelConfig, seed: int = 0):
        super().__init__()
        self.config = config
        self.model = Body(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
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
    def forward(self, batch: StepBatch, cache: PagedKVCache) -> torch.Tensor:
        """One step: write the new tokens' K/V; return (num_requests, vocab) logits of each last new token."""
        x = self.model.embed_tokens(batch.input_ids)  # (T, C)
        cos, sin = rotary(batch.positions, self.config, x.dtype)  # (T, hs) each
        views = _request_views(batch, cache.block_size)
        for i, block in enumerate(self.model.layers):
            x = block(x, cos, sin, batch.write_slots, *cache.layer(i), views)
        last = torch.tensor([view.rows.stop - 1 for view in views], device=x.device)  # (num_requests,)
        return self.lm_head(self.model.norm(x[last]))  # (num_requests, vocab)

    def load_hf_llama(self, hf_model) -> TinyGPT:
        """Copy the weights of an HF `LlamaForCausalLM` of the same size into this model."""
        expected = ModelConfig.from_hf_llama_config(hf_model.config)
        if expected != self.config:
            raise ValueError(f"hf_model has config {expected}, this TinyGPT has {self.config}")
        self.load_state_dict(hf_model.state_dict(), strict=True)
        return self

    @classmethod
    def from_hf_llama(cls, hf_model) -> TinyGPT:
        """A TinyGPT with an HF `LlamaForCausalLM`'s config and weights, on its device and dtype."""
        param = next(hf_model.parameters())
        model = cls(ModelConfig.from_hf_llama_config(hf_model.config))
        return model.to(device=param.device, dtype=param.dtype).load_hf_llama(hf_model)
