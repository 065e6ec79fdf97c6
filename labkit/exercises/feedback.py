"""Verdicts, and reading answers without ever raising.

Invariants:

- `Question.check(answer)` prints exactly one verdict and returns it; a verdict is truthy
  only when the answer is correct;
- any object, however odd, gets a verdict instead of an exception: a message that says
  what was wrong and shows the value;
- None and Ellipsis (alone, or filling a tuple or list) read as "not attempted";
- verdicts and hints are printed wrapped at WIDTH characters, words whole; a Verdict's
  str() stays one line, so its text can be searched.
"""

from __future__ import annotations

import math
import numbers
import textwrap
from dataclasses import dataclass

import numpy as np

CORRECT = "correct"
INCORRECT = "incorrect"
NOT_ATTEMPTED = "not attempted"
_HEADINGS = {CORRECT: "✅ Correct.", INCORRECT: "❌ Not yet.", NOT_ATTEMPTED: "⏳ Not attempted yet."}
_MAX_REPR = 60
WIDTH = 100  # characters per printed line: a notebook's width on a laptop


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check: `status` is "correct", "incorrect" or "not attempted"."""

    status: str
    message: str

    def __bool__(self) -> bool:
        return self.status == CORRECT

    def __str__(self) -> str:
        return f"{_HEADINGS[self.status]} {self.message}"

    def _ipython_display_(self) -> None:
        """Show nothing: `check` has printed the verdict already."""


def correct(message: str) -> Verdict:
    return Verdict(CORRECT, message)


def incorrect(message: str) -> Verdict:
    return Verdict(INCORRECT, message)


def not_attempted(message: str) -> Verdict:
    return Verdict(NOT_ATTEMPTED, message)


class BadAnswer(Exception):
    """An answer that cannot be read the way the question asks; the message says why."""


class Question:
    """A problem with instant feedback. A subclass says how to answer (`answer_format`),
    grades a readable answer (`grade`, which may raise BadAnswer), and gives a hint and
    a solution computed with the library."""

    answer_format = "an answer"

    def check(self, answer) -> Verdict:
        """Print a verdict on `answer` and return it (truthy only when correct)."""
        verdict = self.verdict(answer)
        print(wrap(str(verdict)))
        return verdict

    def verdict(self, answer) -> Verdict:
        """The verdict on `answer`, for any object."""
        try:
            if is_unanswered(answer):
                return not_attempted(f"Set the answer to {self.answer_format} and run the cell again.")
            return self.grade(answer)
        except BadAnswer as bad:
            return incorrect(str(bad))
        except Exception as error:  # an answer must never crash the checker
            return incorrect(f"could not read {describe(answer)} as {self.answer_format}: {describe_error(error)}")

    def hint(self) -> None:
        print(wrap(f"💡 {self.hint_text()}"))

    def solution(self) -> None:
        print(self.solution_text())

    def grade(self, answer) -> Verdict:
        raise NotImplementedError

    def hint_text(self) -> str:
        raise NotImplementedError

    def solution_text(self) -> str:
        raise NotImplementedError


class NumberPair(Question):
    """A question answered by two numbers, each right within `tolerance`. A subclass names
    them (`names`) and gives `expected()`, `praise()` (what a right answer is told) and
    `mistakes()`: (pair, message) for each known wrong answer. An answer with one number
    right is told which, and `half_hint(wrong)` for the other."""

    names = ("the first number", "the second number")
    tolerance = 0.0

    def grade(self, answer) -> Verdict:
        first, second = pair(answer, self.answer_format)
        answered = real_number(first, self.names[0]), real_number(second, self.names[1])
        if self._near(answered, self.expected()):
            return correct(self.praise())
        for candidate, message in self.mistakes():
            if self._near(answered, candidate):
                return incorrect(f"{answered}: {message}")
        right = [self._near((a,), (e,)) for a, e in zip(answered, self.expected())]
        if any(right):  # one of the two: say which, and what to look at again for the other
            wrong = right.index(False)
            return incorrect(f"{answered}: {self.names[1 - wrong]} is right; {self.names[wrong]} is not. "
                             f"{self.half_hint(wrong)}")
        return incorrect(f"{answered} is not it. {self.hint_text()}")

    def _near(self, answered, target) -> bool:
        return all(math.isclose(a, t, abs_tol=self.tolerance) for a, t in zip(answered, target))

    def half_hint(self, wrong: int) -> str:
        """What to look at again when only the number at index `wrong` (0 or 1) is off: the hint,
        unless a subclass knows better."""
        return self.hint_text()

    def expected(self) -> tuple[float, float]:
        raise NotImplementedError

    def praise(self) -> str:
        raise NotImplementedError

    def mistakes(self) -> list[tuple[tuple[float, float], str]]:
        raise NotImplementedError


def wrap(text: str) -> str:
    """Each line of `text` wrapped at WIDTH characters, breaking only between words."""
    return "\n".join(textwrap.fill(line, WIDTH, break_long_words=False, break_on_hyphens=False)
                     for line in text.splitlines())


def is_unanswered(answer) -> bool:
    """None or Ellipsis, alone or filling a tuple or list: the stub a notebook starts with."""
    if answer is None or answer is Ellipsis:
        return True
    return isinstance(answer, (tuple, list)) and len(answer) > 0 and all(a is None or a is Ellipsis for a in answer)


def describe(value) -> str:
    """`repr(value)`, shortened, and its type: safe for any object."""
    try:
        text = repr(value)
    except Exception:
        text = "<unprintable>"
    if len(text) > _MAX_REPR:
        text = text[: _MAX_REPR - 3] + "..."
    name = type(value).__name__
    return f"{text} ({'an' if name[:1].lower() in 'aeiou' else 'a'} {name})"


def count(number: int, noun: str) -> str:
    """"1 request", "2 requests"."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def describe_error(error: BaseException) -> str:
    """"TypeError: message", safe for any exception."""
    try:
        message = str(error)
    except Exception:
        message = "<unprintable message>"
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def real_number(value, name: str) -> float:
    """`value` as a finite float, or BadAnswer naming `name` and the value."""
    if isinstance(value, str):
        raise BadAnswer(f"{name} = {describe(value)}: write the number without quotes.")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise BadAnswer(f"{name} should be a number, got {describe(value)}.")
    number = float(value)
    if not math.isfinite(number):
        raise BadAnswer(f"{name} = {value!r} is not a finite number.")
    return number


def whole_number(value, name: str) -> int:
    """`value` as an int (23 or 23.0), or BadAnswer naming `name` and the value."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    number = real_number(value, name)
    if not number.is_integer():
        raise BadAnswer(f"{name} = {value!r} is not a whole number.")
    return int(number)


def pair(value, what: str) -> tuple:
    """The two items of a tuple, list or array of length 2, or BadAnswer saying `what` was expected."""
    is_sequence = isinstance(value, (tuple, list)) or (isinstance(value, np.ndarray) and value.ndim == 1)
    if not is_sequence or len(value) != 2:
        raise BadAnswer(f"expected {what}, got {describe(value)}.")
    return value[0], value[1]


def choice(value, options: tuple[str, ...], name: str) -> str:
    """`value` as one of `options` (letters in any case, or numbers), or BadAnswer listing them."""
    if isinstance(value, (str, numbers.Integral)) and not isinstance(value, (bool, np.bool_)):
        text = str(value).strip().upper()
        if text in options:
            return text
    raise BadAnswer(f"{name} = {describe(value)}: choose one of {', '.join(options)}.")
