"""Online serving: the engine's loop with requests that arrive while it runs.

`Engine.run` serves a trace known in advance; an online server learns of each request
when a client sends it. `OnlineEngine` runs the same loop as `labkit.sched.driver.drive`,
on the same objects (a policy, a `SchedulerState`, a `BlockPool`, the engine's
`TorchSteps`), in a thread of its own: take in the new requests and the aborted ones, ask
the policy, apply its decision, run one step, hand each sampled token to its request's
client, and count the finished. Nothing about scheduling is forked: only where requests
come from and where tokens go differ.

Invariants:

- a request is checked before it is queued (its prompt ids, its length against the model,
  its priority, `policy.check_fits`); a bad one raises a ValueError in the caller's thread
  and never reaches the loop;
- a request carries its priority (lower is served first, as vLLM's) into the state: a
  policy with a `queue_order` that reads it (`labkit.Priority`) orders the queue by it,
  any other policy ignores it;
- each request gets exactly `max_tokens` tokens, greedy, each handed to `on_token` as
  soon as its step ends, then `on_finish` once; an aborted request gets `on_finish` too;
- an aborted request leaves at the next decision point, and its slot and KV blocks return
  to the pool; when every request has finished or been aborted, the pool is full;
- the clock is the wall clock, in seconds since the server started; when nothing can run
  the loop waits for a request (or the policy's wake-up time) instead of spinning.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from labkit.engine.cuda_graphs import DecodeGraphs
from labkit.engine.device import torch_threads
from labkit.engine.kv import PagedKVCache
from labkit.engine.runner import Engine
from labkit.engine.steps import BOS_TOKEN, TorchSteps
from labkit.sched import BlockPool, Decision, Request, SchedulerState
from labkit.sched.policy import check_policy
from labkit.serve.metrics import ServerMetrics

IDLE_WAIT_SECONDS = 1.0  # the longest the loop sleeps when nothing can run, before it looks again


@dataclass
class Client:
    """Where a request's tokens go: called from the engine's thread."""

    on_token: Callable[[int], None]
    on_finish: Callable[[str], None]  # with the finish reason: "length" or "abort"
    num_sent: int = 0
    last_token_at: float | None = None


class NoRecord:
    """Takes what `TorchSteps` records about each step (phases, host and device time, lanes, KV
    reads) and keeps none of it: a server's log would grow without end; /metrics is its record."""

    def record_host_device(self, host: float, device: float) -> None:
        pass

    def record_phases(self, **seconds: float) -> None:
        pass

    def record_lane(self, lane: str, start: float, end: float) -> None:
        pass

    def record_kv_tokens(self, first: int, count: int = 1, growth: int = 0) -> None:
        pass


class OnlineSteps(TorchSteps):
    """The engine's steps for requests that carry their own prompt ids."""

    def __init__(self, engine: Engine, cache: PagedKVCache, graphs: DecodeGraphs | None):
        super().__init__(engine, cache, trace=None, graphs=graphs, progress=tqdm(disable=True))
        self.prompts: dict[int, list[int]] = {}  # request index -> BOS and prompt ids

    def prompt(self, index: int) -> list[int]:
        return list(self.prompts[index])  # a copy: the sequence grows, the prompt does not


class OnlineEngine:
    """An engine serving requests as they arrive, one policy decision per step."""

    def __init__(self, engine: Engine, policy, metrics: ServerMetrics | None = None):
        check_policy(policy)
        self.engine, self.policy, self.metrics = engine, policy, metrics
        max_blocks = -(-engine.config.max_seq_len // policy.block_size)
        self.blocks = BlockPool(policy.num_blocks or policy.num_slots * max_blocks, policy.block_size)
        cache = PagedKVCache(engine.config, self.blocks.num_blocks, policy.block_size, engine.device, engine.dtype)
        graphs = DecodeGraphs(engine.model, cache) if engine.cuda_graphs else None
        self.steps = OnlineSteps(engine, cache, graphs)
        self.state = SchedulerState(policy.num_slots, [], self.blocks, getattr(policy, "queue_order", None))
        self.start = time.perf_counter()
        self.step_sizes: list[int] = []  # requests scheduled in each step, for the record
        self._clients: dict[int, Client] = {}
        self._inbox: list[Request] = []
        self._aborts: list[int] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._next_index = 0
        self._thread: threading.Thread | None = None
        self.num_aborted_at_stop = 0

    def now(self) -> float:
        return time.perf_counter() - self.start

    # The caller's side (any thread)

    def submit(self, prompt_ids: list[int], max_tokens: int, client: Client, priority: int = 0) -> int:
        """Queue a request with this priority (lower is served first by a policy that reads it);
        returns its id. A ValueError names what is wrong with it."""
        self._check(prompt_ids, max_tokens, priority)
        with self._wake:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            index = self._next_index
            self._next_index += 1
            request = Request(index, index, self.now(), len(prompt_ids), max_tokens, priority=priority)
            self.policy.check_fits(request)
            self.steps.prompts[index] = [BOS_TOKEN, *prompt_ids]
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

    def stop(self) -> int:
        """Take no more requests, abort the ones in flight, and let the loop end; returns how
        many were aborted."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        return self.num_aborted_at_stop

    def _check(self, prompt_ids: list[int], max_tokens: int, priority: int) -> None:
        vocab_size, max_seq_len = self.engine.config.vocab_size, self.engine.config.max_seq_len
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens = {max_tokens!r}: must be a whole number >= 1")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority = {priority!r}: must be a whole number (lower is served first)")
        for position, token in enumerate(prompt_ids):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                raise ValueError(f"prompt token {token!r} at position {position} is outside the vocabulary "
                                 f"(0..{vocab_size - 1})")
        if len(prompt_ids) + max_tokens > max_seq_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + max_tokens {max_tokens} exceed the model's "
                             f"max_seq_len {max_seq_len}")

    # The engine's thread

    def run(self) -> None:
        """The serving loop, until `stop`."""
        with torch.inference_mode(), torch_threads(self.engine.threads):
            while self._take_in():
                decision, batch = self._decide()
                if batch.size:
                    self._step(batch)
                else:
                    self._idle(decision)
            self._abort_everyone()

    def _take_in(self) -> bool:
        """Move new and aborted requests into the state; False once stopping."""
        with self._wake:
            arrived, aborted, self._inbox, self._aborts = self._inbox, self._aborts, [], []
            stopping = self._stopping
        for request in arrived:
            self.state.add(request)
            if self.metrics:
                self.metrics.prompt_tokens.inc(request.prompt_len)
        for request_id in aborted:
            self._abort(request_id)
        return not stopping

    def _decide(self):
        self.state.now = self.now()
        decision = self.policy.schedule(self.state)
        if decision.preempt and self.metrics:
            self.metrics.preemptions.inc(len(decision.preempt))
        for request in self.state.apply(decision):
            if self.policy.reserves_whole_length:
                self.state.reserve(request)
        for index in decision.release:  # finished, and out of their slots: nothing more to keep
            del self.state.by_id[index]
            self._drop_tokens(index)
        return decision, self.state.batch(decision, self.policy.pads_finished)

    def _step(self, batch) -> None:
        self.state.allocate(batch)
        self.steps.execute(self.state, batch, NoRecord())
        self.step_sizes.append(batch.size)
        for request, _ in batch.rows:
            self._send_new_tokens(request.index)
        for index in self.state.complete(batch):
            self._clients.pop(index).on_finish("length")
        self._publish_state()

    def _send_new_tokens(self, index: int) -> None:
        client, sequence = self._clients[index], self.steps.sequences[index]
        new = sequence[len(self.steps.prompts[index]) + client.num_sent :]
        moment = self.now()
        for token in new:
            if self.metrics:
                self._observe_latency(index, client, moment)
            client.on_token(token)
            client.num_sent += 1
            client.last_token_at = moment

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

    def _idle(self, decision: Decision) -> None:
        """Nothing runs: wait for a request, an abort, the policy's wake-up time or a stop."""
        self._publish_state()
        if decision.preempt or decision.release:  # the policy may decide anew at once
            return
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
        self.num_aborted_at_stop = len(self._clients)
        for index in list(self._clients):
            self._abort(index)
        self.state.apply(Decision(release=tuple(r.id for r in self.state.finished_in_slots())))
        self._publish_state()
