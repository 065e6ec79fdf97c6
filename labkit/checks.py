"""Argument checks for every layer: a value's type (and bound), with an error that names the
argument and the value, so that a bad knob anywhere reads the same way.

Invariants: a check returns the value it accepts, as a Python bool, int or float (None where
`or_none` lets it through), and raises a ValueError "NAME = VALUE: must be ..." for
anything else; a bool is never a number, and a number is never a flag; NaN and infinities
are never numbers.

Imports the standard library only, so any module may use it.
"""

from __future__ import annotations

import math
from numbers import Integral, Real


def flag(name: str, value) -> bool:
    """`value` if it is True or False (not 0, 1 or "yes")."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} = {value!r}: must be True or False")
    return value


def whole_number(name: str, value, minimum: int = 1, *, or_none: bool = False) -> int | None:
    """`value` as an int if it is a whole number >= `minimum` (or None, with `or_none`)."""
    if value is None and or_none:
        return None
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise ValueError(f"{name} = {value!r}: must be a whole number >= {minimum}{', or None' if or_none else ''}")
    return int(value)


def number(name: str, value, minimum: float = 0.0, *, or_equal: bool = False, or_none: bool = False,
           unit: str = "") -> float | None:
    """`value` as a float if it is a finite number > `minimum` (>= with `or_equal`; or None,
    with `or_none`). `unit` ("seconds") goes into the message: "a number of seconds > 0"."""
    if value is None and or_none:
        return None
    acceptable = (not isinstance(value, bool) and isinstance(value, Real) and math.isfinite(value)
                  and (value > minimum or (or_equal and value == minimum)))
    if not acceptable:
        of_unit = f" of {unit}" if unit else ""
        bound = f"{'>=' if or_equal else '>'} {minimum:g}"
        raise ValueError(f"{name} = {value!r}: must be a number{of_unit} {bound}{', or None' if or_none else ''}")
    return float(value)
