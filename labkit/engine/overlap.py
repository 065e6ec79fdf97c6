"""Overlap scheduling in the engine: the back end of `labkit.sched.overlap.drive_overlapped`.

The plain back end (`labkit.engine.steps`) makes the host wait for every step. Here the
runner is a `LaneRunner`: its `run` (`ModelRunner.run`, the same step) prepares the step on
the main thread and hands the device work (the forward and the sampling) to a device lane,
one worker thread, returning at once, so the main thread decides and prepares the next step
while the lane computes. A CUDA device runs the lane's kernels asynchronously and the lane
thread waits for them without the Python lock, so on a GPU the overlap is real. On the CPU
the lane runs an eager forward that needs the Python lock between every two operations, so
the two threads partly take turns: the run measures how much is hidden. Python hands the
lock to a waiting thread only every 5 ms by default, which would stall the lane behind any
busy host; an overlapped run asks for a hand-over every `LOCK_HANDOVER_SECONDS` instead, and
restores the setting after.

Placeholders. Step t+1 is prepared before step t has sampled its tokens, so the scheduler
takes each token of step t into its request at launch as a placeholder, -(i + 1) for the
request at trace position i, and `land` puts the real token in its place. Each step's device
work first resolves placeholders from `next_tokens`, a device tensor with one entry per
request, and ends by writing its sampled tokens there; the lane runs steps in order, so step
t's tokens are in place before step t+1 reads them. The host lands step t after it has
launched step t+1 and before it prepares step t+2, so the only placeholders a step reads are
the previous step's.

Invariants:

- an overlapped run gives each request exactly the tokens of a plain run;
- every row of step t+1 reads its placeholder's token from step t, the only step in
  flight, so no row ever reads a token that is not yet written;
- when a run ends every step has landed, and no request holds a placeholder;
- a step's seconds run from the previous landing to its own; its host time is the main
  thread's work in that span (deciding and preparing the next step, taking this one's
  tokens), not waiting; its device time is the lane's forward and sampling;
- every output length is known, so the scheduler knows who finishes at step t before it
  decides step t+1. An engine that stops on a sampled token (EOS) cannot: the request
  runs one more step whose token is thrown away. The log counts those would-be rows in
  `overlap_extra_rows`; this engine, which forces lengths, does not run them.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from labkit.engine.model_runner import ModelRunner, PreparedStep
from labkit.engine.timing import DeviceTimer
from labkit.sched.scheduler import Measured, StepOutcome
from labkit.sched.state import Batch, Request

LOCK_HANDOVER_SECONDS = 1e-4  # sys.setswitchinterval while a run overlaps: 0.1 ms, not Python's 5 ms


@dataclass(frozen=True)
class _Launched:
    """A step on the device lane: its result, and where its sampled tokens go."""

    result: Future  # -> (tokens, device seconds, lane start, lane end)
    emitting: list[Request]  # one per sampled token
    positions: list[int]  # where each token's placeholder sits in its request's `token_ids`
    num_kv_tokens: int


class LaneRunner(ModelRunner):
    """A model runner whose device work runs on a lane of its own: `run` returns a Future of
    (tokens, device seconds, lane start, lane end) at once. It samples on the lane while the
    host moves on, from what the step fixed when it was prepared (greedy, with its banned ids).

    num_requests: the requests of the run, by trace position (one `next_tokens` entry each)."""

    def __init__(self, *args, num_requests: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.lane = ThreadPoolExecutor(1, thread_name_prefix="device-lane")
        self.lane_timer = DeviceTimer(self.device.type == "cuda")
        self.next_tokens = torch.zeros(num_requests, dtype=torch.long, device=self.device)  # (N,)

    def compute(self, step: PreparedStep) -> Future:
        return self.lane.submit(self._on_lane, step)

    def _on_lane(self, step: PreparedStep) -> tuple[list[int], float, float, float]:
        """Resolve placeholders, then the plain device work; it publishes the tokens for the next step."""
        with torch.inference_mode():
            lane_start = time.perf_counter()
            start = self.lane_timer.mark()
            ids = step.inputs.input_ids  # (T,), placeholders < 0
            resolved = torch.where(ids < 0, self.next_tokens[(-ids - 1).clamp(min=0)], ids)  # (T,)
            tokens = super().compute(replace(step, inputs=replace(step.inputs, input_ids=resolved)))
            seconds = self.lane_timer.seconds(start, self.lane_timer.mark())
            return tokens, seconds, lane_start, time.perf_counter()

    def sample(self, logits: torch.Tensor, step: PreparedStep) -> torch.Tensor:
        sampled = super().sample(logits, step)  # (E,)
        self.next_tokens[[request.index for request in step.requests]] = sampled
        return sampled


class OverlappedSteps:
    """Launch a `LaneRunner`'s step and return; land it (put its tokens in place) later.
    `progress` counts the tokens landed."""

    def __init__(self, runner: LaneRunner, progress):
        self.runner, self.progress = runner, progress
        self.run_start = time.perf_counter()
        self._last_land: float | None = None

    def __enter__(self) -> OverlappedSteps:
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(LOCK_HANDOVER_SECONDS)
        return self

    def __exit__(self, *exc) -> None:
        self.runner.lane.shutdown(wait=True)
        sys.setswitchinterval(self._switch_interval)

    def launch(self, batch: Batch) -> tuple[_Launched, list[int]]:
        if self._last_land is None:
            self._last_land = time.perf_counter()
        emitting = [request for request, num_tokens in batch.rows if num_tokens == request.num_uncomputed]
        positions = [len(request.token_ids) for request in emitting]
        result = self.runner.run(batch)
        return _Launched(result, emitting, positions, batch.work().num_kv_tokens), self.placeholders(emitting)

    @staticmethod
    def placeholders(emitting: list[Request]) -> list[int]:
        """What stands in each emitting row's sequence for the token it samples: -(i + 1) for
        the request at trace position i."""
        return [-(request.index + 1) for request in emitting]

    def land(self, launched: _Launched) -> StepOutcome:
        waited_from = time.perf_counter()
        tokens, device, lane_start, lane_end = launched.result.result()
        waited_to = time.perf_counter()
        for request, position, token in zip(launched.emitting, launched.positions, tokens):
            request.token_ids[position] = token
        end = time.perf_counter()
        seconds, start, self._last_land = end - self._last_land, self._last_land, end
        lanes = [(lane, first - self.run_start, last - self.run_start) for lane, first, last in
                 (("host", start, waited_from), ("device", lane_start, lane_end), ("host", waited_to, end))]
        self.progress.update(len(tokens))
        measured = Measured({}, seconds - (waited_to - waited_from), device, lanes)
        return StepOutcome(tokens, seconds, (launched.num_kv_tokens, 1, 0), measured)
