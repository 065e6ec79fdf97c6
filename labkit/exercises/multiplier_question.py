"""A check-yourself problem for lesson 10: the factor a headline leaves unexplained.
The factors are `labkit.analysis.multiplier`'s, drawn by `labkit.viz.multiplier_figures`.

Invariants: the expected answer, and every number a verdict quotes, comes from the
factors given when asked (a headline is their product); nothing is written down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.exercises.feedback import Question, correct, incorrect, real_number


@dataclass(frozen=True)
class MissingFactor(Question):
    """A launch post claims `total`× over static batching. Running the static baseline at the
    batch its memory allows buys `baseline_batch`× (1 when it already did), refill `refill`×,
    the larger batch that paging allows `memory`×, and the fuller steps cost `step_cost`×
    (below 1). How large must the implementation factor be for the product to reach the claim?"""

    total: float
    refill: float
    memory: float
    step_cost: float
    baseline_batch: float = 1.0
    answer_format = "a number, the implementation factor, e.g. 2.5"
    rtol = 0.02

    def expected(self) -> float:
        return self.total / (self.baseline_batch * self.refill * self.memory * self.step_cost)

    def grade(self, answer):
        answered = real_number(answer, "the implementation factor")
        expected = self.expected()
        if math.isclose(answered, expected, rel_tol=self.rtol):
            return correct(f"{expected:.2f}×: {self._known(' × ')} × {expected:.2f} = {self.total:g}. "
                           "Factors multiply, so the claim divides by each one.")
        for candidate, message in self._mistakes():
            if math.isclose(answered, candidate, rel_tol=self.rtol):
                return incorrect(f"{answered:g}: {message}")
        return incorrect(f"{answered:g} is not it. {self.hint_text()}")

    def _given(self) -> list[float]:
        """The factors the question gives, the baseline batch only where it is not 1."""
        return [*([self.baseline_batch] if self.baseline_batch != 1 else []), self.refill, self.memory,
                self.step_cost]

    def _known(self, sep: str) -> str:
        return sep.join(f"{value:g}" for value in self._given())

    def _mistakes(self) -> list[tuple[float, str]]:
        schedule = self.baseline_batch * self.refill * self.memory
        return [
            (self.total - sum(self._given()),
             "factors multiply, they do not add: divide the claim by each one."),
            (self.total / schedule, f"the fuller steps cost something too: {self.step_cost:g}× is part of the "
                                    "product, so the implementation must make up for it."),
            (self.total * self.step_cost / schedule, f"a step cost of {self.step_cost:g}× lowers the product, so "
                                                     "divide by it: the implementation must be larger, not smaller."),
        ]

    def hint_text(self) -> str:
        return ("The headline is the product of every factor: total = implementation × baseline batch × refill × "
                "memory × step cost. Solve for the implementation.")

    def solution_text(self) -> str:
        return f"{self.total:g} / ({self._known(' × ')}) = {self.expected():.2f}×"


q8 = MissingFactor(total=24.0, refill=2.2, memory=6.0, step_cost=0.5)
