"""The model runner: one engine step on the model, prepare → forward → sample, and no clock.

`ModelRunner.run(batch)` is a whole step, as nano-vllm's `ModelRunner.run` is: build the
step's inputs from the rows the scheduler chose (`prepare`), run TinyGPT over them, or
replay a CUDA graph for a pure decode step (`forward`), pick each emitting row's next
token (`sample`) and append it to the request's sequence (`take`). It measures and records
nothing. The back ends call the same phases: `labkit.engine.steps` with a clock between
them, `labkit.engine.overlap` on two threads, and the server (`labkit.serve.online`) as
they are, through `run`.

Invariants:

- a request's sequence is the model's begin-of-sequence token and its prompt (`prompt(index)`,
  taken when the request first runs), then its outputs, each appended as it is sampled;
- a step feeds each row exactly the tokens the scheduler gave it: the next `n` uncomputed
  ones (a prompt, a chunk, a recompute after preemption, or the last output); a padded row
  (a finished request kept computing, n = 0) feeds its last computed token again, rewriting
  its own cache entry in place, and samples nothing; a shape-padding row (the rows that bring
  a pure decode step to a batch size the engine runs, `Batch.num_shape_padding`) feeds token
  0 at position 0 into the cache's padding block, and samples nothing;
- a row samples a token exactly when its step leaves none of its tokens uncomputed.
"""

from __future__ import annotations

import ctypes
import hashlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from labkit.engine.cuda_graphs import DecodeGraphs
from labkit.engine.kv import PagedKVCache
from labkit.engine.model import StepBatch, TinyGPT
from labkit.sched.state import Batch, Request

Sampler = Callable[[torch.Tensor, list[Request]], torch.Tensor]  # (E, vocab) logits, their requests -> (E,) ids


def greedy(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """(E,) the most likely token of each row of (E, vocab) logits."""
    return logits.argmax(dim=-1)


HostWork = Callable[[float], None]  # `seconds` of host work: busy_python, busy_native, sleep_holding_lock, time.sleep
_HASHED = bytes(1 << 18)  # 256 KiB: about 0.15 ms of hashing a call, the interpreter lock released


def busy_python(seconds: float) -> None:
    """Run Python bytecode for `seconds`: a core kept busy and the interpreter lock held, as
    a slow scheduler written in Python holds them."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def busy_native(seconds: float) -> None:
    """Run native code for `seconds`: a core kept busy with the interpreter lock released
    (hashlib releases it while it hashes more than 2,047 bytes, and takes it back for a moment
    between hashes), as a scheduler in C++ would."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        hashlib.sha256(_HASHED).digest()


def sleep_holding_lock(seconds: float) -> None:
    """Sleep for `seconds` without releasing the interpreter lock: the lock held and no core.
    The C library's sleep is called through `ctypes.PyDLL`, which keeps the lock during the
    call (POSIX `usleep` in microseconds; Windows' `Sleep` in milliseconds)."""
    if sys.platform == "win32":
        ctypes.PyDLL("kernel32").Sleep(round(seconds * 1e3))
    else:
        ctypes.PyDLL(None).usleep(round(seconds * 1e6))


@dataclass(frozen=True)
class PreparedStep:
    """A step's model inputs, and the rows among them that sample a token."""

    inputs: StepBatch
    emitting: list[int]  # rows whose step leaves none of their tokens uncomputed
    requests: list[Request]  # the emitting rows' requests, in the same order

    @property
    def num_kv_tokens(self) -> int:
        """The cache entries the step's attention reads: every row's context."""
        return sum(self.inputs.context_lens)


class ModelRunner:
    """Runs steps of `model` over `cache`: prepare, forward, sample.

    prompt(index): the begin-of-sequence token and the prompt ids of the request at that index.
    graphs: CUDA graphs to replay pure decode steps from (None: every step runs eagerly).
    sample: picks each emitting row's token (greedy by default).
    extra_host_seconds: host work added to every step's preparation, a knob to make the
    host's share large on purpose; extra_host_work does it (busy Python by default, holding a
    core and the interpreter lock; `busy_native` holds the core only, `sleep_holding_lock` the
    lock only, `time.sleep` neither).
    """

    def __init__(self, model: TinyGPT, cache: PagedKVCache, prompt: Callable[[int], list[int]],
                 graphs: DecodeGraphs | None = None, sample: Sampler = greedy, extra_host_seconds: float = 0.0,
                 extra_host_work: HostWork = busy_python):
        self.model, self.cache, self.prompt, self.graphs, self.sample = model, cache, prompt, graphs, sample
        self.extra_host_seconds, self.extra_host_work = extra_host_seconds, extra_host_work
        self.device = cache.k.device
        self.sequences: dict[int, list[int]] = {}  # request index -> its tokens so far

    def run(self, batch: Batch) -> list[int]:
        """One step of `batch`: the token each emitting row sampled, in row order, each taken
        into its request's sequence."""
        step = self.prepare(batch)
        logits = self.forward(step.inputs)[step.emitting]  # (E, vocab)
        tokens = self.sample(logits, step.requests).tolist()  # (E,) ids; waits for the device
        self.take(step, tokens)
        return tokens

    def prepare(self, batch: Batch) -> PreparedStep:
        """The step's inputs: the batch's rows, then its padding (finished requests, 0 new
        tokens), then its shape padding (token 0 at position 0, in the padding block)."""
        if self.extra_host_seconds:
            self.extra_host_work(self.extra_host_seconds)
        rows = [*batch.rows, *((request, 0) for request in batch.padding)]
        new_tokens, starts = [], []
        for request, num_tokens in rows:
            if request.index not in self.sequences:  # its first step: its sequence starts as its prompt
                self.sequences[request.index] = self.prompt(request.index)
            first = request.num_computed if num_tokens else request.num_computed - 1
            new_tokens.append(self.tokens(request, first, max(num_tokens, 1)))
            starts.append(first)
        tables = [request.block_table for request, _ in rows]
        for _ in range(batch.num_shape_padding):
            new_tokens.append([0])
            starts.append(0)
            tables.append([self.cache.padding_block])
        inputs = StepBatch.build(new_tokens, starts, tables, self.cache.block_size, self.device)
        emitting = [i for i, (request, n) in enumerate(rows) if n and n == request.num_uncomputed]
        return PreparedStep(inputs, emitting, [rows[i][0] for i in emitting])

    def tokens(self, request: Request, first: int, count: int) -> list[int]:
        """Tokens first .. first + count - 1 of the request's sequence."""
        sequence = self.sequences[request.index]
        assert first + count <= len(sequence), f"{request} needs tokens {first}..{first + count - 1} of {len(sequence)}"
        return sequence[first : first + count]

    def forward(self, inputs: StepBatch) -> torch.Tensor:
        """(R, vocab) logits of each row's last new token: replayed from a CUDA graph for a
        pure decode step when there are graphs, else from the model."""
        if self.graphs is not None and self.graphs.can_run(inputs):
            return self.graphs(inputs)
        return self.model(inputs, self.cache)

    def take(self, step: PreparedStep, tokens: list[int]) -> None:
        """Append each emitting row's token to its request's sequence."""
        for request, token in zip(step.requests, tokens):
            self.sequences[request.index].append(token)
