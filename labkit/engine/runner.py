"""The engine: the "run" back end. A real TinyGPT forward pass for every step.

`Engine.run(trace, policy)` takes the same policy objects as `labkit.simulate` and
returns the same `StepLog`: the shared loop in `labkit.sched.driver` asks the policy,
applies its decision and records the step; this module only executes steps.

Invariants:

- every sequence is a begin-of-sequence token, the request's prompt, then its outputs;
  prompt ids come from the trace when it carries them, and are otherwise drawn from the
  engine's seed and the request id, so a request is the same request alone or batched,
  in any run;
- a request's KV lives in the paged cache blocks that `labkit.sched.BlockPool` lent
  it; every block is back in the pool when a run ends;
- decoding is greedy and each request emits exactly its output length (EOS is ignored);
- the clock advances by each step's measured wall time (schedule + prepare + forward +
  sample); when nothing runs it jumps to the next arrival rather than sleeping;
- under `Static(drop_finished=False)`, a finished request that still holds its slot
  is computed anyway, as a padded row whose output is thrown away (as Hugging Face's
  `generate` does); with `drop_finished=True` only live rows are computed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from labkit.engine.device import resolve_device
from labkit.engine.kv import PagedKVCache
from labkit.engine.model import ModelConfig, StepBatch, TinyGPT
from labkit.sched import BlockPool, Request, SchedulerState, StepLog
from labkit.sched.driver import drive
from labkit.traffic import Trace

BOS_TOKEN = 0


class Engine:
    """A tiny transformer with a paged KV cache, driven by a scheduling policy."""

    def __init__(
        self,
        config: ModelConfig | None = None,
        device: str = "auto",
        seed: int = 0,
        block_size: int = 16,
        model: TinyGPT | None = None,
    ):
        self.device = resolve_device(device)
        self.model = (model or TinyGPT(config or ModelConfig(), seed=seed)).to(self.device).eval()
        self.config = self.model.config
        self.seed = seed
        self.block_size = block_size

    def __repr__(self) -> str:
        return f"Engine({self.config}, device={str(self.device)!r}, seed={self.seed})"

    def prompt_ids(self, request_id: int, prompt_len: int) -> list[int]:
        """The begin-of-sequence token and `prompt_len` prompt ids drawn from (seed, request id)."""
        rng = np.random.default_rng([self.seed, request_id])
        return [BOS_TOKEN, *rng.integers(1, self.config.vocab_size, prompt_len).tolist()]

    def run(self, trace: Trace, policy, on_step=None, progress: bool = True, num_blocks: int | None = None) -> StepLog:
        """Serve `trace` with `policy`; returns the StepLog, with `outputs` and measured times.

        num_blocks: size of the KV pool; None sizes it so every slot can hold the longest request.
        progress: show a progress bar for runs longer than about a second.
        """
        need = self._check_fits(trace)
        self._check_vocabulary(trace)
        num_blocks = self._check_pool(num_blocks, need, policy.num_slots)
        steps = _TorchSteps(self, PagedKVCache(self.config, num_blocks, self.block_size, self.device), policy, trace)
        blocks = BlockPool(num_blocks, self.block_size)
        with torch.inference_mode(), tqdm(
            total=int(trace.output_lengths.sum()), unit="tok", delay=1.0, disable=not progress, leave=False
        ) as steps.progress:
            log = drive(trace, policy, steps, on_step, blocks)
        assert blocks.num_free_blocks == num_blocks, "a run must return every KV block"
        log.outputs = {int(trace.ids[i]): tokens[len(steps.prompt(i)) :] for i, tokens in steps.sequences.items()}
        return log

    def time_decode_step(self, batch_size: int, context_len: int = 128, repeats: int = 5) -> float:
        """Median seconds of one decode step of `batch_size` requests, each `context_len` tokens deep."""
        blocks_per_request = -(-context_len // self.block_size)
        cache = PagedKVCache(self.config, batch_size * blocks_per_request, self.block_size, self.device)
        tables = torch.arange(batch_size * blocks_per_request, device=self.device).view(batch_size, -1)  # (B, blocks)
        batch = StepBatch.build([[1]] * batch_size, [context_len - 1] * batch_size, list(tables), self.block_size)
        timings = []
        with torch.inference_mode():
            for _ in range(repeats + 1):  # the first call warms up
                start = time.perf_counter()
                self.model(batch, cache)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                timings.append(time.perf_counter() - start)
        return float(np.median(timings[1:]))

    def _check_fits(self, trace: Trace) -> int:
        """Blocks the longest request needs; a ValueError if a request can never fit the model."""
        lengths = 1 + trace.prompt_lengths + trace.output_lengths - 1  # BOS + prompt + outputs fed back
        too_long = np.flatnonzero(lengths > self.config.max_seq_len)
        if too_long.size:
            i = int(too_long[0])
            raise ValueError(
                f"request {int(trace.ids[i])}: prompt {int(trace.prompt_lengths[i])} + output "
                f"{int(trace.output_lengths[i])} tokens exceed max_seq_len {self.config.max_seq_len}"
            )
        return -(-int(lengths.max()) // self.block_size)

    def _check_vocabulary(self, trace: Trace) -> None:
        for i, tokens in enumerate(trace.prompt_tokens):
            outside = np.flatnonzero(tokens >= self.config.vocab_size)
            if outside.size:
                raise ValueError(
                    f"request {int(trace.ids[i])}: prompt token id {int(tokens[outside[0]])} at position "
                    f"{int(outside[0])} is outside the vocabulary (0..{self.config.vocab_size - 1})"
                )

    def _check_pool(self, num_blocks: int | None, need: int, num_slots: int) -> int:
        if num_blocks is None:
            return num_slots * need
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < need * num_slots:
            raise ValueError(
                f"num_blocks = {num_blocks!r}: the KV pool must hold {num_slots} slots x {need} blocks of "
                f"{self.block_size} tokens ({need * num_slots} blocks) for the longest request of this trace"
            )
        return num_blocks


@dataclass(eq=False)
class _TorchSteps:
    """The engine's back end for `drive`: prepare, forward, sample; timed."""

    engine: Engine
    cache: PagedKVCache
    policy: object
    trace: Trace
    step_time: None = None  # measured, not fixed: the driver runs one step at a time
    sequences: dict[int, list[int]] = field(default_factory=dict)
    progress: object = None
    _last_step_end: float | None = None

    def prompt(self, index: int) -> list[int]:
        """The begin-of-sequence token and the prompt: the trace's ids if it has them, else drawn."""
        if self.trace.prompt_tokens:
            return [BOS_TOKEN, *self.trace.prompt_tokens[index].tolist()]
        return self.engine.prompt_ids(int(self.trace.ids[index]), int(self.trace.prompt_lengths[index]))

    def execute(self, state: SchedulerState, running: list[Request], num_steps: int, log: StepLog) -> float:
        start = time.perf_counter()
        schedule = start - self._last_step_end if self._last_step_end else 0.0
        batch = self._prepare(running + self._padded_rows(state))
        prepared = time.perf_counter()
        logits = self.engine.model(batch, self.cache)  # (num_rows, vocab)
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize()
        computed = time.perf_counter()
        for request, token in zip(running, logits[: len(running)].argmax(dim=-1).tolist()):
            self.sequences[request.index].append(token)
        self._last_step_end = time.perf_counter()
        log.record_phases(
            schedule=schedule, prepare=prepared - start, forward=computed - prepared, sample=self._last_step_end - computed
        )
        self.progress.update(len(running))
        return schedule + self._last_step_end - start

    def _padded_rows(self, state: SchedulerState) -> list[Request]:
        return [] if getattr(self.policy, "drop_finished", True) else state.finished_in_slots()

    def _prepare(self, rows: list[Request]) -> StepBatch:
        """Each row's new tokens: its whole prompt (prefill), its last output (decode), or,
        for a finished row kept as padding, its last fed token again."""
        new_tokens, starts = [], []
        for request in rows:
            sequence = self.sequences.setdefault(request.index, self.prompt(request.index))
            end = request.context_len(0 if request.is_finished else 1)
            start = 0 if request.num_generated == 0 else end - 1
            new_tokens.append(sequence[start:end])
            starts.append(start)
        tables = [torch.tensor(r.block_table, dtype=torch.long, device=self.engine.device) for r in rows]
        return StepBatch.build(new_tokens, starts, tables, self.engine.block_size)
