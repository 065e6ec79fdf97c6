"""Step prices from public hardware figures: a `CostModel` for a dense transformer on GPUs
with no measured coefficient, to simulate setups this machine cannot run.

A decode step streams every weight from memory once, and every token processed costs
2 × parameters floating-point operations:

    overhead          = weight bytes / (tensor_parallel × memory bandwidth)
    per token         = 2 × parameters / (tensor_parallel × peak FLOP/s)   (prompt and decode alike)
    per KV token read = KV bytes per token / (tensor_parallel × memory bandwidth)

The GPU streams memory while it computes, so a step takes the larger of its memory traffic
(weights and KV reads) and its arithmetic (`CostModel(roofline=True)`): a roofline.

A small batch of a real model is weight-bound: on an H200 serving Llama 3.1 8B, reading the
weights takes about 3.35 ms a step and one more row's arithmetic about 16 µs, so a step's
rows are free until about 200 of them, when the arithmetic overtakes the weights' read. `weight_bound_price()` is that price: the one the
lessons set beside this CPU's fitted price, so that a conclusion about cost says where it
holds.

Pipeline stages run one after another for one batch, so they add memory, not speed.

Invariants and limits, stated so nobody mistakes this for a measurement:

- every figure is a published peak, and nothing is fitted or tuned; real kernels reach
  less, so a real step is slower, mostly for small batches;
- a roofline is the best a step can do: real kernels overlap memory and arithmetic less
  than perfectly, so near the ridge a real step costs more;
- communication between GPUs, the host's work and activations are left out;
- `kv_pool_tokens` is an upper bound: all memory beside the weights holds KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.analysis.cost_fit import CostModel


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: float
    bandwidth: float  # bytes/s of HBM
    flops: float  # dense fp16/bf16 tensor-core FLOP/s, peak
    source: str


@dataclass(frozen=True)
class Model:
    name: str
    num_parameters: float
    num_layers: int
    d_model: int
    max_seq_len: int
    source: str
    bytes_per_value: int = 2  # fp16
    kv_width: int | None = None  # key/value heads × head size; d_model unless grouped-query attention shrinks it

    @property
    def weight_bytes(self) -> float:
        return self.num_parameters * self.bytes_per_value

    @property
    def kv_bytes_per_token(self) -> int:
        """A key and a value per layer, each kv_width wide (d_model without grouped-query
        attention): 800 KiB for OPT-13B, 128 KiB for Llama 3.1 8B's 8 key/value heads of 128."""
        return 2 * self.num_layers * (self.kv_width or self.d_model) * self.bytes_per_value


A100_40GB = GPU("NVIDIA A100 40GB", 40e9, 1.555e12, 312e12,
                "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
OPT_13B = Model("OPT-13B", 13e9, 40, 5120, 2048, "Zhang et al., OPT, arXiv:2205.01068, Table 1")
GPT3_175B = Model("GPT-3 175B", 175e9, 96, 12288, 2048, "Brown et al., GPT-3, arXiv:2005.14165, Table 2.1")
H200 = GPU("NVIDIA H200 SXM", 141e9, 4.8e12, 989e12,
           "https://www.nvidia.com/en-us/data-center/h200/ (datasheet: 4.8 TB/s HBM3e; 1,979 TFLOPS FP16 "
           "with sparsity, so 989 dense)")
LLAMA_3_1_8B = Model("Llama 3.1 8B", 8.03e9, 32, 4096, 131072,
                     "Llama Team, The Llama 3 Herd of Models, arXiv:2407.21783, Table 3 (32 layers, d_model 4096, "
                     "8 key/value heads of 128); 8.03e9 parameters in its Hugging Face model card",
                     kv_width=8 * 128)


def roofline_cost(model: Model, gpu: GPU, tensor_parallel: int = 1) -> CostModel:
    """The step prices of `model` split over `tensor_parallel` GPUs, from peak figures alone."""
    bandwidth, flops = tensor_parallel * gpu.bandwidth, tensor_parallel * gpu.flops
    per_token = 2 * model.num_parameters / flops
    return CostModel(overhead=model.weight_bytes / bandwidth, per_prefill_token=per_token,
                     per_decode_token=per_token, per_kv_token=model.kv_bytes_per_token / bandwidth, roofline=True)


def weight_bound_price(model: Model = LLAMA_3_1_8B, gpu: GPU = H200) -> CostModel:
    """A GPU's price of a step from public figures (by default an H200 serving Llama 3.1 8B
    in bf16): weight-bound at small batches, where an extra row costs almost nothing."""
    return roofline_cost(model, gpu)


def kv_pool_tokens(model: Model, gpu: GPU, num_gpus: int = 1) -> int:
    """Tokens of KV cache that fit beside the weights on `num_gpus` GPUs: an upper bound."""
    free = num_gpus * gpu.memory_bytes - model.weight_bytes
    if free <= 0:
        raise ValueError(f"num_gpus = {num_gpus}: {model.name}'s {model.weight_bytes / 1e9:.0f} GB of weights do not "
                         f"fit in {num_gpus} × {gpu.memory_bytes / 1e9:.0f} GB")
    return int(free // model.kv_bytes_per_token)
