"""Paged KV cache: the tensors only.

The cache is one pool of fixed-size blocks per layer, allocated once. A request's
context lives in the blocks its block table lists, in order: position p sits in block
`block_table[p // block_size]` at offset `p % block_size`. Viewed flat, a layer's cache is
a row of entries, one token's keys and values each, and position p's entry is
`block_id * block_size + offset`.

Invariants:

- `k` and `v` are allocated in the constructor and never reallocated, only written;
- they hold one block more than `num_blocks`: the padding block, id `num_blocks`, which no
  request is ever lent. Rows that only pad a step to a fixed shape (a CUDA graph's batch
  bucket) write and read there, so they touch nobody's keys and values;
- this module decides nothing: which blocks are free and who owns them is labkit.sched's job.
"""

from __future__ import annotations

import torch

from labkit.checks import whole_number
from labkit.engine.config import ModelConfig


class PagedKVCache:
    """Keys and values of every layer, as (n_layers, num_blocks + 1, block_size, n_kv_heads, head_dim):
    the key/value heads only, which grouped-query attention shares among the query heads."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device, dtype=torch.float32):
        whole_number("num_blocks", num_blocks)
        whole_number("block_size", block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.n_layers, num_blocks + 1, block_size, config.kv_heads, config.head_dim)  # + the padding block
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def padding_block(self) -> int:
        return self.num_blocks

    @property
    def num_entries(self) -> int:
        """Every entry of a layer, the padding block's included."""
        return (self.num_blocks + 1) * self.block_size

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values as flat views, (num_entries, n_kv_heads, head_dim) each."""
        _, _, _, nkv, hs = self.k.shape
        return self.k[i].view(self.num_entries, nkv, hs), self.v[i].view(self.num_entries, nkv, hs)
