"""Attention over a paged KV cache, for every request of one step: two layouts, one result.

After a layer has written this step's keys and values into the cache, each request's
queries attend to its own context, cache positions 0..p for a query at position p. The
linear layers never see request boundaries; attention is the one place that does. Two
layouts do the same arithmetic:

- `PerRequestAttention` (Orca's selective batching, as written in its paper): one
  attention call per request per layer, a Python loop over the batch. Clear, and its
  cost grows with the number of requests, not with their work.
- `BatchedAttention` (the default, as serving engines do it): requests with one new token
  (a decode, or a one-token chunk) are grouped by context length, and each group joins one
  padded call, (D, nkv, g, hs) queries against (D, nkv, L, hs) keys (g = 1, nkv = nh without
  grouped-query attention, below) with a mask that hides the padding; a request with
  several new tokens (a prompt, or a chunk of one) gets a call of its own, and a step has
  few. Grouping keeps one long context from padding every short one to its length:
  sorted by context, a group pads at most 25% of its real context tokens, or 256 entries,
  about what one more call costs on a CPU (`bucket_by_context`). A CUDA graph
  (`cuda_graphs`) keeps one group, padded to its bucket: a graph fixes shapes.

Both are planned once per step (`plan_attention`), from the step's block tables, and
then called once per layer. DESIGN.md records the measurements behind the choice.

The engine's fast path (`labkit.engine.fused`) plans the batched layout with one change
(`plan_block_attention`): a decode group gathers its keys and values by whole blocks
(`BlockDecodeGroup`: block_size entries a copy, attended over the same padded length as
before), in chunks of requests that gather at most a few MiB (`labkit.engine.fused.CHUNK_BYTES`),
so the copy is still in the CPU's caches when attention reads it. A served run takes its
blocks in turn, so a request's blocks lie scattered through the pool, and a decode step's
keys and values (37 MB at 32 requests of 145 tokens) outgrow the last-level cache; gathered
all at once they go out to memory and are read back.

Grouped-query attention: the cache holds nkv key/value heads, and query head h reads key/value
head h // g, for g = nh / nkv (HF's `repeat_kv` order). A decode group views its queries as
(D, nkv, g, hs), g queries against each key head, so it copies nothing; a multi-token request
repeats each key/value head g times (`repeat_kv_heads`). With nkv = nh both are no-ops.

Invariants:

- a query at position p of request r reads exactly r's cache entries for positions 0..p;
- padding is masked, never read into a result: the two layouts give the same values;
- in a planned step, every one-token request is in exactly one decode group, and no group
  pads more than the waste bound allows (a block group gathers up to its last block, and
  attends over the same padded length as the group it was cut from);
- planning reads nothing back from the device; a plan holds only index tensors and masks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION_LAYOUTS = ("batched", "per_request")


def context_entries(block_tables: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """(R, context_len) cache entries of positions 0..context_len-1 through each row's block table.

    block_tables: (R, num_blocks) long, each row a request's block ids in token order.
    Position p lives in block block_tables[r, p // block_size], at offset p % block_size.
    """
    offsets = torch.arange(block_size, device=block_tables.device)  # (bs,)
    entries = block_tables[:, :, None] * block_size + offsets  # (R, num_blocks, bs)
    return entries.flatten(1)[:, :context_len]  # (R, context_len)


def gather(cache: torch.Tensor, entries: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """cache rows at `entries`: (*entries.shape, nkv, hs), written into `out` if given.
    `index_select` is the fast gather on every device (advanced indexing is several times slower)."""
    rows = torch.index_select(cache, 0, entries.flatten(), out=out)  # (num_entries_read, nkv, hs)
    return rows.view(*entries.shape, *cache.shape[1:])


class GatherScratch:
    """Reused buffers for the keys and values one attention call gathers: a CPU speed-up.

    On the CPU a fresh multi-megabyte tensor per gather costs thousands of page faults per
    step, because the allocator hands large blocks back to the system when they are freed.
    Two buffers that only grow remove them: they keep the largest size asked for (2 x 4 MB
    at B = 32 and context 128 in the default model) for the model's life. One call reads its
    keys and values before the next call gathers, so two are enough for every call of every
    layer.
    """

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def keys_and_values(self, cache: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two (num_rows, nkv, hs) buffers like `cache`'s rows."""
        return self._take("k", cache, num_rows), self._take("v", cache, num_rows)

    def _take(self, name: str, cache: torch.Tensor, num_rows: int) -> torch.Tensor:
        row_shape = cache.shape[1:]
        numel = num_rows * row_shape.numel()
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != cache.dtype or buffer.device != cache.device:
            buffer = self._buffers[name] = torch.empty(numel, dtype=cache.dtype, device=cache.device)
        return buffer[:numel].view(num_rows, *row_shape)


def gather_keys_and_values(k_cache, v_cache, entries, scratch: GatherScratch | None):
    """Keys and values at `entries`, (*entries.shape, nkv, hs) each, in the scratch buffers if given."""
    k_out, v_out = scratch.keys_and_values(k_cache, entries.numel()) if scratch else (None, None)
    return gather(k_cache, entries, k_out), gather(v_cache, entries, v_out)


def repeat_kv_heads(k: torch.Tensor, v: torch.Tensor, num_query_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, nkv, L, hs) keys and values with each head repeated for the g = nh / nkv query heads that
    read it, (B, nh, L, hs) each; returned as they are, not copied, when nkv = nh."""
    group = num_query_heads // k.shape[1]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


@dataclass
class _OneRequest:
    """One request's queries over its own context: its rows of the step, its entries, its mask."""

    rows: slice
    entries: torch.Tensor  # (L,) its context's cache entries
    mask: torch.Tensor | None  # (n, L) bool, True = may attend; None: see is_causal
    is_causal: bool  # the new tokens are the whole context (a first prefill): plain causal attention

    def attend(self, q, k_cache, v_cache, scratch: GatherScratch | None) -> torch.Tensor:
        k_i, v_i = gather_keys_and_values(k_cache, v_cache, self.entries, scratch)  # (L, nkv, hs) each
        q_i = q[self.rows].transpose(0, 1)[None]  # (1, nh, n, hs)
        k_i, v_i = repeat_kv_heads(k_i.transpose(0, 1)[None], v_i.transpose(0, 1)[None], q.shape[1])  # (1, nh, L, hs)
        y = F.scaled_dot_product_attention(q_i, k_i, v_i, attn_mask=self.mask, is_causal=self.is_causal)
        return y[0].transpose(0, 1)  # (n, nh, hs)


def _one_request(rows: slice, entries: torch.Tensor) -> _OneRequest:
    """Queries at the last n context positions (n = rows' length) over all L of them."""
    n, length = rows.stop - rows.start, len(entries)
    if n == 1 or n == length:  # one query sees every key; or a whole prompt: causal from the start
        return _OneRequest(rows, entries, None, is_causal=n > 1)
    query_positions = torch.arange(length - n, length, device=entries.device)  # (n,)
    mask = query_positions[:, None] >= torch.arange(length, device=entries.device)[None, :]  # (n, L)
    return _OneRequest(rows, entries, mask, is_causal=False)


@dataclass
class PerRequestAttention:
    """One attention call per request and layer (Orca): the loop a student reads first."""

    requests: list[_OneRequest]
    scratch: GatherScratch | None = None

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q: (T, nh, hs) rotated queries; k_cache, v_cache: (num_entries, nkv, hs). Returns (T, nh, hs)."""
        return torch.cat([request.attend(q, k_cache, v_cache, self.scratch) for request in self.requests])


@dataclass
class DecodeGroup:
    """Requests with one new token each, attended in one padded call; the g query heads that share
    a key/value head go as g queries against it.

    rows: (D,) long, their rows among the step's T tokens.
    entries: (D, L) long, each one's context entries, padded to the longest context L.
    key_mask: (D, 1, 1, L) bool, True on a real context position, False on padding.
    """

    rows: torch.Tensor
    entries: torch.Tensor
    key_mask: torch.Tensor

    def attend(self, q, k_cache, v_cache, scratch: GatherScratch | None) -> torch.Tensor:
        k_d, v_d = gather_keys_and_values(k_cache, v_cache, self.entries, scratch)  # (D, L, nkv, hs) each
        return attend_decodes(q, self.rows, k_d, v_d, self.key_mask)


def attend_decodes(q, rows, k_d, v_d, key_mask) -> torch.Tensor:
    """The queries at `rows` (D,) of q (T, nh, hs), one a request, against their gathered keys and values
    (D, L, nkv, hs) each, under a (D, 1, 1, L) key mask: (D, nh, hs)."""
    (D, _, nkv, hs), nh = k_d.shape, q.shape[1]
    q_d = q.index_select(0, rows).view(D, nkv, nh // nkv, hs)  # (D, nkv, g, hs)
    k_d, v_d = k_d.transpose(1, 2), v_d.transpose(1, 2)  # (D, nkv, L, hs) each
    y = F.scaled_dot_product_attention(q_d, k_d, v_d, attn_mask=key_mask)  # (D, nkv, g, hs)
    return y.reshape(D, nh, hs)  # (D, nh, hs)


def decode_group(rows: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 block_size: int, padded_len: int) -> DecodeGroup:
    """The group of D one-token requests; block_tables (D, num_blocks), context_lens (D,)."""
    entries = context_entries(block_tables, padded_len, block_size)  # (D, L)
    key_mask = torch.arange(padded_len, device=rows.device)[None, :] < context_lens[:, None]  # (D, L)
    return DecodeGroup(rows, entries, key_mask[:, None, None, :])


@dataclass
class BlockDecodeGroup:
    """A decode group whose keys and values are gathered by whole blocks: block_size cache entries a copy.

    rows: (D,) long, their rows among the step's T tokens.
    blocks: (D, nb) long, each one's first nb block ids (table padding past its context: masked).
    key_mask: (D, 1, 1, L) bool, True on a real context position; L <= nb * block_size, the padded
    length a DecodeGroup of the same requests has, so that attention sees the same numbers.
    """

    rows: torch.Tensor
    blocks: torch.Tensor
    key_mask: torch.Tensor
    block_size: int

    def attend(self, q, k_cache, v_cache, scratch: GatherScratch | None) -> torch.Tensor:
        nkv, hs = k_cache.shape[1:]
        k_blocks, v_blocks = (c.view(-1, self.block_size, nkv, hs) for c in (k_cache, v_cache))  # (blocks, bs, nkv, hs)
        k_d, v_d = gather_keys_and_values(k_blocks, v_blocks, self.blocks, scratch)  # (D, nb, bs, nkv, hs) each
        padded_len = self.key_mask.shape[-1]
        return attend_decodes(q, self.rows, k_d.flatten(1, 2)[:, :padded_len], v_d.flatten(1, 2)[:, :padded_len],
                              self.key_mask)  # keys and values (D, L, nkv, hs)


def block_decode_group(rows: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                       padded_len: int) -> BlockDecodeGroup:
    """The block group of D one-token requests; block_tables (D, max_blocks), context_lens (D,)."""
    key_mask = torch.arange(padded_len, device=rows.device)[None, :] < context_lens[:, None]  # (D, L)
    return BlockDecodeGroup(rows, block_tables[:, : -(-padded_len // block_size)], key_mask[:, None, None, :],
                            block_size)


MAX_WASTE = 0.25  # a decode group pads at most this fraction of its real context tokens ...
WASTE_ALLOWANCE = 256  # ... or this many entries, whichever is more: about one more call's cost (2-core CPU)


def within_waste_bound(padded: int, real: int) -> bool:
    """Whether padding `real` context tokens out to `padded` entries wastes little enough for one call."""
    return padded - real <= max(MAX_WASTE * real, WASTE_ALLOWANCE)


def bucket_by_context(requests: list[int], context_lens: list[int]) -> list[list[int]]:
    """`requests` in groups whose padding to their longest context stays within the waste bound.

    Taken shortest context first, each request joins the current group if the group, padded to this
    (longest yet) context, stays within the bound, and starts a new group otherwise. Each group lists
    its requests in step order.
    """
    groups: list[list[int]] = []
    real = 0  # the current group's context tokens
    for i in sorted(requests, key=context_lens.__getitem__):
        length = context_lens[i]
        if groups and within_waste_bound(length * (len(groups[-1]) + 1), real + length):
            groups[-1].append(i)
            real += length
        else:
            groups.append([i])
            real = length
    return [sorted(group) for group in groups]


@dataclass
class BatchedAttention:
    """One padded call per group of one-token requests of similar context, one call per multi-token request."""

    decodes: list[DecodeGroup]
    prefills: list[_OneRequest]
    scratch: GatherScratch | None = None

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q: (T, nh, hs) rotated queries; k_cache, v_cache: (num_entries, nkv, hs). Returns (T, nh, hs)."""
        if not self.prefills and len(self.decodes) == 1:  # one group of every request: its rows are 0..T-1
            return self.decodes[0].attend(q, k_cache, v_cache, self.scratch)
        out = torch.empty_like(q)  # (T, nh, hs)
        for group in self.decodes:
            out.index_copy_(0, group.rows, group.attend(q, k_cache, v_cache, self.scratch))
        for prefill in self.prefills:
            out[prefill.rows] = prefill.attend(q, k_cache, v_cache, self.scratch)
        return out


class _StepRequests:
    """One step's requests as the planners see them: their rows, contexts and block tables."""

    def __init__(self, num_new: list[int], context_lens: list[int], block_tables: torch.Tensor, block_size: int):
        self.num_new, self.context_lens, self.block_tables, self.block_size = num_new, context_lens, block_tables, block_size
        self.first_rows = [0, *itertools.accumulate(num_new)][:-1]

    def one_request(self, i: int) -> _OneRequest:
        entries = context_entries(self.block_tables[i : i + 1], self.context_lens[i], self.block_size)[0]  # (L,)
        return _one_request(slice(self.first_rows[i], self.first_rows[i] + self.num_new[i]), entries)

    def multi_token(self) -> list[_OneRequest]:
        """A call of its own for each request with several new tokens."""
        return [self.one_request(i) for i, n in enumerate(self.num_new) if n > 1]

    def decode_buckets(self) -> list[list[int]]:
        """The one-token requests, bucketed by context (`bucket_by_context`)."""
        return bucket_by_context([i for i, n in enumerate(self.num_new) if n == 1], self.context_lens)

    def group(self, requests: list[int], make=decode_group, padded_len: int | None = None):
        """`make(rows, tables, context_lens, block_size, padded_len)` for these one-token requests (by default
        a DecodeGroup), padded to their longest context unless `padded_len` is given."""
        device = self.block_tables.device
        lens = torch.tensor([self.context_lens[i] for i in requests], device=device)  # (D,)
        rows = torch.tensor([self.first_rows[i] for i in requests], device=device)  # (D,)
        tables = self.block_tables.index_select(0, torch.tensor(requests, device=device))  # (D, max_blocks)
        return make(rows, tables, lens, self.block_size, padded_len or self.longest(requests))

    def longest(self, requests: list[int]) -> int:
        return max(self.context_lens[i] for i in requests)


def plan_attention(layout: str, num_new: list[int], context_lens: list[int], block_tables: torch.Tensor,
                   block_size: int, scratch: GatherScratch | None = None) -> PerRequestAttention | BatchedAttention:
    """How one step's attention runs, request by request or batched.

    num_new[i], context_lens[i]: request i's new tokens and its context after this step.
    block_tables: (R, max_blocks) long, request i's block ids in row i (padding past its end).
    scratch: buffers to gather keys and values into, reused across layers and steps.
    """
    step = _StepRequests(num_new, context_lens, block_tables, block_size)
    if layout == "per_request":
        return PerRequestAttention([step.one_request(i) for i in range(len(num_new))], scratch)
    return BatchedAttention([step.group(requests) for requests in step.decode_buckets()], step.multi_token(), scratch)


def plan_block_attention(num_new: list[int], context_lens: list[int], block_tables: torch.Tensor, block_size: int,
                         scratch: GatherScratch | None = None, max_entries: int | None = None) -> BatchedAttention:
    """`plan_attention`'s batched layout with its decode groups gathered by whole blocks, each group cut, in
    step order, into chunks of requests that gather at most `max_entries` cache entries in all (None: no
    cut; at least one request a chunk). A chunk pads to its whole group's longest context, as the group's
    one call would."""
    step = _StepRequests(num_new, context_lens, block_tables, block_size)
    groups = []
    for requests in step.decode_buckets():
        padded_len = step.longest(requests)
        gathered = -(-padded_len // block_size) * block_size  # entries a request gathers: whole blocks
        size = len(requests) if max_entries is None else max(1, max_entries // gathered)
        groups += [step.group(requests[start : start + size], block_decode_group, padded_len)
                   for start in range(0, len(requests), size)]
    return BatchedAttention(groups, step.multi_token(), scratch)
