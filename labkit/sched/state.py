"""Scheduler state: the requests, who holds which slot, and their KV blocks.

A request's sequence is a begin-of-sequence token, its prompt, then its outputs.
`num_uncomputed` counts the known tokens whose keys and values are not in the cache
yet (the rest, `num_computed`, are). A step processes some of them; when it has
processed all, the model emits the next output token, which is then the one token
left uncomputed. So a prefill (or a recompute
after preemption) may take several chunks, and a decode step processes one token.

Invariants:

- a request is in exactly one place: pending (not yet arrived), waiting (FCFS queue),
  or a slot; a finished request stays in its slot until a decision releases it;
- a slot holds at most one request, and at most `num_slots` requests hold slots;
- `1 <= num_uncomputed <= num_prompt_tokens + num_generated` and `num_generated <= output_len`;
- with a block pool, a request holds KV blocks only while it holds a slot, enough for
  its `num_computed` tokens; preemption returns them and makes every known token
  uncomputed again, while the outputs generated so far are kept.

Both back ends apply a policy's `Decision` through `SchedulerState.apply`, so slot
placement (lowest free slot first) and preemption are done in one place.
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
    num_preemptions: int = 0
    admitted_order: int = -1
    slot: int = -1
    block_table: list[int] = field(default_factory=list)
    num_prompt_tokens: int = field(init=False)  # a begin-of-sequence token, then the prompt
    num_uncomputed: int = field(init=False)

    def __post_init__(self):
        self.num_prompt_tokens = 1 + self.prompt_len
        self.num_uncomputed = self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.num_generated == self.output_len

    @property
    def num_computed(self) -> int:
        """Known tokens whose keys and values are in the cache."""
        return self.num_prompt_tokens + self.num_generated - self.num_uncomputed

    @property
    def is_decoding(self) -> bool:
        """Whether the next step is a plain decode step (one token, the previous output)."""
        return self.num_generated > 0 and self.num_uncomputed == 1

    @property
    def max_context_len(self) -> int:
        """The most tokens this request ever holds in the cache: its last output is never fed back."""
        return self.num_prompt_tokens + self.output_len - 1


class SchedulerState:
    """What a policy sees: the clock, the waiting queue, the slots and the block pool."""

    def __init__(self, num_slots: int, requests: list[Request], blocks: BlockPool | None = None):
        self.num_slots = num_slots
        self.blocks = blocks
        self.now = 0.0
        self.num_steps = 0
        self.num_admitted = 0
        self.waiting: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * num_slots
        self.by_id = {request.id: request for request in requests}

    # Views for policies

    def running(self) -> list[Request]:
        """Requests in slots that still have tokens to emit, in slot order."""
        return [r for r in self.slots if r is not None and r.num_generated < r.output_len]

    def finished_in_slots(self) -> list[Request]:
        """Finished requests that still hold their slot."""
        return [r for r in self.slots if r is not None and r.num_generated == r.output_len]

    def num_free_slots(self) -> int:
        return self.slots.count(None)

    def num_free_blocks(self) -> float:
        """Free KV blocks; infinite without a pool."""
        return self.blocks.num_free_blocks if self.blocks is not None else float("inf")

    def num_new_blocks(self, request: Request, num_tokens: int) -> int:
        """Blocks `request` must take to process `num_tokens` more tokens (0 without a pool)."""
        if self.blocks is None:
            return 0
        return self.blocks.num_blocks_for(request.num_computed + num_tokens) - len(request.block_table)

    def waiting_head(self, count: int) -> list[Request]:
        """The first `count` waiting requests, FCFS."""
        return [self.waiting[i] for i in range(min(count, len(self.waiting)))]

    # Applying a decision

    def apply(self, decision: Decision) -> list[Request]:
        """Release, preempt, then admit, as decided; returns the admitted requests."""
        for request_id in decision.release:
            self._free_slot(self._lookup(request_id, "release"), "releases")
        for request_id in reversed(decision.preempt):
            self._preempt(self._lookup(request_id, "preempt"))
        admitted = [self._lookup(request_id, "admit") for request_id in decision.admit]
        if len(admitted) > self.num_free_slots():
            raise ValueError(f"decision admits {len(admitted)} requests but only {self.num_free_slots()} slots are free")
        for request in admitted:
            self._admit(request)
        return admitted

    def grow(self, scheduled: dict[Request, int], num_steps: int) -> None:
        """Give each scheduled request the KV blocks its next `num_steps` steps write to: its
        tokens in the first step, then one token per step."""
        if self.blocks is not None:
            block_size = self.blocks.block_size
            for request, num_tokens in scheduled.items():
                num_cached = request.num_prompt_tokens + request.num_generated - request.num_uncomputed
                num_tokens_held = num_cached + num_tokens + num_steps - 1
                if num_tokens_held > len(request.block_table) * block_size:
                    self.blocks.allocate(request, num_tokens_held)

    def reserve(self, request: Request) -> None:
        """Take every block `request` will ever need, now (static batching's reservation)."""
        if self.blocks is not None:
            self.blocks.allocate(request, request.max_context_len)

    def _lookup(self, request_id: int, verb: str) -> Request:
        if request_id not in self.by_id:
            raise ValueError(f"decision tries to {verb} request {request_id!r}, which is not in the trace")
        return self.by_id[request_id]

    def _free_slot(self, request: Request, verb: str) -> None:
        if request.slot < 0:
            raise ValueError(f"decision {verb} request {request.id}, which holds no slot")
        self.slots[request.slot] = None
        request.slot = -1
        if self.blocks is not None:
            self.blocks.deallocate(request)

    def _preempt(self, request: Request) -> None:
        """Back to the head of the queue, its cache dropped; its outputs so far are kept."""
        self._free_slot(request, "preempts")
        request.num_uncomputed = request.num_prompt_tokens + request.num_generated
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit(self, request: Request) -> None:
        if request not in self.waiting:
            raise ValueError(f"decision admits request {request.id}, which is not waiting")
        self.waiting.remove(request)
        request.slot = self.slots.index(None)
        request.admitted_order = self.num_admitted
        self.num_admitted += 1
        self.slots[request.slot] = request
