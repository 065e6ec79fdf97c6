"""Attention over the paged cache: both layouts equal a dense per-request reference, on any step."""

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.engine import attention
from labkit.engine.attention import (
    ATTENTION_LAYOUTS,
    BatchedAttention,
    GatherScratch,
    PerRequestAttention,
    bucket_by_context,
    context_entries,
    plan_attention,
    within_waste_bound,
)
from labkit.sched.blocks import num_blocks_for

NH, HS = 2, 8


def reference(q, k_cache, v_cache, num_new, context_lens, tables, block_size):
    """Textbook attention, request by request: softmax(q k^T / sqrt(hs)) v over positions 0..p."""
    outs, row = [], 0
    for n, length, table in zip(num_new, context_lens, tables):
        entries = [table[p // block_size] * block_size + p % block_size for p in range(length)]
        k, v = k_cache[entries], v_cache[entries]  # (L, nh, hs)
        for j in range(n):
            position = length - n + j
            scores = torch.einsum("hd,lhd->hl", q[row], k[: position + 1]) / math.sqrt(HS)  # (nh, p + 1)
            outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v[: position + 1]))  # (nh, hs)
            row += 1
    return torch.stack(outs)  # (T, nh, hs)


@st.composite
def steps(draw):
    """A step: requests with 1..5 new tokens (decodes, prompts, chunks), contexts in scattered blocks."""
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_new = draw(st.lists(st.integers(1, 5), min_size=1, max_size=6))
    context_lens = [n + draw(st.integers(0, 12)) for n in num_new]
    blocks_each = [num_blocks_for(length, block_size) for length in context_lens]
    permutation = draw(st.permutations(range(sum(blocks_each) + 3)))  # a pool a little larger than needed
    tables, start = [], 0
    for count in blocks_each:
        tables.append(list(permutation[start : start + count]))
        start += count
    return num_new, context_lens, tables, block_size, len(permutation)


def padded(tables):
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables])  # (R, max_blocks)


def noise(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=60, deadline=None)
@given(steps(), st.sampled_from(ATTENTION_LAYOUTS), st.booleans(), st.sampled_from([0, attention.WASTE_ALLOWANCE]))
def test_both_layouts_equal_the_reference(step, layout, reuse_buffers, waste_allowance):
    """With no allowance of padded entries, these short contexts split into several decode groups."""
    num_new, context_lens, tables, block_size, num_blocks = step
    k_cache, v_cache = noise(num_blocks * block_size, NH, HS, seed=1), noise(num_blocks * block_size, NH, HS, seed=2)
    q = noise(sum(num_new), NH, HS, seed=3)
    with mock.patch.object(attention, "WASTE_ALLOWANCE", waste_allowance):
        plan = plan_attention(layout, num_new, context_lens, padded(tables), block_size,
                              GatherScratch() if reuse_buffers else None)
    expected = reference(q, k_cache, v_cache, num_new, context_lens, tables, block_size)
    torch.testing.assert_close(plan(q, k_cache, v_cache), expected, atol=1e-5, rtol=1e-5)


def test_a_wrong_block_table_fails_the_comparison():
    """Negative control: read request 0 through a table with another block in it."""
    num_new, context_lens, tables, block_size = [1, 3], [6, 5], [[4, 0, 2], [1, 3, 5]], 2
    k_cache, v_cache, q = noise(12, NH, HS, seed=1), noise(12, NH, HS, seed=2), noise(4, NH, HS, seed=3)
    expected = reference(q, k_cache, v_cache, num_new, context_lens, tables, block_size)
    wrong = plan_attention("batched", num_new, context_lens, padded([[4, 0, 5], [1, 3, 5]]), block_size)
    assert (wrong(q, k_cache, v_cache) - expected).abs().max() > 1e-3


def test_batched_plans_one_group_for_one_token_requests():
    plan = plan_attention("batched", [1, 4, 1, 1], [9, 4, 3, 7], padded([[0, 1, 2], [3], [4], [5, 6]]), 4)
    assert isinstance(plan, BatchedAttention) and len(plan.decodes) == 1  # 19 real + 8 padded entries: one call
    assert plan.decodes[0].rows.tolist() == [0, 5, 6]  # the one-token requests' rows among T = 7
    assert plan.decodes[0].entries.shape == (3, 9)  # padded to the longest of their contexts
    assert plan.decodes[0].key_mask[:, 0, 0].sum(-1).tolist() == [9, 3, 7]
    assert [p.rows for p in plan.prefills] == [slice(1, 5)]
    per_request = plan_attention("per_request", [1, 4, 1, 1], [9, 4, 3, 7], padded([[0, 1, 2], [3], [4], [5, 6]]), 4)
    assert isinstance(per_request, PerRequestAttention) and len(per_request.requests) == 4


def test_a_long_context_does_not_pad_the_short_ones():
    """Short, middling and 1,500-token contexts beside a prompt: each group pays for its own contexts."""
    context_lens, block_size = [60, 1500, 16, 400, 30, 44, 300, 100, 5], 4
    num_new = [1, 1, 1, 1, 1, 1, 1, 1, 5]  # the last is a whole prompt
    blocks_each = [num_blocks_for(length, block_size) for length in context_lens]
    pool = torch.randperm(sum(blocks_each), generator=torch.Generator().manual_seed(0)).tolist()
    tables = [pool[sum(blocks_each[:i]) : sum(blocks_each[: i + 1])] for i in range(len(blocks_each))]
    plan = plan_attention("batched", num_new, context_lens, padded(tables), block_size)
    assert [group.rows.tolist() for group in plan.decodes] == [[0, 2, 4, 5, 7], [3, 6], [1]]
    for group in plan.decodes:
        real = int(group.key_mask.sum())
        assert group.entries.numel() - real <= max(real / 4, 256)  # padded entries beyond the real ones
    num_entries = sum(blocks_each) * block_size
    k_cache, v_cache = noise(num_entries, NH, HS, seed=1), noise(num_entries, NH, HS, seed=2)
    q = noise(sum(num_new), NH, HS, seed=3)
    expected = reference(q, k_cache, v_cache, num_new, context_lens, tables, block_size)
    torch.testing.assert_close(plan(q, k_cache, v_cache), expected, atol=1e-5, rtol=1e-5)


def test_groups_are_cut_where_padding_would_pass_the_bound():
    # sorted 10, 20, 400, 450, 2000: 10 and 20 pad 10 entries; 400 would pad 770 > max(430 / 4, 256)
    assert bucket_by_context([0, 1, 2, 3, 4], [450, 10, 2000, 20, 400]) == [[1, 3], [0, 4], [2]]
    assert bucket_by_context([2, 4], [450, 10, 2000, 20, 400]) == [[4], [2]]  # only the requests asked for
    assert bucket_by_context([], [5]) == []
    assert within_waste_bound(1056, 800) and not within_waste_bound(1057, 800)  # 256 entries: more than 25% of 800
    assert within_waste_bound(2500, 2000) and not within_waste_bound(2501, 2000)  # 25% of 2000: more than 256


def test_context_entries_follow_the_block_table():
    assert context_entries(torch.tensor([[3, 0, 2]]), 7, 3).tolist() == [[9, 10, 11, 0, 1, 2, 6]]


def test_scratch_buffers_are_reused_and_grow():
    scratch, cache = GatherScratch(), torch.zeros(10, NH, HS)
    k, v = scratch.keys_and_values(cache, 4)
    assert k.shape == v.shape == (4, NH, HS) and k.data_ptr() != v.data_ptr()
    k_again, _ = scratch.keys_and_values(cache, 3)
    assert k_again.data_ptr() == k.data_ptr()  # the same memory, not a new allocation
    k_bigger, _ = scratch.keys_and_values(cache, 9)
    assert k_bigger.shape == (9, NH, HS)


@pytest.mark.parametrize("layout", ["batch", "orca"])
def test_an_unknown_layout_is_refused(layout):
    from labkit.engine import ModelConfig

    with pytest.raises(ValueError, match=f"attention = '{layout}': must be one of batched, per_request"):
        ModelConfig(attention=layout)
