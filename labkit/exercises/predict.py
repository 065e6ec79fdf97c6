"""Predict-then-run problems: iteration counts, static utilization, which traffic gains
more, the smallest KV pool, and a token budget for a latency target.

Invariants: every expected answer, and every number a verdict, hint or solution quotes,
is computed when asked, with labkit's own simulator, theory and metrics; nothing is
written down. A question's data are fields of a frozen dataclass (`q1.lengths`,
`q4.trace`), so the student works on exactly what the checker grades.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from labkit.sched.blocks import num_blocks_for
from labkit import theory
from labkit.analysis import CostModel, capacity, metrics
from labkit.exercises.feedback import (
    BadAnswer,
    Question,
    choice,
    correct,
    count,
    incorrect,
    pair,
    real_number,
    whole_number,
)
from labkit.sched import Continuous, Static, StepLog, simulate
from labkit.traffic import Trace


def _num_steps(trace: Trace, policy) -> int:
    return simulate(trace, policy).num_steps


@dataclass(frozen=True)
class IterationCounts(Question):
    """Requests with these output lengths all wait at t = 0 for `num_slots` slots: how many
    iterations do static and continuous batching take?"""

    lengths: tuple[int, ...]
    num_slots: int
    answer_format = "(static iterations, continuous iterations), e.g. (20, 15)"

    @property
    def trace(self) -> Trace:
        return Trace.from_lengths(self.lengths)

    def expected(self) -> tuple[int, int]:
        return (_num_steps(self.trace, Static(num_slots=self.num_slots)),
                _num_steps(self.trace, Continuous(num_slots=self.num_slots)))

    def grade(self, answer):
        first, second = pair(answer, self.answer_format)
        answered = whole_number(first, "static iterations"), whole_number(second, "continuous iterations")
        static, continuous = self.expected()
        if answered == (static, continuous) and static == continuous:
            return correct(f"Both take {static} iterations for the same {sum(self.lengths)} tokens: "
                           f"{self._last_to_finish()} sets the end under both, and refilling slots cannot shorten "
                           f"a single request.{self._reversed()}")
        if answered == (static, continuous):
            return correct(f"Static batching takes {static} iterations and continuous batching {continuous}: the same "
                           f"{sum(self.lengths)} tokens, {static - continuous} iterations fewer.")
        if answered == (continuous, static):
            return incorrect("You swapped them: static batching takes the larger count. Give (static, continuous).")
        feedback = self._static_feedback(answered[0], static), self._continuous_feedback(answered[1], continuous)
        return incorrect(" ".join(feedback))

    def _continuous_log(self, lengths=None) -> StepLog:
        return simulate(Trace.from_lengths(lengths or self.lengths), Continuous(num_slots=self.num_slots))

    def _last_to_finish(self) -> str:
        """The request that ends continuous batching's run, and the iteration it starts in."""
        log = self._continuous_log()
        last = int(np.argmax(log.finish_step))
        admitted = "last, " if log.admit_step[last] == log.admit_step.max() else ""
        return f"the {self.lengths[last]}-token request, admitted {admitted}in iteration {log.admit_step[last]},"

    def _reversed(self) -> str:
        """What the same lengths in reverse order take, when that differs."""
        lengths = self.lengths[::-1]
        counts = _num_steps(Trace.from_lengths(lengths), Static(num_slots=self.num_slots)), \
            self._continuous_log(lengths).num_steps
        if counts == self.expected():
            return ""
        return (f" Admitted first, in the order {lengths}, it would run beside the short ones: static "
                f"{counts[0]}, continuous {counts[1]} iterations.")

    @staticmethod
    def _one_short(label: str, answered: int, expected: int, why: str = "") -> str:
        """The off-by-one of counting from 0: the last iteration's number taken for the count."""
        why = why or f"the last iteration is iteration {answered}"
        return f"{label}: {answered} is one short: {why}; numbered from 0, that makes {expected} iterations."

    def _lower_bound(self) -> int:
        """Iterations if no slot ever idled: total tokens / slots, rounded up."""
        return math.ceil(sum(self.lengths) / self.num_slots)

    def _static_feedback(self, answered: int, static: int) -> str:
        if answered == static:
            return f"Static: {answered} is right."
        if answered == self._lower_bound():
            return (f"Static: you divided the total tokens by the slots ({sum(self.lengths)}/{self.num_slots}), as if "
                    "no slot ever idled. Static batching waits for the longest request in each batch: add up the "
                    "batch maxima.")
        if answered == _num_steps(Trace.from_lengths(sorted(self.lengths)), Static(num_slots=self.num_slots)):
            return "Static: you sorted the lengths first. Batches form in arrival order, as listed."
        if answered == sum(self.lengths):
            return (f"Static: {answered} is every token on one slot; with {self.num_slots} slots a batch runs "
                    f"{self.num_slots} requests side by side.")
        if answered == static - 1:
            return self._one_short("Static", answered, static)
        return (f"Static: {answered} is not it. Take the requests {self.num_slots} at a time, in order, and add up "
                "the longest of each batch.")

    def _continuous_feedback(self, answered: int, continuous: int) -> str:
        if answered == continuous:
            return f"Continuous: {answered} is right."
        lower_bound = self._lower_bound()
        if answered < lower_bound:
            return (f"Continuous: {answered} is below {sum(self.lengths)} tokens / {self.num_slots} slots, "
                    f"which no schedule can beat.")
        if answered == lower_bound:
            return (f"Continuous: {answered} is total tokens / slots, as if no slot ever idled. At the end nothing "
                    "is left to replace a finished request, and the last ones run alone: the draining tail.")
        if answered == continuous - 1:
            return self._one_short("Continuous", answered, continuous, self._late_start(answered))
        return (f"Continuous: {answered} is not it. Give each freed slot to the next waiting request at the next "
                "iteration, and count until the last request ends.")

    def _late_start(self, answered: int) -> str:
        """When the answer is the length of the request that ends last, and it did not start at once: why."""
        log = self._continuous_log()
        last = int(np.argmax(log.finish_step))
        if self.lengths[last] != answered or not log.admit_step[last]:
            return ""
        return (f"it is the {answered}-token request's own length, but that request waits for a free slot until "
                f"iteration {log.admit_step[last]} and ends in iteration {log.finish_step[last]}")

    def hint_text(self) -> str:
        return (f"Draw {self.num_slots} rows, one per slot, and fill in one cell per token. Static: take the requests "
                f"{self.num_slots} at a time, in order; a batch lasts as long as its longest request. Continuous: "
                "a slot freed at the end of an iteration takes the next waiting request in the next one.")

    def solution_text(self) -> str:
        static, continuous = self.expected()
        log = simulate(self.trace, Static(num_slots=self.num_slots))
        batches = [np.asarray(self.lengths)[log.admit_step == step].tolist() for step in np.unique(log.admit_step)]
        longest = " + ".join(str(max(batch)) for batch in batches)
        return (f"Static: the batches {batches} last {longest} = {static} iterations.\n"
                f"Continuous: {sum(self.lengths)} tokens on {self.num_slots} slots need at least "
                f"{self._lower_bound()} iterations, and the draining tail adds {continuous - self._lower_bound()}: "
                f"{continuous}.\n"
                f"Run: lk.simulate(q1.trace, lk.Static(num_slots={self.num_slots})).num_steps, and the same with "
                f"lk.Continuous.\nanswer = ({static}, {continuous})")


@dataclass(frozen=True)
class Utilizations(Question):
    """Requests with these output lengths all wait at t = 0 for `num_slots` slots: what share
    of its slot-iterations does each policy keep busy?"""

    lengths: tuple[int, ...]
    num_slots: int
    answer_format = "(static utilization, continuous utilization), fractions, e.g. (0.5, 0.8)"
    tolerance = 0.005

    def _logs(self) -> tuple[StepLog, StepLog]:
        trace = Trace.from_lengths(self.lengths)
        return simulate(trace, Static(num_slots=self.num_slots)), simulate(trace, Continuous(num_slots=self.num_slots))

    def expected(self) -> tuple[float, float]:
        return tuple(log.utilization for log in self._logs())

    def grade(self, answer):
        first, second = pair(answer, self.answer_format)
        answered = [self._fraction(real_number(value, name)) for value, name in
                    ((first, "static utilization"), (second, "continuous utilization"))]
        expected = self.expected()
        right = [math.isclose(a, e, abs_tol=self.tolerance) for a, e in zip(answered, expected)]
        if all(right):
            return correct(self._praise())
        if all(math.isclose(a, e, abs_tol=self.tolerance) for a, e in zip(answered, expected[::-1])):
            return incorrect("The two are swapped: give (static, continuous).")
        notes = [self._note(label, value, log, ok) for label, value, log, ok in
                 zip(("Static", "Continuous"), answered, self._logs(), right)]
        if any(note.endswith("is not it.") for note in notes):
            notes.append(self.hint_text())
        return incorrect(" ".join(notes))

    @staticmethod
    def _fraction(value: float) -> float:
        """A share as a fraction; 60 reads as 60%."""
        return value / 100 if 1 < value <= 100 else value

    def _note(self, label: str, value: float, log: StepLog, ok: bool) -> str:
        if ok:
            return f"{label}: {value:.3g} is right."
        target, one_fewer = log.utilization, log.num_steps - 1
        if one_fewer and math.isclose(value, log.num_output_tokens / (log.num_slots * one_fewer), abs_tol=self.tolerance):
            return (f"{label}: {value:.3g} is {log.num_output_tokens}/({log.num_slots} × {one_fewer}), one iteration short: "
                    f"iterations are numbered 0 to {one_fewer}, so there are {log.num_steps}.")
        if math.isclose(value, 1 - target, abs_tol=self.tolerance):
            return f"{label}: {value:.3g} is the idle share; utilization is the useful one, tokens / (slots × iterations)."
        if label == "Continuous" and value == 1:
            return ("Continuous: not 100%. It keeps every slot busy only while a request waits; at the end the last "
                    "one runs alone (the draining tail), and its slot's partner idles.")
        return f"{label}: {value:.3g} is not it."

    def _praise(self) -> str:
        static, continuous = self._logs()
        return (f"Both emit {static.num_output_tokens} tokens: {static.num_output_tokens}/{static.num_slots * static.num_steps} = "
                f"{static.utilization:.1%} of static batching's slot-iterations, {continuous.num_output_tokens}/"
                f"{continuous.num_slots * continuous.num_steps} = {continuous.utilization:.1%} of continuous "
                "batching's.")

    def hint_text(self) -> str:
        return ("Every token is one useful slot-iteration, so utilization = total tokens / (slots × iterations); "
                "count each policy's iterations first.")

    def solution_text(self) -> str:
        static, continuous = self._logs()
        return "\n".join(f"{log.policy}: {log.num_output_tokens} tokens / ({log.num_slots} × {log.num_steps}) = "
                         f"{log.utilization:.3f}" for log in (static, continuous)) + \
            f"\nanswer = ({static.utilization:.3f}, {continuous.utilization:.3f})"


@dataclass(frozen=True)
class ExponentialUtilization(Question):
    """Long-run utilization of static batches of `batch_size` requests with exponential output lengths."""

    batch_size: int
    answer_format = "a fraction between 0 and 1, to three decimals, e.g. 0.500"
    tolerance = 0.002  # tighter than the gap to 1/(ln B + γ) and to two decimals' rounding

    def expected(self) -> float:
        return theory.exponential_utilization(self.batch_size)

    def grade(self, answer):
        value = real_number(answer, "utilization")
        expected, gain = self.expected(), theory.harmonic(self.batch_size)
        if self._near(value, expected) or (1 < value <= 100 and self._near(value / 100, expected)):
            return correct(f"1/H_{self.batch_size} = 1/{gain:.3f} = {expected:.3f}: over many batches, static batches "
                           f"of {self.batch_size} exponential lengths keep {expected:.1%} of all their slot-steps "
                           "busy (useful slot-steps summed over slot-steps summed, a ratio of expectations), and "
                           f"continuous batching's ideal gain in slot utilization is H_{self.batch_size} = "
                           f"{gain:.2f}×, a gain in seconds only where every step costs the same.")
        if round(expected, 2) in (value, value / 100):
            return incorrect(f"{value:g} is the answer rounded to two decimals{self._rounds_alike()}: give three "
                             "decimals.")
        for scale, (candidate, message) in itertools.product((1, 100), self._mistakes()):
            if self._near(value / scale, candidate):
                return incorrect(f"{value:g}: {message}")
        if not 0 < value <= 100:
            return incorrect(f"{value:g}: a utilization is a share of slot-steps, between 0 and 1 (or 0 and 100%).")
        return incorrect(f"{value:g} is not it. {self.hint_text()}")

    def _near(self, value: float, target: float) -> bool:
        return math.isclose(value, target, abs_tol=self.tolerance)

    def _rounds_alike(self) -> str:
        """The near miss that rounds to the same two decimals as the answer, if one does."""
        near_miss = 1 / (math.log(self.batch_size) + np.euler_gamma)
        if round(near_miss, 2) != round(self.expected(), 2):
            return ""
        return f", but so is 1/(ln {self.batch_size} + γ) = {near_miss:.4f}, a near miss"

    def _mistakes(self) -> list[tuple[float, str]]:
        """(value, what it means) for answers students often give."""
        size, gain = self.batch_size, theory.harmonic(self.batch_size)
        mistakes = [
            (gain, f"that is H_{size} = {gain:.3f}, the ideal gain of continuous over static batching. Utilization "
                   "is useful slot-steps over all slot-steps: the inverse."),
            (1 - 1 / gain, f"that is 1 − 1/H_{size}, the share of slot-steps a static batch leaves idle. "
                           "Utilization is the useful share."),
            (1.0, "you counted the idle slot-steps as useful. In a static batch, the slots of requests that finish "
                  "early sit idle until the longest one ends."),
            (1 / size, f"1/{size} would mean one request did all the work of each batch. The longest of {size} "
                       f"exponential lengths is H_{size} = {gain:.2f} times the mean, not {size} times."),
            (1 / math.log(size), f"that is 1/ln {size} = {1 / math.log(size):.3f}. H_B grows like ln B but is not "
                                 f"ln B: H_{size} = 1 + 1/2 + … + 1/{size} = {gain:.3f}, ln {size} = "
                                 f"{math.log(size):.3f}."),
            (1 / (math.log(size) + np.euler_gamma), f"that is 1/(ln {size} + γ), from H_B ≈ ln B + γ; at B = "
                                                    f"{size} it is off in the third decimal. Take H_{size} itself "
                                                    f"(lk.theory.harmonic({size}))."),
        ]
        mean_of_ratios = theory.monte_carlo("exponential", size, num_batches=100_000, seed=0).mean_of_ratios[-1]
        mistakes.append((mean_of_ratios, "that is the mean of each batch's own utilization, the expectation of the "
                                         "ratio. Long batches take more of the machine's time than short ones: pool "
                                         "the work and the capacity over many batches, E[L] / E[max], the ratio of "
                                         "expectations."))
        return mistakes + [(theory.exponential_utilization(other), f"that is 1/H_{other}, for batches of {other}; "
                            f"here B = {size}.") for other in (8, 32) if other != size]

    def hint_text(self) -> str:
        return ("Over many batches, static utilization is E[L] / E[max of B lengths]. For exponential lengths, "
                "E[max of B] = H_B · E[L], where H_B = 1 + 1/2 + … + 1/B (lk.theory.harmonic).")

    def solution_text(self) -> str:
        size = self.batch_size
        return (f"For exponential lengths E[max of {size}] = H_{size} · E[L], so U = E[L] / E[max] = 1/H_{size}.\n"
                f"H_{size} = {theory.harmonic(size):.4f} (lk.theory.harmonic({size})), so U = {self.expected():.4f}.\n"
                f"answer = lk.theory.exponential_utilization({size})")


_REASONS = (
    "It has more tokens in total, so there is more work to pack into the slots.",
    "Its requests are longer on average, so each static batch lasts longer.",
    "Its longest request is shorter, so no static batch runs for very long.",
    "Its lengths have a larger std / mean (their spread relative to the mean), and that ratio sets the gain.",
    "The longest request of a batch lies further above the mean (a longer tail), and a static batch lasts as "
    "long as its longest request.",
    "It has more requests, so the queue stays full for longer.",
)
_LONGEST_REASON, _STD_REASON, _TAIL_REASON = 3, 4, 5


def _gain(trace: Trace, num_slots: int) -> float:
    """Static steps / continuous steps on a backlog."""
    return _num_steps(trace, Static(num_slots=num_slots)) / _num_steps(trace, Continuous(num_slots=num_slots))


def _std_over_mean(trace: Trace) -> float:
    lengths = trace.output_lengths
    return float(lengths.std() / lengths.mean())


@dataclass(frozen=True)
class WhichGainsMore(Question):
    """Two backlogged traces on `num_slots` slots: which gains more from continuous batching, and why?"""

    num_slots: int
    answer_format = '(trace, reason), e.g. ("P", 1)'

    @property
    def traces(self) -> dict[str, Trace]:
        """The two traces, every request waiting at t = 0."""
        return self._sample(rate=None)

    def arriving(self) -> dict[str, Trace]:
        """The same requests arriving over time (Poisson, 1 request/s: stretch them with at_rate)."""
        return self._sample(rate=1.0)

    @staticmethod
    def _sample(rate: float | None) -> dict[str, Trace]:
        return {
            "P": Trace.sample(300, output="uniform", mean_output=96, prompt="none", rate=rate, seed=1),
            "Q": Trace.sample(200, output="exponential", mean_output=32, prompt="none", rate=rate, seed=2),
        }

    @property
    def counterexample(self) -> Trace:
        """300 lengths of 1 or 191 tokens (191 with probability 0.7), waiting at t = 0: their std / mean is
        larger than P's, their gain smaller. The tail sets the gain, not the std."""
        draws = np.random.default_rng(0).random(300)
        return Trace.from_lengths(np.where(draws < 0.7, 191, 1))

    @property
    def reasons(self) -> dict[int, str]:
        return dict(enumerate(_REASONS, start=1))

    def gains(self) -> dict[str, float]:
        """Static steps / continuous steps for each trace."""
        return {name: _gain(trace, self.num_slots) for name, trace in self.traces.items()}

    def grade(self, answer):
        first, second = pair(answer, self.answer_format)
        trace = choice(first, tuple(self.traces), "trace")
        reason = int(choice(second, tuple(str(r) for r in self.reasons), "reason"))
        gains = self.gains()
        winner = max(gains, key=gains.get)
        other = self._other(winner)
        if trace == winner and reason == _TAIL_REASON:
            return correct(f"{winner} gains {gains[winner]:.2f}× and {other} only {gains[other]:.2f}× "
                           f"(static steps / continuous steps on {self.num_slots} slots). E[max of "
                           f"{self.num_slots}] / E[L] is {self._ideal_gain(winner):.2f} for {winner} and "
                           f"{self._ideal_gain(other):.2f} for {other}: with a backlog that refills every slot, the "
                           "gain follows how far a batch's longest request lies above the mean, not the lengths' "
                           "size; their number matters only through the draining tail.")
        if reason == _TAIL_REASON:
            return incorrect(f"Reason {reason} is the right idea; now apply it. How far does the longest of "
                             f"{self.num_slots} lie above the mean in each trace? "
                             f"lk.theory.ideal_gain(trace.output_lengths, {self.num_slots}) is E[max of "
                             f"{self.num_slots}] / E[L].")
        if reason == _STD_REASON:
            return incorrect(self._std_feedback(trace, winner, other))
        if trace != winner:
            return incorrect(f"{self._fact(reason, trace)} and {self._fact(reason, winner)}, but that is not what the "
                             "gain depends on. Simulate both and compare static steps / continuous steps.")
        if reason == _LONGEST_REASON:
            longest = {name: self.traces[name].output_lengths.max() for name in (winner, other)}
            return incorrect(f"{winner} is the right trace, and its longest request is shorter ({longest[winner]} "
                             f"tokens against {longest[other]}), but the gain is a ratio of two runs: double every "
                             "length and both runs take twice the steps, the gain unchanged. What sets it?")
        return incorrect(f"{winner} is the right trace, but reason {reason} can't be why: "
                         f"{self._fact(reason, winner)} and {self._fact(reason, other)}.")

    def _std_feedback(self, trace: str, winner: str, other: str) -> str:
        """std / mean is not the gain: a two-valued trace has more of it than the loser, and gains less."""
        example = self.counterexample
        return (f"{self._fact(_STD_REASON, trace)} and {self._fact(_STD_REASON, self._other(trace))}, but std / "
                f"mean does not set the gain. q3.counterexample, {len(example)} lengths of 1 or "
                f"{example.output_lengths.max()} tokens, has std / mean {_std_over_mean(example):.2f}, more than "
                f"{other}'s, and gains {_gain(example, self.num_slots):.2f}×, less than {other}'s "
                f"{self.gains()[other]:.2f}×. What else differs between {winner} and {other}?")

    def _other(self, name: str) -> str:
        return next(other for other in self.traces if other != name)

    def _ideal_gain(self, name: str) -> float:
        return theory.ideal_gain(self.traces[name].output_lengths, self.num_slots)

    def _fact(self, reason: int, name: str) -> str:
        """What `reason` says about trace `name`, in numbers."""
        trace = self.traces[name]
        lengths = trace.output_lengths
        if reason == 1:
            return f"{name} has {lengths.sum():,} tokens in total"
        if reason == 2:
            return f"{name}'s requests average {lengths.mean():.1f} tokens"
        if reason == _LONGEST_REASON:
            return f"{name}'s longest request is {lengths.max()} tokens"
        if reason == _STD_REASON:
            return f"{name}'s std / mean is {_std_over_mean(trace):.2f}"
        return f"{name} has {len(lengths)} requests"

    def hint_text(self) -> str:
        return ("A static batch lasts as long as its longest request, so its waste depends on how far the longest "
                "of a batch lies above the mean, not on how long the lengths are. "
                f"lk.theory.ideal_gain(lengths, {self.num_slots}) computes E[max of {self.num_slots}] / E[L] for "
                "each trace's output_lengths.")

    def solution_text(self) -> str:
        gains = self.gains()
        lines = [f"{name}: {len(t)} requests, mean {t.output_lengths.mean():.1f}, longest {t.output_lengths.max()}, "
                 f"E[max of {self.num_slots}] / E[L] = {self._ideal_gain(name):.2f}, simulated gain "
                 f"{gains[name]:.2f}×" for name, t in self.traces.items()]
        winner = max(gains, key=gains.get)
        return "\n".join([*lines, f"answer = ({winner!r}, {_TAIL_REASON})"])


@dataclass(frozen=True)
class SmallestPool(Question):
    """The smallest KV pool, in blocks, that serves this trace under continuous batching without a preemption."""

    output_lengths: tuple[int, ...]
    prompt_lengths: tuple[int, ...]
    num_slots: int
    block_size: int
    answer_format = "a whole number of blocks, e.g. 12"

    @property
    def trace(self) -> Trace:
        return Trace.from_lengths(self.output_lengths, prompt_lengths=self.prompt_lengths)

    def policy(self, num_blocks: int) -> Continuous:
        return Continuous(num_slots=self.num_slots, num_blocks=num_blocks, block_size=self.block_size)

    def num_preemptions(self, num_blocks: int) -> int | None:
        """Preemptions with a pool of `num_blocks`, or None when some request can never fit it."""
        try:
            return simulate(self.trace, self.policy(num_blocks)).num_preemptions
        except ValueError:
            return None

    def expected(self) -> int:
        return next(n for n in itertools.count(1) if self.num_preemptions(n) == 0)

    def fewest_that_fit(self) -> int:
        """The smallest pool that can hold every request, one at a time."""
        return next(n for n in itertools.count(1) if self.num_preemptions(n) is not None)

    def _never_binding(self) -> int:
        """A pool that holds every request's longest sequence at once (1 + prompt + outputs but the last)."""
        tokens = np.add(self.prompt_lengths, self.output_lengths)
        return int(np.sum(num_blocks_for(tokens, self.block_size)))

    def grade(self, answer):
        num_blocks = whole_number(answer, "num_blocks")
        if num_blocks < 1:
            raise BadAnswer(f"num_blocks = {num_blocks}: a pool holds at least 1 block.")
        smallest = self.expected()
        if num_blocks == smallest:
            one_fewer = self.num_preemptions(smallest - 1)
            return correct(f"A pool of {smallest} blocks serves the trace without a preemption; with "
                           f"{smallest - 1} the scheduler preempts {count(one_fewer, 'time')}.")
        try:  # beyond a pool that never binds, the schedule is the same: simulate that one
            preemptions = simulate(self.trace, self.policy(min(num_blocks, self._never_binding()))).num_preemptions
        except ValueError as error:
            return incorrect(f"A pool of {num_blocks} blocks can't serve this trace at all: {error}.")
        if not preemptions:
            return incorrect(f"A pool of {num_blocks} blocks serves the trace without a preemption, but a smaller "
                             "pool does too. Keep shrinking it.")
        message = (f"A pool of {num_blocks} blocks preempts {count(preemptions, 'time')} "
                   f"(lk.simulate(q4.trace, q4.policy({num_blocks})).num_preemptions).")
        if num_blocks == self.fewest_that_fit():
            message += (" That is what the largest request needs alone: enough to admit every request, not to run "
                        f"{self.num_slots} side by side while their caches grow.")
        return incorrect(message)

    def hint_text(self) -> str:
        return ("Search: for each num_blocks, lk.simulate(q4.trace, q4.policy(num_blocks)).num_preemptions. Start "
                "from the largest request's need, or from the peak of a run whose pool never binds "
                "(num_blocks_used.max(), lesson 05), which surely needs no preemption.")

    def solution_text(self) -> str:
        smallest = self.expected()
        rows = [f"{n:10}  {self.num_preemptions(n):11}" for n in range(self.fewest_that_fit(), smallest + 1)]
        fit = self.fewest_that_fit()
        preempting = f"; pools of {fit} to {smallest - 1} hold it but preempt" if smallest > fit else ""
        return "\n".join(["num_blocks  preemptions", *rows, f"Pools under {fit} blocks cannot hold the largest "
                          f"request{preempting}. answer = {smallest}"])


ITL_P99, THROUGHPUT = "ITL p99 (ms)", "tokens/s"


@dataclass(frozen=True)
class TokenBudget(Question):
    """Which token budget (max_tokens_per_step, chunked prefill) meets an ITL p99 target at the highest throughput?
    Throughputs within `tie` of the best are a tie, and the smallest of those budgets wins (its ITL is lower)."""

    budgets: tuple[int, ...]
    itl_p99_target_ms: float
    num_slots: int
    tie: float = 0.01
    num_requests: int = 120
    answer_format = "one budget from q5.budgets, e.g. 128"

    @property
    def trace(self) -> Trace:
        """`num_requests` requests arriving at about 20 a second."""
        return Trace.sample(self.num_requests, output="exponential", mean_output=32, prompt="uniform", mean_prompt=384,
                            rate=20.0, seed=5)

    def policy(self, budget: int) -> Continuous:
        return Continuous(num_slots=self.num_slots, max_tokens_per_step=budget, chunked_prefill=True)

    def measure(self, budget: int, trace: Trace | None = None, cost: CostModel | None = None) -> dict[str, float]:
        """`budget` on `trace` (q5.trace) with steps priced by `cost` (the default CostModel()): the load (arrival
        rate over what the budget serves with every request waiting), the share of steps that carry prompt tokens,
        TTFT p50, ITL p50 and p99, tokens/s."""
        trace, cost = trace or self.trace, cost or CostModel()
        log = simulate(trace, self.policy(budget), cost=cost)
        itl = metrics.itl(log)
        rate = (len(trace) - 1) / np.ptp(trace.arrivals)
        return {"load": rate / capacity(trace, self.policy(budget), cost=cost),
                "steps with prompt": float(np.mean(log.num_prefill_tokens > 0)),
                "TTFT p50 (s)": metrics.percentile(log.ttft, 50),
                "ITL p50 (ms)": 1000 * metrics.percentile(itl, 50),
                ITL_P99: 1000 * metrics.percentile(itl, 99),
                THROUGHPUT: log.tokens_per_second}

    def sweep(self, trace: Trace | None = None, cost: CostModel | None = None) -> dict[int, dict[str, float]]:
        """`measure` for every budget on the list."""
        return {budget: self.measure(budget, trace, cost) for budget in self.budgets}

    def pick(self, sweep: dict[int, dict[str, float]]) -> int | None:
        """The budget that meets the ITL p99 target at the most tokens/s, ties (within `tie`) to the smallest;
        None if no budget meets it."""
        meeting = {budget: row[THROUGHPUT] for budget, row in sweep.items() if row[ITL_P99] <= self.itl_p99_target_ms}
        if not meeting:
            return None
        best = max(meeting.values())
        return min(budget for budget, throughput in meeting.items() if throughput >= (1 - self.tie) * best)

    def expected(self) -> int:
        return self.pick(self.sweep())

    def grade(self, answer):
        budget = whole_number(answer, "budget")
        if budget not in self.budgets:
            raise BadAnswer(f"budget = {budget}: choose one of {self.budgets}.")
        sweep = self.sweep()
        itl, throughput = sweep[budget][ITL_P99], sweep[budget][THROUGHPUT]
        target = self.itl_p99_target_ms
        if budget == self.pick(sweep):
            return correct(f"Budget {budget}: ITL p99 {itl:.1f} ms ≤ {target:g} ms at {throughput:,.0f} tokens/s. "
                           f"{self._next_budget_up(budget, sweep)}")
        if itl > target:
            return incorrect(f"Budget {budget} gives ITL p99 {itl:.1f} ms, above the {target:g} ms target: a step may "
                             f"carry up to {budget} prompt tokens, and every decode in it waits for them.")
        return incorrect(f"Budget {budget} meets the target (ITL p99 {itl:.1f} ms) at {throughput:,.0f} tokens/s, but "
                         "another budget on the list meets it too and serves more tokens per second.")

    def _next_budget_up(self, budget: int, sweep: dict[int, dict[str, float]]) -> str:
        larger = [b for b in self.budgets if b > budget]
        if not larger:
            return ""
        return f"The next budget up, {min(larger)}, has ITL p99 {sweep[min(larger)][ITL_P99]:.1f} ms."

    def hint_text(self) -> str:
        return ("For each budget in q5.budgets, run lk.simulate(q5.trace, q5.policy(budget), cost=lk.CostModel()); "
                "ITL p99 in ms is 1000 * lk.metrics.percentile(lk.metrics.itl(log), 99), throughput is "
                "log.tokens_per_second. Keep the budgets that meet the target, then take the fastest (within 1%, "
                "the smaller budget).")

    def solution_text(self) -> str:
        sweep = self.sweep()
        rows = [f"{budget:6}  {row[ITL_P99]:11.1f}  {row[THROUGHPUT]:8,.0f}  "
                f"{'yes' if row[ITL_P99] <= self.itl_p99_target_ms else 'no'}" for budget, row in sweep.items()]
        return "\n".join([f"budget  ITL p99 (ms)  tokens/s  meets {self.itl_p99_target_ms:g} ms", *rows,
                          f"answer = {self.pick(sweep)}"])


q1 = IterationCounts(lengths=(5, 1, 4, 7, 2, 2, 6, 3), num_slots=3)
q2 = ExponentialUtilization(batch_size=16)
q3 = WhichGainsMore(num_slots=8)
q4 = SmallestPool(output_lengths=(20, 7, 3, 7, 10, 19, 11, 3), prompt_lengths=(13, 12, 16, 3, 14, 0, 9, 4),
                  num_slots=4, block_size=4)
q5 = TokenBudget(budgets=(64, 128, 256, 512, 1024, 2048), itl_p99_target_ms=40.0, num_slots=16)
