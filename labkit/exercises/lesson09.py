"""Lesson 09's check yourself: in which step a long prompt's first token comes out at an idle
server with chunked prefill, under two token budgets.

Invariant: the expected steps, the chunks a verdict quotes and the steps of the slip it names
(the begin-of-sequence token forgotten) come from `labkit.simulate` on the question's trace
when a check runs; nothing is written down. A wrong answer gets a hint, never the worked
solution.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.exercises.feedback import Question, correct, incorrect, pair, whole_number
from labkit.sched import Continuous, StepLog, simulate
from labkit.traffic import Trace


@dataclass(frozen=True)
class FirstTokenStep(Question):
    """A `prompt_length`-token prompt arrives at an idle server with chunked prefill: counting
    from 1, in which step does its first token come out with a budget of `budgets[0]` tokens a
    step, and in which with `budgets[1]`?"""

    prompt_length: int
    budgets: tuple[int, int]

    @property
    def answer_format(self) -> str:
        small, large = self.budgets
        return f"(the step with a budget of {small}, the step with a budget of {large}), e.g. (3, 1)"

    @property
    def trace(self) -> Trace:
        return Trace.from_lengths([1], prompt_lengths=[self.prompt_length])

    def run(self, budget: int) -> StepLog:
        return simulate(self.trace, Continuous(num_slots=1, max_tokens_per_step=budget, chunked_prefill=True))

    def expected(self) -> tuple[int, int]:
        small, large = (int(self.run(budget).first_token_step[0]) + 1 for budget in self.budgets)
        return small, large

    def chunks(self, budget: int) -> list[int]:
        """The prompt tokens of each step up to the first token, as the simulator schedules them."""
        log = self.run(budget)
        return [int(n) for n in log.num_prefill_tokens[: int(log.first_token_step[0]) + 1]]

    def without_bos(self) -> tuple[int, int]:
        """The steps a prefill of the prompt alone would take, the begin-of-sequence token forgotten:
        the simulator's steps for a prompt one token shorter (its prefill adds that token)."""
        return FirstTokenStep(prompt_length=self.prompt_length - 1, budgets=self.budgets).expected()

    def grade(self, answer):
        first, second = pair(answer, self.answer_format)
        answered = (whole_number(first, f"the step with a budget of {self.budgets[0]}"),
                    whole_number(second, f"the step with a budget of {self.budgets[1]}"))
        expected, forgot = self.expected(), self.without_bos()
        bos = (f"The prefill also carries the begin-of-sequence token: count 1 + {self.prompt_length:,} tokens, "
               "then see where the last one falls.")
        if answered == expected:
            return correct(f"{self._worked()} The step that completes the prompt emits its first token.")
        if answered == expected[::-1]:
            return incorrect(f"{answered}: swapped. The smaller budget takes more steps; give "
                             f"{self.answer_format.split(', e.g.')[0]}.")
        if answered == forgot:  # before the one-step slips: a length that divides both budgets makes them equal
            return incorrect(f"{answered}: those are the steps for the prompt's {self.prompt_length:,} tokens alone. "
                             f"{bos}")
        if answered == tuple(e + 1 for e in expected):
            return incorrect(f"{answered}: one step late each. The first token is sampled in the step that "
                             "completes the prompt, not in the step after it.")
        if answered == tuple(e - 1 for e in expected):
            return incorrect(f"{answered}: one step early each. Count the steps from 1, and give the last, partial "
                             "chunk a step of its own.")
        right = [a == e for a, e in zip(answered, expected)]
        if any(right):
            good, bad = self.budgets if right[0] else self.budgets[::-1]
            wrong = right.index(False)
            why = bos if answered[wrong] == forgot[wrong] else self.hint_text()
            return incorrect(f"{answered}: the step with a budget of {good} is right; with {bad} it is not. {why}")
        return incorrect(f"{answered} is not it. {self.hint_text()}")

    def _worked(self) -> str:
        tokens = 1 + self.prompt_length
        parts = []
        for budget, step in zip(self.budgets, self.expected()):
            chunks = self.chunks(budget)
            whole, rest = divmod(tokens, budget)
            split = f"{whole} × {budget} + {rest}" if rest else f"{whole} × {budget}"
            parts.append(f"with {budget} tokens a step, {tokens:,} = {split}, so {len(chunks)} steps (chunks of "
                         f"{', '.join(map(str, chunks))}): step {step}")
        return (f"The prompt is {tokens:,} tokens with its begin-of-sequence token; nothing else runs, so each "
                f"step gives it the whole budget: " + "; ".join(parts) + ".")

    def hint_text(self) -> str:
        return (f"The prefill is 1 + {self.prompt_length:,} tokens (the begin-of-sequence token first). At an idle "
                "server each step gives the prompt its whole budget; a step that does not complete the prompt emits "
                "nothing, and the step that completes it emits the first token.")

    def solution_text(self) -> str:
        small, large = self.expected()
        tokens = 1 + self.prompt_length
        return (f"ceil({tokens} / {self.budgets[0]}) = {small} and ceil({tokens} / {self.budgets[1]}) = {large}: "
                f"answer = ({small}, {large})")


q1 = FirstTokenStep(prompt_length=1024, budgets=(128, 512))
