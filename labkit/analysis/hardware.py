"""Step prices from public hardware figures: a `CostModel` for a dense transformer on GPUs
with no measured coefficient, to simulate setups this machine cannot run.

A decode step streams every weight from memory once, and every token processed costs
2 × parameters floating-point operations:

    overhead          = weight bytes / (tensor_parallel × memory bandwidth)
    per token         = 2 × parameters / (tensor_parallel × peak FLOP/s)   (prompt and decode alike)
    per KV token read = KV bytes per token / (tensor_parallel × memory bandwidth)

Pipeline stages run one after another for one batch, so they add memory, not speed.

Invariants and limits, stated so nobody mistakes this for a measurement:

- every figure is a published peak, and nothing is fitted or tuned; real kernels reach
  less, so a real step is slower, mostly for small batches;
- the terms add where a real GPU overlaps memory traffic with compute (a roofline takes
  the larger), so large steps are priced a little high;
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

    @property
    def weight_bytes(self) -> float:
        return self.num_parameters * self.bytes_per_value

    @property
    def kv_bytes_per_token(self) -> int:
        """A key and a value of d_model per layer: 800 KiB for OPT-13B."""
        return 2 * self.num_layers * self.d_model * self.bytes_per_value


A100_40GB = GPU("NVIDIA A100 40GB", 40e9, 1.555e12, 312e12,
                "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
OPT_13B = Model("OPT-13B", 13e9, 40, 5120, 2048, "Zhang et al., OPT, arXiv:2205.01068, Table 1")
GPT3_175B = Model("GPT-3 175B", 175e9, 96, 12288, 2048, "Brown et al., GPT-3, arXiv:2005.14165, Table 2.1")


def roofline_cost(model: Model, gpu: GPU, tensor_parallel: int = 1) -> CostModel:
    """The step prices of `model` split over `tensor_parallel` GPUs, from peak figures alone."""
    bandwidth, flops = tensor_parallel * gpu.bandwidth, tensor_parallel * gpu.flops
    per_token = 2 * model.num_parameters / flops
    return CostModel(overhead=model.weight_bytes / bandwidth, per_prefill_token=per_token,
                     per_decode_token=per_token, per_kv_token=model.kv_bytes_per_token / bandwidth)


def kv_pool_tokens(model: Model, gpu: GPU, num_gpus: int = 1) -> int:
    """Tokens of KV cache that fit beside the weights on `num_gpus` GPUs: an upper bound."""
    free = num_gpus * gpu.memory_bytes - model.weight_bytes
    if free <= 0:
        raise ValueError(f"num_gpus = {num_gpus}: {model.name}'s {model.weight_bytes / 1e9:.0f} GB of weights do not "
                         f"fit in {num_gpus} × {gpu.memory_bytes / 1e9:.0f} GB")
    return int(free // model.kv_bytes_per_token)
