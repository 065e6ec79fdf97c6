"""StepLog: the one output contract of both back ends.

A back end appends runs of identical steps ("segments") while it works; the log
materialises its per-step arrays on first read and caches them until the next
append, so a live view can read the log so far and a long run stays cheap.

Invariants:

- `slots[s, k]` is the id of the request slot k works for at step s, or -1 when the
  slot is idle, including a finished request's slot that is still held;
- step s starts at `step_start[s]` and lasts `step_seconds[s]`; steps never overlap;
- a request that holds a slot at a step emits one token at the end of that step;
- per-request arrays are indexed by position in `trace`; -1 (steps) or NaN (times)
  means "not yet";
- `prefill_tokens[s, k]` is how many prompt tokens slot k processed at step s (0 for a
  decode step or an idle slot);
- an engine also fills `outputs` (request id -> generated token ids) and `phase_seconds`
  (where each measured step's time went); a simulation leaves them empty.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from labkit.traffic import Trace

_STEP_ARRAYS = ("slots", "num_queued", "blocked", "step_start", "step_seconds")


class StepLog:
    """Per-step slot occupancy, queue and timing, and per-request milestones."""

    def __init__(self, trace: Trace, num_slots: int, policy: str):
        self.trace = trace
        self.num_slots = num_slots
        self.policy = policy
        self.num_steps = 0
        self.num_tokens = 0
        self._segments: list[tuple[np.ndarray, int, int, str, float, float]] = []
        self._prefills: list[tuple[int, list[int], list[int]]] = []
        self._phases: dict[str, list[float]] = {}
        self.outputs: dict[int, list[int]] = {}
        self.admit_step = np.full(len(trace), -1, np.int64)
        self.first_token_step = np.full(len(trace), -1, np.int64)
        self.finish_step = np.full(len(trace), -1, np.int64)

    def __repr__(self) -> str:
        return (
            f"StepLog({self.policy}: {self.num_steps} steps, {self.num_tokens} tokens, "
            f"utilization {self.utilization:.1%})"
        )

    # Writing (back ends only)

    def append(self, row: np.ndarray, count: int, num_queued: int, blocked: str, start: float, seconds: float):
        """Record `count` identical steps: slot row, queue depth, why the head waits, timing."""
        self._segments.append((row, count, num_queued, blocked, start, seconds))
        self.num_steps += count
        self.num_tokens += count * int(np.count_nonzero(row >= 0))
        for name in (*_STEP_ARRAYS, "prefill_tokens"):
            self.__dict__.pop(name, None)

    def mark_prefills(self, step: int, slots: list[int], num_tokens: list[int]) -> None:
        """Record that each of `slots` processed its `num_tokens` prompt tokens at `step`."""
        self._prefills.append((step, slots, num_tokens))
        self.__dict__.pop("prefill_tokens", None)

    def record_phases(self, **seconds: float) -> None:
        """Record where one measured step's time went, e.g. schedule=..., forward=...."""
        for phase, value in seconds.items():
            self._phases.setdefault(phase, []).append(value)

    # Per step

    @cached_property
    def prefill_tokens(self) -> np.ndarray:
        """int [num_steps, num_slots]: prompt tokens processed per slot and step."""
        tokens = np.zeros((self.num_steps, self.num_slots), np.int64)
        for step, slots, num_tokens in self._prefills:
            tokens[step, slots] = num_tokens
        return tokens

    @property
    def phase_seconds(self) -> dict[str, np.ndarray]:
        """Measured seconds per step and phase (engine runs only)."""
        return {phase: np.array(values) for phase, values in self._phases.items()}

    @cached_property
    def slots(self) -> np.ndarray:
        """int [num_steps, num_slots]: request id per slot and step, -1 when idle."""
        if not self._segments:
            return np.empty((0, self.num_slots), np.int64)
        rows = np.stack([segment[0] for segment in self._segments])
        return np.repeat(rows, self._counts(), axis=0)

    @cached_property
    def num_queued(self) -> np.ndarray:
        """int [num_steps]: requests waiting during the step."""
        return self._per_step(2, np.int64)

    @cached_property
    def blocked(self) -> np.ndarray:
        """str [num_steps]: why the head of the queue was not admitted ("" if none waited)."""
        return self._per_step(3, object)

    @cached_property
    def step_seconds(self) -> np.ndarray:
        """float [num_steps]: duration of each step."""
        return self._per_step(5, np.float64)

    @cached_property
    def step_start(self) -> np.ndarray:
        """float [num_steps]: start time of each step, in seconds on the trace's clock."""
        counts = self._counts()
        first = np.repeat([segment[4] for segment in self._segments], counts)
        offset = np.arange(self.num_steps) - np.repeat(np.cumsum(counts) - counts, counts)
        return first + offset * self.step_seconds

    @property
    def step_end(self) -> np.ndarray:
        return self.step_start + self.step_seconds

    def _counts(self) -> np.ndarray:
        return np.array([segment[1] for segment in self._segments], np.int64)

    def _per_step(self, field: int, dtype) -> np.ndarray:
        values = np.array([segment[field] for segment in self._segments], dtype)
        return np.repeat(values, self._counts())

    # Aggregates

    @property
    def utilization(self) -> float:
        """Useful slot-steps / (num_slots * num_steps)."""
        return self.num_tokens / (self.num_slots * self.num_steps) if self.num_steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.num_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def duration(self) -> float:
        """Seconds from the first arrival to the end of the last step."""
        return float(self.step_end[-1] - self.trace.arrivals.min()) if self.num_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.duration if self.num_steps else 0.0

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

    @property
    def ttft(self) -> np.ndarray:
        """Time to first token, from arrival (queueing included)."""
        return self.first_token_at - self.trace.arrivals

    @property
    def latency(self) -> np.ndarray:
        """End-to-end seconds from arrival to the last token."""
        return self.finished_at - self.trace.arrivals
