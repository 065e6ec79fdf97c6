"""Scheduling policies: they decide, they never act.

`policy.schedule(state) -> Decision` looks at a `SchedulerState` and says which
finished requests leave their slots and which waiting requests join. The back end
(simulator or engine) applies the decision and runs the step. In this version every
request that holds a slot and is not finished decodes one token per step.

Invariant every policy keeps: its decision depends only on who waits, who holds
which slot, who has finished, and the clock compared with the `wake_at` time it
asked for. Between such events it would decide nothing new, which lets the
simulator run a decision for many steps at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from labkit.sched.state import SchedulerState

NO_SLOT = "no_slot"
BATCH_FORMING = "batch_forming"


@dataclass(frozen=True)
class Decision:
    """What happens before the next step.

    release: ids of requests whose slots are freed.
    admit: ids of waiting requests that take free slots, in this order.
    blocked: why the head of the queue still waits ("" when nothing waits).
    wake_at: a time at which to ask again even if nothing else changes.
    """

    release: tuple[int, ...] = ()
    admit: tuple[int, ...] = ()
    blocked: str = ""
    wake_at: float | None = None


def _ids(requests) -> tuple[int, ...]:
    return tuple(r.id for r in requests)


def _short_repr(policy) -> str:
    """Policy(num_slots=2, timeout=0.5): the fields that differ from their defaults."""
    shown = [f"{f.name}={getattr(policy, f.name)!r}" for f in fields(policy) if getattr(policy, f.name) != f.default]
    return f"{type(policy).__name__}({', '.join(shown)})"


def _check_num_slots(num_slots) -> None:
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots = {num_slots!r}: must be a whole number >= 1")


@dataclass(frozen=True, repr=False)
class Continuous:
    """Iteration-level scheduling: before every step, finished requests leave and
    waiting ones join the free slots, first come first served."""

    num_slots: int

    def __post_init__(self):
        _check_num_slots(self.num_slots)

    __repr__ = _short_repr

    def schedule(self, state: SchedulerState) -> Decision:
        release = state.finished_in_slots()
        admit = state.waiting_head(state.num_free_slots() + len(release))
        blocked = NO_SLOT if len(state.waiting) > len(admit) else ""
        return Decision(release=_ids(release), admit=_ids(admit), blocked=blocked)


@dataclass(frozen=True, repr=False)
class Static:
    """Request-level batching: when the engine is idle, take up to `num_slots`
    waiting requests as one batch and run it until its longest request ends.
    A finished request keeps its slot until then.

    drop_finished: whether an engine skips a finished request's row. By default it
    still computes it, padded, as Hugging Face's `generate` does; slot occupancy (and so
    the simulator) is the same either way, only the engine's wall clock differs.
    """

    num_slots: int
    drop_finished: bool = field(default=False, kw_only=True)

    def __post_init__(self):
        _check_num_slots(self.num_slots)

    __repr__ = _short_repr

    def schedule(self, state: SchedulerState) -> Decision:
        if state.running():
            return Decision(blocked=NO_SLOT if state.waiting else "")
        release = _ids(state.finished_in_slots())
        if not state.waiting:
            return Decision(release=release)
        wake_at = self.batch_start_time(state)
        if wake_at > state.now:
            return Decision(release=release, blocked=BATCH_FORMING, wake_at=wake_at)
        admit = state.waiting_head(self.num_slots)
        blocked = NO_SLOT if len(state.waiting) > len(admit) else ""
        return Decision(release=release, admit=_ids(admit), blocked=blocked)

    def batch_start_time(self, state: SchedulerState) -> float:
        """When the waiting requests may start as a batch: at once."""
        return state.now


@dataclass(frozen=True, repr=False)
class Dynamic(Static):
    """Static batching that waits to fill the batch: a batch starts when it is full,
    or `timeout` seconds after the arrival of its first waiting request."""

    timeout: float = field(default=0.0, kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not math.isfinite(
            self.timeout
        ) or self.timeout < 0:
            raise ValueError(f"timeout = {self.timeout!r}: must be a finite number of seconds >= 0")

    def batch_start_time(self, state: SchedulerState) -> float:
        if len(state.waiting) >= self.num_slots:
            return state.now
        return max(state.now, state.waiting[0].arrival + self.timeout)
