"""labkit.engine: the "run" back end. A tiny Llama-style transformer with a paged KV cache,
driven by the same policies as the simulator. Imports torch and labkit.sched."""

from labkit.engine.config import ModelConfig
from labkit.engine.device import available_devices, resolve_device
from labkit.engine.fused import FusedTinyGPT
from labkit.engine.kv import PagedKVCache
from labkit.engine.model import ModelInputs, TinyGPT
from labkit.engine.model_runner import ModelRunner
from labkit.engine.engine import Engine

__all__ = [
    "Engine",
    "FusedTinyGPT",
    "ModelConfig",
    "ModelRunner",
    "PagedKVCache",
    "ModelInputs",
    "TinyGPT",
    "available_devices",
    "resolve_device",
]
