"""Rope scaling: the rotary frequencies of checkpoints trained to reach past their pretraining length.

A rotary head of size hs turns its pair i by position * f_i, with f_i = theta^(-2i/hs). Two
scalings of those frequencies are used by small public Llama-family checkpoints, and labkit
computes them exactly as transformers does (`transformers.modeling_rope_utils`):

- "linear" (position interpolation): every frequency divided by `factor`;
- "llama3" (Llama 3.1 and 3.2): wavelengths 2 pi / f shorter than
  original_max_position_embeddings / high_freq_factor are kept, those longer than
  original_max_position_embeddings / low_freq_factor are divided by `factor`, and the ones
  between are interpolated smoothly between the two.

Neither changes the attention's scale (transformers' attention_factor is 1 for both).

Invariant: a `RopeScaling` is valid when built: an unknown type or a missing or bad
parameter raises a ValueError that names the field and its value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from labkit.checks import number

ROPE_SCALING_TYPES = ("linear", "llama3")
LLAMA3_FIELDS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint scales its rotary frequencies; the llama3 fields are for "llama3" only."""

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self):
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(f"rope_type = {self.rope_type!r}: must be one of {', '.join(ROPE_SCALING_TYPES)}")
        number("factor", self.factor, 1, or_equal=True)
        llama3 = {name: getattr(self, name) for name in LLAMA3_FIELDS}
        if self.rope_type == "linear":
            for name, value in llama3.items():
                if value is not None:
                    raise ValueError(f"{name} = {value!r}: applies to rope_type 'llama3', not 'linear'")
            return
        for name, value in llama3.items():
            if not _is_number(value) or not value > 0:
                raise ValueError(f"{name} = {value!r}: rope_type 'llama3' needs a number > 0")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"high_freq_factor = {self.high_freq_factor!r}: must exceed low_freq_factor = "
                             f"{self.low_freq_factor!r}")

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """(hs/2,) rotary frequencies, scaled."""
        if self.rope_type == "linear":
            return inv_freq / self.factor
        return self._llama3(inv_freq)

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """transformers' `_compute_llama3_parameters`, step for step, so the floats agree."""
        low_freq_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_freq_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq  # (hs/2,)
        long_divided = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)  # (hs/2,)
        smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)  # (hs/2,)
        smoothed = (1 - smooth) * long_divided / self.factor + smooth * long_divided  # (hs/2,)
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)  # (hs/2,)
        return torch.where(is_medium, smoothed, long_divided)
