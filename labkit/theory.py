"""Theory: closed forms for static batching's waste.

A static batch of B requests runs for max(L_1..L_B) steps and does sum(L_i) useful
slot-steps, so over many batches its utilization is the ratio of expectations

    U_static(B) = E[L] / E[max of B draws of L],

and, on a backlogged queue with constant step time and no prefill or memory limit,
continuous batching's ideal gain is 1 / U_static(B). For exponential lengths
E[max] = H_B * E[L], so U = 1/H_B and the gain is H_B (the B-th harmonic number).

Invariants: every function is deterministic given its seed, imports numpy only,
and returns plain floats or numpy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit.checks import whole_number


def harmonic(n):
    """H_n = 1 + 1/2 + ... + 1/n, for a whole number n >= 1 or an array of them."""
    ns = np.atleast_1d(np.asarray(n))
    if ns.dtype.kind not in "iu" or (ns < 1).any():
        raise ValueError(f"n = {n!r}: harmonic numbers need whole numbers >= 1")
    table = np.cumsum(1.0 / np.arange(1, ns.max() + 1))
    values = table[ns - 1]
    return float(values[0]) if np.ndim(n) == 0 else values


def exponential_utilization(batch_size):
    """Expected static utilization for exponential lengths: 1 / H_B."""
    return 1.0 / harmonic(batch_size)


def exponential_gain(batch_size):
    """Ideal continuous-over-static gain for exponential lengths: H_B."""
    return harmonic(batch_size)


def batch_utilization(lengths) -> float:
    """One static batch: useful slot-steps / (B * longest)."""
    lengths = _lengths(lengths)
    return float(lengths.sum() / (len(lengths) * lengths.max()))


def expected_max(lengths, batch_size: int) -> float:
    """E[max of B independent draws] from the empirical distribution of `lengths`.

    Exact, from order statistics: E[max] = sum_v v * (F(v)^B - F(v-)^B).
    """
    _check_batch_size(batch_size)
    values, counts = np.unique(_lengths(lengths), return_counts=True)
    cdf = np.cumsum(counts) / counts.sum()
    below = np.concatenate([[0.0], cdf[:-1]])
    return float(np.sum(values * (cdf**batch_size - below**batch_size)))


def static_utilization(lengths, batch_size: int) -> float:
    """E[L] / E[max of B]: the long-run utilization of static batches of size B."""
    return float(_lengths(lengths).mean() / expected_max(lengths, batch_size))


def ideal_gain(lengths, batch_size: int) -> float:
    """E[max of B] / E[L]: continuous batching's ideal gain over static batching."""
    return 1.0 / static_utilization(lengths, batch_size)


@dataclass(frozen=True)
class MonteCarlo:
    """Repeated static batches of size B, drawn at random.

    pooled[k]: utilization of the first k+1 batches together, sum(L) / (B * sum(max));
        it converges to the ratio of expectations E[L]/E[max].
    mean_of_ratios[k]: the average of the first k+1 per-batch utilizations;
        it converges to E[sum(L)/(B*max)], a different number (larger for exponential
        lengths, though not for every law).
    shares[k], longest[k]: batch k's own utilization and its longest request.
    """

    batch_size: int
    pooled: np.ndarray
    mean_of_ratios: np.ndarray
    shares: np.ndarray | None = None
    longest: np.ndarray | None = None

    def share_by_longest(self, num_groups: int = 4) -> np.ndarray:
        """The mean of the batches' own shares in each of `num_groups` equal groups, the batches
        sorted by their longest request, shortest first. The pooled share weighs each batch by
        its longest request, so it lies below the mean of the shares when these fall."""
        whole_number("num_groups", num_groups)
        if self.shares is None or self.longest is None:
            raise ValueError("shares and longest are None: run theory.monte_carlo to get them")
        if num_groups > len(self.shares):
            raise ValueError(f"num_groups = {num_groups}: more groups than the {len(self.shares)} batches")
        order = np.argsort(self.longest, kind="stable")
        return np.array([self.shares[group].mean() for group in np.array_split(order, num_groups)])


def monte_carlo(lengths, batch_size: int, num_batches: int = 10_000, seed: int = 0) -> MonteCarlo:
    """Draw `num_batches` batches from `lengths` ("exponential" for the continuous law)."""
    _check_batch_size(batch_size)
    whole_number("num_batches", num_batches)
    rng = np.random.default_rng(seed)
    shape = (num_batches, batch_size)
    if isinstance(lengths, str) and lengths == "exponential":
        draws = rng.exponential(1.0, size=shape)
    else:
        draws = rng.choice(_lengths(lengths), size=shape)
    useful, longest = draws.sum(axis=1), draws.max(axis=1)
    pooled = np.cumsum(useful) / (batch_size * np.cumsum(longest))
    per_batch = useful / (batch_size * longest)
    mean_of_ratios = np.cumsum(per_batch) / np.arange(1, num_batches + 1)
    return MonteCarlo(batch_size, pooled, mean_of_ratios, per_batch, longest)


def _lengths(lengths) -> np.ndarray:
    array = np.asarray(lengths, dtype=np.float64).ravel()
    if array.size == 0:
        raise ValueError("lengths is empty")
    if not np.isfinite(array).all() or (array <= 0).any():
        raise ValueError(f"lengths must be finite and > 0, got {array[~np.isfinite(array) | (array <= 0)][:3]}")
    return array


def _check_batch_size(batch_size) -> None:
    whole_number("batch_size", batch_size)
