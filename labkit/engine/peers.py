"""Peers on the same weights: a Hugging Face Llama built from a labkit `ModelConfig`, and
transformers' `generate` serving a trace in static batches, recorded as a `GenerateLog`.

`generate` pads each batch to its longest prompt on the left and runs every row until the
batch's longest output ends, computing the finished rows anyway: static batching as
transformers does it. Each request gets the engine's prompt ids (`Engine.prompt_ids`) and
emits exactly its output length (no EOS), so its greedy tokens can be compared with
labkit's, id for id.

Invariants: a `GenerateLog` is a `labkit.analysis.metrics.RunLog` (per request, the time of
every token on the run's clock, from 0 when the first batch starts), and its `num_steps`
counts forward passes, which equals `simulate`'s steps for `Static` on the same trace.
transformers is imported when first needed (it is in the `lab` and `test` extras).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from labkit.sched.steplog import RequestTimes
from labkit.traffic import Trace

PAD = 0  # the id left padding uses; the attention mask hides it


def transformers_llama(config, seed: int = 0, initializer_range: float = 0.02):
    """An fp32 `LlamaForCausalLM` in eval mode with `config`'s shape (a labkit `ModelConfig`)
    and weights drawn after `torch.manual_seed(seed)`, with HF's standard deviation
    `initializer_range` (larger weights make attention, and so positions, weigh more in the
    tokens); `TinyGPT.from_hf_llama` copies them."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    hf_config = config.to_hf_llama_config()
    hf_config.initializer_range = initializer_range
    model = LlamaForCausalLM(hf_config).float().eval()
    model.set_attn_implementation("sdpa")  # transformers' CPU default, and the kernel TinyGPT calls
    return model


class GenerateLog(RequestTimes):
    """What `generate_static` measured: per request (indexed like `trace`) the time of each
    token and its ids, and the number of forward passes."""

    def __init__(self, trace: Trace, tokens_at: list[np.ndarray], outputs: dict[int, list[int]], num_steps: int):
        self.trace, self.tokens_at, self.outputs, self.num_steps = trace, tokens_at, outputs, num_steps
        self.first_token_at = np.array([t[0] for t in tokens_at])
        self.finished_at = np.array([t[-1] for t in tokens_at])
        self.num_output_tokens = int(trace.output_lengths.sum())

    def __repr__(self) -> str:
        return f"GenerateLog({len(self.trace)} requests, {self.num_steps} steps, {self.duration:.2f} s)"

    @property
    def duration(self) -> float:
        """Seconds from the start of the first batch to the last token."""
        return float(self.finished_at.max())

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.duration

    def token_times(self) -> tuple[np.ndarray, np.ndarray]:
        """(request ids, times) of every token, grouped by request."""
        return np.repeat(self.trace.ids, [len(t) for t in self.tokens_at]), np.concatenate(self.tokens_at)


def generate_static(model, prompts: list[list[int]], trace: Trace, batch_size: int) -> GenerateLog:
    """transformers' greedy `generate` on `trace` in static batches of `batch_size`, in trace order."""
    tokens_at, outputs, num_steps = [], {}, 0
    start = time.perf_counter()
    for first in range(0, len(trace), batch_size):
        lengths = trace.output_lengths[first : first + batch_size]
        step_ends, tokens = generate_batch(model, prompts[first : first + batch_size], int(lengths.max()))
        step_times = step_ends - start  # (steps,)
        num_steps += len(step_times)
        for row, length in enumerate(lengths):
            tokens_at.append(step_times[:length])
            outputs[int(trace.ids[first + row])] = tokens[row, :length].tolist()
    return GenerateLog(trace, tokens_at, outputs, num_steps)


def generate_batch(model, prompts: list[list[int]], num_steps: int) -> tuple[np.ndarray, torch.Tensor]:
    """One static batch through `generate`, its prompts padded on the left, for `num_steps`
    steps: when each step ended (perf_counter seconds) and the (B, num_steps) tokens generated."""
    from transformers.generation.streamers import BaseStreamer

    class StepClock(BaseStreamer):
        """`generate` hands the streamer the prompt, then each step's new tokens: note when."""

        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts], device=model.device)  # (B, width)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)  # (B, width)
    clock = StepClock()
    with torch.inference_mode():
        tokens = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=num_steps,
                                min_new_tokens=num_steps, eos_token_id=None, pad_token_id=PAD, streamer=clock)
    return np.array(clock.times[1:]), tokens[:, width:]  # the first put is the prompt


def byte_level_tokenizer(add_bos: bool = True):
    """A Hugging Face fast tokenizer with `labkit.serve.tokenizer`'s ids: UTF-8 byte b is id
    b + 1, id 0 is the begin-of-sequence token "<s>", which encoding puts first as labkit's
    engine does (unless `add_bos` is False, as some saved Llamas' tokenizers add none), and no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {"<s>": 0, **{char: byte + 1 for byte, char in bytes_to_unicode().items()}}
    core = Tokenizer(models.BPE(vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    if add_bos:
        core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>")


def save_llama_dir(directory, config, seed: int = 0, initializer_range: float = 0.02, add_bos: bool = True) -> None:
    """Write a local Hugging Face model directory: `transformers_llama(config, seed, initializer_range)`'s
    weights (safetensors), its config.json and the byte-level tokenizer (`add_bos`: whether it
    puts the begin-of-sequence token first). Any server that loads a
    Llama directory (`labkit serve DIR`, `transformers serve DIR`) then serves the same weights.
    transformers' progress bar for writing the weights stays off."""
    from transformers.utils import logging as hf_logging

    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        transformers_llama(config, seed, initializer_range).save_pretrained(directory)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    byte_level_tokenizer(add_bos).save_pretrained(directory)
