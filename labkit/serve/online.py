"""Online serving: the engine's loop with requests that arrive while it runs.

`Engine.run` serves a trace known in advance; an online server learns of each request
when a client sends it. `OnlineEngine` runs the same loop as `labkit.sched.driver.drive`,
on the same objects (a `Scheduler` with its policy, `SchedulerState` and `BlockPool` from
`kv_pool`, and the engine's `ModelRunner`), in a thread of its own: take in the new requests
and the aborted ones, schedule a step, run it, hand each sampled token to its request's
client, and count the step done. Nothing about scheduling is forked: only where requests
come from and where tokens go differ.

Invariants:

- a request is checked before it is queued (its prompt ids, its length against the model,
  its priority, `policy.check_fits`); a bad one raises a ValueError in the caller's thread
  and never reaches the loop; a request the engine cannot take now (its queue holds
  `max_waiting` requests, it is closing, or it has failed) raises `Unavailable`;
- a request carries its priority (lower is served first, as vLLM's) into the state: a
  policy with a `queue_order` that reads it (`labkit.Priority`) orders the queue by it,
  any other policy ignores it;
- each request gets `max_tokens` tokens, greedy, each handed to `on_token` as soon as its
  step ends, then `on_finish` once ("length"); an aborted request gets `on_finish` too;
- a request ends early ("stop") when it samples one of the model's EOS ids, unless it asked
  to `ignore_eos`: the EOS is its last token, and `SchedulerState.stop` makes its output
  length what it has produced, so the next decision frees its slot and KV blocks as any
  finished request's. Before `min_tokens` outputs those ids are masked and never sampled
  (as vLLM and transformers do). A model without EOS ids (TinyGPT) never stops early;
- an aborted request leaves at the next decision point, and its slot and KV blocks return
  to the pool; when every request has finished or been aborted, the pool is full;
- `stop` aborts what is still in flight and counts it (a client that left is not counted);
  if a step raises, every request in flight gets `on_finish("error")`, `failure` keeps the
  exception, the thread ends with it, and no request is taken again;
- the clock is the wall clock, in seconds since the server started; when nothing can run
  the loop waits for a request (or the policy's wake-up time) instead of spinning.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from labkit.checks import whole_number
from labkit.engine.device import torch_threads
from labkit.engine.model_runner import greedy
from labkit.engine.runner import Engine
from labkit.sched import BlockPool, Decision, Request
from labkit.sched.policy import check_policy
from labkit.sched.scheduler import Scheduler, kv_pool
from labkit.sched.state import Batch
from labkit.serve.metrics import ServerMetrics

IDLE_WAIT_SECONDS = 1.0  # the longest the loop sleeps when nothing can run, before it looks again


class Unavailable(RuntimeError):
    """The engine cannot take a request now: its queue is full, it is closing, or it has failed."""


@dataclass
class Client:
    """Where a request's tokens go: called from the engine's thread."""

    on_token: Callable[[int], None]
    on_finish: Callable[[str], None]  # the finish reason: "length", "stop" (an EOS), "abort" or "error"
    num_sent: int = 0
    last_token_at: float | None = None


@dataclass(frozen=True)
class EosRule:
    """When a request may end before max_tokens: on sampling one of `token_ids` (the model's EOS
    ids; none with ignore_eos), which cannot be sampled before it has `min_tokens` outputs."""

    token_ids: tuple[int, ...] = ()
    min_tokens: int = 0


class OnlineSteps:
    """The engine's model runner, for requests that carry their own prompt ids and EOS rules.
    A server keeps no step log (it would grow without end): /metrics is its record."""

    def __init__(self, engine: Engine, blocks: BlockPool):
        self.prompts: dict[int, list[int]] = {}  # request index -> BOS and prompt ids
        self.eos_rules: dict[int, EosRule] = {}  # request index -> its rule
        self.runner = engine.model_runner(blocks, self.prompt, self.sample)

    @property
    def sequences(self) -> dict[int, list[int]]:
        """Request index -> BOS, prompt and the outputs sampled so far."""
        return self.runner.sequences

    def run(self, batch: Batch) -> list[int]:
        """One step of `batch`; each token sampled joins its request's sequence."""
        return self.runner.run(batch)

    def prompt(self, index: int) -> list[int]:
        return list(self.prompts[index])  # a copy: the sequence grows, the prompt does not

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Greedy, but a request short of its min_tokens cannot sample an EOS id."""
        for row, request in enumerate(requests):
            rule = self.eos_rules[request.index]
            if rule.token_ids and request.num_generated < rule.min_tokens:
                logits[row, list(rule.token_ids)] = float("-inf")  # (E, vocab): a copy of the forward's logits
        return greedy(logits, requests)


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
        self.steps = OnlineSteps(engine, self.blocks)
        self.scheduler = Scheduler(policy, blocks=self.blocks)
        self.state = self.scheduler.state
        self.start = time.perf_counter()
        self.step_sizes: list[int] = []  # requests scheduled in each step, for the record
        self._clients: dict[int, Client] = {}
        self._inbox: list[Request] = []
        self._aborts: list[int] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._closed = False
        self._next_index = 0
        self._thread: threading.Thread | None = None
        self.num_aborted_at_stop = 0
        self.failure: Exception | None = None  # what ended the engine's thread, if a step raised

    def now(self) -> float:
        return time.perf_counter() - self.start

    # The caller's side (any thread)

    def submit(self, prompt_ids: list[int], max_tokens: int, client: Client, priority: int = 0,
               ignore_eos: bool = False, min_tokens: int = 0) -> int:
        """Queue a request whose sequence starts as `prompt_ids`, used as given (no
        begin-of-sequence token is added, as in vLLM), with this priority (lower is served first
        by a policy that reads it); it may stop at an EOS after `min_tokens` outputs unless
        `ignore_eos`. Returns its id.
        A ValueError names what is wrong with it; `Unavailable` says why none can be taken now."""
        self._check(prompt_ids, max_tokens, priority)
        self._check_eos_rule(ignore_eos, min_tokens, max_tokens)
        with self._wake:
            self._check_available()
            index = self._next_index
            self._next_index += 1
            # the ids are the whole sequence so far, used as given (as vLLM does): the first plays
            # the part a request's begin-of-sequence token plays in the scheduler's counts
            request = Request(index, index, self.now(), len(prompt_ids) - 1, max_tokens, priority=priority)
            self.policy.check_fits(request)
            self.steps.prompts[index] = list(prompt_ids)
            self.steps.eos_rules[index] = EosRule(() if ignore_eos else self.eos_token_ids, min_tokens)
            self._clients[index] = client
            self._inbox.append(request)
            self._wake.notify()
        return index

    def abort(self, request_id: int) -> None:
        """Drop a request at the next decision point (its client went away)."""
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    def start_thread(self) -> None:
        self._thread = threading.Thread(target=self.run, name="labkit-engine", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def num_in_flight(self) -> int:
        """Requests taken and not yet finished or aborted."""
        return len(self._clients)

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

    def run(self) -> None:
        """The serving loop, until `stop`; a step that raises ends it (`_fail`)."""
        try:
            with torch.inference_mode(), torch_threads(self.engine.threads):
                while self._take_in():
                    batch = self._decide()
                    if batch.size:
                        self._step(batch)
                    else:
                        self._idle(self.scheduler.decision)
                self._abort_everyone()
        except Exception as problem:
            self._fail(problem)
            raise  # the thread's traceback, once, in the server's log

    def _fail(self, problem: Exception) -> None:
        """Tell every request in flight that the engine failed, and take none again."""
        with self._wake:
            self.failure = problem
            clients, self._clients = self._clients, {}
        for client in clients.values():
            client.on_finish("error")

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

    def _decide(self) -> Batch:
        """Schedule the next step at the wall clock's time; forget the requests its decisions
        released (finished, and out of their slots: nothing more to keep)."""
        self.state.now = self.now()
        batch = self.scheduler.schedule()
        for decision in self.scheduler.decisions:
            if decision.preempt and self.metrics:
                self.metrics.preemptions.inc(len(decision.preempt))
            for index in decision.release:
                del self.state.by_id[index]
                self._drop_tokens(index)
        return batch

    def _step(self, batch: Batch) -> None:
        self.steps.run(batch)
        self.step_sizes.append(batch.size)
        sampled = {request.index: self._send_new_tokens(request.index) for request, _ in batch.rows}
        finished = self.scheduler.postprocess(batch).finished
        for index in finished:
            self._clients.pop(index).on_finish("length")
        for index, tokens in sampled.items():
            if tokens and tokens[-1] in self.steps.eos_rules[index].token_ids and index not in finished:
                self.state.stop(index)
                self._clients.pop(index).on_finish("stop")
        self._publish_state()

    def _send_new_tokens(self, index: int) -> list[int]:
        """Hand the request's tokens sampled since the last call to its client; returns them."""
        client, sequence = self._clients[index], self.steps.sequences[index]
        new = sequence[len(self.steps.prompts[index]) + client.num_sent :]
        moment = self.now()
        for token in new:
            if self.metrics:
                self._observe_latency(index, client, moment)
            client.on_token(token)
            client.num_sent += 1
            client.last_token_at = moment
        return new

    def _observe_latency(self, index: int, client: Client, moment: float) -> None:
        if client.last_token_at is None:
            self.metrics.ttft.observe(moment - self.state.by_id[index].arrival)
        else:
            self.metrics.itl.observe(moment - client.last_token_at)
        self.metrics.generation_tokens.inc()

    def _abort(self, index: int) -> None:
        """End a request its client left: out of the queue or its slot, its blocks freed."""
        client = self._clients.pop(index, None)
        if client is None:  # finished already, or aborted twice
            return
        self.state.abort(index)
        self._drop_tokens(index)
        client.on_finish("abort")

    def _drop_tokens(self, index: int) -> None:
        self.steps.sequences.pop(index, None)
        self.steps.prompts.pop(index, None)
        self.steps.eos_rules.pop(index, None)

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
        self.num_aborted_at_stop = len(self._clients)
        for index in list(self._clients):
            self._abort(index)
        self.scheduler.release_finished()
        self._publish_state()
