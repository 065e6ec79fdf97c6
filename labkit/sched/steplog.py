"""StepLog: the one output contract of both back ends.

A back end appends runs of identical steps ("segments") while it works; the log
materialises its per-step arrays on first read and caches them until the next
append, so a live view can read the log so far and a long run stays cheap.

Invariants:

- `slots[s, k]` is the id of the request slot k works for at step s, or -1 when the
  slot is idle, including a finished request's slot that is still held;
- step s starts at `step_start[s]` and lasts `step_seconds[s]`; steps never overlap;
- a scheduled request processes tokens in its slot at a step (a prefill, a chunk of one,
  a recompute, or a decode); `num_emitted[s]` of them emit an output token at the end
  of step s, and `num_output_tokens` counts the emitted tokens;
- `num_preemptions` and `recomputed_tokens` count the work preemption threw away: the
  cached tokens of each preempted request, which it computes again when readmitted;
  `preempted_at` lists (step, request id) for each; `admit_step` is a request's last
  admission;
- per-request arrays are indexed by position in `trace`; -1 (steps) or NaN (times)
  means "not yet";
- `prefill_tokens[s, k]` is how many prompt tokens slot k processed at step s (0 for a
  decode step or an idle slot);
- `num_padded_rows[s]` counts the finished requests that still computed a row at step s
  (static batching's padding): their slots are idle in `slots` and in utilization, since
  they emit nothing useful, but the step's work (`num_decode_tokens`, `num_kv_tokens`,
  `num_rows`) counts them, because the step computes them;
- `num_shape_padded_rows[s]` counts the rows that padded a pure decode step up to a batch
  size the engine runs (`labkit.sched.shape`); they too are work and never a slot's use;
- an engine also fills `outputs` (request id -> generated token ids), `phase_seconds`
  (where each measured step's time went) and `lanes` (wall-clock stretches of host and
  device work); a simulation leaves them empty;
- `host_seconds[s]` and `device_seconds[s]` split step s into host work (scheduling,
  preparing inputs, bookkeeping) and device work (the forward and sampling kernels):
  measured by an engine, priced by the cost model of a simulation. Without overlap a
  step is host then device, so they sum to its seconds; with `overlap`, the host works
  on the next step while the device runs this one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from labkit.traffic import Trace

TIME_SLACK = 1e-9  # seconds: clock arithmetic slack when comparing times


def _per_step_array(compute):
    """A read-only property computed once and kept until the log grows again."""

    def cached(self):
        if compute.__name__ not in self._arrays:
            self._arrays[compute.__name__] = compute(self)
        return self._arrays[compute.__name__]

    return property(cached, doc=compute.__doc__)


class RunSeconds(NamedTuple):
    """The seconds of a run of steps: their sum now, one per step only when a log is read."""

    total: float
    per_step: Callable[[], np.ndarray]


class _Segment(NamedTuple):
    """`count` identical steps; `seconds` is one number or one per step."""

    row: list[int]
    count: int
    num_queued: int
    blocked: str
    start: float
    seconds: float | RunSeconds  # a float: every step's
    num_emitted: int
    num_blocks_used: int | np.ndarray | Callable[[], np.ndarray]
    arrivals: np.ndarray | None  # arrival times of requests that join the queue during the steps
    num_padded: int  # finished rows computed as padding in each step
    num_shape_padded: int  # rows that pad each step to a size the engine runs


class RequestTimes:
    """TTFT and end-to-end latency of each request, from its arrival (queueing included), for a
    log with per-request `first_token_at` and `finished_at` times; NaN for a request not done."""

    @property
    def ttft(self) -> np.ndarray:
        """Time to first token, from arrival (queueing included)."""
        return self.first_token_at - self.trace.arrivals

    @property
    def latency(self) -> np.ndarray:
        """End-to-end seconds from arrival to the last token."""
        return self.finished_at - self.trace.arrivals


class StepLog(RequestTimes):
    """Per-step slot occupancy, queue and timing, and per-request milestones."""

    def __init__(self, trace: Trace, num_slots: int, policy: str):
        self.trace = trace
        self.num_slots = num_slots
        self.policy = policy
        self.num_steps = 0
        self.num_output_tokens = 0
        self.num_preemptions = 0
        self.recomputed_tokens = 0
        self.preemptions = np.zeros(len(trace), np.int64)
        self.preempted_at: list[tuple[int, int]] = []  # (step, request id): lost its slot before that step
        self._segments: list[_Segment] = []
        self._arrays: dict[str, np.ndarray] = {}
        self._prefills: list[tuple[int, list[tuple[int, int]]]] = []
        self._phases: dict[str, list[float]] = {}
        self._kv_tokens: list[tuple[int, int, int]] = []
        self._host_device: list[tuple[float, float]] = []
        self.cost = None  # the StepPrice that timed a simulation, if any
        self.overlap = False  # whether host work for a step overlapped the device's previous step
        self.lanes: dict[str, list[tuple[float, float]]] = {"host": [], "device": []}
        self.outputs: dict[int, list[int]] = {}
        self.admit_step = np.full(len(trace), -1, np.int64)
        self.first_token_step = np.full(len(trace), -1, np.int64)
        self.finish_step = np.full(len(trace), -1, np.int64)

    def __repr__(self) -> str:
        return (
            f"StepLog({self.policy}: {self.num_steps} steps, {self.num_output_tokens} tokens, "
            f"utilization {self.utilization:.1%})"
        )

    # Writing (back ends only)

    def append(self, row, count, num_queued, blocked, start, seconds, num_emitted, num_blocks_used=0, arrivals=None,
               num_padded=0, num_shape_padded=0) -> None:
        """Record `count` identical steps: who works in which slot, queue depth, why the head
        waits, start time, seconds, output tokens emitted per step, and KV blocks held (a number,
        one per step, or a function that gives one per step when the log is read). `arrivals`:
        arrival times of requests that join the queue during these steps, each from the first
        step that starts at or after it (`num_queued` is the depth at the first step).
        `num_padded`: finished rows each step computes as padding; `num_shape_padded`: rows
        that pad each step to a batch size the engine runs."""
        self._segments.append(
            _Segment(row, count, num_queued, blocked, start, seconds, num_emitted, num_blocks_used, arrivals, num_padded,
                     num_shape_padded)
        )
        self.num_steps += count
        self.num_output_tokens += count * num_emitted
        if self._arrays:
            self._arrays.clear()

    def count_preemptions(self, step: int, requests) -> None:
        """Record the preemption of `requests` before `step` (each with its `id`, `index` and the
        `num_computed` tokens it had cached)."""
        for request in requests:
            self.preempted_at.append((step, request.id))
            self.num_preemptions += 1
            self.recomputed_tokens += request.num_computed
            self.preemptions[request.index] += 1

    def mark_prefills(self, step: int, prefills: list[tuple[int, int]]) -> None:
        """Record that at `step` each (slot, num_tokens) of `prefills` processed that many prompt tokens."""
        self._prefills.append((step, prefills))
        self._arrays.pop("prefill_tokens", None)

    def record_measured(self, measured) -> None:
        """Record what an engine measured of one step (a `labkit.sched.scheduler.Measured`):
        where its time went, its host and device seconds, and its lanes' stretches of work."""
        for phase, value in measured.phases.items():
            self._phases.setdefault(phase, []).append(value)
        self._host_device.append((measured.host, measured.device))
        for lane, start, end in measured.lanes:
            self.lanes[lane].append((start, end))

    def record_kv_tokens(self, first: int, count: int = 1, growth: int = 0) -> None:
        """Record the KV tokens attention reads in the next `count` steps: `first` in the
        first, then `growth` more each step (one per decoding request)."""
        self._kv_tokens.append((first, count, growth))

    # Per step

    @property
    def num_kv_tokens(self) -> np.ndarray:
        """int [num_steps]: KV-cache tokens attention reads in the step, summed over requests.
        Recorded by back ends that time steps by their work (the engine, a cost model)."""
        if sum(count for _, count, _ in self._kv_tokens) != self.num_steps:
            raise ValueError("this log has no KV reads: they are recorded by the engine and by simulate(cost=...)")
        return np.concatenate([first + growth * np.arange(count) for first, count, growth in self._kv_tokens])

    @property
    def num_rows(self) -> np.ndarray:
        """int [num_steps]: rows the step computes: the requests scheduled, finished ones
        computed as padding, and rows that pad the step to a size the engine runs."""
        return (self.slots >= 0).sum(axis=1) + self.num_padded_rows + self.num_shape_padded_rows

    @_per_step_array
    def num_padded_rows(self) -> np.ndarray:
        """int [num_steps]: finished requests that still computed a row (static batching's padding)."""
        return self._per_step("num_padded", np.int64)

    @_per_step_array
    def num_shape_padded_rows(self) -> np.ndarray:
        """int [num_steps]: rows that padded a pure decode step up to a batch size the engine runs."""
        return self._per_step("num_shape_padded", np.int64)

    @property
    def has_host_time(self) -> bool:
        """Whether steps are split into host and device time (an engine's, or a cost model's)."""
        return len(self._host_device) == self.num_steps > 0 or self.cost is not None

    @property
    def host_seconds(self) -> np.ndarray:
        """float [num_steps]: host seconds of each step, measured or priced by the cost model."""
        return self._host_and_device()[0]

    @property
    def device_seconds(self) -> np.ndarray:
        """float [num_steps]: device seconds of each step, measured or priced by the cost model."""
        return self._host_and_device()[1]

    @property
    def overlap_extra_rows(self) -> int:
        """Rows an overlapped engine that stops on a sampled token (EOS) would run past a stop:
        it decides step t+1 before it sees step t's token, so each finished request would run
        one step more. Every output length is known here, so none ran; 0 without overlap."""
        return int((self.finish_step >= 0).sum()) if self.overlap else 0

    @property
    def device_idle_fraction(self) -> float:
        """The share of the run's step time in which the device did no work."""
        return 1.0 - float(self.device_seconds.sum() / self.step_seconds.sum()) if self.num_steps else 0.0

    def _host_and_device(self) -> tuple[np.ndarray, np.ndarray]:
        if len(self._host_device) == self.num_steps > 0:
            return tuple(np.array(values) for values in zip(*self._host_device))
        if self.cost is None:
            raise ValueError("this log has no host and device time: an engine measures them, "
                             "and simulate(cost=...) prices them")
        num_tokens = self.num_prefill_tokens + self.num_decode_tokens
        return (self.cost.host_seconds(self.num_rows, num_tokens),
                self.cost.device_seconds(self.num_prefill_tokens, self.num_decode_tokens, self.num_kv_tokens))

    @_per_step_array
    def prefill_tokens(self) -> np.ndarray:
        """int [num_steps, num_slots]: prompt tokens processed per slot and step."""
        tokens = np.zeros((self.num_steps, self.num_slots), np.int64)
        for step, prefills in self._prefills:
            for slot, num_tokens in prefills:
                tokens[step, slot] = num_tokens
        return tokens

    @property
    def phase_seconds(self) -> dict[str, np.ndarray]:
        """Measured seconds per step and phase (engine runs only)."""
        return {phase: np.array(values) for phase, values in self._phases.items()}

    @_per_step_array
    def slots(self) -> np.ndarray:
        """int [num_steps, num_slots]: id of the request each slot works for, -1 when idle."""
        if not self._segments:
            return np.empty((0, self.num_slots), np.int64)
        rows = np.array([segment.row for segment in self._segments], np.int64)
        return np.repeat(rows, self._counts(), axis=0)

    @_per_step_array
    def num_queued(self) -> np.ndarray:
        """int [num_steps]: requests waiting during the step."""
        queued = self._per_step("num_queued", np.int64)
        first_steps = np.cumsum(self._counts()) - self._counts()
        for first, segment in zip(first_steps.tolist(), self._segments):
            if segment.arrivals is not None:
                starts = self.step_start[first : first + segment.count]
                queued[first : first + segment.count] += np.searchsorted(segment.arrivals, starts + TIME_SLACK, "right")
        return queued

    @_per_step_array
    def blocked(self) -> np.ndarray:
        """str [num_steps]: why the head of the queue was not admitted ("" if none waited)."""
        return self._per_step("blocked", object)

    @_per_step_array
    def num_blocks_used(self) -> np.ndarray:
        """int [num_steps]: KV blocks in use during the step (0 without a pool)."""
        return self._expanded("num_blocks_used", np.int64)

    @_per_step_array
    def num_emitted(self) -> np.ndarray:
        """int [num_steps]: output tokens emitted at the end of the step."""
        return self._per_step("num_emitted", np.int64)

    @property
    def num_prefill_tokens(self) -> np.ndarray:
        """int [num_steps]: prompt (and recompute) tokens processed in the step."""
        return self.prefill_tokens.sum(axis=1)

    @property
    def num_decode_tokens(self) -> np.ndarray:
        """int [num_steps]: decode tokens processed in the step, one per decoding request and
        one per padded row of either kind."""
        return self.num_rows - (self.prefill_tokens > 0).sum(axis=1)

    @_per_step_array
    def step_seconds(self) -> np.ndarray:
        """float [num_steps]: duration of each step."""
        return self._expanded("seconds", np.float64)

    @_per_step_array
    def step_start(self) -> np.ndarray:
        """float [num_steps]: start time of each step, in seconds on the trace's clock."""
        elapsed = np.cumsum(self.step_seconds) - self.step_seconds  # since the first step began
        segment_first_step = np.cumsum(self._counts()) - self._counts()
        since_segment_start = elapsed - np.repeat(elapsed[segment_first_step], self._counts())
        return self._per_step("start", np.float64) + since_segment_start

    @property
    def step_end(self) -> np.ndarray:
        return self.step_start + self.step_seconds

    def _counts(self) -> np.ndarray:
        return np.array([segment.count for segment in self._segments], np.int64)

    def _expanded(self, field: str, dtype) -> np.ndarray:
        """One value per step of segments whose `field` is one number for all their steps, one
        per step, or computed when read (a function, or a RunSeconds' `per_step`)."""
        values = []
        for segment in self._segments:
            value = getattr(segment, field)
            value = value.per_step if isinstance(value, RunSeconds) else value
            values.append(np.broadcast_to(value() if callable(value) else value, segment.count))
        return np.concatenate(values).astype(dtype) if values else np.empty(0, dtype)

    def _per_step(self, field: str, dtype) -> np.ndarray:
        values = np.array([getattr(segment, field) for segment in self._segments], dtype)
        return np.repeat(values, self._counts())

    # Aggregates

    @property
    def num_runs(self) -> int:
        """Runs of identical steps recorded: one per decision that ran steps. A simulation runs
        a decision until its next event, so it has far fewer runs than steps; with `on_step`
        (and on the engine) every step is a run."""
        return len(self._segments)

    @property
    def utilization(self) -> float:
        """Useful slot-steps / (num_slots * num_steps)."""
        return self.num_output_tokens / (self.num_slots * self.num_steps) if self.num_steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.num_output_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def duration(self) -> float:
        """Seconds from the first arrival to the end of the last step."""
        return float(self.step_end[-1] - self.trace.arrivals.min()) if self.num_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.duration if self.num_steps else 0.0

    # Per request (indexed like the trace)

    def _time(self, steps: np.ndarray, times: np.ndarray) -> np.ndarray:
        out = np.full(len(steps), np.nan)
        done = steps >= 0
        out[done] = times[steps[done]]
        return out

    @property
    def admitted_at(self) -> np.ndarray:
        return self._time(self.admit_step, self.step_start)

    @property
    def first_token_at(self) -> np.ndarray:
        return self._time(self.first_token_step, self.step_end)

    @property
    def finished_at(self) -> np.ndarray:
        return self._time(self.finish_step, self.step_end)

    @property
    def waiting_time(self) -> np.ndarray:
        """Seconds from arrival to admission."""
        return self.admitted_at - self.trace.arrivals


