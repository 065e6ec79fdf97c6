"""StepPrice: the simulator's model of how long one engine step takes.

A step has device work and host work. The device prices a fixed overhead, each prompt
token, each decode token and each KV-cache token that attention reads; the host (the
loop, the scheduler, input preparation, bookkeeping) prices a fixed part, each scheduled
request and each token processed:

    device = overhead + per_prefill_token * prefill + per_decode_token * decode + per_kv_token * kv
    host   = host_overhead + host_per_request * requests + host_per_token * (prefill + decode)

Without overlap the two take turns, and a step takes host + device. With `overlap=True`
the host prepares the next step while the device runs this one, so a step takes
max(host, device) + overlap_exposed, the part of each step the loop cannot hide.

With `roofline=True` the device streams memory while it computes, so its time is the larger
of its memory traffic and its arithmetic rather than their sum (a roofline):

    device = max(overhead + per_kv_token * kv, per_prefill_token * prefill + per_decode_token * decode)

`overhead` is then the weights' read. A price from published GPU figures
(`labkit.analysis.hardware`) is a roofline; a price fitted on this CPU adds its terms.

The default coefficients are hand-set placeholders for a small model on a laptop CPU,
with the host terms at zero (the device `overhead` then stands for every fixed cost).
`lk.CostModel` (`labkit.analysis.cost_fit`) is this class with fitting, loading a saved fit
and printing the coefficients in readable units; `lk.CostModel.fit` replaces the defaults
with coefficients measured from an engine's StepLog. Pricing needs only this class.

Invariant: every coefficient is a finite number >= 0, so a step never takes negative time
and more work never makes a step shorter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from functools import cached_property

import numpy as np

from labkit.checks import flag, number

DEVICE_TERMS = ("overhead", "per_prefill_token", "per_decode_token", "per_kv_token")
HOST_TERMS = ("host_overhead", "host_per_request", "host_per_token")
FLAGS = ("overlap", "roofline")


@dataclass(frozen=True)
class StepPrice:
    """Seconds per engine step as a linear function of the work in the step, on the device
    and on the host, taking turns or overlapped."""

    overhead: float = 3e-3  # s per step on the device: kernel launches, sampling
    per_prefill_token: float = 1e-4  # s per prompt token processed in the step
    per_decode_token: float = 3e-4  # s per decode token (one per decoding request)
    per_kv_token: float = 2e-7  # s per KV-cache token read by attention in the step
    host_overhead: float = 0.0  # s per step on the host: the loop, launching, bookkeeping
    host_per_request: float = 0.0  # s per scheduled request: scheduling it, preparing its inputs
    host_per_token: float = 0.0  # s per token processed (prompt or decode): input ids, positions, slots
    overlap_exposed: float = 0.0  # s per step an overlapped loop cannot hide (only with overlap)
    overlap: bool = False  # whether the host prepares step t+1 while the device runs step t
    roofline: bool = False  # whether the device's memory terms and arithmetic terms overlap (max, not sum)

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name in FLAGS:
                flag(field.name, value)
            else:
                number(field.name, value, or_equal=True)

    def __repr__(self) -> str:
        """The device terms always; host terms and overlap only when they are set."""
        shown = [f.name for f in fields(self) if f.name in DEVICE_TERMS or getattr(self, f.name) != f.default]
        return f"{type(self).__name__}({', '.join(f'{name}={getattr(self, name)!r}' for name in shown)})"

    def scaled(self, factor: float) -> StepPrice:
        """Every time coefficient times `factor`: the same work on an implementation `factor` times slower."""
        number("factor", factor)
        return replace(self, **{f.name: getattr(self, f.name) * factor for f in fields(self) if f.name not in FLAGS})

    @cached_property
    def has_host_terms(self) -> bool:
        return any(getattr(self, name) for name in HOST_TERMS)

    def device_seconds(self, num_prefill_tokens, num_decode_tokens, num_kv_tokens):
        """Seconds of device work in one step; scalars give a float, arrays an array of the same shape."""
        if type(num_prefill_tokens) is type(num_decode_tokens) is type(num_kv_tokens) is int:  # the common case, cheaply
            memory = self.overhead + self.per_kv_token * num_kv_tokens
            arithmetic = self.per_prefill_token * num_prefill_tokens + self.per_decode_token * num_decode_tokens
            return max(memory, arithmetic) if self.roofline else memory + arithmetic
        memory = self.overhead + self.per_kv_token * np.asarray(num_kv_tokens, dtype=float)
        arithmetic = (self.per_prefill_token * np.asarray(num_prefill_tokens, dtype=float)
                      + self.per_decode_token * np.asarray(num_decode_tokens, dtype=float))
        seconds = np.maximum(memory, arithmetic) if self.roofline else memory + arithmetic
        return float(seconds) if seconds.ndim == 0 else seconds

    def host_seconds(self, num_requests, num_tokens):
        """Seconds of host work in one step of `num_requests` scheduled requests processing `num_tokens`."""
        seconds = (self.host_overhead + self.host_per_request * np.asarray(num_requests, dtype=float)
                   + self.host_per_token * np.asarray(num_tokens, dtype=float))
        return float(seconds) if seconds.ndim == 0 else seconds

    def step_seconds(self, num_prefill_tokens, num_decode_tokens, num_kv_tokens, num_requests=None):
        """Seconds one step takes: host + device, or with overlap max(host, device) + overlap_exposed.

        num_requests: rows the step computes (requests scheduled, and padded rows); needed only
        when `host_per_request` is set.
        """
        device = self.device_seconds(num_prefill_tokens, num_decode_tokens, num_kv_tokens)
        if not self.has_host_terms and not self.overlap:
            return device
        if num_requests is None:
            if self.host_per_request:
                raise ValueError("num_requests = None: host_per_request is set, so a step's price needs its requests")
            num_requests = 0
        host = self.host_seconds(num_requests, np.add(num_prefill_tokens, num_decode_tokens))
        return self._combine(host, device)

    def _combine(self, host, device):
        if self.overlap:
            seconds = np.maximum(host, device) + self.overlap_exposed
        else:
            seconds = np.add(host, device)
        return float(seconds) if np.ndim(seconds) == 0 else seconds

    def decode_run_seconds(self, num_requests: int, first_num_kv_tokens: int, num_steps: int,
                           num_padded: int = 0) -> np.ndarray:
        """Seconds of each of `num_steps` plain decode steps of `num_requests` requests, the
        first reading `first_num_kv_tokens` KV tokens and each later one `num_requests` more;
        `num_padded` more rows compute a token each at a context that does not grow (static
        batching's finished rows; their KV tokens are in `first_num_kv_tokens`)."""
        floor, first, growth = self._decode_run_terms(num_requests, first_num_kv_tokens, num_padded)
        return np.maximum(floor, first + growth * np.arange(num_steps))  # (steps,)

    def decode_run_total(self, num_requests: int, first_num_kv_tokens: int, num_steps: int,
                         num_padded: int = 0) -> float:
        """The sum of `decode_run_seconds`, in closed form."""
        return _run_total(self._decode_run_terms(num_requests, first_num_kv_tokens, num_padded), num_steps)

    def decode_run_length(self, num_requests: int, first_num_kv_tokens: int, seconds: float, max_steps: int,
                          num_padded: int = 0) -> int:
        """How many steps of such a run pass, at most `max_steps`, until `seconds` have passed:
        the step during which they pass counts. A bisection on the closed-form total."""
        terms = self._decode_run_terms(num_requests, first_num_kv_tokens, num_padded)
        low, high = 1, max_steps  # the answer lies in [low, high]
        while low < high:
            middle = (low + high) // 2
            if _run_total(terms, middle) >= seconds:
                high = middle
            else:
                low = middle + 1
        return low

    def _decode_run_terms(self, num_requests: int, first_num_kv_tokens: int,
                          num_padded: int) -> tuple[float, float, float]:
        """(floor, first, growth): step k of a decode run takes max(floor, first + growth * k) seconds.

        Only the KV reads grow; what does not grow (the host's work with overlap, the arithmetic
        under a roofline) sets the floor."""
        num_rows = num_requests + num_padded
        memory = self.overhead + self.per_kv_token * first_num_kv_tokens
        arithmetic = self.per_decode_token * num_rows
        growth = self.per_kv_token * num_requests  # padded rows' contexts do not grow
        host = self.host_overhead + (self.host_per_request + self.host_per_token) * num_rows  # a token each
        device_floor, device_first = (arithmetic, memory) if self.roofline else (0.0, memory + arithmetic)
        if self.overlap:
            return max(host, device_floor) + self.overlap_exposed, device_first + self.overlap_exposed, growth
        return host + device_floor, host + device_first, growth


def _run_total(terms: tuple[float, float, float], num_steps: int) -> float:
    """The sum over steps k = 0 .. num_steps-1 of max(floor, first + growth * k): the steps at
    the floor, then the rising ones."""
    floor, first, growth = terms
    num_at_floor = _steps_below(floor, first, growth, num_steps)
    rising = first * (num_steps - num_at_floor) + growth * (
        num_steps * (num_steps - 1) - num_at_floor * (num_at_floor - 1)) / 2
    return floor * num_at_floor + rising


def _steps_below(floor: float, first: float, growth: float, num_steps: int) -> int:
    """How many of steps 0 .. num_steps-1 have first + growth * k below floor."""
    if first >= floor:
        return 0
    if growth <= 0:
        return num_steps
    return min(num_steps, math.ceil((floor - first) / growth))
