"""The engine's plain back end for `labkit.sched.driver.drive`: one step, start to finish.

`TorchSteps.execute` prepares a step's inputs from the scheduled requests, runs the model
(or replays a CUDA graph for a decode step), samples greedily and takes the tokens into
each request's sequence, then returns the step's measured seconds. The host waits for
the device in every step; `labkit.engine.overlap` is the loop that does not.

Invariants:

- every sequence is the model's begin-of-sequence token (`ModelConfig.bos_token_id`), the
  request's prompt, then its outputs; a step feeds each row exactly the tokens the policy
  scheduled for it;
- a step's seconds run from the end of the previous step to the end of this one, and
  split into device time (the forward and the sampling kernels: their wall time on the
  CPU, CUDA events on a GPU) and host time (the rest), so the two sum to the step;
- the lanes record host and device stretches on the wall clock, from the run's start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from labkit.engine.cuda_graphs import DecodeGraphs
from labkit.engine.kv import PagedKVCache
from labkit.engine.model import StepBatch
from labkit.engine.timing import DeviceTimer
from labkit.sched import Request, SchedulerState, StepLog
from labkit.sched.state import Batch
from labkit.traffic import Trace


def busy_python(seconds: float) -> None:
    """Run Python bytecode for `seconds`, holding the interpreter lock as a slow scheduler
    would (sleeping would release it, and cost the process nothing)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@dataclass(eq=False)
class TorchSteps:
    """Prepare, forward, sample; timed. The phases of a step: schedule (from the previous
    step's end to this one's start), prepare, forward (the device work, waited for) and
    sample (taking the sampled tokens into the sequences)."""

    engine: object  # the Engine: its model, device and prompt ids
    cache: PagedKVCache
    trace: Trace
    graphs: DecodeGraphs | None = None
    sequences: dict[int, list[int]] = field(default_factory=dict)
    progress: object = None
    _last_step_end: float | None = None

    def __post_init__(self):
        self.timer = DeviceTimer(self.engine.device.type == "cuda")
        self.run_start = time.perf_counter()

    def prompt(self, index: int) -> list[int]:
        """The begin-of-sequence token and the prompt: the trace's ids if it has them, else drawn."""
        if self.trace.prompt_tokens:
            return [self.engine.config.bos_token_id, *self.trace.prompt_tokens[index].tolist()]
        return self.engine.prompt_ids(int(self.trace.ids[index]), int(self.trace.prompt_lengths[index]))

    def execute(self, state: SchedulerState, batch: Batch, log: StepLog) -> float:
        start = time.perf_counter()
        step_start = self._last_step_end or start
        rows = self._rows(batch)
        step_batch = self._prepare(rows)
        prepared = time.perf_counter()
        emitting = self._emitting(rows)
        device_start = self.timer.mark()
        logits = self._forward(step_batch)[emitting]  # (E, vocab)
        sampled = self._sample(logits, [rows[i][0] for i in emitting])  # (E,)
        device_end = self.timer.mark()
        tokens = sampled.tolist()  # waits for the device
        computed = time.perf_counter()
        for i, token in zip(emitting, tokens):
            self.sequences[rows[i][0].index].append(token)
        end = self._last_step_end = time.perf_counter()
        self._record(log, (step_start, start, prepared, computed, end), self.timer.seconds(device_start, device_end))
        log.record_kv_tokens(sum(step_batch.context_lens))
        self.progress.update(len(emitting))
        return end - step_start

    def _record(self, log: StepLog, moments: tuple[float, ...], device: float) -> None:
        """Log a step's phases, its host and device seconds, and its lanes, from the moments it
        began, started work, had its inputs, had its tokens, and ended."""
        step_start, start, prepared, computed, end = moments
        log.record_phases(schedule=start - step_start, prepare=prepared - start, forward=computed - prepared,
                          sample=end - computed)
        log.record_host_device(end - step_start - device, device)
        for lane, stretch in (("host", (step_start, prepared)), ("device", (prepared, computed)), ("host", (computed, end))):
            log.record_lane(lane, *(moment - self.run_start for moment in stretch))

    @staticmethod
    def _rows(batch: Batch) -> list[tuple[Request, int]]:
        """(request, tokens) per row: the batch's, then its padding (finished requests, 0 new tokens)."""
        return [*batch.rows, *((request, 0) for request in batch.padding)]

    @staticmethod
    def _emitting(rows: list[tuple[Request, int]]) -> list[int]:
        """The rows whose step leaves none of their tokens uncomputed: they sample a token."""
        return [i for i, (request, n) in enumerate(rows) if n and n == request.num_uncomputed]

    def _sample(self, logits, requests: list[Request]):
        """(E,) greedy tokens from (E, vocab) logits, one row per emitting request."""
        return logits.argmax(dim=-1)

    def _forward(self, step_batch: StepBatch):
        """(num_rows, vocab) logits: replayed from a CUDA graph for a decode step when there are graphs."""
        if self.graphs is not None and self.graphs.can_run(step_batch):
            return self.graphs(step_batch)
        return self.engine.model(step_batch, self.cache)

    def _prepare(self, rows: list[tuple[Request, int]]) -> StepBatch:
        """Each row's new tokens: the next `n` uncomputed ones (a prompt, a chunk, a recompute,
        or the last output), or, for a finished row kept as padding (n = 0), its last
        computed token again, rewritten in place. First, the engine's extra host work, if any."""
        busy_python(self.engine.extra_host_seconds)
        new_tokens, starts = [], []
        for request, num_tokens in rows:
            if request.index not in self.sequences:  # admitted this step: its sequence starts as its prompt
                self.sequences[request.index] = self.prompt(request.index)
            first = request.num_computed if num_tokens else request.num_computed - 1
            new_tokens.append(self._tokens(request, first, max(num_tokens, 1)))
            starts.append(first)
        tables = [request.block_table for request, _ in rows]
        return StepBatch.build(new_tokens, starts, tables, self.cache.block_size, self.engine.device)

    def _tokens(self, request: Request, first: int, count: int) -> list[int]:
        """Tokens first .. first + count - 1 of the request's sequence."""
        return self.sequences[request.index][first : first + count]
