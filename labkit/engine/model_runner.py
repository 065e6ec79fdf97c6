"""The model runner: one engine step on the model, prepare → forward → sample, and no clock.

`ModelRunner.run(batch)` is a whole step, as nano-vllm's `ModelRunner.run` is: build the
step's inputs from the rows the scheduler chose and the tokens their requests hold
(`prepare`), run TinyGPT over them, or replay a CUDA graph for a pure decode step
(`forward`), and pick each emitting row's next token (`sample`). It returns the tokens;
the scheduler's `postprocess` takes them into the requests. Every loop calls it: `Engine.run`
(by way of `labkit.engine.steps`, whose timer the runner calls at each phase), the
overlapped engine (`labkit.engine.overlap`, whose lane runs the forward and the sampling)
and the server (`labkit.serve.online`).

Invariants:

- a request's tokens are its own (`Request.token_ids`): its first tokens (begin-of-sequence
  and prompt ids), then its outputs, each taken in by the scheduler as it is sampled; the
  runner reads them and writes none;
- a step feeds each row exactly the tokens the scheduler gave it: the next `n` uncomputed
  ones (a prompt, a chunk, a recompute after preemption, or the last output); a padded row
  (a finished request kept computing, n = 0) feeds its last computed token again, rewriting
  its own cache entry in place, and samples nothing; a shape-padding row (the rows that bring
  a pure decode step to a batch size the engine runs, `Batch.num_shape_padding`) feeds token
  0 at position 0 into the cache's padding block, and samples nothing;
- a row samples a token exactly when its step leaves none of its tokens uncomputed;
- sampling is greedy, except that a request short of its `min_tokens` outputs cannot pick
  one of its end-of-sequence ids (as vLLM and transformers mask them); which ids each row
  may not pick is fixed when the step is prepared.
"""

from __future__ import annotations

import ctypes
import hashlib
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from labkit.engine.cuda_graphs import DecodeGraphs
from labkit.engine.kv import PagedKVCache
from labkit.engine.model import ModelInputs, TinyGPT
from labkit.sched.state import Batch, Request

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
    """A step's model inputs, the rows among them that sample a token, and for each of those
    the ids it may not pick yet (a request short of its `min_tokens`: its end-of-sequence ids)
    and the only ids it may pick (its `allowed_token_ids`; empty: any)."""

    inputs: ModelInputs
    emitting: list[int]  # rows whose step leaves none of their tokens uncomputed
    requests: list[Request]  # the emitting rows' requests, in the same order
    banned: list[tuple[int, ...]]  # per emitting row
    allowed: list[tuple[int, ...]]  # per emitting row


class Untimed:
    """The timer of a runner that nobody times: each phase just runs."""

    def phase(self, name: str) -> nullcontext:
        return nullcontext()


class ModelRunner:
    """Runs steps of `model` over `cache`: prepare, forward, sample.

    graphs: CUDA graphs to replay pure decode steps from (None: every step runs eagerly).
    extra_host_seconds: host work added to every step's preparation, a knob to make the
    host's share large on purpose; extra_host_work does it (busy Python by default, holding a
    core and the interpreter lock; `busy_native` holds the core only, `sleep_holding_lock` the
    lock only, `time.sleep` neither).
    timer: what `run` tells when each phase ("prepare", "forward", "sample") starts and ends
    (`labkit.engine.steps.StepTimer`); by default nobody is told.
    """

    def __init__(self, model: TinyGPT, cache: PagedKVCache, graphs: DecodeGraphs | None = None,
                 extra_host_seconds: float = 0.0, extra_host_work: HostWork = busy_python, timer=None):
        self.model, self.cache, self.graphs = model, cache, graphs
        self.extra_host_seconds, self.extra_host_work = extra_host_seconds, extra_host_work
        self.timer = timer or Untimed()
        self.device = cache.k.device

    def run(self, batch: Batch) -> list[int]:
        """One step of `batch`: the token each emitting row sampled, in row order."""
        with self.timer.phase("prepare"):
            step = self.prepare(batch)
        return self.compute(step)

    def compute(self, step: PreparedStep) -> list[int]:
        """The device's part of a step: the forward pass, then sampling."""
        with self.timer.phase("forward"):
            logits = self.forward(step.inputs)[step.emitting]  # (E, vocab)
        with self.timer.phase("sample"):
            return self.sample(logits, step).tolist()  # (E,) ids; waits for the device

    def prepare(self, batch: Batch) -> PreparedStep:
        """The step's inputs: the batch's rows, then its padding (finished requests, 0 new
        tokens), then its shape padding (token 0 at position 0, in the padding block)."""
        if self.extra_host_seconds:
            self.extra_host_work(self.extra_host_seconds)
        rows = [*batch.rows, *((request, 0) for request in batch.padding)]
        new_tokens, starts = [], []
        for request, num_tokens in rows:
            first = request.num_computed if num_tokens else request.num_computed - 1
            new_tokens.append(request.token_ids[first : first + max(num_tokens, 1)])
            starts.append(first)
        tables = [request.block_table for request, _ in rows]
        for _ in range(batch.num_shape_padding):
            new_tokens.append([0])
            starts.append(0)
            tables.append([self.cache.padding_block])
        inputs = ModelInputs.build(new_tokens, starts, tables, self.cache.block_size, self.device)
        emitting = [i for i, (request, n) in enumerate(rows) if n and n == request.num_uncomputed]
        requests = [rows[i][0] for i in emitting]
        return PreparedStep(inputs, emitting, requests, [banned_ids(request) for request in requests],
                            [request.allowed_token_ids for request in requests])

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """(R, vocab) logits of each row's last new token: replayed from a CUDA graph for a
        pure decode step when there are graphs, else from the model."""
        if self.graphs is not None and self.graphs.can_run(inputs):
            return self.graphs(inputs)
        return self.model(inputs, self.cache)

    def sample(self, logits: torch.Tensor, step: PreparedStep) -> torch.Tensor:
        """(E,) the most likely token of each emitting row's (E, vocab) logits that it may pick."""
        for row, (banned, allowed) in enumerate(zip(step.banned, step.allowed)):
            if banned:
                logits[row, list(banned)] = float("-inf")  # a copy of the forward's logits: indexed
            if allowed:
                kept = logits[row, list(allowed)]  # (A,) a copy, banned ones at -inf still
                logits[row] = float("-inf")
                logits[row, list(allowed)] = kept
        return logits.argmax(dim=-1)


def banned_ids(request: Request) -> tuple[int, ...]:
    """The ids `request` may not sample next: its end-of-sequence ids, until it has `min_tokens` outputs."""
    return request.eos_token_ids if request.num_generated < request.min_tokens else ()
