"""Scheduler state: the requests, the waiting queue, who holds which slot, and their KV blocks.

A request's sequence is a begin-of-sequence token, its prompt, then its outputs.
`num_computed` counts the known tokens whose keys and values are in the cache, and
`num_uncomputed` the rest. A step processes some of the uncomputed ones; when it has
processed all, the model emits the next output token, which is then the one token
left uncomputed. So a prefill (or a recompute after preemption) may take several
chunks, and a decode step processes one token.

Invariants:

- a request is in exactly one place: pending (not yet arrived), waiting, or a slot;
  a finished request stays in its slot until a decision releases it;
- a slot holds at most one request, and `seated` lists the slot holders in the order
  they were admitted, so at most `num_slots` requests hold slots;
- `num_computed + num_uncomputed == num_prompt_tokens + num_generated`, with
  `1 <= num_uncomputed` and `num_generated <= output_len`;
- with a block pool, a request holds KV blocks only while it holds a slot: exactly
  enough for its `num_computed` tokens, or, if it reserved them (static batching), for
  its whole length;
  preemption returns them and makes every known token uncomputed again, while the
  outputs generated so far are kept;
- the waiting queue is first come, first served, a preempted request going back to
  its head; under a policy with a `queue_order`, it is sorted by that instead;
- a request's counters change in two places only: `apply` (release, preempt, admit)
  and `complete` (a step done). Nothing else moves them (the fast-forward moves them as
  that many `complete` calls would), and no number reads a clock;
- a request is all there is to know about it: its counters, and, when a back end samples
  tokens, its `token_ids` (the sequence so far: its first tokens, then each output as
  `complete` takes it) and its stop rule. Its `output_len` (the most outputs it may have)
  changes only when that rule ends it early: it sampled one of its `eos_token_ids` after
  `min_tokens` outputs, and its output length becomes what it has produced.

A policy's `Decision` lives here, beside the state it is applied to: policies import the
state, and the state imports no policy. Every loop applies decisions through
`SchedulerState.apply` (by way of `labkit.sched.scheduler.Scheduler`), so slot placement
(lowest free slot first) and preemption are done in one place.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from typing import NamedTuple

from labkit.sched.blocks import BlockPool
from labkit.sched.shape import ExecutionShape


PROMPT_WEIGHT, OUTPUT_WEIGHT = 1.0, 2.0  # a virtual token counter's weights: Sheng et al.'s, an output twice a prompt token


@dataclass(frozen=True)
class Decision:
    """What happens before the next step.

    release: ids of finished requests whose slots are freed.
    preempt: ids of running requests sent back to the head of the queue, their KV blocks
        freed, in the order they will wait there.
    admit: ids of waiting requests that take free slots, in this order.
    num_tokens: {id: tokens} each scheduled request processes this step; None means every
        running request processes all its uncomputed tokens (a whole prefill or a decode).
    blocked: why the head of the queue still waits ("" when nothing waits).
    wake_at: a time at which to ask again even if nothing else changes.
    """

    release: tuple[int, ...] = ()
    preempt: tuple[int, ...] = ()
    admit: tuple[int, ...] = ()
    num_tokens: dict[int, int] | None = None
    blocked: str = ""
    wake_at: float | None = None


class Request:
    """One request: its progress, and, when a back end samples tokens, its tokens and its stop rule.

    index: its position in the trace (an online server's: in the order requests came);
    id: its request id. priority: lower is served first by policies that read it (as vLLM's).
    client: who sent it, a whole number (0 when there is one client), which `labkit.Fair` reads.
    token_ids: the sequence so far, its first tokens (a begin-of-sequence token and the prompt
    ids) then its outputs; empty when the back end samples none (the simulator).
    eos_token_ids, min_tokens: it ends early on sampling one of those ids after `min_tokens`
    outputs (a back end never lets it sample one before); output_len is its most outputs.
    allowed_token_ids: the only ids a back end lets it sample (empty: any).
    """

    __slots__ = (
        "index", "id", "arrival", "prompt_len", "output_len", "priority", "num_prompt_tokens", "num_generated",
        "num_computed", "num_uncomputed", "num_preemptions", "admitted_order", "slot", "block_table",
        "token_ids", "eos_token_ids", "min_tokens", "is_stopped", "client", "allowed_token_ids",
    )

    def __init__(self, index: int, id: int, arrival: float, prompt_len: int, output_len: int,
                 num_generated: int = 0, priority: int = 0, token_ids: list[int] | None = None,
                 eos_token_ids: tuple[int, ...] = (), min_tokens: int = 0, client: int = 0,
                 allowed_token_ids: tuple[int, ...] = ()):
        self.index, self.id, self.arrival, self.client = index, id, arrival, client
        self.prompt_len, self.output_len, self.priority = prompt_len, output_len, priority
        self.num_prompt_tokens = 1 + prompt_len  # a begin-of-sequence token, then the prompt
        self.num_generated = num_generated
        self.num_computed = 0  # known tokens in the KV cache
        self.num_uncomputed = self.num_prompt_tokens + num_generated  # known tokens not in it yet
        self.num_preemptions = 0
        self.admitted_order = -1  # the how-manieth admission of the run was its latest
        self.slot = -1
        self.block_table: list[int] = []  # ids of the KV blocks it holds, in the order of its tokens
        self.token_ids = list(token_ids or ())
        self.eos_token_ids, self.min_tokens = tuple(eos_token_ids), min_tokens
        self.is_stopped = False  # whether it ended at an end-of-sequence token
        self.allowed_token_ids = tuple(allowed_token_ids)

    def __repr__(self) -> str:
        return (
            f"Request(id={self.id}, prompt_len={self.prompt_len}, output_len={self.output_len}, "
            f"num_generated={self.num_generated}, num_uncomputed={self.num_uncomputed}, slot={self.slot})"
        )

    @property
    def num_blocks_held(self) -> int:
        return len(self.block_table)

    @property
    def is_finished(self) -> bool:
        return self.num_generated == self.output_len

    @property
    def finish_reason(self) -> str:
        """"stop" (it sampled an end-of-sequence id), "length" (it has all its outputs), or "" (not finished)."""
        return "stop" if self.is_stopped else "length" if self.is_finished else ""

    @property
    def is_decoding(self) -> bool:
        """Whether the next step is a plain decode step (one token, the previous output)."""
        return self.num_generated > 0 and self.num_uncomputed == 1

    @property
    def max_context_len(self) -> int:
        """The most tokens this request ever holds in the cache: its last output is never fed back."""
        return self.num_prompt_tokens + self.output_len - 1

    @property
    def output_ids(self) -> list[int]:
        """The outputs it has sampled (empty when the back end samples none)."""
        return self.token_ids[self.num_prompt_tokens :]

    def take(self, token: int) -> None:
        """Append an output it sampled; an end-of-sequence id after `min_tokens` outputs ends it there."""
        self.token_ids.append(token)
        if token in self.eos_token_ids and self.num_generated > self.min_tokens:
            self.output_len, self.is_stopped = self.num_generated, True


class SortedQueue:
    """A waiting queue sorted by `order(request)`, first come first served among equals: the
    queue of a policy that does not admit in arrival order. It answers what a deque does for
    the state; `append` and `appendleft` both put a request where its order says."""

    def __init__(self, order: Callable[[Request], object]):
        self.order = order
        self._keys: list[tuple] = []  # sorted: (order, arrival, trace position), one per request
        self._requests: list[Request] = []  # in the same order
        self._key_of: dict[int, tuple] = {}  # request id -> its key

    def append(self, request: Request) -> None:
        key = self._key_of[request.id] = (self.order(request), request.arrival, request.index)
        position = bisect.bisect(self._keys, key)
        self._keys.insert(position, key)
        self._requests.insert(position, request)

    appendleft = append

    def extend(self, requests) -> None:
        for request in requests:
            self.append(request)

    def remove(self, request: Request) -> None:
        position = bisect.bisect_left(self._keys, self._key_of.pop(request.id))
        del self._keys[position], self._requests[position]

    def __contains__(self, request: Request) -> bool:
        return request.id in self._key_of

    def __iter__(self):
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    def __getitem__(self, position: int) -> Request:
        return self._requests[position]


class StepWork(NamedTuple):
    """What one step computes: prompt tokens (prompts, chunks, recomputes), decode tokens (a
    padded row's one token included), and the KV tokens in cache after it, which attention reads."""

    num_prefill_tokens: int
    num_decode_tokens: int
    num_kv_tokens: int


class Batch:
    """Who works in one step: `rows` of (request, tokens it processes), in slot order;
    `padding`, finished requests that still compute a row (static batching's, by default):
    each feeds its last token again, at its own frozen context, and its output is thrown away;
    and, in a pure decode step, `num_shape_padding` rows that bring it to `decode_size`, the
    batch size the engine runs (`labkit.sched.shape`): each feeds one token at position 0
    against one cache entry of its own, and emits nothing."""

    __slots__ = ("rows", "size", "padding", "decode_size", "num_shape_padding", "_work")

    def __init__(self, rows: list[tuple[Request, int]], padding: list[Request] = (), decode_size: int | None = None):
        self.rows = rows
        self.size = len(rows)
        self.padding = list(padding)
        num_rows = self.size + len(self.padding)
        self.decode_size = decode_size or num_rows  # rows a pure decode step of this batch computes
        needs_padding = self.size and self.decode_size > num_rows  # checked first: most runs have no shape
        self.num_shape_padding = self.decode_size - num_rows if needs_padding and self.is_pure_decode else 0
        self._work: StepWork | None = None

    @property
    def is_pure_decode(self) -> bool:
        """Whether every row processes one token after an output: the steps a graph replays."""
        return all(request.is_decoding for request, _ in self.rows)

    @property
    def num_rows(self) -> int:
        """Rows the step computes: the scheduled requests and both kinds of padding."""
        return self.size + len(self.padding) + self.num_shape_padding

    @property
    def num_padded_rows(self) -> int:
        """Rows the step computes that emit nothing: finished requests and shape padding."""
        return len(self.padding) + self.num_shape_padding

    def work(self) -> StepWork:
        """The step's work, counted when first asked for (a back end that prices it asks)."""
        if self._work is None:
            num_prefill_tokens = num_decode_tokens = num_kv_tokens = 0
            for request, num_tokens in self.rows:
                if request.is_decoding:
                    num_decode_tokens += 1
                else:
                    num_prefill_tokens += num_tokens
                num_kv_tokens += request.num_computed + num_tokens
            num_decode_tokens += self.num_padded_rows  # one token each
            num_kv_tokens += sum(request.num_computed for request in self.padding)  # at its frozen context
            num_kv_tokens += self.num_shape_padding  # its one entry
            self._work = StepWork(num_prefill_tokens, num_decode_tokens, num_kv_tokens)
        return self._work


class SchedulerState:
    """What a policy sees: the clock, the waiting queue, the slots and the block pool.

    queue_order: how the waiting queue is sorted (a policy's `queue_order`); None is first
    come, first served.
    forgets_released: drop a request from `by_id` once a decision releases it (an online
    server's state, which would otherwise grow without end); a run of a trace keeps them all.
    counts_service: keep each client's virtual token counter in `service` (a policy that
    shares the engine between clients reads it, `labkit.Fair`): the Virtual Token Counter of
    Sheng et al. ("Fairness in Serving Large Language Models", OSDI 2024). Each prompt token a
    client's request processes (a chunk, a recompute) adds PROMPT_WEIGHT, each output it
    emits OUTPUT_WEIGHT; a client that arrives with none of its requests waiting is lifted to
    the least counter among the clients waiting (or, if nobody waits, to that of the client
    admitted last), so that time away earns it no credit.
    """

    def __init__(self, num_slots: int, requests: list[Request], blocks: BlockPool | None = None,
                 queue_order: Callable[[Request], object] | None = None, forgets_released: bool = False,
                 counts_service: bool = False):
        self.forgets_released, self.counts_service = forgets_released, counts_service
        self.service: dict[int, float] = {}  # client -> its virtual token counter (with counts_service)
        self.last_admitted_client: int | None = None
        self.num_slots = num_slots
        self.blocks = blocks
        self.now = 0.0
        self.num_steps = 0
        self.num_admitted = 0
        self.waiting: deque[Request] | SortedQueue = deque() if queue_order is None else SortedQueue(queue_order)
        self.slots: list[Request | None] = [None] * num_slots
        self.seated: list[Request] = []  # slot holders, in admission order
        self.by_id = {request.id: request for request in requests}

    # Views for policies

    def running(self) -> list[Request]:
        """Requests in slots that still have tokens to emit, oldest admission first."""
        return [request for request in self.seated if request.num_generated < request.output_len]

    def finished_in_slots(self) -> list[Request]:
        """Finished requests that still hold their slot."""
        return [request for request in self.seated if request.num_generated == request.output_len]

    def num_free_slots(self) -> int:
        return self.num_slots - len(self.seated)

    def num_free_blocks(self) -> float:
        """Free KV blocks; infinite without a pool."""
        return self.blocks.num_free_blocks if self.blocks is not None else float("inf")

    def num_new_blocks(self, request: Request, num_tokens: int) -> int:
        """Blocks `request` must take to process `num_tokens` more tokens (0 without a pool)."""
        if self.blocks is None:
            return 0
        # ceil(tokens / block_size), as `num_blocks_for`, written inline: this runs for every running
        # request at every decision, and the call made `Continuous.schedule` a fifth slower at 64
        missing = -(-(request.num_computed + num_tokens) // self.blocks.block_size) - len(request.block_table)
        return missing if missing > 0 else 0  # a reservation may hold more than the tokens fill

    def waiting_head(self, count: int) -> list[Request]:
        """The first `count` waiting requests, in queue order."""
        return list(islice(self.waiting, count))

    # Decisions

    def apply(self, decision: Decision) -> list[Request]:
        """Release, preempt, then admit, as decided; returns the admitted requests."""
        for request_id in decision.release:
            self._free_slot(self._lookup(request_id, "release"), "releases")
            if self.forgets_released:
                del self.by_id[request_id]
        for request_id in reversed(decision.preempt):
            self._preempt(self._lookup(request_id, "preempt"))
        admitted = [self._lookup(request_id, "admit") for request_id in decision.admit]
        if len(admitted) > self.num_free_slots():
            raise ValueError(f"decision admits {len(admitted)} requests but only {self.num_free_slots()} slots are free")
        for request in admitted:
            self._admit(request)
        return admitted

    def batch(self, decision: Decision, pad_finished: bool = False, shape: ExecutionShape = ExecutionShape()) -> Batch:
        """Who works in the step `decision` schedules (applied already), with how many tokens;
        with `pad_finished`, the finished requests that hold slots compute padded rows; a pure
        decode step is padded to the smallest of the `shape`'s decode sizes that holds it."""
        given = decision.num_tokens
        rows = []
        for request in self.slots:
            if request is not None and request.num_generated < request.output_len:
                num_tokens = request.num_uncomputed if given is None else given.get(request.id, 0)
                if num_tokens:
                    rows.append((request, num_tokens))
        padding = self.finished_in_slots() if pad_finished and rows else ()
        return Batch(rows, padding, shape.decode_size(len(rows) + len(padding)))

    def add(self, request: Request) -> None:
        """A request that arrives while the engine runs joins the queue (an online server's
        arrivals; a run of a known trace knows its requests up front, and they `arrive`)."""
        if request.id in self.by_id:
            raise ValueError(f"request {request.id} is already known")
        self.by_id[request.id] = request
        self.arrive([request])

    def arrive(self, requests: list[Request]) -> None:
        """Known requests join the queue, in this order (with counts_service, their clients lifted)."""
        for request in requests:
            if self.counts_service:
                self._lift(request.client)
            self.waiting.append(request)

    def _lift(self, client: int) -> None:
        """A client none of whose requests waits starts from the least counter among those that do."""
        waiting = {request.client for request in self.waiting}
        if client in waiting:
            return
        floor = (min(self.service.get(other, 0.0) for other in waiting) if waiting
                 else self.service.get(self.last_admitted_client, 0.0))
        self.service[client] = max(self.service.get(client, 0.0), floor)

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
        self.seated.append(request)

    def reserve(self, request: Request) -> None:
        """Take every block `request` will ever need, now (static batching's reservation)."""
        if self.blocks is not None:
            needed = self.blocks.num_blocks_for(request.max_context_len)
            self.blocks.allocate(request.block_table, needed - len(request.block_table))

    # Steps

    def allocate(self, batch: Batch) -> None:
        """Give each request of `batch` the KV blocks its tokens in the step are written to."""
        if self.blocks is not None:
            for request, num_tokens in batch.rows:
                if num_new_blocks := self.num_new_blocks(request, num_tokens):
                    self.blocks.allocate(request.block_table, num_new_blocks)

    def complete(self, batch: Batch, tokens: list[int] | None = None) -> list[int]:
        """Count a step of `batch` done: each request processed its tokens, and one that left
        none uncomputed emitted a token: the next of `tokens` (one per emitting row, in row
        order) when the back end sampled them, taken into the request, which may stop there.
        Returns the trace indices of the requests that finished."""
        self.num_steps += 1
        finished, sampled = [], iter(tokens or ())
        for request, num_tokens in batch.rows:
            if self.counts_service:
                self.serve(request, num_tokens, num_outputs=int(num_tokens == request.num_uncomputed))
            request.num_computed += num_tokens
            if num_tokens < request.num_uncomputed:  # a chunk: nothing to emit yet
                request.num_uncomputed -= num_tokens
                continue
            request.num_generated += 1
            request.num_uncomputed = 1  # the new token, not yet in the cache
            if tokens is not None:
                request.take(next(sampled))
            if request.is_finished:
                finished.append(request.index)
        return finished

    def serve(self, request: Request, num_tokens: int, num_outputs: int) -> None:
        """Add to its client's counter a step's work for `request`, about to count it done: the
        `num_tokens` it processes, prompt tokens unless it decodes, and the outputs it emits."""
        prompt_tokens = 0 if request.is_decoding else num_tokens
        self.service[request.client] = (self.service.get(request.client, 0.0) + PROMPT_WEIGHT * prompt_tokens
                                        + OUTPUT_WEIGHT * num_outputs)

    def _lookup(self, request_id: int, verb: str) -> Request:
        if request_id not in self.by_id:
            raise ValueError(f"decision tries to {verb} request {request_id!r}, which is not in the trace")
        return self.by_id[request_id]

    def _free_slot(self, request: Request, verb: str) -> None:
        if request.slot < 0:
            raise ValueError(f"decision {verb} request {request.id}, which holds no slot")
        if self.blocks is not None:
            self.blocks.deallocate(request.block_table)
        self.slots[request.slot] = None
        self.seated.remove(request)
        request.slot = -1

    def _preempt(self, request: Request) -> None:
        """Back to the queue (its head, first come first served), its cache dropped; its outputs so far are kept."""
        self._free_slot(request, "preempts")
        request.num_computed, request.num_uncomputed = 0, request.num_prompt_tokens + request.num_generated
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit(self, request: Request) -> None:
        if request.slot >= 0 or request not in self.waiting:
            raise ValueError(f"decision admits request {request.id}, which is not waiting")
        self.waiting.remove(request)
        request.admitted_order = self.num_admitted
        self.num_admitted += 1
        self.last_admitted_client = request.client
        self.place(request, self.slots.index(None))
