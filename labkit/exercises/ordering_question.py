"""A predict-then-check problem for lesson 11: what admitting the shortest request first
does to the mean TTFT, and who pays for it.

Invariants: the expected answer, and every number a verdict quotes, comes from
`labkit.simulate` (first come, first served against shortest predicted first with a
perfect predictor) when asked; nothing is written down.

`labkit.analysis.ordering` holds the tables that compare queue orders, and
`labkit.viz.ordering_figures` their figures.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit.exercises.feedback import NumberPair
from labkit.sched import Continuous, ShortestPredictedFirst, StepLog, simulate
from labkit.traffic import Trace


@dataclass(frozen=True)
class ShortestFirst(NumberPair):
    """Requests with these output lengths (no prompts) all wait at t = 0, in this arrival
    order, for `num_slots` slots; every step takes one unit of time and gives each running
    request one token. What is the mean TTFT, in steps, first come first served, and
    shortest first? (A first token from the first step has a TTFT of 1.)"""

    output_lengths: tuple[int, ...]
    num_slots: int
    answer_format = "(mean TTFT first come first served, mean TTFT shortest first), in steps, e.g. (4.0, 3.0)"
    names = ("the mean TTFT first come first served", "the mean TTFT shortest first")
    tolerance = 0.05  # steps

    def runs(self, num_slots: int | None = None) -> tuple[StepLog, StepLog]:
        """The two schedules, first come first served and shortest first, one step a unit of time."""
        slots = num_slots or self.num_slots
        plain = Trace.from_lengths(list(self.output_lengths))
        letters = tuple(chr(ord("A") + i) if i < 26 else str(i) for i in range(len(plain)))
        trace = Trace(plain.output_lengths, plain.prompt_lengths, plain.arrivals, plain.ids, letters)
        return (simulate(trace, Continuous(num_slots=slots), step_time=1.0),
                simulate(trace, ShortestPredictedFirst(num_slots=slots), step_time=1.0))

    def expected(self) -> tuple[float, float]:
        return tuple(float(np.mean(log.ttft)) for log in self.runs())

    def praise(self) -> str:
        fcfs, shortest = self.runs()
        fcfs_mean, shortest_mean = float(np.mean(fcfs.ttft)), float(np.mean(shortest.ttft))
        worse = int(np.argmax(shortest.ttft - fcfs.ttft))
        return (f"{fcfs_mean:g} steps first come first served, {shortest_mean:g} shortest first: "
                f"{1 - shortest_mean / fcfs_mean:.0%} lower. Request {fcfs.trace.labels[worse]} pays: its first token "
                f"comes at step {shortest.ttft[worse]:g} instead of {fcfs.ttft[worse]:g}, and it finishes at step "
                f"{shortest.latency[worse]:g} instead of {fcfs.latency[worse]:g}; the whole queue takes "
                f"{shortest.num_steps} steps instead of {fcfs.num_steps}.")

    def mistakes(self) -> list[tuple[tuple[float, float], str]]:
        fcfs, shortest = self.runs()
        one_slot = tuple(float(np.mean(log.ttft)) for log in self.runs(num_slots=1))
        return [
            ((float(np.mean(shortest.ttft)), float(np.mean(fcfs.ttft))),
             "the two are swapped: first come first served is the one with the longer mean wait."),
            ((float(np.mean(fcfs.ttft)) - 1, float(np.mean(shortest.ttft)) - 1),
             "close: those are the steps each request waits before it starts. TTFT counts the step that emits "
             "the first token too, so add 1 to each."),
            ((float(np.sum(fcfs.ttft)), float(np.sum(shortest.ttft))),
             f"those are the totals of the {len(self.output_lengths)} TTFTs; the question asks for their mean: "
             f"divide each by {len(self.output_lengths)}."),
            ((float(np.mean(fcfs.latency)), float(np.mean(shortest.latency))),
             "those are the mean times to the last token (end-to-end latency); TTFT stops at the first."),
            (one_slot, f"that is the answer for one slot; there are {self.num_slots}, and a request joins the "
                       "moment any of them frees."),
        ]

    def hint_text(self) -> str:
        return (f"Draw {self.num_slots} rows, one per slot, and fill them step by step: a request holds its slot "
                "for as many steps as it has tokens, and the next one in the queue takes the slot the step after. "
                "First come first served takes the queue in arrival order; shortest first sorts it by length "
                "(ties by arrival). A request's TTFT is the step of its first token.")

    def half_hint(self, wrong: int) -> str:
        if wrong == 0:
            return ("First come first served takes the queue in arrival order, A first: when a slot frees, the next "
                    "letter in the alphabet takes it the step after, whichever slot it is.")
        return ("Shortest first sorts the waiting queue by output length, ties by arrival, and takes from its front "
                "each time a slot frees: fill the rows again in that order, counting each first token's step.")

    def solution_text(self) -> str:
        lines = []
        for name, log in zip(("first come first served", "shortest first"), self.runs()):
            ttfts = ", ".join(f"{t:g}" for t in log.ttft)
            lines.append(f"{name}: TTFTs {ttfts} steps, mean {float(np.mean(log.ttft)):g}")
        return "\n".join(lines)


q9 = ShortestFirst(output_lengths=(6, 1, 5, 2, 1), num_slots=2)
