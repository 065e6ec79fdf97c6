"""CostModel: the simulator's model of how long one engine step takes.

A step has device work and host work. The device prices a fixed overhead, each prompt
token, each decode token and each KV-cache token that attention reads; the host (the
loop, the scheduler, input preparation, bookkeeping) prices a fixed part, each scheduled
request and each token processed:

    device = overhead + per_prefill_token * prefill + per_decode_token * decode + per_kv_token * kv
    host   = host_overhead + host_per_request * requests + host_per_token * (prefill + decode)

Without overlap the two take turns, and a step takes host + device. With `overlap=True`
the host prepares the next step while the device runs this one, so a step takes
max(host, device) + overlap_exposed, the part of each step the loop cannot hide.

The default coefficients are hand-set placeholders for a small model on a laptop CPU,
with the host terms at zero (the device `overhead` then stands for every fixed cost);
`CostModel.fit` replaces them with coefficients measured from an engine's StepLog.

Invariants:

- every coefficient is a finite number >= 0, so a step never takes negative time and
  more work never makes a step shorter;
- a fit is judged only on held-out steps it never saw, chosen by a seeded split, so the
  same data and seed always give the same model and the same error.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from functools import cached_property
from itertools import combinations
from numbers import Real

import numpy as np

MIN_NUM_STEPS = 8  # fewer steps than this cannot train 4 coefficients and test them
NUM_COEFFICIENTS = 4  # overhead, per_prefill_token, per_decode_token, per_kv_token
DEVICE_TERMS = ("overhead", "per_prefill_token", "per_decode_token", "per_kv_token")
HOST_TERMS = ("host_overhead", "host_per_request", "host_per_token")
MAX_LINE = 100  # characters of one printed line


@dataclass(frozen=True)
class CostModel:
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

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name == "overlap":
                if not isinstance(value, bool):
                    raise ValueError(f"overlap = {value!r}: must be True or False")
            elif isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{field.name} = {value!r}: must be a finite number >= 0")

    def __repr__(self) -> str:
        """The device terms always; host terms and overlap only when they are set."""
        shown = [f.name for f in fields(self) if f.name in DEVICE_TERMS or getattr(self, f.name) != f.default]
        return f"CostModel({', '.join(f'{name}={getattr(self, name)!r}' for name in shown)})"

    def __str__(self) -> str:
        """The coefficients in readable units, three significant digits."""
        terms = [f"device {_ms(self.overhead)}/step", f"{_ms(self.per_prefill_token)}/prompt token",
                 f"{_ms(self.per_decode_token)}/decode token", f"{_ms(self.per_kv_token)}/KV token read"]
        device = " + ".join(terms)
        if len(f"CostModel: {device};") > MAX_LINE:  # the KV term on a line of its own, so a notebook shows it whole
            device = " + ".join(terms[:3]) + "\n           + " + terms[3]
        if not self.has_host_terms and not self.overlap:
            return f"CostModel: {device}"
        host = (f"host {_ms(self.host_overhead)}/step + {_ms(self.host_per_request)}/request + "
                f"{_ms(self.host_per_token)}/token")
        how = (f"overlapped: max(host, device) + {_ms(self.overlap_exposed)}" if self.overlap
               else "taking turns: host + device")
        return f"CostModel: {device};\n           {host};\n           {how}"

    def scaled(self, factor: float) -> CostModel:
        """Every time coefficient times `factor`: the same work on an implementation `factor` times slower."""
        if isinstance(factor, bool) or not isinstance(factor, Real) or not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"factor = {factor!r}: must be a finite number > 0")
        return replace(self, **{f.name: getattr(self, f.name) * factor for f in fields(self) if f.name != "overlap"})

    @cached_property
    def has_host_terms(self) -> bool:
        return any(getattr(self, name) for name in HOST_TERMS)

    def device_seconds(self, num_prefill_tokens, num_decode_tokens, num_kv_tokens):
        """Seconds of device work in one step; scalars give a float, arrays an array of the same shape."""
        if type(num_prefill_tokens) is type(num_decode_tokens) is type(num_kv_tokens) is int:  # the common case, cheaply
            return (self.overhead + self.per_prefill_token * num_prefill_tokens
                    + self.per_decode_token * num_decode_tokens + self.per_kv_token * num_kv_tokens)
        seconds = (
            self.overhead
            + self.per_prefill_token * np.asarray(num_prefill_tokens, dtype=float)
            + self.per_decode_token * np.asarray(num_decode_tokens, dtype=float)
            + self.per_kv_token * np.asarray(num_kv_tokens, dtype=float)
        )
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
        """(floor, first, growth): step k of a decode run takes max(floor, first + growth * k) seconds."""
        num_rows = num_requests + num_padded
        device = self.overhead + self.per_decode_token * num_rows + self.per_kv_token * first_num_kv_tokens
        growth = self.per_kv_token * num_requests  # padded rows' contexts do not grow
        host = self.host_overhead + (self.host_per_request + self.host_per_token) * num_rows  # a token each
        if self.overlap:
            return host + self.overlap_exposed, device + self.overlap_exposed, growth
        return 0.0, host + device, growth

    @classmethod
    def load(cls, path) -> CostModel:
        """The model saved under "model" in a JSON file, as `benchmarks/fit_engine_cost.py`
        saves this engine's price in `benchmarks/results/engine-cost.json`."""
        with open(path) as handle:
            saved = json.load(handle).get("model")
        names = {f.name for f in fields(cls)}
        if not isinstance(saved, dict) or not saved.keys() <= names:
            raise ValueError(f"{path}: its \"model\" must map coefficient names ({', '.join(sorted(names))}) to "
                             f"numbers, not {saved!r}")
        return cls(**saved)

    @classmethod
    def fit(cls, log, holdout: float = 0.25, seed: int = 0) -> CostFit:
        """Fit to a StepLog's steps. A log that splits steps into host and device time (an
        engine's, or a simulation's with a cost model) gets both sets of terms (`fit_split`);
        any other, the device terms alone, to its step times (`fit_arrays`)."""
        if not log.has_host_time:
            return cls.fit_arrays(
                log.num_prefill_tokens, log.num_decode_tokens, log.num_kv_tokens, log.step_seconds, holdout, seed
            )
        return cls.fit_split(
            log.num_prefill_tokens, log.num_decode_tokens, log.num_kv_tokens, log.num_rows,
            log.host_seconds, log.device_seconds, log.step_seconds, log.overlap, holdout, seed,
        )

    @classmethod
    def fit_arrays(
        cls, num_prefill_tokens, num_decode_tokens, num_kv_tokens, seconds, holdout: float = 0.25, seed: int = 0
    ) -> CostFit:
        """Device terms, by least squares with coefficients >= 0, on a random (1 - holdout) of
        the steps' total seconds, tested on the rest. The host terms stay 0."""
        prefill, decode, kv, seconds = _checked_steps(
            num_prefill_tokens=num_prefill_tokens, num_decode_tokens=num_decode_tokens,
            num_kv_tokens=num_kv_tokens, seconds=seconds,
        )
        train, test = _split(len(seconds), holdout, seed)
        model = cls(*_nonnegative_lstsq(_device_columns(prefill, decode, kv)[train], seconds[train]))
        predicted = model.step_seconds(prefill[test], decode[test], kv[test])
        return CostFit(model, len(train), len(test), *_errors(predicted, seconds[test]))

    @classmethod
    def fit_split(
        cls, num_prefill_tokens, num_decode_tokens, num_kv_tokens, num_requests, host_seconds, device_seconds,
        seconds, overlap: bool = False, holdout: float = 0.25, seed: int = 0,
    ) -> CostFit:
        """Device terms fitted to device time and host terms to host time, each by least
        squares with coefficients >= 0 on the same random (1 - holdout) of the steps; with
        `overlap`, `overlap_exposed` is what the training steps took beyond max(host, device)
        on average. Tested on the held-out steps' total seconds."""
        prefill, decode, kv, requests, host, device, seconds = _checked_steps(
            num_prefill_tokens=num_prefill_tokens, num_decode_tokens=num_decode_tokens, num_kv_tokens=num_kv_tokens,
            num_requests=num_requests, host_seconds=host_seconds, device_seconds=device_seconds, seconds=seconds,
        )
        train, test = _split(len(seconds), holdout, seed)
        device_terms = _nonnegative_lstsq(_device_columns(prefill, decode, kv)[train], device[train])
        host_columns = np.column_stack([np.ones_like(seconds), requests, prefill + decode])  # (steps, 3)
        host_terms = _nonnegative_lstsq(host_columns[train], host[train])
        model = cls(*map(float, device_terms), *map(float, host_terms), overlap=bool(overlap))
        price = _step_pricer(prefill, decode, kv, requests)
        if overlap:
            exposed = max(0.0, float((seconds[train] - price(model, train)).mean()))
            model = replace(model, overlap_exposed=exposed)
        return CostFit(model, len(train), len(test), *_errors(price(model, test), seconds[test]))


@dataclass(frozen=True)
class CostFit:
    """A fitted CostModel and how well it predicts the steps held out of the fit."""

    model: CostModel
    num_train: int
    num_test: int
    mean_abs_error: float  # s, on held-out steps
    relative_error: float  # mean |predicted - measured| / mean measured, on held-out steps
    r2: float  # on held-out steps; nan when they all took the same time

    def __str__(self) -> str:
        return (
            f"CostModel fit on {self.num_train} steps, held-out error {self.relative_error:.1%} "
            f"over {self.num_test} steps (MAE {self.mean_abs_error * 1e3:.2f} ms, R² {self.r2:.2f})"
        )


def _ms(seconds: float) -> str:
    """Seconds as ms or µs, three significant digits: 0.00144 -> '1.44 ms', 7.19e-05 -> '71.9 µs'."""
    if seconds == 0:
        return "0"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def _device_columns(prefill: np.ndarray, decode: np.ndarray, kv: np.ndarray) -> np.ndarray:
    return np.column_stack([np.ones_like(prefill), prefill, decode, kv])  # (steps, 4)


def _step_pricer(prefill, decode, kv, requests):
    """price(model, steps): what `model` says the given steps take."""
    return lambda model, steps: model.step_seconds(prefill[steps], decode[steps], kv[steps], requests[steps])


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


def _checked_steps(**arrays) -> list[np.ndarray]:
    """The per-step arrays as floats, after checking shape, length and values."""
    checked = {name: np.asarray(values, dtype=float) for name, values in arrays.items()}
    for name, values in checked.items():
        if values.ndim != 1:
            raise ValueError(f"{name} has shape {values.shape}: must be one value per step")
    lengths = {name: len(values) for name, values in checked.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"per-step arrays differ in length: {lengths}")
    if lengths["seconds"] < MIN_NUM_STEPS:
        raise ValueError(f"only {lengths['seconds']} steps: a fit needs at least {MIN_NUM_STEPS}")
    for name, values in checked.items():
        if not np.isfinite(values).all():
            raise ValueError(f"{name} has NaN or infinite values at steps {np.flatnonzero(~np.isfinite(values))}")
        if (values < 0).any():
            raise ValueError(f"{name} has negative values at steps {np.flatnonzero(values < 0)}")
    if (checked["seconds"] == 0).any():
        raise ValueError(f"seconds has zero-length steps at {np.flatnonzero(checked['seconds'] == 0)}")
    return list(checked.values())


def _split(num_steps: int, holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) step indices: a seeded random `holdout` share of the steps is test."""
    if not 0 < holdout < 1:
        raise ValueError(f"holdout = {holdout!r}: must be a fraction strictly between 0 and 1")
    num_test = max(1, round(holdout * num_steps))
    if num_steps - num_test < NUM_COEFFICIENTS:
        raise ValueError(
            f"holdout = {holdout!r} leaves {num_steps - num_test} of {num_steps} steps to train "
            f"{NUM_COEFFICIENTS} coefficients"
        )
    order = np.random.default_rng(seed).permutation(num_steps)
    return np.sort(order[num_test:]), np.sort(order[:num_test])


def _nonnegative_lstsq(columns: np.ndarray, target: np.ndarray) -> np.ndarray:
    """argmin |columns @ x - target| subject to x >= 0, exactly, by trying every subset of columns.

    The constrained optimum is the unconstrained least-squares fit on some subset of
    linearly independent columns, so the best fit among subsets whose coefficients all
    come out >= 0 is the answer. With 4 columns that is at most 16 tiny solves. An
    all-zero column (say, no prefill in the run) is never tried; its coefficient stays 0.
    """
    scale = np.abs(columns).max(axis=0)  # solve on columns scaled to 1: kv counts dwarf the ones
    usable = np.flatnonzero(scale > 0)
    best, best_residual = np.zeros(columns.shape[1]), float(target @ target)
    for size in range(1, len(usable) + 1):
        for subset in map(list, combinations(usable, size)):
            scaled, *_ = np.linalg.lstsq(columns[:, subset] / scale[subset], target, rcond=None)
            coefficients = scaled / scale[subset]
            residual = target - columns[:, subset] @ coefficients
            if (coefficients >= 0).all() and residual @ residual < best_residual:
                best = np.zeros(columns.shape[1])
                best[subset] = coefficients
                best_residual = float(residual @ residual)
    return best


def _errors(predicted: np.ndarray, measured: np.ndarray) -> tuple[float, float, float]:
    """(mean absolute error, relative error, R²) of predicted against measured seconds."""
    absolute = np.abs(predicted - measured)
    spread = float(((measured - measured.mean()) ** 2).sum())
    r2 = 1 - float(((predicted - measured) ** 2).sum()) / spread if spread > 0 else math.nan
    return float(absolute.mean()), float(absolute.mean() / measured.mean()), r2
