"""Scheduler state: the requests and who holds which slot.

Invariants:

- a request is in exactly one place: pending (not yet arrived), waiting (FCFS queue),
  or a slot; a finished request stays in its slot until a decision releases it;
- a slot holds at most one request, and at most `num_slots` requests hold slots;
- `num_generated` never exceeds `output_len`;
- with a block pool, a request holds KV blocks only while it holds a slot, and a
  running request's blocks cover every token it has written (see `context_len`).

Both back ends apply a policy's `Decision` through `SchedulerState.apply`, so slot
placement (lowest free slot first) is decided in one place.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from labkit.sched.blocks import BlockPool
from labkit.sched.policy import Decision


@dataclass(slots=True, eq=False)
class Request:
    """One request's progress. `index` is its position in the trace, `id` its request id."""

    index: int
    id: int
    arrival: float
    prompt_len: int
    output_len: int
    num_generated: int = 0
    slot: int = -1
    block_table: list[int] = field(default_factory=list)

    @property
    def is_finished(self) -> bool:
        return self.num_generated == self.output_len

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens a prefill processes: a begin-of-sequence token, then the prompt."""
        return 1 + self.prompt_len

    def context_len(self, num_steps: int = 1) -> int:
        """Tokens in this request's KV cache after `num_steps` more steps: a prefill writes
        the prompt tokens, and each decode step writes the previous output token."""
        return self.num_prompt_tokens + self.num_generated + num_steps - 1


class SchedulerState:
    """What a policy sees: the clock, the waiting queue and the slots."""

    def __init__(self, num_slots: int, requests: list[Request], blocks: BlockPool | None = None):
        self.num_slots = num_slots
        self.blocks = blocks
        self.now = 0.0
        self.num_steps = 0
        self.waiting: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * num_slots
        self.by_id = {request.id: request for request in requests}

    # Views for policies

    def running(self) -> list[Request]:
        """Requests in slots that still have tokens to emit."""
        return [r for r in self.slots if r is not None and r.num_generated < r.output_len]

    def finished_in_slots(self) -> list[Request]:
        """Finished requests that still hold their slot."""
        return [r for r in self.slots if r is not None and r.num_generated == r.output_len]

    def num_free_slots(self) -> int:
        return self.slots.count(None)

    def waiting_head(self, count: int) -> list[Request]:
        """The first `count` waiting requests, FCFS."""
        return [self.waiting[i] for i in range(min(count, len(self.waiting)))]

    # Applying a decision

    def apply(self, decision: Decision) -> list[Request]:
        """Release then admit, as decided; returns the admitted requests."""
        for request_id in decision.release:
            self._release(self._lookup(request_id, "release"))
        admitted = [self._lookup(request_id, "admit") for request_id in decision.admit]
        if len(admitted) > self.num_free_slots():
            raise ValueError(f"decision admits {len(admitted)} requests but only {self.num_free_slots()} slots are free")
        for request in admitted:
            self._admit(request)
        return admitted

    def grow(self, running: list[Request], num_steps: int) -> None:
        """Give each running request the KV blocks its next `num_steps` steps write to."""
        if self.blocks is not None:
            for request in running:
                self.blocks.allocate(request, request.context_len(num_steps))

    def _lookup(self, request_id: int, verb: str) -> Request:
        if request_id not in self.by_id:
            raise ValueError(f"decision tries to {verb} request {request_id!r}, which is not in the trace")
        return self.by_id[request_id]

    def _release(self, request: Request) -> None:
        if request.slot < 0:
            raise ValueError(f"decision releases request {request.id}, which holds no slot")
        self.slots[request.slot] = None
        request.slot = -1
        if self.blocks is not None:
            self.blocks.deallocate(request)

    def _admit(self, request: Request) -> None:
        if request not in self.waiting:
            raise ValueError(f"decision admits request {request.id}, which is not waiting")
        self.waiting.remove(request)
        request.slot = self.slots.index(None)
        self.slots[request.slot] = request
