"""The command line's shared pieces: argparse types with a bound, and the traces a command
names (`toy`, `exponential`, `azure-conv`, a CSV file). `labkit demo`, `labkit serve` and
`labkit replay` all read their options through these, so each says a bad value the same way.

Invariant: an argparse type raises `argparse.ArgumentTypeError` with the text as given and
the bound it missed ("'0': must be a whole number >= 1"), which argparse turns into one
`labkit COMMAND: error: argument --NAME: ...` line and exit code 2.

Imports the standard library and labkit.traffic only, so every layer's command may use it.
"""

from __future__ import annotations

import argparse
import math

from labkit.traffic import Trace

BUILTIN_TRACES = ("toy", "exponential", "azure-conv")
MEAN_OUTPUT = 32  # the exponential trace's mean output, in tokens
MEAN_PROMPT = 16  # and its mean prompt


def whole_number(minimum: int):
    """An argparse type: a whole number >= `minimum`, with an error message that says so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: must be a whole number >= {minimum}")
        return value

    return parse


def number(minimum: float, or_equal: bool = False):
    """An argparse type: a finite number > `minimum` (>= with `or_equal`), with an error message that says so."""
    bound = f"{'>=' if or_equal else '>'} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum or (value == minimum and not or_equal):
            raise argparse.ArgumentTypeError(f"{text!r}: must be a number {bound}")
        return value

    return parse


positive_number = number(0)


def sampled_trace(name: str, num_requests: int, rate: float | None, seed: int) -> tuple[Trace, str]:
    """The trace `toy` or `exponential` names, and one line saying what it is."""
    if name == "toy":
        return Trace.toy(), "toy: requests A-H, all waiting at t=0, no prompt"
    trace = Trace.sample(num_requests, output="exponential", mean_output=MEAN_OUTPUT, prompt="uniform",
                         mean_prompt=MEAN_PROMPT, rate=rate, seed=seed)
    arrivals = "all waiting at t=0" if rate is None else f"Poisson arrivals at {rate:g} requests/s"
    return trace, f"exponential outputs (mean {MEAN_OUTPUT}), uniform prompts (mean {MEAN_PROMPT}), {arrivals}, seed {seed}"


def recorded_trace(name: str) -> Trace:
    """The trace `azure-conv` or a CSV path names (TIMESTAMP,ContextTokens,GeneratedTokens rows)."""
    return Trace.azure_conv() if name == "azure-conv" else Trace.from_csv(name)


def trace_error(name: str, error: Exception) -> str:
    """One line naming the trace file and what is wrong with it."""
    if isinstance(error, FileNotFoundError):
        return f"{name}: no such file (choose {', '.join(BUILTIN_TRACES)} or a path to a CSV file)"
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    return reason if reason.startswith(name) else f"{name}: {reason}"
