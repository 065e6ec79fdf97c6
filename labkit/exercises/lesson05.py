"""Lesson 05's check yourself: a request's blocks at admission and at its last step (q1), and
which victim rule preempts fewer times and which recomputes fewer tokens (q2).

Invariants: q1's counts come from `labkit.sched.blocks.num_blocks_for` and q2's from
`labkit.simulate` on the lesson's trace, when a check runs; nothing is written down.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.exercises.feedback import Question, choice, correct, incorrect, pair, whole_number
from labkit.sched import Continuous, simulate
from labkit.sched.blocks import num_blocks_for
from labkit.traffic import Trace


@dataclass(frozen=True)
class BlockCounts(Question):
    """A request with a `prompt_length`-token prompt wants `output_length` tokens: how many
    `block_size`-token blocks does it hold when admitted, and at its last step?"""

    prompt_length: int
    output_length: int
    block_size: int
    answer_format = "(blocks at admission, blocks at the last step), e.g. (2, 7)"

    def blocks(self, tokens: int) -> int:
        return int(num_blocks_for(tokens, self.block_size))

    def expected(self) -> tuple[int, int]:
        # the prefill caches the begin-of-sequence token and the prompt; the last output is never fed back
        return self.blocks(1 + self.prompt_length), self.blocks(self.prompt_length + self.output_length)

    def grade(self, answer):
        first, second = pair(answer, self.answer_format)
        answered = whole_number(first, "blocks at admission"), whole_number(second, "blocks at the last step")
        admission, last = self.expected()
        prompt, output = self.prompt_length, self.output_length
        if answered == (admission, last):
            return correct(f"{1 + prompt} tokens at admission (the begin-of-sequence token and the prompt): "
                           f"{admission} blocks; {prompt + output} at its last step (its last output is never fed "
                           f"back): {last} blocks.")
        notes = []
        if answered[0] != admission:
            notes.append(f"At admission: {answered[0]} blocks would hold {self.prompt_length} tokens; the prefill "
                         f"also caches the begin-of-sequence token, so {1 + prompt}."
                         if answered[0] == self.blocks(prompt) else
                         f"At admission: count the begin-of-sequence token and the prompt, {1 + prompt} tokens, "
                         f"in blocks of {self.block_size}.")
        if answered[1] != last:
            notes.append(f"At the last step: {answered[1]} blocks would hold every output fed back; the last "
                         f"output is sampled, never cached, so 1 + {prompt} + {output} − 1 tokens."
                         if answered[1] == self.blocks(1 + prompt + output) else
                         f"At the last step: 1 + {prompt} + ({output} − 1) tokens are cached, in blocks of "
                         f"{self.block_size}.")
        return incorrect(" ".join(notes))

    def hint_text(self) -> str:
        return ("A sequence is a begin-of-sequence token, the prompt, then the outputs. The prefill caches the first "
                "two; each later step caches the output fed back, and the last output is never fed back. Round up "
                "to whole blocks.")

    def solution_text(self) -> str:
        admission, last = self.expected()
        return (f"admission: 1 + {self.prompt_length} = {1 + self.prompt_length} tokens, {admission} blocks; last "
                f"step: {self.prompt_length} + {self.output_length} = {self.prompt_length + self.output_length} "
                f"tokens, {last} blocks. answer = ({admission}, {last})")


NEWEST, LONGEST = "NEWEST", "LONGEST"


@dataclass(frozen=True)
class VictimRule(Question):
    """The lesson's 32 requests on 16 slots and a pool of `num_blocks`: which victim rule
    preempts fewer times, and which recomputes fewer cached tokens?"""

    num_blocks: int
    answer_format = '(fewer preemptions, fewer tokens recomputed), each "newest" or "longest"'

    @property
    def trace(self) -> Trace:
        return Trace.sample(32, output="uniform", mean_output=64, prompt="uniform", mean_prompt=32, seed=0)

    def runs(self) -> dict[str, tuple[int, int]]:
        """Each rule's (preemptions, recomputed tokens)."""
        runs = {}
        for rule in (NEWEST, LONGEST):
            log = simulate(self.trace, Continuous(num_slots=16, num_blocks=self.num_blocks, victim=rule.lower()))
            runs[rule] = (log.num_preemptions, log.recomputed_tokens)
        return runs

    def expected(self) -> tuple[str, str]:
        runs = self.runs()
        return (min(runs, key=lambda rule: runs[rule][0]), min(runs, key=lambda rule: runs[rule][1]))

    def grade(self, answer):
        first, second = pair(answer, self.answer_format)
        answered = choice(first, (NEWEST, LONGEST), "fewer preemptions"), choice(second, (NEWEST, LONGEST),
                                                                                 "fewer tokens recomputed")
        runs, expected = self.runs(), self.expected()
        facts = "; ".join(f'"{rule.lower()}": {preemptions} preemptions, {tokens} tokens recomputed'
                          for rule, (preemptions, tokens) in runs.items())
        if answered == expected:
            return correct(f"{facts}. On this run, evicting a request that holds much cache frees many blocks at "
                           "once, so fewer evictions, but throws away much computed work each time; the margin is "
                           "small, and another pool or draw can reverse it.")
        if answered == expected[::-1]:
            return incorrect(f"{facts}. (The first answer is the rule with fewer preemptions, the second the one "
                             "with fewer tokens recomputed.)")
        return incorrect(f"{facts}. Count again: lk.simulate(trace, lk.Continuous(num_slots=16, num_blocks="
                         f"{self.num_blocks}, victim=...)).num_preemptions and .recomputed_tokens.")

    def hint_text(self) -> str:
        return ('Run the 64-block pool twice, with victim="newest" and victim="longest", and compare '
                "num_preemptions and recomputed_tokens.")

    def solution_text(self) -> str:
        runs = self.runs()
        lines = [f'victim="{rule.lower()}": {p} preemptions, {t} recomputed' for rule, (p, t) in runs.items()]
        first, second = self.expected()
        return "\n".join([*lines, f'answer = ("{first.lower()}", "{second.lower()}")'])


q1 = BlockCounts(prompt_length=48, output_length=96, block_size=16)
q2 = VictimRule(num_blocks=64)
