"""Step prices from published peaks: closed forms for OPT-13B on an A100 40GB, tensor
parallelism, and the KV pool beside the weights."""

import dataclasses
import math
from dataclasses import fields

import pytest

import labkit as lk
from labkit.analysis.hardware import (A100_40GB, GPT3_175B, H200, LLAMA_3_1_8B, OPT_13B, GPU, Model, kv_pool_tokens,
                                     roofline_cost, weight_bound_price)

# the published figures, written out here rather than read back from the module
A100_BANDWIDTH, A100_FLOPS, A100_MEMORY = 1.555e12, 312e12, 40e9
OPT_PARAMETERS, OPT_LAYERS, OPT_D_MODEL = 13e9, 40, 5120


def test_opt_13b_kv_is_the_vllm_papers_800_kb_a_token():
    assert OPT_13B.kv_bytes_per_token == 819200 == 800 * 1024
    assert OPT_13B.kv_bytes_per_token == 2 * OPT_LAYERS * OPT_D_MODEL * 2  # key and value, fp16, every layer
    assert OPT_13B.weight_bytes == 26e9
    assert GPT3_175B.kv_bytes_per_token == 2 * 96 * 12288 * 2


def test_roofline_cost_of_opt_13b_on_an_a100():
    cost = roofline_cost(OPT_13B, A100_40GB)
    assert cost.overhead == 26e9 / A100_BANDWIDTH  # every fp16 weight streamed once a step: ~16.7 ms
    assert cost.per_decode_token == 2 * OPT_PARAMETERS / A100_FLOPS
    assert cost.per_prefill_token == cost.per_decode_token
    assert cost.per_kv_token == 819200 / A100_BANDWIDTH
    assert (cost.host_overhead, cost.host_per_request, cost.host_per_token, cost.overlap) == (0, 0, 0, False)
    assert 16e-3 < cost.overhead < 17e-3


def test_a_decode_step_prices_weights_tokens_and_context():
    cost = roofline_cost(OPT_13B, A100_40GB)
    batch, context = 32, 32 * 600
    memory = 26e9 / A100_BANDWIDTH + context * 819200 / A100_BANDWIDTH
    arithmetic = batch * 2 * OPT_PARAMETERS / A100_FLOPS
    assert math.isclose(cost.step_seconds(0, batch, context), max(memory, arithmetic), rel_tol=1e-12)
    assert memory > arithmetic  # a decode step of 32 is memory-bound
    prefill = 4096  # a long prompt's arithmetic overtakes the weights' read
    assert math.isclose(cost.step_seconds(prefill, 0, 0), prefill * 2 * OPT_PARAMETERS / A100_FLOPS, rel_tol=1e-12)


def test_the_roofline_is_not_the_sum():
    """Negative control: adding memory and arithmetic prices a decode step of 32 dearer."""
    cost = roofline_cost(OPT_13B, A100_40GB)
    added = dataclasses.replace(cost, roofline=False)
    assert added.step_seconds(0, 32, 19200) > cost.step_seconds(0, 32, 19200)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_divides_every_term(tp):
    one, split = roofline_cost(OPT_13B, A100_40GB), roofline_cost(OPT_13B, A100_40GB, tensor_parallel=tp)
    for field in ("overhead", "per_prefill_token", "per_decode_token", "per_kv_token"):
        assert getattr(split, field) == getattr(one, field) / tp  # a power of two divides exactly
    assert split.overhead == 26e9 / (tp * A100_BANDWIDTH)


def test_tensor_parallel_changes_the_price():
    """Negative control of the division: three GPUs are not one."""
    assert roofline_cost(OPT_13B, A100_40GB, tensor_parallel=3) != roofline_cost(OPT_13B, A100_40GB)
    assert math.isclose(roofline_cost(OPT_13B, A100_40GB, tensor_parallel=3).overhead * 3,
                        roofline_cost(OPT_13B, A100_40GB).overhead, rel_tol=1e-12)


def test_the_kv_pool_is_the_memory_beside_the_weights():
    assert kv_pool_tokens(OPT_13B, A100_40GB) == int((A100_MEMORY - 26e9) // 819200) == 17089
    assert kv_pool_tokens(OPT_13B, A100_40GB, num_gpus=2) == int((2 * A100_MEMORY - 26e9) // 819200)
    assert kv_pool_tokens(GPT3_175B, A100_40GB, num_gpus=16) == int((16 * A100_MEMORY - 350e9) // (2 * 96 * 12288 * 2))
    assert isinstance(kv_pool_tokens(OPT_13B, A100_40GB), int)


@pytest.mark.parametrize("num_gpus", [1, 8])
def test_weights_that_do_not_fit_name_num_gpus(num_gpus):
    with pytest.raises(ValueError, match=f"num_gpus = {num_gpus}: GPT-3 175B's 350 GB of weights do not fit"):
        kv_pool_tokens(GPT3_175B, A100_40GB, num_gpus=num_gpus)


def test_a_pool_from_the_figures_runs_a_multiplier():
    """The pieces fit together: a paged pool of OPT-13B's KV on one A100, priced by the roofline."""
    pool = kv_pool_tokens(OPT_13B, A100_40GB)
    trace = lk.Trace.sample(64, output="exponential", mean_output=128, max_output=1024, prompt="equal",
                            mean_prompt=1024, seed=0)
    memory = lk.multiplier.Memory(pool_tokens=pool, reserve_tokens=OPT_13B.max_seq_len)
    assert memory.num_reserved_slots == 8
    m = lk.multiplier.predict(trace, memory, roofline_cost(OPT_13B, A100_40GB))
    assert math.isclose(math.prod(f.value for f in m.factors), m.total, rel_tol=1e-12)
    assert m.total > 1


def test_figures_carry_their_sources():
    for record in (A100_40GB, OPT_13B, GPT3_175B):
        assert record.source
    assert {f.name for f in fields(GPU)} >= {"memory_bytes", "bandwidth", "flops"}
    assert Model("x", 1e9, 2, 8, 16, "here").kv_bytes_per_token == 2 * 2 * 8 * 2


H200_BANDWIDTH, H200_FLOPS = 4.8e12, 989e12  # H200 datasheet: HBM3e bandwidth, dense FP16 tensor cores
LLAMA_PARAMETERS, LLAMA_LAYERS, LLAMA_KV_HEADS, LLAMA_HEAD_SIZE = 8.03e9, 32, 8, 128


def test_llama_3_1_8b_keeps_keys_and_values_of_its_eight_kv_heads_only():
    assert LLAMA_3_1_8B.kv_bytes_per_token == 2 * LLAMA_LAYERS * LLAMA_KV_HEADS * LLAMA_HEAD_SIZE * 2 == 128 * 1024
    assert LLAMA_3_1_8B.kv_bytes_per_token < 2 * LLAMA_LAYERS * LLAMA_3_1_8B.d_model * 2  # negative control: MHA's


def test_the_weight_bound_price_is_an_h200_serving_llama_3_1_8b():
    price = weight_bound_price()
    assert price == roofline_cost(LLAMA_3_1_8B, H200)
    assert price.overhead == 2 * LLAMA_PARAMETERS / H200_BANDWIDTH
    assert price.per_decode_token == price.per_prefill_token == 2 * LLAMA_PARAMETERS / H200_FLOPS
    assert price.per_kv_token == 128 * 1024 / H200_BANDWIDTH
    one, eight = price.step_seconds(0, 1, 0), price.step_seconds(0, 8, 0)
    assert eight == one  # weight-bound: a step of 8 costs what a step of 1 does
    ridge = H200_FLOPS / H200_BANDWIDTH  # rows at which a row's arithmetic matches reading its share of weights
    assert price.step_seconds(0, math.floor(ridge), 0) == one < price.step_seconds(0, math.ceil(ridge), 0)
