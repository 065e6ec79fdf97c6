"""The step simulator: the "predict" back end.

A step lasts `step_time` seconds, or, given a `StepPrice`, as long as the model says for
the work in it (prompt tokens, decode tokens, KV tokens read, rows computed), on the
device and on the host, taking turns or overlapped; the log then splits each step into
the model's host and device seconds. The simulator computes
nothing per step: the fast-forward (`labkit.sched.fastforward`) runs each decision until
the next event in one go, asking the back end how many steps pass before a moment.
Scheduling rules and invariants are the scheduler's and the driver's
(`labkit.sched.scheduler`, `labkit.sched.driver`).

A run makes no reference cycles (reference counting frees all it drops), so `simulate`
pauses the cyclic garbage collector while it runs, unless `on_step` runs user code between
steps: otherwise the collector rescans every live request and log segment again and again,
a quarter of a long run's time.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial

import numpy as np

from labkit.checks import flag, number
from labkit.sched.cost import StepPrice
from labkit.sched.driver import drive
from labkit.sched.fastforward import fast_forward as fast_forward_run
from labkit.sched.scheduler import StepOutcome
from labkit.sched.state import Batch
from labkit.sched.steplog import RunSeconds, StepLog
from labkit.traffic import Trace

DEFAULT_STEP_TIME = 0.025  # seconds per decode step: a mid-sized model's iteration


@dataclass(frozen=True)
class FixedStepTime:
    """A back end whose steps take `step_time` seconds and compute nothing."""

    step_time: float

    def steps_until(self, batch: Batch, max_steps: int, seconds: float) -> int:
        return max(1, min(max_steps, math.ceil(seconds / self.step_time)))

    def execute(self, batch: Batch, num_steps: int = 1) -> StepOutcome:
        return StepOutcome(None, self.step_time)


@dataclass(frozen=True)
class ModeledStepTime:
    """A back end whose steps take what `cost` predicts for their work, and compute nothing.

    Over a run of steps the first processes each request's scheduled tokens and the rest
    are plain decodes, so the KV tokens read grow by one per request and step: the cost
    model prices the rest as one decode run, in closed form. A batch's padded rows (static
    batching's finished requests, at their frozen contexts, and rows that pad a decode step
    to a size the engine runs, at one cache entry each) are priced in every step, as the
    engine computes them.
    """

    cost: StepPrice

    def steps_until(self, batch: Batch, max_steps: int, seconds: float) -> int:
        first = self._first_step_seconds(batch)
        if seconds <= first or max_steps == 1:
            return 1
        after_first = batch.work().num_kv_tokens + batch.size
        return 1 + self.cost.decode_run_length(batch.size, after_first, seconds - first, max_steps - 1,
                                               batch.num_padded_rows)

    def execute(self, batch: Batch, num_steps: int = 1) -> StepOutcome:
        kv_tokens = (batch.work().num_kv_tokens, num_steps, batch.size)
        first = self._first_step_seconds(batch)
        if num_steps == 1:
            return StepOutcome(None, first, kv_tokens)
        rest = (batch.size, batch.work().num_kv_tokens + batch.size, num_steps - 1, batch.num_padded_rows)  # decodes after the first
        per_step = partial(_prepend, first, partial(self.cost.decode_run_seconds, *rest))
        return StepOutcome(None, RunSeconds(first + self.cost.decode_run_total(*rest), per_step), kv_tokens)

    def _first_step_seconds(self, batch: Batch) -> float:
        return self.cost.step_seconds(*batch.work(), batch.num_rows)


def _prepend(first: float, rest: Callable[[], np.ndarray]) -> np.ndarray:
    return np.concatenate([[first], rest()])


def simulate(
    trace: Trace,
    policy,
    step_time: float = DEFAULT_STEP_TIME,
    on_step: Callable[[StepLog], None] | None = None,
    cost: StepPrice | None = None,
    fast_forward: bool = True,
) -> StepLog:
    """Predict how `policy` serves `trace`; `on_step(log)` is called after every step if given.

    Steps take `step_time` seconds each, or what `cost` predicts for their work if given.
    fast_forward: run each decision until the next event at once (`labkit.sched.fastforward`);
    False, or an `on_step`, asks the policy before every step instead. The log is the same.
    """
    number("step_time", step_time, unit="seconds")
    if cost is not None and not isinstance(cost, StepPrice):
        raise ValueError(f"cost = {cost!r}: must be a labkit.CostModel or None")
    flag("fast_forward", fast_forward)
    backend = FixedStepTime(step_time) if cost is None else ModeledStepTime(cost)
    with nullcontext() if on_step else _cyclic_gc_paused():
        if fast_forward and not on_step:
            log = fast_forward_run(trace, policy, backend)
        else:
            log = drive(trace, policy, backend, on_step)
    log.cost, log.overlap = cost, cost is not None and cost.overlap
    return log


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Switch the cyclic garbage collector off for the block, and back on after it if it was on."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
