"""Write-a-policy: the student writes continuous batching's refill step, graded against
`lk.Continuous` (`labkit.sched.policy`, where the policies live) on traces the lesson never
shows, in the simulator and on the engine.

`refill(state) -> lk.Decision` releases the finished requests and admits waiting ones
into the free slots; `as_policy(refill, num_slots)` makes it a policy that `lk.simulate`
and `Engine.run` accept (unlimited KV pool, no token budget).

Invariants:

- `RefillPolicy` checks every decision before the back end applies it: a Decision of
  request ids that releases only finished requests, admits only waiting ones into slots
  that are free, and never leaves requests waiting while nothing runs; so a run with it
  always ends, with a log or a PolicyError that names the field and the value;
- grading compares slot occupancy and finish steps, step by step, with `lk.Continuous`
  on seeded traces from `GRADING_SEED`, then slots and tokens on a tiny engine (fp32,
  CPU), which asks the policy before every step; torch is imported only then;
- an answer that is a known mistake (newest first, refilling a step late) is named as such;
- while the answer runs, `lk.Continuous` refuses to decide (`withholding_the_reference`): a
  refill that asks the schedule it is graded against is told so, and the class is restored.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from labkit.checks import whole_number
from labkit.exercises.feedback import (
    BadAnswer,
    Question,
    Verdict,
    correct,
    count,
    describe,
    describe_error,
    incorrect,
    not_attempted,
)
from labkit.sched import Continuous, Decision, Request, SchedulerState, StepLog, simulate
from labkit.traffic import Trace

GRADING_SEED = 20_240_605  # the grading traces: drawn from this seed, never shown before grading
NUM_GRADING_CASES = 10
WIDE_SLOTS = (8, 16)  # the last cases' slots: a refill that admits only a few a step fails them


class PolicyError(ValueError):
    """A refill decision that breaks the rules of the exercise; the message says which and how."""


class NoDecision(PolicyError):
    """refill returned None. `at_start`: on the very first decision of a run (a stub, most likely)."""

    def __init__(self, message: str, at_start: bool):
        super().__init__(message)
        self.at_start = at_start


class AskedTheReference(PolicyError):
    """refill asked lk.Continuous to decide while it was being graded against it."""


_REFERENCE_METHODS = ("schedule", "fill", "admit_waiting")  # lk.Continuous's ways to a Decision


@contextmanager
def withholding_the_reference() -> Iterator[None]:
    """While the block runs, lk.Continuous (and every policy built on it) refuses to decide:
    a refill that delegates to it would copy the schedule it is graded against."""

    def refuse(policy, *args, **kwargs):
        raise AskedTheReference(f"refill asked {type(policy).__name__} to decide: lk.Continuous is the schedule "
                                "yours is graded against, so it is withheld while grading. Release and admit the "
                                "requests yourself, from state")

    saved = {name: Continuous.__dict__[name] for name in _REFERENCE_METHODS}
    try:
        for name in _REFERENCE_METHODS:
            setattr(Continuous, name, refuse)
        yield
    finally:
        for name, method in saved.items():
            setattr(Continuous, name, method)


@dataclass(frozen=True)
class RefillPolicy:
    """A policy made of a refill function: unlimited KV pool, no token budget. It has what
    `drive` asks of a policy: num_slots, num_blocks, block_size, reserves_whole_length,
    pads_finished, check_fits and schedule."""

    refill: Callable[[SchedulerState], Decision]
    num_slots: int
    num_blocks = None
    block_size = 16
    reserves_whole_length = False
    pads_finished = False

    def __post_init__(self):
        if not callable(self.refill):
            raise ValueError(f"refill = {describe(self.refill)}: must be a function refill(state) -> lk.Decision")
        whole_number("num_slots", self.num_slots)

    def __repr__(self) -> str:
        return f"{self.name}(num_slots={self.num_slots})"

    @property
    def name(self) -> str:
        return getattr(self.refill, "__name__", type(self.refill).__name__)

    def check_fits(self, request: Request) -> None:
        """Every request fits: the pool is unlimited."""

    def schedule(self, state: SchedulerState) -> Decision:
        decision = self.refill(state)
        self._check(decision, state)
        return decision

    def _check(self, decision, state: SchedulerState) -> None:
        if decision is None:
            raise NoDecision(f"{self.name} returned None at step {state.num_steps}: every path must return a "
                             "lk.Decision (lk.Decision() when there is nothing to do)",
                             at_start=state.num_steps == 0 and state.num_admitted == 0)
        if not isinstance(decision, Decision):
            raise PolicyError(f"{self.name} returned {describe(decision)}, not a lk.Decision")
        if decision.num_tokens is not None or decision.preempt or decision.wake_at is not None:
            raise PolicyError(f"{self.name} set num_tokens, preempt or wake_at ({describe(decision)}): a refill step "
                              "only releases and admits, so leave them at their defaults")
        if not isinstance(decision.blocked, str):
            raise PolicyError(f"Decision.blocked = {describe(decision.blocked)}: must be a string, or left out")
        release = self._ids(decision.release, "release")
        admit = self._ids(decision.admit, "admit")
        self._check_release(release, state)
        self._check_admit(admit, state, num_free_slots=state.num_free_slots() + len(release))
        if state.waiting and not (release or admit or state.running()):
            raise PolicyError(f"{self.name} releases and admits nobody while nothing runs and the queue holds "
                              f"{count(len(state.waiting), 'request')}: release the finished requests "
                              "(state.finished_in_slots()) and admit waiting ones into the slots that frees")

    def _ids(self, values, field: str) -> list[int]:
        if not isinstance(values, (tuple, list)):
            raise PolicyError(f"Decision.{field} = {describe(values)}: must be a tuple of request ids")
        for value in values:
            if isinstance(value, Request):
                raise PolicyError(f"Decision.{field} holds Request objects; it takes their ids: "
                                  "tuple(r.id for r in requests)")
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
                raise PolicyError(f"Decision.{field} holds {describe(value)}; it takes request ids (whole numbers)")
        if len(set(values)) != len(values):
            raise PolicyError(f"Decision.{field} = {values!r} names a request twice")
        return [int(value) for value in values]

    def _check_release(self, release: list[int], state: SchedulerState) -> None:
        finished = {r.id for r in state.finished_in_slots()}
        running = {r.id for r in state.running()}
        for request_id in release:
            if request_id in running:
                raise PolicyError(f"{self.name} releases request {request_id}, which has not finished: release "
                                  "only state.finished_in_slots()")
            if request_id not in finished:
                raise PolicyError(f"{self.name} releases request {request_id}, which holds no slot")

    def _check_admit(self, admit: list[int], state: SchedulerState, num_free_slots: int) -> None:
        waiting = {r.id for r in state.waiting}
        for request_id in admit:
            if request_id not in waiting:
                raise PolicyError(f"{self.name} admits request {request_id}, which is not waiting. Name requests "
                                  "from state.waiting without removing them: the back end does that")
        if len(admit) > num_free_slots:
            raise PolicyError(f"{self.name} admits {count(len(admit), 'request')}, but only "
                              f"{count(num_free_slots, 'slot')} free after its releases: "
                              "state.num_free_slots() + the number released")


def as_policy(refill: Callable[[SchedulerState], Decision], num_slots: int) -> RefillPolicy:
    """`refill(state) -> lk.Decision` as a policy for `lk.simulate` and `Engine.run`."""
    return RefillPolicy(refill, num_slots)


def grading_cases() -> list[tuple[Trace, int]]:
    """(trace, num_slots) pairs the refill step is graded on: backlogged or arriving, with prompts,
    on 1 to 4 slots and then on 8 and 16, where a backlog fills every slot in one decision."""
    rng = np.random.default_rng(GRADING_SEED)
    slots = [int(rng.integers(1, 5)) for _ in range(NUM_GRADING_CASES - len(WIDE_SLOTS))] + list(WIDE_SLOTS)
    cases = []
    for index, num_slots in enumerate(slots):
        trace = Trace.sample(int(rng.integers(num_slots + 2, 2 * num_slots + 14)), output="exponential",
                             mean_output=float(rng.uniform(2, 10)), prompt="uniform", mean_prompt=8,
                             rate=None if index % 2 else float(rng.uniform(10, 60)), seed=int(rng.integers(2**31)))
        cases.append((trace, num_slots))
    return cases


def has_no_body(function) -> bool:
    """Whether `function` does nothing at all: a docstring, `pass` or `...` alone (it names
    nothing and keeps no variable of its own)."""
    code = getattr(function, "__code__", None)
    return code is not None and not code.co_names and code.co_nlocals == code.co_argcount


def admit_newest_first(state: SchedulerState) -> Decision:
    """A known mistake: LIFO admission."""
    finished = state.finished_in_slots()
    newest = list(reversed(state.waiting))[: state.num_free_slots() + len(finished)]
    return Decision(release=tuple(r.id for r in finished), admit=tuple(r.id for r in newest))


def refill_a_step_late(state: SchedulerState) -> Decision:
    """A known mistake: admits only into slots that were free before this decision's releases."""
    finished = state.finished_in_slots()
    admit = state.waiting_head(state.num_free_slots())
    return Decision(release=tuple(r.id for r in finished), admit=tuple(r.id for r in admit))


MISTAKES = (
    (admit_newest_first, "You admit the newest waiting request first. Continuous batching serves first come, first "
                         "served: take requests from the front of state.waiting."),
    (refill_a_step_late, "A freed slot stays idle for one step: you admit only into the slots that were free before "
                         "this decision. The slots you release are free too: state.num_free_slots() + len(finished)."),
)


def _tiny_engine():
    """A TinyGPT small enough to grade on in a moment: fp32 on the CPU. Imports torch."""
    from labkit.engine import Engine, ModelConfig

    config = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=128)
    return Engine(config, device="cpu", seed=0)


def _same_schedule(mine: StepLog, reference: StepLog) -> bool:
    return np.array_equal(mine.slots, reference.slots) and np.array_equal(mine.finish_step, reference.finish_step)


def _first_difference(mine: StepLog, reference: StepLog) -> str:
    """Where two schedules part, in words."""
    num_common = min(mine.num_steps, reference.num_steps)
    differs = np.flatnonzero((mine.slots[:num_common] != reference.slots[:num_common]).any(axis=1))
    if not len(differs):
        return (f"yours takes {mine.num_steps} steps and lk.Continuous {reference.num_steps}, with the same slots "
                "while both run")
    step = int(differs[0])
    return (f"at step {step} the slots hold {mine.slots[step].tolist()} with yours and "
            f"{reference.slots[step].tolist()} with lk.Continuous (-1 is an idle slot)")


def _diagnosis(trace: Trace, num_slots: int, mine: StepLog) -> str:
    """The known mistake whose schedule `mine` reproduces, or a pointer to the rules."""
    for mistake, message in MISTAKES:
        if _same_schedule(mine, simulate(trace, as_policy(mistake, num_slots))):
            return message
    return "Release every finished request, then admit waiting requests, oldest first, into every free slot."


@dataclass(frozen=True)
class RefillStep(Question):
    """Write `refill(state) -> lk.Decision`, the refill step of continuous batching."""

    answer_format = "a function refill(state) -> lk.Decision"

    def case(self, index: int) -> tuple[Trace, int]:
        """Grading case `index`: (trace, num_slots), to debug a failure."""
        return grading_cases()[index]

    def grade(self, answer):
        if not callable(answer):
            raise BadAnswer(f"expected {self.answer_format}, got {describe(answer)}.")
        on_simulator = self.on_simulator(answer)
        if not on_simulator:
            return on_simulator
        on_engine = self.on_engine(answer)
        if not on_engine:
            return on_engine
        return correct(f"Your refill step schedules exactly as lk.Continuous does. {on_simulator.message} "
                       f"{on_engine.message}")

    def on_simulator(self, refill) -> Verdict:
        """Whether `refill` schedules every grading case as lk.Continuous does, in the simulator."""
        for index, (trace, num_slots) in enumerate(grading_cases()):
            where = f"On grading case {index} ({len(trace)} requests, {num_slots} slots; q6.case({index}))"
            try:
                with withholding_the_reference():
                    mine = simulate(trace, as_policy(refill, num_slots))
            except Exception as error:
                return self._run_failure(error, where, refill)
            reference = simulate(trace, Continuous(num_slots=num_slots))
            if not _same_schedule(mine, reference):
                return incorrect(f"{where}, {_first_difference(mine, reference)}. "
                                 f"{_diagnosis(trace, num_slots, mine)}")
        return correct(f"In the simulator, on {NUM_GRADING_CASES} unseen traces: the same slots at every step and "
                       "the same finish steps.")

    def on_engine(self, refill) -> Verdict:
        """Whether `refill` runs grading case 0 on a tiny engine as lk.Continuous does: slots and tokens."""
        engine = _tiny_engine()
        trace, num_slots = grading_cases()[0]
        trace = trace.backlogged()  # the engine's clock is measured: with arrivals, its schedule would follow its speed
        where = f"On the engine (grading case 0, all {len(trace)} requests waiting at t = 0, {num_slots} slots)"
        try:
            with withholding_the_reference():
                mine = engine.run(trace, as_policy(refill, num_slots), progress=False)
        except Exception as error:
            return self._run_failure(error, where, refill)
        reference = engine.run(trace, Continuous(num_slots=num_slots), progress=False)
        if not _same_schedule(mine, reference):
            return incorrect(f"{where}, {_first_difference(mine, reference)}. {_diagnosis(trace, num_slots, mine)} "
                             "The engine asks refill before every step, the simulator only when something changes: "
                             "decide only on who waits, who holds which slot and who has finished.")
        if mine.outputs != reference.outputs:
            return incorrect(f"{where}, the slots match lk.Continuous but the tokens differ.")
        num_output_tokens = sum(len(tokens) for tokens in mine.outputs.values())
        return correct(f"On the engine, which asks it before every step: the same slots and the same {num_output_tokens} "
                       "tokens.")

    def _run_failure(self, error: Exception, where: str, refill):
        if isinstance(error, NotImplementedError) or (isinstance(error, NoDecision) and error.at_start
                                                      and has_no_body(refill)):
            return not_attempted("refill has no body yet: write it so that it returns a lk.Decision, then run the "
                                 "cell again.")
        if isinstance(error, NoDecision):
            return incorrect(f"{where}: {error}. Did you forget `return`? A function that computes a Decision and "
                             "does not return it returns None.")
        if isinstance(error, PolicyError):
            return incorrect(f"{where}: {error}.")
        return incorrect(f"{where}, the run stopped with {describe_error(error)}. For the traceback, run "
                         "lk.simulate(trace, as_policy(refill, num_slots)) yourself on that case.")

    def hint_text(self) -> str:
        return ("state.finished_in_slots() lists the finished requests that still hold a slot; release them all. "
                "The free slots are then state.num_free_slots() plus those. Admit that many from the front of "
                "state.waiting (state.waiting_head(n)). A Decision takes request ids: "
                "lk.Decision(release=tuple(r.id for r in ...), admit=...).")

    def solution_text(self) -> str:
        return ("def refill(state):\n"
                "    finished = state.finished_in_slots()\n"
                "    admit = state.waiting_head(state.num_free_slots() + len(finished))\n"
                "    return lk.Decision(release=tuple(r.id for r in finished), admit=tuple(r.id for r in admit))\n"
                "This is lk.Continuous's short path when neither blocks nor a token budget limit it.")


q6 = RefillStep()
