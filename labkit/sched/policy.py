"""Scheduling policies: they decide, they never act.

`policy.schedule(state) -> Decision` looks at a `SchedulerState` and says which
finished requests leave their slots, which running requests are preempted, which
waiting requests join, and how many tokens each scheduled request processes. The
`Scheduler` (`labkit.sched.scheduler`) applies the decision; a back end (simulator or
engine) runs the step.

Knobs, and the vLLM setting each one plays:

- `num_slots`: requests that may run at once (`max_num_seqs`);
- `num_blocks`: the KV pool in blocks (the number of GPU blocks); None is unlimited;
- `block_size`: tokens per KV block (`block_size`);
- `max_tokens_per_step` (Continuous): tokens one step may process (`max_num_batched_tokens`);
- `chunked_prefill` (Continuous): whether a prompt may be split over steps
  (`enable_chunked_prefill`);
- `victim` (Continuous): which running request is preempted when blocks run out:
  "newest" (as vLLM does) or "longest" (the one holding the most cache);
- `reserve` (Continuous): "on_demand" takes a block when a request's tokens fill the last
  one (vLLM's paging); "whole" takes every block of its whole length at admission, as
  Orca's continuous batching did (and as static batching always does);
- `drop_finished` (Static): whether a finished request that keeps its slot stops computing
  its row (by default it computes one padded token a step, as Hugging Face's `generate` does);
- `shape`: the batches the engine runs (`labkit.sched.shape.ExecutionShape`): decode batch
  sizes (`cudagraph_capture_sizes`), the most tokens a step may process
  (`max_num_batched_tokens`) and the longest sequence (`max_model_len`);
- `min_shape_fill` (Continuous): admission grows the decode batch into a larger supported
  size only if it fills at least this share of it (0, the default, always grows, as vLLM does).

Invariant every policy keeps: its decision depends only on who waits, who holds which
slot, how far each request has got, the free blocks, the clock compared with the
`wake_at` time it asked for, and, for a policy that `counts_service` (`labkit.Fair`), the
clients' counters. So a decision made before a run of plain decode steps, in which nobody
finishes, arrives or runs out of blocks, holds for all of them (the counters move at every
step, so while anyone waits under such a policy a run is one step), and a back end may run
it for many steps at once (`labkit.sched.fastforward`).

The waiting queue is first come, first served; a policy with a `queue_order` has the
state keep it sorted by that instead (`labkit.sched.ordered`). A policy that
`admits_in_order` (Static, Dynamic, Continuous) admits from the head of that queue and
stops at the first request it cannot admit, and its queue is first come, first served:
so while the head waits for a slot, blocks or budget, an arrival changes no decision.
"""

from __future__ import annotations

import math
from operator import attrgetter
from dataclasses import dataclass, field, fields

from labkit.checks import flag, number, whole_number
from labkit.sched.blocks import num_blocks_for
from labkit.sched.shape import ExecutionShape
from labkit.sched.state import Decision, Request, SchedulerState

NO_SLOT = "no_slot"
NO_BLOCKS = "no_blocks"
NO_BUDGET = "no_budget"
ANY_SHAPE = ExecutionShape()  # the shape of a policy that names none: any batch
NO_SHAPE = "no_shape"  # admitting the head would run the decode batch at a size mostly padded
BATCH_FORMING = "batch_forming"
VICTIMS = ("newest", "longest")
RESERVES = ("on_demand", "whole")
HEAD_BLOCKED = (NO_SLOT, NO_BLOCKS, NO_BUDGET)  # reasons the head of the queue waits that no arrival lifts
_ADMITTED_ORDER = attrgetter("admitted_order")


POLICY_ATTRIBUTES = (
    "num_slots", "num_blocks", "block_size", "reserves_whole_length", "pads_finished", "check_fits", "schedule",
)


def check_policy(policy) -> None:
    """A TypeError, before any work, if `policy` is not a scheduling policy."""
    missing = [name for name in POLICY_ATTRIBUTES if not hasattr(policy, name)]
    if missing:
        raise TypeError(
            f"policy = {policy!r} is not a scheduling policy (it has no {', '.join(missing)}). Pass one such as "
            "labkit.Continuous(num_slots=8), labkit.Static(num_slots=8) or labkit.Dynamic(num_slots=8, timeout=0.5): "
            f"an object with {', '.join(POLICY_ATTRIBUTES[:-2])}, check_fits(request) and schedule(state) -> Decision"
        )


def shape_of(policy) -> ExecutionShape:
    """The batches `policy` says the engine runs: its `shape`, or any batch for a policy that
    names none (one written by hand, such as lesson 07's refill step)."""
    return getattr(policy, "shape", ANY_SHAPE)


def _ids(requests) -> tuple[int, ...]:
    return tuple([r.id for r in requests])


def _short_repr(policy) -> str:
    """Policy(num_slots=2, timeout=0.5): the fields that differ from their defaults."""
    shown = [f"{f.name}={getattr(policy, f.name)!r}" for f in fields(policy) if getattr(policy, f.name) != f.default]
    return f"{type(policy).__name__}({', '.join(shown)})"


@dataclass(frozen=True, repr=False)
class _Policy:
    """Knobs every policy has: slots and the KV pool."""

    num_slots: int
    num_blocks: int | None = field(default=None, kw_only=True)
    block_size: int = field(default=16, kw_only=True)
    shape: ExecutionShape = field(default=ExecutionShape(), kw_only=True)
    reserves_whole_length = False  # whether admission takes every block a request will need
    pads_finished = False  # whether a finished request that holds its slot still computes a row each step
    admits_in_order = True  # FCFS: while the head of the queue is blocked, arrivals change nothing
    queue_order = None  # the waiting queue's sort key, a function of a request; None: first come, first served

    def __post_init__(self):
        whole_number("num_slots", self.num_slots)
        whole_number("num_blocks", self.num_blocks, or_none=True)
        whole_number("block_size", self.block_size)
        if not isinstance(self.shape, ExecutionShape):
            raise ValueError(f"shape = {self.shape!r}: must be a labkit.ExecutionShape, such as "
                             "ExecutionShape(decode_sizes=[8, 16])")
        self.shape.check_slots(self.num_slots)

    __repr__ = _short_repr

    def check_fits(self, request: Request) -> None:
        """A ValueError, before any work, if `request` can never be served."""
        self.shape.check_fits(request)
        need = num_blocks_for(request.max_context_len, self.block_size)
        if self.num_blocks is not None and need > self.num_blocks:
            raise ValueError(
                f"request {request.id}: prompt {request.prompt_len} + output {request.output_len} tokens need "
                f"{need} blocks of {self.block_size}, more than the whole pool of num_blocks = {self.num_blocks}"
            )


@dataclass(frozen=True, repr=False)
class Continuous(_Policy):
    """Iteration-level scheduling: before every step, finished requests leave, running
    requests are scheduled first (one token per decode), oldest first, and waiting
    requests join the free slots, in queue order, while slots, blocks and token budget
    last. When a running request cannot get a block, the `victim` is preempted.
    With `reserve="whole"` a request takes the blocks of its whole length when admitted,
    so none ever runs out of blocks and nobody is preempted."""

    max_tokens_per_step: int | None = field(default=None, kw_only=True)
    chunked_prefill: bool = field(default=False, kw_only=True)
    victim: str = field(default="newest", kw_only=True)
    reserve: str = field(default="on_demand", kw_only=True)
    min_shape_fill: float = field(default=0.0, kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        whole_number("max_tokens_per_step", self.max_tokens_per_step, or_none=True)
        flag("chunked_prefill", self.chunked_prefill)
        number("min_shape_fill", self.min_shape_fill, or_equal=True)
        if self.min_shape_fill > 1:
            raise ValueError(f"min_shape_fill = {self.min_shape_fill!r}: must be a share of a batch, in [0, 1]")
        if self.victim not in VICTIMS:
            raise ValueError(f"victim = {self.victim!r}: choose one of {VICTIMS}")
        if self.reserve not in RESERVES:
            raise ValueError(f"reserve = {self.reserve!r}: choose one of {RESERVES}")

    @property
    def reserves_whole_length(self) -> bool:
        return self.reserve == "whole"

    @property
    def token_budget(self) -> int | None:
        """Tokens a step may process: the policy's budget or the engine's shape, the smaller."""
        limits = [n for n in (self.max_tokens_per_step, self.shape.max_num_tokens) if n is not None]
        return min(limits) if limits else None

    @property
    def may_preempt(self) -> bool:
        """Whether a running request can be pushed out and later recompute its whole context."""
        return self.num_blocks is not None

    def check_fits(self, request: Request) -> None:
        super().check_fits(request)
        longest_prefill = request.max_context_len if self.may_preempt else request.num_prompt_tokens
        budget = self.token_budget
        if not self.chunked_prefill and budget is not None and longest_prefill > budget:
            what = "prompt plus outputs to recompute after a preemption" if self.may_preempt else "prompt"
            limit = ("max_tokens_per_step" if budget == self.max_tokens_per_step else "shape.max_num_tokens")
            raise ValueError(
                f"request {request.id}: its {what} can take {longest_prefill} tokens in one step, more than "
                f"{limit} = {budget}; allow chunked_prefill=True or raise the budget"
            )

    def schedule(self, state: SchedulerState) -> Decision:
        return self.fill(StepPlan(state, self.token_budget))

    def fill(self, plan: StepPlan) -> Decision:
        """Schedule the running requests, oldest first, then admit waiting ones if nobody was preempted."""
        for request in plan.state.running():
            if request.id not in plan.preempted:
                self.schedule_running(plan, request)
        blocked = NO_BLOCKS if plan.preempted else self.admit_waiting(plan)
        return plan.decision(blocked)

    def schedule_running(self, plan: StepPlan, request: Request) -> None:
        """Give a running request its tokens and blocks, preempting victims while blocks run out."""
        num_tokens = plan.tokens_for(request, self.chunked_prefill)
        if not num_tokens:
            return
        num_new_blocks = plan.state.num_new_blocks(request, num_tokens)
        while num_new_blocks > plan.free_blocks:
            victim = self.choose_victim(plan.unscheduled())
            plan.preempt(victim)
            if victim is request:
                return
        plan.schedule(request, num_tokens, num_new_blocks)

    def choose_victim(self, candidates: list[Request]) -> Request:
        """The running request to preempt, among those not scheduled yet: the newest, or the
        one holding the most cache."""
        if self.victim == "longest":
            return max(candidates, key=lambda r: (r.num_computed, r.admitted_order))
        return max(candidates, key=_ADMITTED_ORDER)

    def admit_waiting(self, plan: StepPlan) -> str:
        """Admit waiting requests in queue order while slots, blocks and budget last; returns
        why the head waits ("" if nobody does)."""
        most = self.admissions_the_shape_allows(plan)
        for request in self.candidates(plan):
            if not plan.free_slots:
                return NO_SLOT
            if len(plan.admitted) == most:
                return NO_SHAPE
            num_tokens = plan.tokens_for(request, self.chunked_prefill)
            if not num_tokens:
                return NO_BUDGET
            num_new_blocks = self.blocks_to_admit(plan.state, request, num_tokens)
            if num_new_blocks > plan.free_blocks:
                return NO_BLOCKS
            plan.admit(request, num_tokens, num_new_blocks)
        return ""

    def candidates(self, plan: StepPlan):
        """The waiting requests in the order admission tries them: the queue's."""
        return plan.state.waiting

    def admissions_the_shape_allows(self, plan: StepPlan) -> float:
        """How many waiting requests may join before the decode batch would grow into a
        supported size it fills less than `min_shape_fill` of: then only up to the largest
        size it fills (`ExecutionShape.rows_to_run`). Unlimited when `min_shape_fill` is 0."""
        if not self.min_shape_fill:
            return math.inf
        num_running = plan.state.num_slots - plan.free_slots
        num_wanted = num_running + min(plan.free_slots, len(plan.state.waiting))
        return self.shape.rows_to_run(num_running, num_wanted, self.min_shape_fill) - num_running

    def blocks_to_admit(self, state: SchedulerState, request: Request, num_tokens: int) -> int:
        """Blocks a waiting request takes when admitted: those its first `num_tokens` fill, or,
        reserving its whole length, every block it will ever need."""
        if self.reserves_whole_length and state.blocks is not None:
            return state.blocks.num_blocks_for(request.max_context_len)
        return state.num_new_blocks(request, num_tokens)


class StepPlan:
    """One step's schedule in the making: the slots, blocks and token budget left, and who gets
    tokens, is preempted or admitted. Nothing is applied until the decision is."""

    __slots__ = ("state", "release", "budget", "free_slots", "free_blocks", "num_tokens", "preempted", "admitted")

    def __init__(self, state: SchedulerState, max_tokens_per_step: int | None):
        self.state = state
        self.release = state.finished_in_slots()
        self.budget = math.inf if max_tokens_per_step is None else max_tokens_per_step
        self.free_slots = state.num_free_slots() + len(self.release)
        self.free_blocks = state.num_free_blocks() + sum(r.num_blocks_held for r in self.release)
        self.num_tokens: dict[int, int] = {}  # request id -> tokens this step
        self.preempted: dict[int, Request] = {}
        self.admitted: list[Request] = []

    def tokens_for(self, request: Request, may_split: bool) -> int:
        """Tokens `request` can process within the budget left: all it has pending, a chunk
        of them if it may split, or none. (A decode is one token: all or none.)"""
        wanted = request.num_uncomputed
        if wanted <= self.budget:
            return wanted
        return int(self.budget) if may_split else 0

    def unscheduled(self) -> list[Request]:
        """Running requests neither scheduled nor preempted yet."""
        return [r for r in self.state.running() if r.id not in self.num_tokens and r.id not in self.preempted]

    def schedule(self, request: Request, num_tokens: int, num_new_blocks: int) -> None:
        self.free_blocks -= num_new_blocks
        self.budget -= num_tokens
        self.num_tokens[request.id] = num_tokens

    def admit(self, request: Request, num_tokens: int, num_new_blocks: int) -> None:
        self.schedule(request, num_tokens, num_new_blocks)
        self.free_slots -= 1
        self.admitted.append(request)

    def preempt(self, request: Request) -> None:
        self.free_blocks += request.num_blocks_held
        self.free_slots += 1
        self.preempted[request.id] = request

    def decision(self, blocked: str) -> Decision:
        """The decision: preempted requests wait oldest first; `blocked` only if someone waits."""
        preempt = sorted(self.preempted.values(), key=_ADMITTED_ORDER)
        return Decision(
            release=_ids(self.release),
            preempt=_ids(preempt),
            admit=_ids(self.admitted),
            num_tokens=self.num_tokens,
            blocked=blocked if self.state.waiting or preempt else "",
        )


@dataclass(frozen=True, repr=False)
class Static(_Policy):
    """Request-level batching: when the engine is idle, take up to `num_slots`
    waiting requests as one batch and run it until its longest request ends.
    A finished request keeps its slot until then. With a finite pool, each admitted
    request reserves the blocks for its whole length up front, as systems did before
    paging, so a batch never runs out of memory mid-way.

    drop_finished: whether a finished request's row is skipped. By default it still
    computes one token a step at its last position, thrown away, as Hugging Face's
    `generate` does: the engine runs that row and the simulator prices it. Slot occupancy
    and utilization are the same either way (a padded row is no useful slot-step); only
    the work in a step, and so its time, differs.
    """

    drop_finished: bool = field(default=False, kw_only=True)
    reserves_whole_length = True

    def __post_init__(self):
        super().__post_init__()
        flag("drop_finished", self.drop_finished)

    @property
    def pads_finished(self) -> bool:
        return not self.drop_finished

    def check_fits(self, request: Request) -> None:
        super().check_fits(request)
        budget = self.shape.max_num_tokens
        if budget is not None and request.num_prompt_tokens > budget:
            raise ValueError(
                f"request {request.id}: its prompt takes {request.num_prompt_tokens} tokens in one step, more than "
                f"shape.max_num_tokens = {budget}, and static batching never splits a prompt"
            )

    def schedule(self, state: SchedulerState) -> Decision:
        if state.running():
            return Decision(blocked=self._reason_while_running(state))
        held = state.finished_in_slots()
        if not state.waiting:
            return Decision(release=_ids(held))
        wake_at = self.batch_start_time(state)
        if wake_at > state.now:
            return Decision(release=_ids(held), blocked=BATCH_FORMING, wake_at=wake_at)
        admit, blocked = self._batch(state, state.num_free_blocks() + sum(r.num_blocks_held for r in held))
        return Decision(release=_ids(held), admit=_ids(admit), blocked=blocked)

    def _reason_while_running(self, state: SchedulerState) -> str:
        """Why the head of the queue waits while a batch runs, the same in every step of it:
        for blocks, if the batch left slots free but the head's whole length does not fit the
        blocks its reservations left (they hold until the batch ends); else for a slot, since a
        running batch takes nobody in."""
        if not state.waiting:
            return ""
        free_slot_but_no_blocks = state.num_free_slots() and state.blocks is not None and (
            state.blocks.num_blocks_for(state.waiting[0].max_context_len) > state.num_free_blocks())
        return NO_BLOCKS if free_slot_but_no_blocks else NO_SLOT

    def _batch(self, state: SchedulerState, free_blocks: float) -> tuple[list[Request], str]:
        """Up to `num_slots` waiting requests, FCFS, while their whole-length reservations fit,
        and their prompts fit the shape's `max_num_tokens` (the batch's first step runs them all)."""
        batch = []
        budget = self.shape.max_num_tokens or math.inf
        for request in state.waiting_head(self.num_slots):
            need = state.blocks.num_blocks_for(request.max_context_len) if state.blocks is not None else 0
            if need > free_blocks:
                return batch, NO_BLOCKS
            if request.num_prompt_tokens > budget:
                return batch, NO_BUDGET
            free_blocks -= need
            budget -= request.num_prompt_tokens
            batch.append(request)
        return batch, NO_SLOT if len(state.waiting) > len(batch) else ""

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
        number("timeout", self.timeout, or_equal=True, unit="seconds")

    def batch_start_time(self, state: SchedulerState) -> float:
        if len(state.waiting) >= self.num_slots:
            return state.now
        return max(state.now, state.waiting[0].arrival + self.timeout)
