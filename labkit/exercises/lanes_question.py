"""A predict-then-check problem for lesson 08: how long a step takes when host and device
take turns, and when they overlap.

Invariants: the expected answer, and every number a verdict quotes, comes from
`labkit.analysis.lanes` when asked; nothing is written down. `labkit.viz.lanes_figures`
draws the two lanes.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.analysis.lanes import two_lanes
from labkit.exercises.feedback import NumberPair, Verdict, incorrect, pair, real_number


@dataclass(frozen=True)
class OverlapStep(NumberPair):
    """Each step needs `host` ms of host work and `device` ms of device work. In steady state,
    how many ms does a step take without overlap, and with it?"""

    host: float
    device: float
    answer_format = "(ms without overlap, ms with overlap), e.g. (9.0, 6.0)"
    names = ("ms without overlap", "ms with overlap")
    tolerance = 0.05  # ms

    def expected(self) -> tuple[float, float]:
        return tuple(two_lanes(self.host, self.device, 4, overlap).step_period for overlap in (False, True))

    def grade(self, answer) -> Verdict:
        answered = tuple(real_number(value, name) for value, name in zip(pair(answer, self.answer_format), self.names))
        if self._near(tuple(1000 * value for value in answered), self.expected()):
            return incorrect(f"{answered}: right in seconds, but the question asks for milliseconds: "
                             f"multiply each by 1,000.")
        return super().grade(answer)

    def praise(self) -> str:
        plain, overlapped = self.expected()
        slower = "host" if self.host > self.device else "device"
        return (f"{plain:g} ms without overlap, {overlapped:g} ms with it: the slower lane, the {slower}, "
                f"sets the pace, {plain / overlapped:.2f}× the throughput.")

    def mistakes(self) -> list[tuple[tuple[float, float], str]]:
        plain, overlapped = self.expected()
        faster = min(self.host, self.device)
        if self.host > self.device:
            only_faster = (f"the device cannot start a step before its {self.host:g} ms of host work is done: the host "
                           "is the slower lane here, and it sets the pace.")
        else:
            only_faster = (f"overlap cannot make a step shorter than its slower lane: {faster:g} ms is the host's, "
                           "and every step still waits for the device.")
        return [
            ((overlapped, plain), "the two are swapped: taking turns is the slower loop."),
            ((plain, faster), only_faster),
            ((plain, plain), "overlap hides the shorter lane behind the longer one, so a step shrinks to the longer."),
        ]

    def hint_text(self) -> str:
        return ("Without overlap the lanes take turns, so a step is host + device. With overlap the host prepares "
                "the next step while the device runs this one: which lane then decides how often a step ends?")

    def solution_text(self) -> str:
        plain, overlapped = self.expected()
        return (f"Without overlap: {self.host:g} + {self.device:g} = {plain:g} ms. With overlap: "
                f"max({self.host:g}, {self.device:g}) = {overlapped:g} ms.")


q7 = OverlapStep(host=6.0, device=4.0)
