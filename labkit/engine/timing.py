"""What one decode step costs, and what it is made of: measurements for lessons and benchmarks.

A decode step of B requests, each with `context_len` tokens in the cache (or each with its
own, `ragged_decode_step_seconds`), runs on a cache laid out as a real run's would be after
that many tokens; with `prompt_len`, the same step also admits one request's prompt of that
many tokens, prefilled in the same forward pass (eagerly: CUDA graphs replay pure decode
steps only). Its time splits three ways:

- GEMMs: every linear layer of the step (per layer qkv, o, gate_up, down; then the LM
  head), timed alone on inputs of the same shapes;
- attention: planning it and running it for every layer over the paged cache, alone;
- everything else: the rest of the step (norms, rotary positions, KV writes, the
  embedding, and the framework's per-operation overhead), by subtraction.

Two measurements change one cause of that cost alone: `linear_layers_seconds` runs the
same rows through the linear layers in one pass or in several (each pass reads every
weight), and `count_step_operations` counts the operations a step asks the framework for
(run a model of tiny widths to time them with next to no work).

Invariants: every time is the median of `repeats` calls after one warm-up call, measured
under the engine's thread count, with the device synchronised before the clock is read.
The clock is the wall clock, or with `cpu_time=True` (CPU engines only) the CPU time the
process spends, which other programs cannot inflate by taking the CPU away: with one
thread that is the call's own time, with more the sum over its threads.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from labkit.engine.attention import plan_attention
from labkit.engine.cuda_graphs import DecodeGraphs
from labkit.engine.device import torch_threads
from labkit.engine.kv import PagedKVCache
from labkit.engine.model import ModelInputs
from labkit.checks import whole_number
from labkit.sched.blocks import num_blocks_for


@dataclass(frozen=True)
class DeviceTimer:
    """Times stretches of device work: CUDA events on a GPU (read once the work is done),
    the wall clock elsewhere, where the device is the CPU and works while it is timed."""

    is_cuda: bool

    def mark(self):
        if self.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        """Device seconds between two marks; on a GPU this waits for the second."""
        if self.is_cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start


def _median_seconds(call, device: torch.device, repeats: int, cpu_time: bool = False) -> float:
    if cpu_time and device.type != "cpu":
        raise ValueError(f"cpu_time = True: the engine runs on {device.type}, whose work is not this process's "
                         "CPU time; time it on the wall clock")
    clock = time.process_time if cpu_time else time.perf_counter
    timings = []
    for _ in range(repeats + 1):  # the first call warms up (and captures a CUDA graph)
        start = clock()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        timings.append(clock() - start)
    return float(np.median(timings[1:]))


def _decode_step(engine, context_lens: list[int], block_size: int,
                 prompt_len: int = 0) -> tuple[PagedKVCache, ModelInputs]:
    """A cache and a decode step of one request per entry of `context_lens`, each at position context_len - 1,
    and, with `prompt_len`, one more request's prompt of that many tokens from position 0; the
    requests' blocks laid out one after another."""
    whole_number("prompt_len", prompt_len, minimum=0)
    if prompt_len > engine.config.max_seq_len:
        raise ValueError(f"prompt_len = {prompt_len}: must be at most the model's max_seq_len "
                         f"{engine.config.max_seq_len}")
    lengths = [*context_lens, prompt_len] if prompt_len else list(context_lens)
    blocks_each = [num_blocks_for(length, block_size) for length in lengths]
    cache = PagedKVCache(engine.config, sum(blocks_each), block_size, engine.device, engine.dtype)
    first_blocks = np.cumsum(blocks_each) - blocks_each  # (R,)
    tables = [np.arange(first, first + count) for first, count in zip(first_blocks, blocks_each)]
    new_tokens = [[1]] * len(context_lens) + ([[1] * prompt_len] if prompt_len else [])
    starts = [length - 1 for length in context_lens] + ([0] if prompt_len else [])
    batch = ModelInputs.build(new_tokens, starts, tables, block_size, engine.device)
    return cache, batch


def decode_step_seconds(engine, batch_size: int, context_len: int = 128, repeats: int = 5,
                        block_size: int = 16, cpu_time: bool = False, prompt_len: int = 0) -> float:
    """Median seconds of one decode step, as the engine runs it (from a CUDA graph where it uses them);
    with `prompt_len`, a step that also prefills one prompt of that many tokens."""
    return ragged_decode_step_seconds(engine, [context_len] * batch_size, repeats, block_size, cpu_time, prompt_len)


def ragged_decode_step_seconds(engine, context_lens: list[int], repeats: int = 5, block_size: int = 16,
                               cpu_time: bool = False, prompt_len: int = 0) -> float:
    """Median seconds of one decode step of requests `context_lens[i]` tokens deep each, as the engine runs it;
    with `prompt_len`, a step that also prefills one prompt of that many tokens."""
    cache, batch = _decode_step(engine, context_lens, block_size, prompt_len)
    graphs = engine.cuda_graphs and not prompt_len  # graphs replay pure decode steps only
    step = DecodeGraphs(engine.model, cache) if graphs else functools.partial(engine.model, cache=cache)
    with torch.inference_mode(), torch_threads(engine.threads):
        return _median_seconds(lambda: step(batch), engine.device, repeats, cpu_time)


def decode_step_parts(engine, batch_size: int, context_len: int = 128, repeats: int = 5,
                      block_size: int = 16, cpu_time: bool = False) -> dict[str, float]:
    """Median seconds of an eager decode step and of its parts: "step", "GEMMs", "attention", "other";
    with `cpu_time`, CPU seconds."""
    model, config = engine.model, engine.config
    cache, batch = _decode_step(engine, [context_len] * batch_size, block_size)
    gemms = _linear_layers(engine, batch_size)
    q = torch.randn(batch_size, config.n_heads, config.head_dim, device=engine.device, dtype=engine.dtype)

    def attention():
        plan = plan_attention(config.attention, batch.num_new, batch.context_lens, batch.block_tables, block_size,
                              model.gather_scratch)
        for layer in range(config.n_layers):
            plan(q, *cache.layer(layer))

    with torch.inference_mode(), torch_threads(engine.threads):
        parts = {name: _median_seconds(call, engine.device, repeats, cpu_time)
                 for name, call in (("step", lambda: model(batch, cache)), ("GEMMs", gemms), ("attention", attention))}
    parts["other"] = parts["step"] - parts["GEMMs"] - parts["attention"]
    return parts


def linear_layers_seconds(engine, rows: int, passes: int = 1, repeats: int = 5, cpu_time: bool = False) -> float:
    """Median seconds of the step's linear layers over `rows` rows, in `passes` passes of
    rows / passes rows each: the same rows and arithmetic, with every weight read once a pass.
    One pass is the GEMMs of `decode_step_parts`."""
    whole_number("rows", rows)
    whole_number("passes", passes)
    if rows % passes:
        raise ValueError(f"passes = {passes}: must divide rows = {rows}")
    layers = _linear_layers(engine, rows // passes)

    def all_passes():
        for _ in range(passes):
            layers()

    with torch.inference_mode(), torch_threads(engine.threads):
        return _median_seconds(all_passes, engine.device, repeats, cpu_time)


def count_step_operations(engine, batch_size: int, context_len: int = 128, block_size: int = 16) -> int:
    """Operations one eager decode step of `batch_size` requests, each `context_len` tokens
    deep, asks the framework for (torch's dispatcher calls, views included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    cache, batch = _decode_step(engine, [context_len] * batch_size, block_size)
    counter = Counter()
    with torch.inference_mode(), counter:
        engine.model(batch, cache)
    return counter.count


def _linear_layers(engine, rows: int):
    """A call that runs the step's linear layers, in order (per layer qkv, o, gate_up, down;
    then the LM head), on `rows` rows of random input."""
    linears = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(rows, m.in_features, device=engine.device, dtype=engine.dtype)
              for m in linears}

    def run():
        for linear in linears:
            F.linear(inputs[linear.in_features], linear.weight)

    return run
