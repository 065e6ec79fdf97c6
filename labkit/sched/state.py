"""Scheduler state: the requests, who holds which slot, and their KV blocks.

A request's sequence is a begin-of-sequence token, its prompt, then its outputs.
`num_uncomputed` counts the known tokens whose keys and values are not in the cache
yet (the rest, `num_computed`, are). A step processes some of them; when it has
processed all, the model emits the next output token, which is then the one token
left uncomputed. So a prefill (or a recompute after preemption) may take several
chunks, and a decode step processes one token.

Invariants:

- a request is in exactly one place: pending (not yet arrived), waiting (FCFS queue),
  or a slot; a finished request stays in its slot until a decision releases it;
- a slot holds at most one request, and at most `num_slots` requests hold slots;
- `1 <= num_uncomputed <= num_prompt_tokens + num_generated` and `num_generated <= output_len`;
- with a block pool, a request holds KV blocks only while it holds a slot, enough for
  its `num_computed` tokens; preemption returns them and makes every known token
  uncomputed again, while the outputs generated so far are kept;
- a request in a slot is of one kind (`Seats`): steady (it decoded in every step since
  it became steady, so its counts, tokens and blocks, follow from the step clock),
  irregular (unfinished, anything else), or finished. So a run of decode steps changes
  no per-request number: it moves the clock, and the pool lends the steady requests'
  new blocks in one subtraction (`ClockBlocks`).

Both back ends apply a policy's `Decision` through `SchedulerState.apply`, so slot
placement (lowest free slot first) and preemption are done in one place.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque

import numpy as np

from labkit.sched.blocks import BlockPool
from labkit.sched.policy import Decision

NEVER = np.iinfo(np.int64).max // 4  # a step no run reaches: "not steady" in Seats' step columns


class Request:
    """One request's progress. `index` is its position in the trace, `id` its request id."""

    __slots__ = (
        "index", "id", "arrival", "prompt_len", "output_len", "num_prompt_tokens", "num_preemptions",
        "admitted_order", "slot", "_block_ids", "_num_generated", "_num_uncomputed", "_seats", "_is_steady",
    )

    def __init__(self, index: int, id: int, arrival: float, prompt_len: int, output_len: int, num_generated: int = 0):
        self.index, self.id, self.arrival = index, id, arrival
        self.prompt_len, self.output_len = prompt_len, output_len
        self.num_prompt_tokens = 1 + prompt_len  # a begin-of-sequence token, then the prompt
        self.num_preemptions = 0
        self.admitted_order = -1
        self.slot = -1
        self._block_ids: list[int] = []
        self._num_generated = num_generated
        self._num_uncomputed = self.num_prompt_tokens
        self._seats: Seats | None = None  # while it holds a slot
        self._is_steady = False

    def __repr__(self) -> str:
        return (
            f"Request(id={self.id}, prompt_len={self.prompt_len}, output_len={self.output_len}, "
            f"num_generated={self.num_generated}, num_uncomputed={self.num_uncomputed}, slot={self.slot})"
        )

    @property
    def num_generated(self) -> int:
        if self._is_steady:
            return self._seats.now + self._seats.cached_base[self.slot] - self.num_prompt_tokens
        return self._num_generated

    @property
    def num_uncomputed(self) -> int:
        return 1 if self._is_steady else self._num_uncomputed

    @num_uncomputed.setter
    def num_uncomputed(self, value: int) -> None:
        assert not self._is_steady, "a steady request decodes: one token uncomputed"
        self._num_uncomputed = value

    @property
    def num_blocks_held(self) -> int:
        return 0 if self._seats is None else self._seats.blocks_held(self.slot)

    @property
    def block_table(self) -> list[int]:
        """The ids of the KV blocks this request holds, in the order of its tokens."""
        if self._seats is not None and self._seats.pool is not None:
            self._seats.pool.assign(self._block_ids, self.num_blocks_held)
        return self._block_ids

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


class ClockBlocks:
    """The KV blocks held, by the step clock alone, by requests that decode a token every step
    and hold just the blocks their tokens fill: the growing steady ones (`Seats`), and, for
    the bound on a run, the irregular ones of its batch too.

    A request whose cache holds `base + t - 1` tokens at the decision before step t holds
    ceil((base + t - 1) / b) blocks then, b the block size. Writing base + b - 2 = q b + r
    with 0 <= r < b, that is q + t // b + (1 if r >= b - t % b else 0). So all of them
    together hold sum(q) + n (t // b) + #{r >= b - t % b}, which the sorted residues r
    count by bisection; a run of steps takes the difference at its two ends.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.residues: list[int] = []  # sorted, one per request
        self.sum_quotients = 0

    def held_by(self, base: int, t: int) -> int:
        """Blocks one request with `base` holds at the decision before step t."""
        return -(-(base + t - 1) // self.block_size)

    def add(self, base: int) -> None:
        quotient, residue = divmod(base + self.block_size - 2, self.block_size)
        bisect.insort(self.residues, residue)
        self.sum_quotients += quotient

    def remove(self, base: int) -> None:
        quotient, residue = divmod(base + self.block_size - 2, self.block_size)
        self.residues.remove(residue)
        self.sum_quotients -= quotient

    def held_at(self, t: int) -> int:
        """Blocks they all hold at the decision before step t (once the steps before it ran)."""
        cycles, phase = divmod(t, self.block_size)
        num_past = len(self.residues) - bisect.bisect_left(self.residues, self.block_size - phase)
        return self.sum_quotients + len(self.residues) * cycles + num_past

    def copy(self) -> ClockBlocks:
        twin = ClockBlocks(self.block_size)
        twin.residues, twin.sum_quotients = self.residues.copy(), self.sum_quotients
        return twin

    def last_step_within(self, num_blocks: int) -> int:
        """The last step t before which they hold at most `num_blocks` blocks (held_at is
        nondecreasing in t); NEVER if there are none. At a step t = c b + u they hold
        sum(q) + n c + #{r >= b - u}: the last cycle c within reach, then the last phase u in
        it at which no more than the blocks to spare have a residue that large."""
        residues, block_size = self.residues, self.block_size
        if not residues:
            return NEVER
        cycles, spare = divmod(num_blocks - self.sum_quotients, len(residues))
        return cycles * block_size + block_size - 1 - residues[len(residues) - 1 - spare]


class Seats:
    """The requests holding slots, by kind, and their numbers in columns (one entry per slot).

    A steady request in slot k holds `cached_base[k] + now` tokens in cache after the step
    that starts at `now` (so its `num_generated` is `now + cached_base[k] - num_prompt_tokens`)
    and becomes finished when `now` reaches `finish_at[k]`; `finish_at[k]` is NEVER, and
    `steady_id[k]` is -1, for any other slot. `sum_steady_base` is the sum of `cached_base`
    over steady requests, and `steady_tokens` maps each one's id to 1, its decode token.
    `_finishes` is a heap of (finish_at, slot) holding every steady request's entry, and
    stale ones (whose slot's `finish_at` differs), skipped when they come up.

    With a pool, `num_blocks_held[k]` is how many KV blocks slot k's request holds, except
    for the steady requests in `growing` (those holding just the blocks their tokens fill):
    their counts follow from the clock through `clock_blocks`, read at `blocks_now`, the
    steps whose blocks are taken. `grow` takes a run's blocks before the run, so `blocks_now`
    is ahead of `now` only while the run executes. A steady request not in `growing` holds
    every block it will ever need (static batching's reservation).
    """

    def __init__(self, num_slots: int, pool: BlockPool | None):
        self.pool = pool
        self.now = 0  # steps run so far: the index of the next step
        self.blocks_now = 0  # steps whose KV blocks are taken
        self.steady: set[int] = set()
        self.irregular: dict[int, Request] = {}
        self.finished: dict[int, Request] = {}
        self.growing: set[int] = set()
        self.clock_blocks = ClockBlocks(pool.block_size if pool is not None else 1)
        self.sum_steady_base = 0
        self.steady_id = np.full(num_slots, -1, np.int64)
        self.steady_tokens: dict[int, int] = {}
        self.cached_base = [0] * num_slots
        self.num_blocks_held = [0] * num_slots
        self.finish_at = [NEVER] * num_slots
        self._finishes: list[tuple[int, int]] = []

    def seat(self, request: Request) -> None:
        request._seats = self
        self._file(request)

    def unseat(self, request: Request) -> None:
        if request._is_steady:
            self.freeze(request)
        slot = request.slot
        self.irregular.pop(slot, None)
        self.finished.pop(slot, None)
        self.num_blocks_held[slot] = 0
        request._seats = None

    def blocks_held(self, slot: int) -> int:
        if slot in self.growing:
            return self.clock_blocks.held_by(self.cached_base[slot], self.blocks_now)
        return self.num_blocks_held[slot]

    def decode_blocks(self, slot: int) -> int:
        """Blocks the steady request in `slot` takes in step `now`."""
        if slot not in self.growing:
            return 0
        base = self.cached_base[slot]
        return self.clock_blocks.held_by(base, self.now + 1) - self.clock_blocks.held_by(base, self.now)

    def make_steady(self, request: Request) -> None:
        """From now on `request` decodes in every step, until it finishes."""
        slot = request.slot
        del self.irregular[slot]
        base = request.num_prompt_tokens + request._num_generated - self.now
        self.cached_base[slot] = base
        self.finish_at[slot] = finish_at = request.output_len + request.num_prompt_tokens - base
        heapq.heappush(self._finishes, (finish_at, slot))
        self.steady_id[slot] = request.id
        self.steady_tokens[request.id] = 1
        self.sum_steady_base += base
        self.steady.add(slot)
        request._is_steady = True
        if self.pool is not None and self.num_blocks_held[slot] == self.clock_blocks.held_by(base, self.blocks_now):
            self.growing.add(slot)
            self.clock_blocks.add(base)
        else:
            assert self.pool is None or self.num_blocks_held[slot] * self.pool.block_size >= request.max_context_len

    def freeze(self, request: Request) -> None:
        """`request` stops being steady: its counts are its own again."""
        slot = request.slot
        request._num_generated, request._num_uncomputed = request.num_generated, 1
        request._is_steady = False
        if slot in self.growing:
            self.num_blocks_held[slot] = self.blocks_held(slot)
            self.growing.remove(slot)
            self.clock_blocks.remove(self.cached_base[slot])
        self.steady.remove(slot)
        self.sum_steady_base -= self.cached_base[slot]
        self.finish_at[slot] = NEVER
        self.steady_id[slot] = -1
        del self.steady_tokens[request.id]
        self._file(request)

    def next_finish(self) -> int:
        """The step at whose start the first steady request has finished; NEVER if none is steady."""
        finishes = self._finishes
        while finishes and self.finish_at[finishes[0][1]] != finishes[0][0]:
            heapq.heappop(finishes)  # stale
        return finishes[0][0] if finishes else NEVER

    def take_finished(self) -> list[int]:
        """The slots, in order, of the steady requests that have finished by now; their entries
        leave the heap (the caller freezes them). A stale entry equal to a live one counts once."""
        slots, finishes = set(), self._finishes
        while finishes and finishes[0][0] <= self.now:
            finish_at, slot = heapq.heappop(finishes)
            if self.finish_at[slot] == finish_at:
                slots.add(slot)
        return sorted(slots)

    def _file(self, request: Request) -> None:
        kind = self.finished if request._num_generated == request.output_len else self.irregular
        kind[request.slot] = request


class Batch:
    """Who works in the next run of steps: every steady request (one decode token each)
    and the listed irregular ones, in slot order, with the tokens each processes first.

    The work of the first step: `num_prefill_tokens` (prompts, chunks, recomputes),
    `num_decode_tokens`, and `num_kv_tokens` in cache after it (what attention reads).
    `emits`: whether every request emits a token at the end of the first step.
    """

    __slots__ = ("num_steady", "irregular", "size", "emits", "is_decoding", "num_emitted",
                 "num_prefill_tokens", "num_decode_tokens", "num_kv_tokens")

    def __init__(self, seats: Seats, irregular: list[tuple[Request, int]]):
        self.num_steady = num_steady = len(seats.steady)
        self.irregular = irregular
        self.size = num_steady + len(irregular)
        num_emitting = num_decoding = num_prefill_tokens = num_kv_tokens = 0
        for request, num_tokens in irregular:
            num_emitting += num_tokens == request.num_uncomputed
            if request.is_decoding:
                num_decoding += 1
            else:
                num_prefill_tokens += num_tokens
            num_kv_tokens += request.num_computed + num_tokens
        self.emits, self.is_decoding = num_emitting == len(irregular), num_decoding == len(irregular)
        self.num_emitted = num_steady + num_emitting
        self.num_decode_tokens = num_steady + num_decoding
        self.num_prefill_tokens = num_prefill_tokens
        self.num_kv_tokens = num_steady * seats.now + seats.sum_steady_base + num_kv_tokens

    def rows(self, state: SchedulerState) -> list[tuple[Request, int]]:
        """(request, tokens) pairs in slot order, for a back end that works request by request."""
        rows = [(state.slots[slot], 1) for slot in state.seats.steady] + self.irregular
        return sorted(rows, key=lambda row: row[0].slot)


class SchedulerState:
    """What a policy sees: the clock, the waiting queue, the slots and the block pool."""

    def __init__(self, num_slots: int, requests: list[Request], blocks: BlockPool | None = None):
        self.num_slots = num_slots
        self.blocks = blocks
        self.now = 0.0
        self.num_admitted = 0
        self.waiting: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * num_slots
        self.seats = Seats(num_slots, blocks)
        self.by_id = {request.id: request for request in requests}

    @property
    def num_steps(self) -> int:
        return self.seats.now

    # Views for policies

    def running(self) -> list[Request]:
        """Requests in slots that still have tokens to emit, in slot order."""
        return [self.slots[slot] for slot in sorted([*self.seats.steady, *self.seats.irregular])]

    def finished_in_slots(self) -> list[Request]:
        """Finished requests that still hold their slot."""
        return [self.seats.finished[slot] for slot in sorted(self.seats.finished)]

    def num_free_slots(self) -> int:
        seats = self.seats
        return self.num_slots - len(seats.steady) - len(seats.irregular) - len(seats.finished)

    def num_free_blocks(self) -> float:
        """Free KV blocks; infinite without a pool."""
        return self.blocks.num_free_blocks if self.blocks is not None else float("inf")

    def num_new_blocks(self, request: Request, num_tokens: int) -> int:
        """Blocks `request` must take to process `num_tokens` more tokens (0 without a pool)."""
        if self.blocks is None:
            return 0
        return max(0, self.blocks.num_blocks_for(request.num_computed + num_tokens) - request.num_blocks_held)

    def decode_blocks(self, request: Request) -> int | None:
        """Blocks a running `request` must take to decode its next token; None if its next step is
        not a plain decode. From the clock for a steady request."""
        if request.slot in self.seats.steady:
            return self.seats.decode_blocks(request.slot)
        return self.num_new_blocks(request, 1) if request.is_decoding else None

    def waiting_head(self, count: int) -> list[Request]:
        """The first `count` waiting requests, FCFS."""
        return [self.waiting[i] for i in range(min(count, len(self.waiting)))]

    # Batches: who runs next

    def running_batch(self) -> Batch:
        """Every running request, with all its uncomputed tokens."""
        irregular = self.seats.irregular
        return Batch(self.seats, [(irregular[slot], irregular[slot].num_uncomputed) for slot in sorted(irregular)])

    def batch(self, decision: Decision) -> Batch:
        """Who works in the step `decision` schedules (applied already), and with how many tokens.
        A steady request the decision leaves out (or gives more than its one token) stops being steady."""
        if decision.num_tokens is None:
            return self.running_batch()
        given = decision.num_tokens
        if not self.seats.steady_tokens.items() <= given.items():
            for slot in sorted(self.seats.steady):
                if given.get(self.slots[slot].id) != 1:
                    self.seats.freeze(self.slots[slot])
        irregular = [(r, given.get(r.id, 0)) for r in map(self.seats.irregular.get, sorted(self.seats.irregular))]
        return Batch(self.seats, [(r, n) for r, n in irregular if n > 0])

    def num_new_steady_blocks(self) -> int:
        """Blocks the steady requests must take, together, for their next decode step."""
        clock_blocks, now = self.seats.clock_blocks, self.seats.now
        return clock_blocks.held_at(now + 1) - clock_blocks.held_at(now) if self.seats.growing else 0

    def steps_until_a_finish(self, batch: Batch) -> int:
        """Steps of `batch` until the first of its requests emits its last token (all emit every step)."""
        steady = self.seats.next_finish() - self.seats.now
        return min([steady, *(r.output_len - r.num_generated for r, _ in batch.irregular)])

    def steps_within_free_blocks(self, batch: Batch, max_steps: int) -> int:
        """Of the next `max_steps` steps of `batch`, as many as the free blocks cover. Each
        request takes a block whenever its tokens cross a block boundary, as the growing steady
        ones do (`ClockBlocks`): the irregular ones too, once the first step's tokens are in,
        unless they already hold blocks for the whole run (a static reservation)."""
        now, block_size = self.seats.now, self.blocks.block_size
        growing = self.seats.clock_blocks.copy()
        num_blocks = self.blocks.num_free_blocks + growing.held_at(now)  # what they may hold in all
        for request, num_tokens in batch.irregular:
            cached, held = request.num_computed + num_tokens, request.num_blocks_held  # cached: after the first step
            if held * block_size >= cached + max_steps - 1:
                continue
            assert held <= -(-cached // block_size), f"{request} holds blocks beyond its tokens but not for the run"
            growing.add(cached - now)
            num_blocks += held
        return min(max_steps, growing.last_step_within(num_blocks) - now)

    # Applying a decision and running steps

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

    def add(self, request: Request) -> None:
        """A request that arrives while the engine runs joins the end of the queue (an online
        server's arrivals; a run of a known trace adds its requests up front instead)."""
        if request.id in self.by_id:
            raise ValueError(f"request {request.id} is already known")
        self.by_id[request.id] = request
        self.waiting.append(request)

    def abort(self, request_id: int) -> None:
        """Forget a request whose client went away: out of the queue, or out of its slot with its
        KV blocks freed. A later decision naming it fails."""
        request = self._lookup(request_id, "abort")
        if request.slot >= 0:
            self._free_slot(request, "aborts")
        else:
            self.waiting.remove(request)
        del self.by_id[request_id]

    def place(self, request: Request, slot: int) -> None:
        """Seat `request` in free `slot` (admission does this with the lowest free slot)."""
        request.slot = slot
        self.slots[slot] = request
        self.seats.seat(request)

    def grow(self, batch: Batch, num_steps: int) -> Growth | None:
        """Give each request of `batch` the KV blocks its next `num_steps` steps write to: its
        tokens in the first step, then one token per step. Returns who grew, for `Growth.blocks_used`."""
        if self.blocks is None:
            return None
        growth = Growth(self.blocks, self.seats.now, num_steps)
        for request, num_tokens in batch.irregular:
            cached_after_first = request.num_computed + num_tokens
            self._grow_one(growth, request, cached_after_first, cached_after_first + num_steps - 1)
        self._grow_steady(growth, self.seats.now + num_steps - 1)
        growth.used = self.blocks.num_blocks - self.blocks.num_free_blocks
        return growth

    def _grow_one(self, growth: Growth, request: Request, cached_after_first: int, num_tokens_held: int) -> None:
        held = request.num_blocks_held
        if num_tokens_held > held * self.blocks.block_size:
            needed = self.blocks.num_blocks_for(num_tokens_held)
            self.blocks.take(needed - held)
            self.seats.num_blocks_held[request.slot] = needed
            if num_tokens_held > cached_after_first:  # a run of steps: remember who grew
                growth.add(held, needed, cached_after_first)

    def _grow_steady(self, growth: Growth, last_step: int) -> None:
        seats = self.seats
        num_new_blocks = seats.clock_blocks.held_at(last_step + 1) - seats.clock_blocks.held_at(seats.blocks_now)
        self.blocks.take(num_new_blocks)
        seats.blocks_now = last_step + 1
        if num_new_blocks and last_step > seats.now:  # a run of steps: remember who grew, for the blocks used per step
            growth.steady = seats.clock_blocks.copy()

    def advance(self, batch: Batch, num_steps: int) -> list[int]:
        """Count `num_steps` steps of `batch` done: each request processed its tokens in the
        first, and if that left nothing uncomputed it emitted a token in every one of them.
        Returns the trace indices of the requests that finished."""
        seats = self.seats
        seats.now += num_steps
        finished = []
        for request, num_tokens in batch.irregular:
            if num_tokens < request._num_uncomputed:  # a chunk: nothing to emit yet
                request._num_uncomputed -= num_tokens
                continue
            request._num_generated += num_steps
            request._num_uncomputed = 1
            if request._num_generated == request.output_len:
                seats.finished[request.slot] = seats.irregular.pop(request.slot)
                finished.append(request.index)
            else:
                seats.make_steady(request)
        for slot in seats.take_finished():
            seats.freeze(self.slots[slot])
            finished.append(self.slots[slot].index)
        return finished

    def row(self, batch: Batch) -> np.ndarray:
        """int [num_slots]: the id of the request each slot works for in `batch`'s steps, -1 if none."""
        row = self.seats.steady_id.copy()
        for request, _ in batch.irregular:
            row[request.slot] = request.id
        return row

    def reserve(self, request: Request) -> None:
        """Take every block `request` will ever need, now (static batching's reservation)."""
        if self.blocks is not None:
            needed = self.blocks.num_blocks_for(request.max_context_len)
            self.blocks.take(needed - request.num_blocks_held)
            self.seats.num_blocks_held[request.slot] = needed

    def _lookup(self, request_id: int, verb: str) -> Request:
        if request_id not in self.by_id:
            raise ValueError(f"decision tries to {verb} request {request_id!r}, which is not in the trace")
        return self.by_id[request_id]

    def _free_slot(self, request: Request, verb: str) -> None:
        if request.slot < 0:
            raise ValueError(f"decision {verb} request {request.id}, which holds no slot")
        if self.blocks is not None:
            self.blocks.give_back(request._block_ids, request.num_blocks_held)
        self.seats.unseat(request)
        self.slots[request.slot] = None
        request.slot = -1

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


class Growth:
    """Who took blocks for a run of steps, to tell how many blocks were in use at each step:
    `grow` takes them all up front, but a request needs its last ones only from the step that
    writes to them. Irregular requests are listed; the growing steady ones are a copy of
    their `ClockBlocks`, as they were in the run."""

    def __init__(self, blocks: BlockPool, first_step: int, num_steps: int):
        self.block_size, self.first_step, self.num_steps = blocks.block_size, first_step, num_steps
        self.used = 0  # blocks held once the run's blocks are taken
        self.held_before: list[int] = []
        self.held_after: list[int] = []
        self.cached_after_first: list[int] = []
        self.steady: ClockBlocks | None = None

    def add(self, held_before: int, held_after: int, cached_after_first: int) -> None:
        self.held_before.append(held_before)
        self.held_after.append(held_after)
        self.cached_after_first.append(cached_after_first)

    def blocks_used(self):
        """KV blocks in use during the run: a number if it is the same at every step, else a
        function that gives one number per step (a StepLog calls it when it is read)."""
        if self.num_steps == 1 or not (self.held_after or self.steady):
            return self.used
        return self._blocks_used_per_step

    def _blocks_used_per_step(self) -> np.ndarray:
        used = np.full(self.num_steps, self.used)  # (steps,)
        if self.held_after:
            held_before, held_after, cached = (np.array(values) for values in (
                self.held_before, self.held_after, self.cached_after_first))  # (G,)
            needed = -(-(cached[None, :] + np.arange(self.num_steps)[:, None]) // self.block_size)  # (steps, G)
            used -= (held_after - np.maximum(held_before, needed)).sum(axis=1)
        if self.steady is not None:
            steps = range(self.first_step + 1, self.first_step + 1 + self.num_steps)
            steady_held = np.array([self.steady.held_at(step) for step in steps])  # (steps,)
            used -= steady_held[-1] - steady_held
        return used
