"""Lesson 06's check yourself: how many iterations a long prompt's chunked prefill takes beside
running decodes, and which of them emits its first token.

Invariant: the expected answer comes from `labkit.simulate` on the question's trace when a
check runs; nothing is written down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.exercises.feedback import Question, correct, incorrect, pair, whole_number
from labkit.sched import Continuous, simulate
from labkit.traffic import Trace


@dataclass(frozen=True)
class ChunkedPrefill(Question):
    """`num_decodes` requests decode when a `prompt_length`-token prompt arrives, with a budget of
    `budget` tokens a step and chunked prefill: how many iterations does its prefill take, and
    which of them (counting from 1) emits its first token?"""

    num_decodes: int
    prompt_length: int
    budget: int
    answer_format = "(iterations of prefill, the one that emits the first token), e.g. (3, 3)"

    @property
    def trace(self) -> Trace:
        return Trace.from_lengths([64] * self.num_decodes + [4], prompt_lengths=[16] * self.num_decodes
                                  + [self.prompt_length], arrivals=[0.0] * self.num_decodes + [0.05])

    def expected(self) -> tuple[int, int]:
        log = simulate(self.trace, Continuous(num_slots=self.num_decodes + 1, max_tokens_per_step=self.budget,
                                              chunked_prefill=True))
        chunks = log.num_prefill_tokens[log.admit_step[-1]:]
        num_iterations = int(chunks.cumsum().searchsorted(1 + self.prompt_length)) + 1
        return num_iterations, int(log.first_token_step[-1] - log.admit_step[-1]) + 1

    def grade(self, answer):
        first, second = pair(answer, self.answer_format)
        answered = whole_number(first, "iterations of prefill"), whole_number(second, "the iteration of the first token")
        expected = self.expected()
        per_step = self.budget - self.num_decodes
        tokens = 1 + self.prompt_length
        if answered == expected:
            return correct(f"Each iteration has {self.budget} − {self.num_decodes} = {per_step} tokens left for the "
                           f"prompt, so its {tokens:,} tokens take {expected[0]} iterations; the last, which completes "
                           "the prompt, emits the first token.")
        slips = []
        if answered[0] == math.ceil(tokens / self.budget):
            slips.append(f"if you divided by the whole budget: the {self.num_decodes} running decodes take their token "
                         f"each first, so a chunk gets {per_step} of the {self.budget}, not all of it")
        if answered[0] == tokens // per_step and tokens % per_step:
            slips.append(f"if you did subtract: {tokens:,} / {per_step} = {tokens / per_step:.2f}, so the last "
                         f"{tokens % per_step} tokens need an iteration of their own, number {tokens // per_step + 1}")
        if slips:
            return incorrect(f"{answered}: " + "; ".join(slips) + ".")
        if answered == (expected[0], expected[0] - 1):
            return incorrect(f"{answered}: count the iterations from 1, as the question does.")
        return incorrect(f"{answered} is not it. {self.hint_text()}")

    def hint_text(self) -> str:
        return (f"Decodes are scheduled first, one token each. What is left of the budget of {self.budget} goes to the "
                f"prompt, which is 1 + {self.prompt_length} tokens with its begin-of-sequence token. A partial prefill "
                "emits nothing; the iteration that completes the prompt emits its first token.")

    def solution_text(self) -> str:
        iterations, first = self.expected()
        per_step = self.budget - self.num_decodes
        return (f"{self.budget} − {self.num_decodes} = {per_step} prompt tokens an iteration; "
                f"ceil({1 + self.prompt_length} / {per_step}) = {iterations}. answer = ({iterations}, {first})")


q1 = ChunkedPrefill(num_decodes=7, prompt_length=999, budget=256)
