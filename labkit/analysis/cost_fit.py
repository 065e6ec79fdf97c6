"""Fitting a step's price to measured steps: `CostModel.fit` and how well the fit predicts.

`labkit.sched.cost.StepPrice` prices a step; `CostModel` is that same frozen dataclass with
the classmethods that fit it (`fit`, `fit_arrays`, `fit_split`) or load a saved fit
(`load`), and a readable `str`; it is the one `labkit` exports as `lk.CostModel`. It adds no
field, so the simulator prices with it as with its base, and `sched` never imports this module.

Invariants:

- every fitted coefficient is >= 0 (the exact least-squares optimum under that constraint;
  `overlap_exposed` a mean excess, floored at 0), so a fitted model is a valid `CostModel`;
- a fit is judged only on held-out steps it never saw, chosen by a seeded split, so the
  same data and seed always give the same model and the same error.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from itertools import combinations

import numpy as np

from labkit.sched.cost import StepPrice

MAX_LINE = 100  # characters of one printed line
MIN_NUM_STEPS = 8  # fewer steps than this cannot train 4 coefficients and test them
NUM_COEFFICIENTS = 4  # overhead, per_prefill_token, per_decode_token, per_kv_token


class CostModel(StepPrice):
    """A step's price (`labkit.sched.cost.StepPrice`) that can also be fitted to a StepLog,
    loaded from a saved fit, and printed in readable units."""

    def __str__(self) -> str:
        """The coefficients in readable units, three significant digits."""
        device = self._roofline_terms() if self.roofline else self._added_terms()
        if not self.has_host_terms and not self.overlap:
            return f"CostModel: {device}"
        host = (f"host {_ms(self.host_overhead)}/step + {_ms(self.host_per_request)}/request + "
                f"{_ms(self.host_per_token)}/token")
        how = (f"overlapped: max(host, device) + {_ms(self.overlap_exposed)}" if self.overlap
               else "taking turns: host + device")
        return f"CostModel: {device};\n           {host};\n           {how}"

    def _added_terms(self) -> str:
        terms = [f"device {_ms(self.overhead)}/step", f"{_ms(self.per_prefill_token)}/prompt token",
                 f"{_ms(self.per_decode_token)}/decode token", f"{_ms(self.per_kv_token)}/KV token read"]
        device = " + ".join(terms)
        if len(f"CostModel: {device};") > MAX_LINE:  # the KV term on a line of its own, so a notebook shows it whole
            device = " + ".join(terms[:3]) + "\n           + " + terms[3]
        return device

    def _roofline_terms(self) -> str:
        """The larger of the memory traffic and the arithmetic, each on a line of its own."""
        return (f"device the larger of {_ms(self.overhead)}/step + {_ms(self.per_kv_token)}/KV token read\n"
                f"           and {_ms(self.per_prefill_token)}/prompt token + {_ms(self.per_decode_token)}/decode token")

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


def _device_columns(prefill: np.ndarray, decode: np.ndarray, kv: np.ndarray) -> np.ndarray:
    return np.column_stack([np.ones_like(prefill), prefill, decode, kv])  # (steps, 4)


def _step_pricer(prefill, decode, kv, requests):
    """price(model, steps): what `model` says the given steps take."""
    return lambda model, steps: model.step_seconds(prefill[steps], decode[steps], kv[steps], requests[steps])


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


def _ms(seconds: float) -> str:
    """Seconds as ms or µs, three significant digits: 0.00144 -> '1.44 ms', 7.19e-05 -> '71.9 µs'."""
    if seconds == 0:
        return "0"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"
