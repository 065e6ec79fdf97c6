"""Lesson 02's check yourself: which gain a uniform law gives at B = 32 (q1), and whether a
trace sorted by length beats the theory for its lengths (q3).

Invariants: the expected answers come from `labkit.theory` and `labkit.simulate` when a
check runs; q3 replays the Azure conversation trace that ships with labkit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit import theory
from labkit.exercises.feedback import BadAnswer, Question, choice, correct, incorrect, real_number
from labkit.sched import Static, simulate
from labkit.traffic import Trace


@dataclass(frozen=True)
class NearestGain(Question):
    """Output lengths uniform on `shortest`..`longest`: is the ideal gain at `batch_size`
    closer to one of `options` times?"""

    shortest: int
    longest: int
    batch_size: int
    options: tuple[float, ...] = (1, 2, 4)

    @property
    def answer_format(self) -> str:
        return f"one of {', '.join(map(str, self.options[:-1]))} or {self.options[-1]} (times)"

    @property
    def lengths(self) -> np.ndarray:
        return np.arange(self.shortest, self.longest + 1)  # every length equally likely

    def gain(self) -> float:
        return theory.ideal_gain(self.lengths, self.batch_size)

    def expected(self) -> int:
        return min(self.options, key=lambda option: abs(np.log(option / self.gain())))

    def grade(self, answer):
        value = real_number(answer, "gain")
        if value not in self.options:
            raise BadAnswer(f"gain = {value:g}: choose one of {', '.join(map(str, self.options))}.")
        gain, size, mean = self.gain(), self.batch_size, self.lengths.mean()
        if value == self.expected():
            return correct(f"E[max of {size}] / E[L] = {gain:.2f}: a batch of {size} almost always holds a request "
                           f"near {self.longest} tokens, and never one longer, against a mean of {mean:g}.")
        if value > self.expected():
            return incorrect(f"{value:g} is too much: no length exceeds {self.longest}, so E[max] / E[L] is at most "
                             f"{self.longest} / {mean:g} = {self.longest / mean:.2f}.")
        return incorrect(f"{value:g} would mean every batch's longest request is as long as its average one, as with "
                         f"equal lengths; these spread from {self.shortest} to {self.longest}.")

    def hint_text(self) -> str:
        return (f"The gain is E[max of {self.batch_size}] / E[L]. The mean is {self.lengths.mean():g}; with "
                f"{self.batch_size} draws, how close to {self.longest} does the longest get?")

    def solution_text(self) -> str:
        size, low, high = self.batch_size, self.shortest, self.longest
        return (f"For a continuous uniform law on (a, b), E[max of B] = a + (b − a) · B/(B + 1): here "
                f"{low + (high - low) * size / (size + 1):.1f} against a mean of {self.lengths.mean():g}, a gain of "
                f"about {(low + (high - low) * size / (size + 1)) / self.lengths.mean():.2f}; for these whole-number "
                f"lengths lk.theory.ideal_gain gives {self.gain():.2f}. answer = {self.expected()}")


ABOVE, BELOW = "ABOVE", "BELOW"


@dataclass(frozen=True)
class SortedTrace(Question):
    """The Azure conversation trace, sorted by output length and backlogged: is static
    batching's utilization at `batch_size` above or below the theory for its lengths?"""

    batch_size: int
    answer_format = '"above" or "below"'

    def utilizations(self) -> tuple[float, float]:
        """(simulated on the sorted trace, theory for the trace's lengths)."""
        azure = Trace.azure_conv().backlogged()
        lengths = azure.output_lengths
        in_order = azure.select(np.argsort(lengths, kind="stable"))
        simulated = simulate(in_order, Static(num_slots=self.batch_size)).utilization
        return simulated, theory.static_utilization(lengths, self.batch_size)

    def expected(self) -> str:
        simulated, predicted = self.utilizations()
        return ABOVE if simulated > predicted else BELOW

    def grade(self, answer):
        answered = choice(answer, (ABOVE, BELOW), "answer")
        simulated, predicted = self.utilizations()
        facts = (f"Sorted, static batching keeps {simulated:.1%} of its slot-iterations busy at B = "
                 f"{self.batch_size}; the theory for these lengths says {predicted:.1%}.")
        if answered == self.expected():
            return correct(f"{facts} Each batch of neighbours holds nearly equal lengths, so its straggler is barely "
                           "longer than the rest: the order correlation of lesson 02, taken to its limit.")
        return incorrect(f"{facts} The theory draws each batch's lengths independently; sorted, a batch takes "
                         "consecutive requests. How different are neighbours' lengths then?")

    def hint_text(self) -> str:
        return ("A static batch lasts as long as its longest request. Sorted by length, what do a batch's "
                f"{self.batch_size} consecutive requests look like?")

    def solution_text(self) -> str:
        simulated, predicted = self.utilizations()
        return (f"Simulated on the sorted trace: {simulated:.3f}; theory for its lengths: {predicted:.3f}. "
                f'answer = "{self.expected().lower()}"')


q1 = NearestGain(shortest=100, longest=300, batch_size=32, options=(1, 1.5, 2))
q3 = SortedTrace(batch_size=8)
