"""CostModel: the simulator's model of how long one engine step takes.

A step costs a fixed overhead plus a price per prompt token, per decode token and per
KV-cache token that attention reads:

    seconds = overhead + per_prefill_token * prefill + per_decode_token * decode
              + per_kv_token * kv

The default coefficients are hand-set placeholders for a small model on a laptop CPU;
`CostModel.fit` replaces them with coefficients measured from an engine's StepLog.

Invariants:

- every coefficient is a finite number >= 0, so a step never takes negative time and
  more work never makes a step shorter;
- a fit is judged only on held-out steps it never saw, chosen by a seeded split, so the
  same data and seed always give the same model and the same error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import partial
from itertools import combinations
from numbers import Real

import numpy as np

MIN_NUM_STEPS = 8  # fewer steps than this cannot train 4 coefficients and test them
NUM_COEFFICIENTS = 4  # overhead, per_prefill_token, per_decode_token, per_kv_token


@dataclass(frozen=True)
class CostModel:
    """Seconds per engine step as a linear function of the work in the step."""

    overhead: float = 3e-3  # s per step: scheduling, kernel launches, sampling
    per_prefill_token: float = 1e-4  # s per prompt token processed in the step
    per_decode_token: float = 3e-4  # s per decode token (one per decoding request)
    per_kv_token: float = 2e-7  # s per KV-cache token read by attention in the step

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{field.name} = {value!r}: must be a finite number >= 0")

    def step_seconds(self, num_prefill_tokens, num_decode_tokens, num_kv_tokens):
        """Seconds one step takes; scalars give a float, arrays an array of the same shape."""
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

    def decode_run_seconds(self, num_requests: int, first_num_kv_tokens: int, num_steps: int) -> np.ndarray:
        """Seconds of each of `num_steps` plain decode steps of `num_requests` requests, the
        first reading `first_num_kv_tokens` KV tokens and each later one `num_requests` more."""
        first, growth = self._decode_run_terms(num_requests, first_num_kv_tokens)
        return first + growth * np.arange(num_steps)  # (steps,)

    def decode_run_total(self, num_requests: int, first_num_kv_tokens: int, num_steps: int) -> float:
        """The sum of `decode_run_seconds`, in closed form."""
        first, growth = self._decode_run_terms(num_requests, first_num_kv_tokens)
        return first * num_steps + growth * num_steps * (num_steps - 1) / 2

    def decode_run_length(self, num_requests: int, first_num_kv_tokens: int, seconds: float, max_steps: int) -> int:
        """How many steps of such a run pass, at most `max_steps`, until `seconds` have passed:
        the step during which they pass counts."""
        first, growth = self._decode_run_terms(num_requests, first_num_kv_tokens)
        if seconds <= 0:
            return min(1, max_steps)
        if growth > 0:  # growth/2 n^2 + (first - growth/2) n >= seconds
            linear = first - growth / 2
            estimate = (math.sqrt(linear * linear + 2 * growth * seconds) - linear) / growth
        else:
            estimate = seconds / first if first > 0 else max_steps
        num_steps = max(1, min(max_steps, math.ceil(estimate)))
        total = partial(self.decode_run_total, num_requests, first_num_kv_tokens)
        while num_steps > 1 and total(num_steps - 1) >= seconds:  # float rounding in the estimate
            num_steps -= 1
        while num_steps < max_steps and total(num_steps) < seconds:
            num_steps += 1
        return num_steps

    def _decode_run_terms(self, num_requests: int, first_num_kv_tokens: int) -> tuple[float, float]:
        """(seconds of the first step, seconds more per later step) of a decode run."""
        first = self.overhead + self.per_decode_token * num_requests + self.per_kv_token * first_num_kv_tokens
        return first, self.per_kv_token * num_requests

    @classmethod
    def fit(cls, log, holdout: float = 0.25, seed: int = 0) -> CostFit:
        """Fit to a StepLog's measured steps; see `fit_arrays`."""
        return cls.fit_arrays(
            log.num_prefill_tokens, log.num_decode_tokens, log.num_kv_tokens, log.step_seconds, holdout, seed
        )

    @classmethod
    def fit_arrays(
        cls, num_prefill_tokens, num_decode_tokens, num_kv_tokens, seconds, holdout: float = 0.25, seed: int = 0
    ) -> CostFit:
        """Least squares with coefficients >= 0 on a random (1 - holdout) of the steps, tested on the rest."""
        prefill, decode, kv, seconds = _checked_steps(
            num_prefill_tokens=num_prefill_tokens, num_decode_tokens=num_decode_tokens,
            num_kv_tokens=num_kv_tokens, seconds=seconds,
        )
        train, test = _split(len(seconds), holdout, seed)
        columns = np.column_stack([np.ones_like(seconds), prefill, decode, kv])
        model = cls(*(float(c) for c in _nonnegative_lstsq(columns[train], seconds[train])))
        predicted = model.step_seconds(prefill[test], decode[test], kv[test])
        return CostFit(model, len(train), len(test), *_errors(predicted, seconds[test]))


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
