"""Lesson 03's check yourself: the backlog's first 16 requests on 4 slots, iterations under
static and continuous batching."""

from __future__ import annotations

from dataclasses import dataclass

from labkit.exercises.feedback import incorrect, pair, whole_number
from labkit.exercises.predict import IterationCounts
from labkit.traffic import Trace

BACKLOG = Trace.sample(32, output="exponential", mean_output=32, prompt="uniform", mean_prompt=16, seed=0)  # the lesson's
BACKLOG_SLOTS = 8  # the slots the lesson serves the whole backlog with


@dataclass(frozen=True)
class FirstOfBacklog(IterationCounts):
    """IterationCounts for the first requests of a backlog on fewer slots, which also names the
    setups an answer may belong to instead: the whole backlog (the counts the lesson printed),
    on either number of slots, or these requests on the backlog's slots."""

    backlog: tuple[int, ...] = ()
    backlog_slots: int = BACKLOG_SLOTS

    def grade(self, answer):
        verdict = super().grade(answer)
        if verdict:
            return verdict
        first, second = pair(answer, self.answer_format)
        answered = whole_number(first, "static iterations"), whole_number(second, "continuous iterations")
        return next((incorrect(message) for counts, message in self.mix_ups() if counts == answered), verdict)

    def mix_ups(self) -> list[tuple[tuple[int, int], str]]:
        """(counts, feedback) for each other setup whose counts differ from the answer's."""
        whole, first = f"all {len(self.backlog)} requests of the backlog", f"the first {len(self.lengths)} requests"
        setups = [(self.backlog, self.backlog_slots, f"{whole} on {self.backlog_slots} slots, as the lesson printed"),
                  (self.backlog, self.num_slots, f"{whole} on {self.num_slots} slots"),
                  (self.lengths, self.backlog_slots, f"{first} on {self.backlog_slots} slots")]
        expected, mix_ups = self.expected(), []
        for lengths, num_slots, what in setups:
            counts = IterationCounts(lengths=lengths, num_slots=num_slots).expected()
            if counts != expected:
                mix_ups.append((counts, f"{counts} are the counts for {what}. Here take {first} (q1.lengths) on "
                                        f"{self.num_slots} slots."))
        return mix_ups


q1 = FirstOfBacklog(lengths=tuple(int(n) for n in BACKLOG.output_lengths[:16]), num_slots=4,
                    backlog=tuple(int(n) for n in BACKLOG.output_lengths))
