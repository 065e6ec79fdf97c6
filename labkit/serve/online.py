"""Online serving: the engine's loop with requests that arrive while it runs.

`Engine.run` serves a trace known in advance; an online server learns of each request
when a client sends it. `OnlineEngine` runs the same loop as `labkit.sched.driver.drive`,
on the same objects (a `Scheduler` with its policy, `SchedulerState` and `BlockPool` from
`kv_pool`, and the engine's `ModelRunner`), in a thread of its own, as the same three calls:
`schedule()`, `runner.run(batch)`, `postprocess(batch, tokens)`. Around them it takes in the
new and the aborted requests, and hands each request's new tokens to its `Stream`. Nothing
about scheduling is forked: only where requests come from and where tokens go differ.

Invariants:

- a request is checked before it is queued (its prompt ids, its length against the model,
  its priority, its EOS rule, `policy.check_fits`); a bad one raises a ValueError in the
  caller's thread and never reaches the loop; a request the engine cannot take now (its queue
  holds `max_waiting` requests, it is closing, or it has failed) raises `Unavailable`;
- a request is one `Request` (`labkit.sched.state`), known by its id: its prompt ids, its
  stop rule and its outputs live on it, and the state forgets it once a decision releases it;
- a request carries its priority (lower is served first, as vLLM's) into the state: a
  policy with a `queue_order` that reads it (`labkit.Priority`) orders the queue by it,
  any other policy ignores it;
- each request's stream gets its tokens, greedy, each as soon as its step ends, then its
  finish reason once: "length" at `max_tokens`; "stop" when it samples one of the model's
  EOS ids after `min_tokens` outputs (unless it asked to `ignore_eos`; before `min_tokens`
  those ids are masked and never sampled, as vLLM and transformers do), the EOS its last
  token; "abort" or "error" as below. A model without EOS ids (TinyGPT) never stops early;
- the engine's thread never calls into its callers: it puts items on streams, which the
  caller's event loop reads;
- an aborted request leaves at the next decision point, and its slot and KV blocks return
  to the pool; when every request has finished or been aborted, the pool is full;
- `stop` aborts what is still in flight and counts it (a client that left is not counted);
  if a step raises, every request in flight gets "error", `failure` keeps the exception,
  the thread ends with it, and no request is taken again;
- the clock is the wall clock, in seconds since the server started; when nothing can run
  the loop waits for a request (or the policy's wake-up time) instead of spinning.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import torch

from labkit.checks import whole_number
from labkit.engine.device import torch_threads
from labkit.engine.engine import Engine
from labkit.sched import Decision, Request
from labkit.sched.policy import check_policy
from labkit.sched.scheduler import Scheduler, StepRecord, kv_pool
from labkit.sched.state import Batch
from labkit.serve.prometheus import ServerMetrics

IDLE_WAIT_SECONDS = 1.0  # the longest the loop sleeps when nothing can run, before it looks again


class Unavailable(RuntimeError):
    """The engine cannot take a request now: its queue is full, it is closing, or it has failed."""


class Stream:
    """A request's outputs on their way from the engine's thread to the event loop that made
    the stream: each token (an int) as its step ends, then, once, the reason it finished (a
    str: "length", "stop", "abort" or "error"). The reader awaits `get`."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.items: asyncio.Queue[int | str] = asyncio.Queue()
        self.num_sent = 0
        self.last_sent_at: float | None = None

    def put(self, item: int | str) -> None:
        """From the engine's thread: queue `item` for the reader."""
        hand_over([(self, item)])

    async def get(self) -> int | str:
        return await self.items.get()


def hand_over(items: list[tuple[Stream, int | str]]) -> None:
    """From the engine's thread: queue each (stream, item) for its reader, in order, waking each
    reader's event loop once for them all."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, int | str]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, pairs in by_loop.items():
        with contextlib.suppress(RuntimeError):  # its loop has closed: nobody is left to read them
            loop.call_soon_threadsafe(_put_each, pairs)


def _put_each(pairs: list[tuple[Stream, int | str]]) -> None:
    for stream, item in pairs:
        stream.items.put_nowait(item)


class OnlineEngine:
    """An engine serving requests as they arrive, one policy decision per step."""

    def __init__(self, engine: Engine, policy, metrics: ServerMetrics | None = None,
                 eos_token_ids: tuple[int, ...] = (), max_waiting: int | None = None):
        """eos_token_ids: the model's end-of-sequence ids (a checkpoint's; TinyGPT has none);
        max_waiting: the most requests that may wait for a slot (None: no limit)."""
        check_policy(policy)
        self.engine, self.policy, self.metrics, self.max_waiting = engine, policy, metrics, max_waiting
        self.eos_token_ids = tuple(eos_token_ids)
        self.blocks = kv_pool(policy, engine.config.max_seq_len)
        self.runner = engine.model_runner(self.blocks)
        self.scheduler = Scheduler(policy, blocks=self.blocks, forgets_released=True)
        self.state = self.scheduler.state
        self.start = time.perf_counter()
        self.step_sizes: list[int] = []  # requests scheduled in each step, for the record
        self._streams: dict[int, Stream] = {}  # request id -> its stream, while it is in flight
        self._inbox: list[Request] = []
        self._aborts: list[int] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._closed = False
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self.num_aborted_at_stop = 0
        self.failure: Exception | None = None  # what ended the engine's thread, if a step raised

    def now(self) -> float:
        return time.perf_counter() - self.start

    # The caller's side (any thread with a running event loop)

    def submit(self, prompt_ids: list[int], max_tokens: int, priority: int = 0, ignore_eos: bool = False,
               min_tokens: int = 0) -> tuple[int, Stream]:
        """Queue a request whose sequence starts as `prompt_ids`, used as given (no
        begin-of-sequence token is added, as in vLLM), with this priority (lower is served first
        by a policy that reads it); it may stop at an EOS after `min_tokens` outputs unless
        `ignore_eos`. Returns its id and the stream its outputs come on.
        A ValueError names what is wrong with it; `Unavailable` says why none can be taken now."""
        self._check(prompt_ids, max_tokens, priority)
        self._check_eos_rule(ignore_eos, min_tokens, max_tokens)
        with self._wake:
            self._check_available()
            stream = Stream()
            request_id = self._next_id
            self._next_id += 1
            # the ids are the whole sequence so far, used as given (as vLLM does): the first plays
            # the part a request's begin-of-sequence token plays in the scheduler's counts
            request = Request(request_id, request_id, self.now(), len(prompt_ids) - 1, max_tokens, priority=priority,
                              token_ids=prompt_ids, eos_token_ids=() if ignore_eos else self.eos_token_ids,
                              min_tokens=min_tokens)
            self.policy.check_fits(request)
            self._streams[request_id] = stream
            self._inbox.append(request)
            self._wake.notify()
        return request_id, stream

    def abort(self, request_id: int) -> None:
        """Drop a request at the next decision point (its client went away)."""
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    def start_thread(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="labkit-engine", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def num_in_flight(self) -> int:
        """Requests taken and not yet finished or aborted."""
        return len(self._streams)

    def close(self) -> None:
        """Take no more requests; the ones in flight run on."""
        with self._wake:
            self._closed = True

    def stop(self) -> int:
        """Take no more requests, abort the ones in flight, and let the loop end; returns how
        many were aborted. Calling it again returns the same count."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        return self.num_aborted_at_stop

    def _check_available(self) -> None:
        """Under `_wake`: an `Unavailable` when no request can be taken now."""
        if self.failure is not None:
            raise Unavailable(f"the engine stopped after an error ({type(self.failure).__name__}); restart the server")
        if self._closed or self._stopping:
            raise Unavailable("the server is shutting down")
        num_waiting = len(self._inbox) + len(self.state.waiting)  # lengths: safe to read beside the engine's thread
        if self.max_waiting is not None and num_waiting >= self.max_waiting:
            raise Unavailable(f"{num_waiting} requests are waiting for a slot, the most this server queues "
                              f"(max_waiting {self.max_waiting}); try again later")

    def _check(self, prompt_ids: list[int], max_tokens: int, priority: int) -> None:
        vocab_size, max_seq_len = self.engine.config.vocab_size, self.engine.config.max_seq_len
        whole_number("max_tokens", max_tokens)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority = {priority!r}: must be a whole number (lower is served first)")
        if not prompt_ids:
            raise ValueError("prompt = []: give at least one token id; token ids are used as given, so start with "
                             f"the model's begin-of-sequence id ({self.engine.config.bos_token_id}) if it has one")
        if len(prompt_ids) + max_tokens > max_seq_len:  # first: a huge prompt is refused before its ids are read
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + max_tokens {max_tokens} exceed the model's "
                             f"max_seq_len {max_seq_len}")
        for position, token in enumerate(prompt_ids):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                raise ValueError(f"prompt token {token!r} at position {position} is outside the vocabulary "
                                 f"(0..{vocab_size - 1})")

    @staticmethod
    def _check_eos_rule(ignore_eos: bool, min_tokens: int, max_tokens: int) -> None:
        if not isinstance(ignore_eos, bool):
            raise ValueError(f"ignore_eos = {ignore_eos!r}: must be true or false")
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or not 0 <= min_tokens <= max_tokens:
            raise ValueError(f"min_tokens = {min_tokens!r}: must be a whole number in 0..max_tokens ({max_tokens})")

    # The engine's thread

    def serve_forever(self) -> None:
        """The serving loop, until `stop`; a step that raises ends it (`_fail`)."""
        try:
            with torch.inference_mode(), torch_threads(self.engine.threads):
                while self._take_in():
                    self.state.now = self.now()
                    batch = self.scheduler.schedule()
                    if not batch.size:
                        self._idle(self.scheduler.decision)
                        continue
                    tokens = self.runner.run(batch)
                    record = self.scheduler.postprocess(batch, tokens)
                    self._deliver(batch, record)
                self._abort_everyone()
        except Exception as problem:
            self._fail(problem)
            raise  # the thread's traceback, once, in the server's log

    def _fail(self, problem: Exception) -> None:
        """Tell every request in flight that the engine failed, and take none again."""
        with self._wake:
            self.failure = problem
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put("error")

    def _take_in(self) -> bool:
        """Move new and aborted requests into the state; False once stopping."""
        with self._wake:
            arrived, aborted, self._inbox, self._aborts = self._inbox, self._aborts, [], []
            stopping = self._stopping
        for request in arrived:
            self.state.add(request)
            if self.metrics:
                self.metrics.prompt_tokens.inc(request.num_prompt_tokens)  # the ids as given
        for request_id in aborted:
            self._abort(request_id)
        return not stopping

    def _deliver(self, batch: Batch, record: StepRecord) -> None:
        """Hand each scheduled request's new tokens to its stream, and its finish reason once it
        has finished; count the step's preemptions."""
        if self.metrics:
            self.metrics.preemptions.inc(len(record.preempted))
        moment, handed = self.now(), []
        for request, _ in batch.rows:
            stream = self._streams[request.id]
            for token in request.token_ids[request.num_prompt_tokens + stream.num_sent :]:  # its outputs not sent
                self._observe(request, stream, moment)
                handed.append((stream, token))
            if request.is_finished:
                del self._streams[request.id]
                handed.append((stream, request.finish_reason))
        hand_over(handed)
        self.step_sizes.append(batch.size)
        self._publish_state()

    def _observe(self, request: Request, stream: Stream, moment: float) -> None:
        """Count a token sent, and its latency: from arrival for the first, from the last one after."""
        if self.metrics:
            first = stream.last_sent_at is None
            latency = self.metrics.ttft if first else self.metrics.itl
            latency.observe(moment - (request.arrival if first else stream.last_sent_at))
            self.metrics.generation_tokens.inc()
        stream.num_sent += 1
        stream.last_sent_at = moment

    def _abort(self, request_id: int) -> None:
        """End a request its client left: out of the queue or its slot, its blocks freed."""
        stream = self._streams.pop(request_id, None)
        if stream is None:  # finished already, or aborted twice
            return
        self.state.abort(request_id)
        stream.put("abort")

    def _idle(self, decision: Decision) -> None:
        """Nothing runs: wait for a request, an abort, the policy's wake-up time or a stop."""
        self._publish_state()
        timeout = IDLE_WAIT_SECONDS if decision.wake_at is None else max(0.0, decision.wake_at - self.now())
        with self._wake:
            if not (self._inbox or self._aborts or self._stopping):
                self._wake.wait(timeout)

    def _publish_state(self) -> None:
        if self.metrics:
            used = self.blocks.num_blocks - self.blocks.num_free_blocks
            self.metrics.set_state(len(self.state.running()) + len(self.state.finished_in_slots()),
                                   len(self.state.waiting), used / self.blocks.num_blocks)

    def _abort_everyone(self) -> None:
        """On stop: every request still waiting or running is aborted, and every slot freed."""
        self._take_in()  # the last arrivals, and the aborts of clients that left: those are not counted
        self.num_aborted_at_stop = len(self._streams)
        for request_id in list(self._streams):
            self._abort(request_id)
        self.scheduler.release_finished()
        self._publish_state()
