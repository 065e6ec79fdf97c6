"""Overlap scheduling in the engine: the back end of `labkit.sched.overlap.drive_overlapped`.

The plain back end (`labkit.engine.steps`) makes the host wait for every step. Here the
device work of a step (the runner's forward and sampling, `labkit.engine.model_runner`)
runs on a device lane, one worker thread, while the main thread decides and prepares the
next step. A CUDA device runs the lane's kernels asynchronously and the lane thread waits
for them without the Python lock, so on a GPU the overlap is real. On the CPU the lane
runs an eager forward that needs the Python lock between every two operations, so the two
threads partly take turns: the run measures how much is hidden. Python hands the lock to a
waiting thread only every 5 ms by default, which would stall the lane behind any busy
host; an overlapped run asks for a hand-over every `LOCK_HANDOVER_SECONDS` instead, and
restores the setting after.

Placeholders. Step t+1 is prepared before step t has sampled its tokens, so the token a
request samples in step t enters its sequence at launch as a placeholder, -(i + 1) for the
request at trace position i, and is replaced by the real token when step t lands. Each
step's device work first resolves placeholders from `next_tokens`, a device tensor with
one entry per request, and ends by writing its sampled tokens there; the lane runs steps
in order, so step t's tokens are in place before step t+1 reads them. The host lands step
t after it has launched step t+1 and before it prepares step t+2, so the only placeholders
a step reads are the previous step's.

Invariants:

- an overlapped run gives each request exactly the tokens of a plain run;
- every row of step t+1 reads its placeholder's token from step t, the only step in
  flight, so no row ever reads a token that is not yet written;
- when a run ends every step has landed, and no sequence holds a placeholder;
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
from labkit.sched import SchedulerState, StepLog
from labkit.sched.state import Batch

LOCK_HANDOVER_SECONDS = 1e-4  # sys.setswitchinterval while a run overlaps: 0.1 ms, not Python's 5 ms


@dataclass(frozen=True)
class _Launched:
    """A step on the device lane: its result, and where its sampled tokens go."""

    result: Future  # -> (tokens, device seconds, lane start, lane end)
    emitting: list[int]  # trace indices, one per sampled token
    positions: list[int]  # where each token's placeholder sits in its request's sequence
    num_kv_tokens: int


class OverlappedRunner:
    """Launch a runner's step on the device lane and return; land it (take its tokens) later.
    The lane samples while the host moves on, so the runner's sampler may read the logits
    only, not the requests (greedy does). `progress` counts the tokens landed."""

    def __init__(self, runner: ModelRunner, num_requests: int, progress):
        self.runner, self.progress = runner, progress
        self.timer = DeviceTimer(runner.device.type == "cuda")
        self.lane = ThreadPoolExecutor(1, thread_name_prefix="device-lane")
        self.next_tokens = torch.zeros(num_requests, dtype=torch.long, device=runner.device)  # (N,)
        self.run_start = time.perf_counter()
        self._last_land: float | None = None

    def __enter__(self) -> OverlappedRunner:
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(LOCK_HANDOVER_SECONDS)
        return self

    def __exit__(self, *exc) -> None:
        self.lane.shutdown(wait=True)
        sys.setswitchinterval(self._switch_interval)

    def launch(self, state: SchedulerState, batch: Batch, log: StepLog) -> _Launched:
        if self._last_land is None:
            self._last_land = time.perf_counter()
        step = self.runner.prepare(batch)
        indices = [request.index for request in step.requests]
        positions = [len(self.runner.sequences[index]) for index in indices]
        self.runner.take(step, self.placeholders(step))
        device = self.runner.device
        result = self.lane.submit(self._device_step, step, torch.tensor(step.emitting, dtype=torch.long, device=device),
                                  torch.tensor(indices, dtype=torch.long, device=device))
        return _Launched(result, indices, positions, step.num_kv_tokens)

    @staticmethod
    def placeholders(step: PreparedStep) -> list[int]:
        """What stands in each emitting row's sequence for the token it samples: -(i + 1) for
        the request at trace position i."""
        return [-(request.index + 1) for request in step.requests]

    def land(self, launched: _Launched, log: StepLog) -> float:
        waited_from = time.perf_counter()
        tokens, device, lane_start, lane_end = launched.result.result()
        waited_to = time.perf_counter()
        for index, position, token in zip(launched.emitting, launched.positions, tokens):
            self.runner.sequences[index][position] = token
        end = time.perf_counter()
        seconds = end - self._last_land
        log.record_host_device(seconds - (waited_to - waited_from), device)
        for lane, stretch in (("host", (self._last_land, waited_from)), ("device", (lane_start, lane_end)),
                              ("host", (waited_to, end))):
            log.record_lane(lane, *(moment - self.run_start for moment in stretch))
        log.record_kv_tokens(launched.num_kv_tokens)
        self.progress.update(len(tokens))
        self._last_land = end
        return seconds

    def _device_step(self, step: PreparedStep, emitting_rows, emitting_indices) -> tuple[list[int], float, float, float]:
        """On the lane: resolve placeholders, forward, sample, publish the tokens for the next step."""
        with torch.inference_mode():
            lane_start = time.perf_counter()
            start = self.timer.mark()
            ids = step.inputs.input_ids  # (T,), placeholders < 0
            resolved = torch.where(ids < 0, self.next_tokens[(-ids - 1).clamp(min=0)], ids)  # (T,)
            logits = self.runner.forward(replace(step.inputs, input_ids=resolved))[emitting_rows]  # (E, vocab)
            sampled = self.runner.sample(logits, step.requests)  # (E,)
            self.next_tokens[emitting_indices] = sampled
            end = self.timer.mark()
            tokens = sampled.tolist()  # waits for the device
            return tokens, self.timer.seconds(start, end), lane_start, time.perf_counter()
