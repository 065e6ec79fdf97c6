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
  uncomputed again, while the outputs generated so far are kept;
- while a request holds slot k, its counters live in row k of the state's
  `SlotCounters` (and `num_blocks_held[k] == len(block_table)`), so policies and back
  ends can look at every running request in one numpy operation; a request that holds
  no slot keeps them itself.

Both back ends apply a policy's `Decision` through `SchedulerState.apply`, so slot
placement (lowest free slot first) and preemption are done in one place.
"""

from __future__ import annotations

from collections import deque
import numpy as np

from labkit.sched.blocks import BlockPool
from labkit.sched.policy import Decision


class Request:
    """One request's progress. `index` is its position in the trace, `id` its request id."""

    __slots__ = (
        "index", "id", "arrival", "prompt_len", "output_len", "num_prompt_tokens", "num_preemptions",
        "admitted_order", "slot", "block_table", "_num_generated", "_num_uncomputed", "_seat",
    )

    def __init__(self, index: int, id: int, arrival: float, prompt_len: int, output_len: int, num_generated: int = 0):
        self.index, self.id, self.arrival = index, id, arrival
        self.prompt_len, self.output_len = prompt_len, output_len
        self.num_prompt_tokens = 1 + prompt_len  # a begin-of-sequence token, then the prompt
        self.num_preemptions = 0
        self.admitted_order = -1
        self.slot = -1
        self.block_table: list[int] = []
        self._num_generated = num_generated
        self._num_uncomputed = self.num_prompt_tokens
        self._seat: SlotCounters | None = None  # the state's counters while this request holds a slot

    def __repr__(self) -> str:
        return (
            f"Request(id={self.id}, prompt_len={self.prompt_len}, output_len={self.output_len}, "
            f"num_generated={self.num_generated}, num_uncomputed={self.num_uncomputed}, slot={self.slot})"
        )

    @property
    def num_generated(self) -> int:
        seat = self._seat
        return self._num_generated if seat is None else int(seat.num_generated[self.slot])

    @num_generated.setter
    def num_generated(self, value: int) -> None:
        if self._seat is None:
            self._num_generated = value
        else:
            self._seat.num_generated[self.slot] = value

    @property
    def num_uncomputed(self) -> int:
        seat = self._seat
        return self._num_uncomputed if seat is None else int(seat.num_uncomputed[self.slot])

    @num_uncomputed.setter
    def num_uncomputed(self, value: int) -> None:
        if self._seat is None:
            self._num_uncomputed = value
        else:
            self._seat.num_uncomputed[self.slot] = value

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


class SlotCounters:
    """The counters of the requests holding slots: `table[field, slot]`, one column per
    slot. A free slot's column is all zeros but its output_len, -1, so that no
    comparison of num_generated with output_len counts it as running or finished."""

    FIELDS = ("index", "id", "num_prompt_tokens", "output_len", "num_generated", "num_uncomputed", "num_blocks_held")
    _FREE = np.array([0, 0, 0, -1, 0, 0, 0], np.int64)

    def __init__(self, num_slots: int):
        self.table = np.repeat(self._FREE[:, None], num_slots, axis=1)  # (fields, slots)
        self.num_generated, self.num_uncomputed, self.num_blocks_held = self.table[4:]  # writable views
        self.id, self.output_len = self.table[1], self.table[3]

    def seat(self, request: Request) -> None:
        """Move `request`'s counters into its slot's column."""
        self.table[:, request.slot] = (
            request.index, request.id, request.num_prompt_tokens, request.output_len,
            request.num_generated, request.num_uncomputed, len(request.block_table),
        )
        request._seat = self

    def unseat(self, request: Request) -> None:
        """Give `request` its counters back and free its slot's column."""
        request._num_generated, request._num_uncomputed = request.num_generated, request.num_uncomputed
        request._seat = None
        self.table[:, request.slot] = self._FREE

    def running(self) -> np.ndarray:
        """Slots whose request still has tokens to emit, in slot order."""
        return np.flatnonzero(self.num_generated < self.output_len)

    def finished(self) -> np.ndarray:
        """Slots still held by a finished request."""
        return np.flatnonzero(self.num_generated == self.output_len)


class Batch:
    """Who works in the next step, in slot order: each request's slot, the tokens it
    processes, and its counters before the step (int arrays, one entry per request)."""

    __slots__ = ("slots", "num_tokens", "index", "id", "num_prompt_tokens", "output_len", "num_generated",
                 "num_uncomputed", "num_blocks_held", "num_cached_after", "is_decoding", "emits")

    def __init__(self, counters: SlotCounters, slots: np.ndarray, num_tokens: np.ndarray):
        self.slots, self.num_tokens = slots, num_tokens
        (self.index, self.id, self.num_prompt_tokens, self.output_len, self.num_generated, self.num_uncomputed,
         self.num_blocks_held) = counters.table[:, slots]
        self.num_cached_after = self.num_prompt_tokens + self.num_generated - self.num_uncomputed + num_tokens
        self.is_decoding = (self.num_generated > 0) & (self.num_uncomputed == 1)  # one token, the previous output
        self.emits = num_tokens == self.num_uncomputed  # all but unfinished prefill chunks emit a token

    @property
    def size(self) -> int:
        return len(self.slots)

    def rows(self, state: SchedulerState) -> list[tuple[Request, int]]:
        """(request, tokens) pairs, for a back end that works request by request."""
        return [(state.slots[slot], n) for slot, n in zip(self.slots.tolist(), self.num_tokens.tolist())]


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
        self.counters = SlotCounters(num_slots)
        self.by_id = {request.id: request for request in requests}

    # Views for policies

    def running(self) -> list[Request]:
        """Requests in slots that still have tokens to emit, in slot order."""
        return [self.slots[slot] for slot in self.counters.running().tolist()]

    def finished_in_slots(self) -> list[Request]:
        """Finished requests that still hold their slot."""
        return [self.slots[slot] for slot in self.counters.finished().tolist()]

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

    def num_new_blocks_of(self, batch: Batch) -> int:
        """Blocks the requests of `batch` must take, together, to process their tokens."""
        if self.blocks is None:
            return 0
        num_new_blocks = -(-batch.num_cached_after // self.blocks.block_size) - batch.num_blocks_held
        return int(num_new_blocks[num_new_blocks > 0].sum())

    def waiting_head(self, count: int) -> list[Request]:
        """The first `count` waiting requests, FCFS."""
        return [self.waiting[i] for i in range(min(count, len(self.waiting)))]

    def running_batch(self) -> Batch:
        """Every running request, with all its uncomputed tokens."""
        slots = self.counters.running()
        return Batch(self.counters, slots, self.counters.num_uncomputed[slots])

    def batch(self, decision: Decision) -> Batch:
        """Who works in the step `decision` schedules (applied already), and with how many tokens."""
        if decision.num_tokens is None:
            return self.running_batch()
        slots = self.counters.running()
        given = decision.num_tokens.get
        num_tokens = np.array([given(i, 0) for i in self.counters.id[slots].tolist()], np.int64)
        scheduled = num_tokens > 0
        return Batch(self.counters, slots[scheduled], num_tokens[scheduled])

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

    def place(self, request: Request, slot: int) -> None:
        """Seat `request` in free `slot` (admission does this with the lowest free slot)."""
        request.slot = slot
        self.slots[slot] = request
        self.counters.seat(request)

    def grow(self, batch: Batch, num_steps: int) -> None:
        """Give each request of `batch` the KV blocks its next `num_steps` steps write to: its
        tokens in the first step, then one token per step."""
        if self.blocks is None:
            return
        num_tokens_held = batch.num_cached_after + (num_steps - 1)
        short = num_tokens_held > batch.num_blocks_held * self.blocks.block_size
        for slot, num_tokens in zip(batch.slots[short].tolist(), num_tokens_held[short].tolist()):
            self._allocate(self.slots[slot], num_tokens)

    def advance(self, batch: Batch, num_steps: int) -> None:
        """Count `num_steps` steps of `batch` done: each request processed its tokens in the
        first, and if that left nothing uncomputed it emitted a token in every one of them."""
        emits = batch.emits
        self.counters.num_uncomputed[batch.slots] = np.where(emits, 1, batch.num_uncomputed - batch.num_tokens)
        self.counters.num_generated[batch.slots] = batch.num_generated + num_steps * emits

    def reserve(self, request: Request) -> None:
        """Take every block `request` will ever need, now (static batching's reservation)."""
        if self.blocks is not None:
            self._allocate(request, request.max_context_len)

    def _allocate(self, request: Request, num_tokens: int) -> None:
        self.blocks.allocate(request, num_tokens)
        self.counters.num_blocks_held[request.slot] = len(request.block_table)

    def _lookup(self, request_id: int, verb: str) -> Request:
        if request_id not in self.by_id:
            raise ValueError(f"decision tries to {verb} request {request_id!r}, which is not in the trace")
        return self.by_id[request_id]

    def _free_slot(self, request: Request, verb: str) -> None:
        if request.slot < 0:
            raise ValueError(f"decision {verb} request {request.id}, which holds no slot")
        self.counters.unseat(request)
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
        request.admitted_order = self.num_admitted
        self.num_admitted += 1
        self.place(request, self.slots.index(None))
