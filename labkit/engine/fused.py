"""FusedTinyGPT: TinyGPT's step in fewer, larger torch calls, on the same weights. The engine's fast path.

`TinyGPT.forward` (`labkit.engine.model`) is the step a student reads: a module for each
part, each norm written out. `labkit serve` runs this one by default (`Engine(fused=True)`;
`Engine` itself runs the plain step unless asked), and `benchmarks/bench_token_time.py` shows where the time it saves went. The same
arithmetic, in the same order, with four changes, each where that benchmark measured time:

- attention: a decode group's keys and values are gathered from the paged cache by whole
  blocks (16 entries a copy, not one), in chunks of requests whose keys and values stay in
  the CPU's caches (`labkit.engine.attention.plan_block_attention`), so attention reads its
  copy from the cache instead of from memory; requests with several new tokens attend as in
  TinyGPT;
- GEMMs: each projection's weight is kept transposed, (in, out), and multiplied as
  `x @ w`: the same products, which MKL's GEMM reads faster than (out, in) when x has few
  rows, as a decode step's x has;
- norms: torch's own RMSNorm (`F.rms_norm`), one call instead of eight;
- dispatches: no module call per part, the rotary tables shaped for the heads once a step,
  not once a layer, and the residual stream added to in place.

The projections were already fused in TinyGPT (q, k and v in one `qkv_proj`, gate and up
in one `gate_up_proj`), so both paths make the same GEMMs.

Invariants:

- it computes with the weights the TinyGPT has when it is built: the norms' are the
  model's own tensors, the projections' transposed copies (the Engine builds one for each
  run, after its weights are loaded);
- on float32, a step's logits, and the keys and values it writes, equal `TinyGPT.forward`'s
  within 1e-5, and its greedy tokens are the same wherever the top two logits are further
  apart than that (`tests/test_fused.py`). Not always bit for bit: for 1 to 3 rows, MKL's
  GEMM rounds otherwise for the transposed layout, and torch's CPU attention rounds
  otherwise for a chunk than for its whole group; from 4 rows up with no group cut, they
  are the same bits on this machine;
- `logits` takes any attention plan, as `TinyGPT.logits` does, so CUDA graphs
  (`labkit.engine.cuda_graphs`) capture this path as they capture TinyGPT's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from labkit.engine.attention import GatherScratch, plan_attention, plan_block_attention
from labkit.engine.kv import PagedKVCache
from labkit.engine.model import DecoderLayer, ModelInputs, TinyGPT, rotate

CHUNK_BYTES = 4 << 20  # keys and values a decode chunk gathers: the fastest of 1-16 MiB on a 2-core EPYC


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's (out, in) weight as an (in, out) copy: `x @ transposed(w)` is `F.linear(x, w)`,
    and MKL's GEMM reads this layout faster when x has few rows."""
    return weight.detach().t().contiguous()


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer's weights (the projections' transposed), called without a module per part."""

    input_norm: torch.Tensor  # (C,)
    qkv: torch.Tensor  # (C, nh·hs + 2·nkv·hs)
    o: torch.Tensor  # (nh·hs, C)
    post_norm: torch.Tensor  # (C,)
    gate_up: torch.Tensor  # (C, 2·d_ff)
    down: torch.Tensor  # (d_ff, C)
    n_heads: int
    n_kv_heads: int
    eps: float

    @classmethod
    def of(cls, layer: DecoderLayer) -> FusedLayer:
        attention, mlp = layer.self_attn, layer.mlp
        return cls(layer.input_layernorm.weight, transposed(attention.qkv_proj.weight),
                   transposed(attention.o_proj.weight), layer.post_attention_layernorm.weight,
                   transposed(mlp.gate_up_proj.weight), transposed(mlp.down_proj.weight),
                   attention.n_heads, attention.n_kv_heads, layer.input_layernorm.eps)

    def __call__(self, x, cos, signed_sin, write_entries, k_cache, v_cache, attention) -> torch.Tensor:
        """x: (T, C), changed in place and returned; cos, signed_sin: (T, 1, hs)."""
        (T, C), nh, nkv = x.shape, self.n_heads, self.n_kv_heads
        qkv = (F.rms_norm(x, (C,), self.input_norm, self.eps) @ self.qkv).view(T, nh + 2 * nkv, -1)
        qk = rotate(qkv[:, : nh + nkv], cos, signed_sin)  # (T, nh + nkv, hs): q and k at once
        k_cache.index_copy_(0, write_entries, qk[:, nh:])  # (T, nkv, hs)
        v_cache.index_copy_(0, write_entries, qkv[:, nh + nkv :])  # (T, nkv, hs)
        y = attention(qk[:, :nh], k_cache, v_cache)  # (T, nh, hs)
        x += y.reshape(T, -1) @ self.o
        gate, up = (F.rms_norm(x, (C,), self.post_norm, self.eps) @ self.gate_up).chunk(2, dim=-1)  # (T, d_ff) each
        x += (F.silu(gate) * up) @ self.down
        return x


class FusedTinyGPT:
    """A TinyGPT's step, called as the TinyGPT is: (inputs, cache) -> (R, vocab) logits.

    chunk_bytes: the most bytes of keys and values one decode chunk gathers on a CPU (None: groups
    are not cut; nor are they on other devices, where a gather does not wait on a core's cache).
    `benchmarks/bench_token_time.py --sections chunks` measures the sizes.
    """

    def __init__(self, model: TinyGPT, chunk_bytes: int | None = CHUNK_BYTES):
        self.model, self.config = model, model.config
        self.layers = [FusedLayer.of(layer) for layer in model.model.layers]
        self.norm = model.model.norm
        self.lm_head = transposed(model.lm_head.weight)  # (C, vocab)
        self.scratch = GatherScratch()
        entry_bytes = 2 * self.config.kv_heads * self.config.head_dim * model.lm_head.weight.element_size()  # k and v
        on_cpu = model.lm_head.weight.device.type == "cpu"
        self.max_chunk_entries = chunk_bytes // entry_bytes if chunk_bytes and on_cpu else None

    @torch.no_grad()
    def __call__(self, inputs: ModelInputs, cache: PagedKVCache) -> torch.Tensor:
        """One step: write the new tokens' K/V; return (num_requests, vocab) logits of each last new token."""
        return self.logits(inputs.input_ids, inputs.positions, inputs.write_entries, inputs.last_rows, cache,
                           self.plan(inputs, cache.block_size))

    def plan(self, inputs: ModelInputs, block_size: int):
        """The step's attention: by whole blocks in chunks, or request by request if the config asks."""
        if self.config.attention == "per_request":
            return plan_attention("per_request", inputs.num_new, inputs.context_lens, inputs.block_tables, block_size,
                                  self.scratch)
        return plan_block_attention(inputs.num_new, inputs.context_lens, inputs.block_tables, block_size, self.scratch,
                                    self.max_chunk_entries)

    @torch.no_grad()
    def logits(self, input_ids, positions, write_entries, last_rows, cache: PagedKVCache, attention) -> torch.Tensor:
        """`TinyGPT.logits`, fused: (R, vocab) logits at `last_rows` of the (T,) tokens."""
        x = F.embedding(input_ids, self.model.model.embed_tokens.weight)  # (T, C)
        cos, signed_sin = (table[:, None] for table in self.model.rotary(positions))  # (T, 1, hs) each
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, signed_sin, write_entries, *cache.layer(i), attention)
        last = x.index_select(0, last_rows)  # (R, C)
        return F.rms_norm(last, last.shape[1:], self.norm.weight, self.norm.eps) @ self.lm_head  # (R, vocab)
