"""Online serving: the engine's loop with requests that arrive while it runs.

`Engine.run` serves a trace known in advance; an online server learns of each request
when a client sends it. It has two sides, as vLLM's engine core and its front end:

- `EngineLoop`, the engine's side, runs the same loop as `labkit.sched.driver.drive`, on
  the same objects (a `Scheduler` with its policy, `SchedulerState` and `BlockPool` from
  `kv_pool`, and the engine's `ModelRunner`), as the same three calls: `schedule()`,
  `runner.run(batch)`, `postprocess(batch, tokens)`. Around them it takes in the new and the
  aborted requests, and reports what each step gave (`LoopReport`): every request's new
  tokens, who finished and why, and the queue and pool as they are then;
- `OnlineEngine`, the callers' side, checks each request, gives it an id and a `Stream`,
  and hands each reported token to its stream; it keeps the server's metrics.

The loop runs in a thread of the callers' process, or in a process of its own
(`EngineProcess`, `own_process=True`), which is what `labkit serve` does on a CPU: there the
HTTP side and a thread of the engine would take turns at one interpreter lock. Nothing about
scheduling is forked: only where requests come from and where tokens go differ.

Invariants:

- a request is checked before it is queued (its prompt ids, its length against the model,
  its priority, its EOS rule, `policy.check_fits`); a bad one raises a ValueError in the
  caller's thread and never reaches the loop; a request the engine cannot take now (its queue
  holds `max_waiting` requests, it is closing, or it has failed) raises `Unavailable`;
- a request is one `Request` (`labkit.sched.state`), known by its id: its prompt ids, its
  stop rule and its outputs live on it, and the loop's state forgets it once a decision
  releases it;
- a request carries its priority (lower is served first, as vLLM's) into the state: a
  policy with a `queue_order` that reads it (`labkit.Priority`) orders the queue by it,
  any other policy ignores it;
- each request's stream gets its tokens, greedy, each as soon as its step ends, then its
  finish reason once: "length" at `max_tokens`; "stop" when it samples one of the model's
  EOS ids after `min_tokens` outputs (unless it asked to `ignore_eos`; before `min_tokens`
  those ids are masked and never sampled, as vLLM and transformers do), the EOS its last
  token; "abort" or "error" as below. A model without EOS ids (TinyGPT) never stops early;
- the loop never calls into the callers: it reports to `OnlineEngine`, which puts items on
  streams, which the caller's event loop reads;
- an aborted request's stream ends with "abort" at once; the request leaves the loop at its
  next decision point, and its slot and KV blocks return to the pool; when every request
  has finished or been aborted, the pool is full;
- `stop` aborts what is still in flight and counts it (a client that left is not counted);
  if a step raises, or the engine's process ends, every request in flight gets "error",
  `failure` keeps the exception, and no request is taken again;
- the clock is the wall clock, in seconds since the server started, the same in both
  processes; when nothing can run the loop waits for a request (or the policy's wake-up
  time) instead of spinning.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import pickle
import signal
import statistics
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch

from labkit.checks import whole_number
from labkit.engine.device import torch_threads
from labkit.engine.engine import Engine
from labkit.sched import Decision, Request
from labkit.sched.policy import check_policy
from labkit.sched.scheduler import Scheduler, kv_pool
from labkit.sched.state import Batch
from labkit.serve.prometheus import ServerMetrics

IDLE_WAIT_SECONDS = 1.0  # the longest the loop sleeps when nothing can run, before it looks again
MAX_CLIENTS = 10_000  # clients told apart; past them, new names share one number (memory stays bounded)
STOP_TIMEOUT_S = 10.0  # how long a stopping loop may take to finish its step: then a process is killed, a thread left
STUCK_AFTER_S, STUCK_FACTOR = 3.0, 50  # a loop silent this long, and this many times its usual step, is stuck


class Unavailable(RuntimeError):
    """The engine cannot take a request now: its queue is full, it is closing, or it has failed."""


class Stream:
    """A request's outputs on their way from the engine's loop to the event loop that made the
    stream: each token (an int) as its step ends, then, once, the reason it finished (a str:
    "length", "stop", "abort", "shed" or "error"). The reader awaits `get`."""

    def __init__(self, submitted_at: float, client: str = ""):
        self.loop = asyncio.get_running_loop()
        self.items: asyncio.Queue[int | str] = asyncio.Queue()
        self.submitted_at, self.client = submitted_at, client
        self.last_sent_at: float | None = None

    async def get(self) -> int | str:
        return await self.items.get()


def hand_over(items: list[tuple[Stream, int | str]]) -> None:
    """From any thread: queue each (stream, item) for its reader, in order, waking each
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


class LoopReport(NamedTuple):
    """What the loop tells the callers' side: after every step, after a decision that admitted
    or preempted anyone, when it has nothing to run, and once when it ends (or fails)."""

    outputs: list[tuple[int, list[int], str]]  # (request id, its new output ids, its finish reason or "")
    num_scheduled: int  # requests that worked in the step (0: a report of no step)
    admitted: list[int]  # ids of the requests the latest decisions admitted (those reported once)
    preempted: list[int]  # and of those they preempted, back in the queue
    num_in_slots: int  # requests holding a slot, finished ones waiting to leave included
    num_waiting: int
    num_blocks_used: int
    num_blocks: int
    failure: Exception | None = None  # what ended the loop, if a step raised


class EngineLoop:
    """The engine's side of an online server: the `Scheduler` and the engine's `ModelRunner`,
    stepping while there is work, fed requests and aborts from any thread. It calls `report`
    from its own thread (`LoopReport`); `start` is the clock's zero (a `time.perf_counter()`)."""

    def __init__(self, engine: Engine, policy, report: Callable[[LoopReport], None], start: float):
        self.threads = engine.threads
        self.blocks = kv_pool(policy, engine.config.max_seq_len)
        self.runner = engine.model_runner(self.blocks)
        self.scheduler = Scheduler(policy, blocks=self.blocks, forgets_released=True)
        self.state = self.scheduler.state
        self.report, self.start = report, start
        self._num_reported: dict[int, int] = {}  # request id -> its outputs reported, until it finishes
        self._inbox: list[Request] = []
        self._aborts: list[int] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def now(self) -> float:
        return time.perf_counter() - self.start

    # Any thread

    def add(self, request: Request) -> None:
        with self._wake:
            self._inbox.append(request)
            self._wake.notify()

    def abort(self, request_id: int) -> None:
        """Drop a request at the next decision point (its client went away)."""
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    def run_in_background(self) -> None:
        """Start the loop in a thread of its own."""
        self._thread = threading.Thread(target=self.serve_forever, name="labkit-engine", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Let the loop end: it aborts what is in flight (and reports it) first. Joins its thread,
        for STOP_TIMEOUT_S at most: a thread stuck in a step is left behind (it is a daemon)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)

    # The loop's thread

    def serve_forever(self) -> None:
        """The serving loop, until `stop`; a step that raises is reported, then raised again."""
        try:
            self.report(self._report_of([]))  # running: the callers time its silences from here
            with torch.inference_mode(), torch_threads(self.threads):
                while self._take_in():
                    self.state.now = self.now()
                    batch = self.scheduler.schedule()
                    self._report_admissions()
                    if not batch.size:
                        self._idle(self.scheduler.decision)
                        continue
                    tokens = self.runner.run(batch)
                    self.scheduler.postprocess(batch, tokens)
                    self._report_step(batch)
                self._abort_everyone()
        except Exception as problem:
            self.report(self._report_of([], failure=problem))
            raise  # the thread's traceback, once, in the server's log

    def _take_in(self) -> bool:
        """Move new and aborted requests into the state; False once stopping."""
        with self._wake:
            arrived, aborted, self._inbox, self._aborts = self._inbox, self._aborts, [], []
            stopping = self._stopping
        for request in arrived:
            self.state.add(request)
            self._num_reported[request.id] = 0
        for request_id in aborted:
            if self._num_reported.pop(request_id, None) is not None:  # else it finished already
                self.state.abort(request_id)
        return not stopping

    def _report_step(self, batch: Batch) -> None:
        """Each scheduled request's new tokens, and its finish reason once it has finished."""
        outputs = []
        for request, _ in batch.rows:
            num_reported = self._num_reported[request.id]
            new = request.token_ids[request.num_prompt_tokens + num_reported :]
            if request.is_finished:
                del self._num_reported[request.id]
            else:
                self._num_reported[request.id] = num_reported + len(new)
            if new or request.is_finished:
                outputs.append((request.id, new, request.finish_reason))
        self.report(self._report_of(outputs, batch.size))

    def _report_admissions(self) -> None:
        """After a decision: who it admitted and who it preempted, if anyone (callers count the
        requests waiting, each client's, by them), before the step runs."""
        admitted = [request_id for decision in self.scheduler.decisions for request_id in decision.admit]
        preempted = [request_id for decision in self.scheduler.decisions for request_id in decision.preempt]
        if admitted or preempted:
            self.report(self._report_of([], admitted=admitted, preempted=preempted))

    def _report_of(self, outputs: list, num_scheduled: int = 0, admitted: list[int] = (), preempted: list[int] = (),
                   failure: Exception | None = None) -> LoopReport:
        return LoopReport(outputs, num_scheduled, list(admitted), list(preempted), len(self.state.seated),
                          len(self.state.waiting), self.blocks.num_blocks - self.blocks.num_free_blocks,
                          self.blocks.num_blocks, failure)

    def _idle(self, decision: Decision) -> None:
        """Nothing runs: report, then wait for a request, an abort, the policy's wake-up time or a stop."""
        self.report(self._report_of([]))
        timeout = IDLE_WAIT_SECONDS if decision.wake_at is None else max(0.0, decision.wake_at - self.now())
        with self._wake:
            if not (self._inbox or self._aborts or self._stopping):
                self._wake.wait(timeout)

    def _abort_everyone(self) -> None:
        """On stop: every request still waiting or running is aborted, and every slot freed."""
        self._take_in()  # the last arrivals, and the aborts of clients that left
        outputs = [(request_id, [], "abort") for request_id in self._num_reported]
        for request_id in self._num_reported:
            self.state.abort(request_id)
        self._num_reported.clear()
        self.scheduler.release_finished()
        self.report(self._report_of(outputs))


class EngineProcess:
    """An `EngineLoop` in a process of its own, as vLLM runs its engine core: requests, aborts
    and the stop go to it through a pipe, and its reports come back through the pipe, read by a
    thread of this process that calls `report`. The engine's model reaches the process in
    shared memory (torch.multiprocessing). If the process ends unasked, that is reported as a
    failure."""

    def __init__(self, engine: Engine, policy, report: Callable[[LoopReport], None], start: float):
        context = torch.multiprocessing.get_context("spawn")
        self._pipe, theirs = context.Pipe()
        self._process = context.Process(target=serve_in_process, args=(engine, policy, theirs, start),
                                        name="labkit-engine", daemon=True)
        self._reader = threading.Thread(target=self._read_reports, name="labkit-engine-reports", daemon=True)
        self.report = report
        self._sending = threading.Lock()
        self._stopping = False

    def run_in_background(self) -> None:
        """Start the process, and the thread that reads its reports."""
        self._process.start()
        self._reader.start()

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def add(self, request: Request) -> None:
        self._send("add", request)

    def abort(self, request_id: int) -> None:
        self._send("abort", request_id)

    def stop(self) -> None:
        """Let the loop end, as `EngineLoop.stop`; a process that has not ended after STOP_TIMEOUT_S is killed."""
        self._stopping = True
        if self._process.pid is None:  # never started
            return
        self._send("stop", None)
        self._process.join(STOP_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._reader.join()

    def _send(self, command: str, argument) -> None:
        with self._sending, contextlib.suppress(OSError):  # the process has ended: the reader reports it
            self._pipe.send((command, argument))

    def _read_reports(self) -> None:
        while True:
            try:
                report = self._pipe.recv()
            except (EOFError, OSError):
                break
            self.report(report)
        if not self._stopping:
            self._process.join(STOP_TIMEOUT_S)
            ended = RuntimeError(f"the engine's process ended (exit code {self._process.exitcode})")
            self.report(LoopReport([], 0, [], [], 0, 0, 0, 0, failure=ended))


def serve_in_process(engine: Engine, policy, pipe, start: float) -> None:
    """The engine's process: the loop on its main thread; the server's commands, read by another."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server decides when to stop
    loop = EngineLoop(engine, policy, partial(_send_report, pipe), start)
    threading.Thread(target=_obey, args=(pipe, loop), name="labkit-engine-commands", daemon=True).start()
    loop.serve_forever()


def _obey(pipe, loop: EngineLoop) -> None:
    """Carry out the server's commands until it says stop or goes away."""
    commands = {"add": loop.add, "abort": loop.abort}
    while True:
        try:
            command, argument = pipe.recv()
        except (EOFError, OSError):
            break
        if command == "stop":
            break
        commands[command](argument)
    loop.stop()


def _send_report(pipe, report: LoopReport) -> None:
    """Send a report to the server; a failure whose exception would not arrive whole goes as a
    RuntimeError naming it."""
    if report.failure is not None and not _survives_pickling(report.failure):
        report = report._replace(failure=RuntimeError(f"{type(report.failure).__name__}: {report.failure}"))
    pipe.send(report)


def _survives_pickling(problem: Exception) -> bool:
    try:
        pickle.loads(pickle.dumps(problem))
    except Exception:
        return False
    return True


class OnlineEngine:
    """An engine serving requests as they arrive, one policy decision per step; its loop runs in
    a thread of this process, or, with `own_process`, in a process of its own."""

    def __init__(self, engine: Engine, policy, metrics: ServerMetrics | None = None,
                 eos_token_ids: tuple[int, ...] = (), max_waiting: int | None = None, own_process: bool = False,
                 max_waiting_per_client: int | None = None):
        """eos_token_ids: the model's end-of-sequence ids (a checkpoint's; TinyGPT has none);
        max_waiting: the most requests that may wait for a slot (None: no limit), and
        max_waiting_per_client the most of one client's (see `_make_room`)."""
        check_policy(policy)
        self.engine, self.policy, self.metrics, self.max_waiting = engine, policy, metrics, max_waiting
        self.max_waiting_per_client = max_waiting_per_client
        self.eos_token_ids = tuple(eos_token_ids)
        self.start = time.perf_counter()
        self.core = (EngineProcess if own_process else EngineLoop)(engine, policy, self._take_report, self.start)
        self.step_sizes: list[int] = []  # requests scheduled in each step, for the record
        self.last_report: LoopReport | None = None
        self.last_report_at = 0.0  # when it came (seconds since the start)
        self._step_gaps: collections.deque[float] = collections.deque(maxlen=64)  # between step reports
        self._streams: dict[int, Stream] = {}  # request id -> its stream, while it is in flight
        self._waiting: dict[int, str] = {}  # request id -> its client, while it waits for a slot (as the loop said)
        self._client_numbers: dict[str, int] = {}  # a client's name -> the number its requests carry
        self._lock = threading.Lock()
        self._closed = False
        self._stopping = False
        self._next_id = 0
        self.num_aborted_at_stop = 0
        self.failure: Exception | None = None  # what ended the engine's loop, if a step raised

    def now(self) -> float:
        return time.perf_counter() - self.start

    def submit(self, prompt_ids: list[int], max_tokens: int, priority: int = 0, ignore_eos: bool = False,
               min_tokens: int = 0, client: str = "", allowed_token_ids: list[int] = ()) -> tuple[int, Stream]:
        """Queue a request whose sequence starts as `prompt_ids`, used as given (no
        begin-of-sequence token is added, as in vLLM), with this priority (lower is served first
        by a policy that reads it), from this client (a policy that shares the engine between
        clients reads it); it may stop at an EOS after `min_tokens` outputs unless
        `ignore_eos`, and samples only `allowed_token_ids` if given. Returns its id and the
        stream its outputs come on.
        A ValueError names what is wrong with it; `Unavailable` says why none can be taken now."""
        self._check(prompt_ids, max_tokens, priority)
        self._check_eos_rule(ignore_eos, min_tokens, max_tokens)
        self._check_allowed(allowed_token_ids, () if ignore_eos or not min_tokens else self.eos_token_ids)
        with self._lock:
            self._check_available()
            shed = self._make_room(client)
            request_id = self._next_id
            # the ids are the whole sequence so far, used as given (as vLLM does): the first plays
            # the part a request's begin-of-sequence token plays in the scheduler's counts
            request = Request(request_id, request_id, self.now(), len(prompt_ids) - 1, max_tokens, priority=priority,
                              token_ids=prompt_ids, eos_token_ids=() if ignore_eos else self.eos_token_ids,
                              min_tokens=min_tokens, client=self._client_number(client),
                              allowed_token_ids=tuple(allowed_token_ids))
            self.policy.check_fits(request)
            self._next_id += 1
            stream = self._streams[request_id] = Stream(request.arrival, client)
            self._waiting[request_id] = client
            self.core.add(request)  # under the lock: before any stop
            if shed is not None:
                self._end(shed, "shed")
        if self.metrics:
            self.metrics.prompt_tokens.inc(request.num_prompt_tokens)  # the ids as given
        return request_id, stream

    def _client_number(self, client: str) -> int:
        """The number the state knows `client` by: one each, in the order they first came; past
        MAX_CLIENTS names, the rest share one."""
        if client not in self._client_numbers and len(self._client_numbers) < MAX_CLIENTS:
            self._client_numbers[client] = len(self._client_numbers)
        return self._client_numbers.get(client, MAX_CLIENTS)

    def abort(self, request_id: int) -> None:
        """End a request whose client went away: its stream ends with "abort", and it leaves the
        loop at the next decision point."""
        with self._lock:
            if request_id in self._streams:  # else finished already, or aborted twice
                self._end(request_id, "abort")

    def _end(self, request_id: int, reason: str) -> None:
        """Under `_lock`: end a request in flight with `reason` now; the loop drops it at its next decision."""
        stream = self._streams.pop(request_id)
        self._waiting.pop(request_id, None)
        self.core.abort(request_id)
        hand_over([(stream, reason)])

    def start_thread(self) -> None:
        """Start the loop (its thread, or its process)."""
        self.core.run_in_background()

    def is_running(self) -> bool:
        return self.core.is_alive() and self.failure is None

    def num_in_flight(self) -> int:
        """Requests taken and not yet finished or aborted."""
        return len(self._streams)

    def close(self) -> None:
        """Take no more requests; the ones in flight run on."""
        with self._lock:
            self._closed = True

    def stop(self) -> int:
        """Take no more requests, abort the ones in flight, and let the loop end; returns how
        many were aborted. A loop stuck in a step is given STOP_TIMEOUT_S (then its process is
        killed), and what it still held ends here. Calling it again returns the same count."""
        with self._lock:
            self._stopping = True
        self.core.stop()
        with self._lock:
            stranded = list(self._streams)
            self.num_aborted_at_stop += len(stranded)
            for request_id in stranded:
                self._end(request_id, "abort")
        return self.num_aborted_at_stop

    def stuck(self) -> tuple[float, float] | None:
        """(seconds the loop has been silent, its usual step's seconds) while requests are in
        flight and it has been silent more than STUCK_AFTER_S and STUCK_FACTOR usual steps; else
        None. (An idle loop reports every IDLE_WAIT_SECONDS.)"""
        if not self._streams or self.last_report is None:  # nothing to do, or not started yet
            return None
        silent = self.now() - self.last_report_at
        usual = statistics.median(self._step_gaps) if self._step_gaps else 0.0
        return (silent, usual) if silent > max(STUCK_AFTER_S, STUCK_FACTOR * usual) else None

    def _check_available(self) -> None:
        """Under `_lock`: an `Unavailable` when no request can be taken now."""
        if self.failure is not None:
            raise Unavailable(f"the engine stopped after an error ({type(self.failure).__name__}); restart the server")
        if self._closed or self._stopping:
            raise Unavailable("the server is shutting down")

    def _make_room(self, client: str) -> int | None:
        """Under `_lock`: whether a request from `client` may wait, and for whom it makes room.
        A client already holding `max_waiting_per_client` waiting requests is refused. When the
        queue holds `max_waiting`, the client holding the most of it loses its newest waiting
        request (returned: to be shed) if it holds more than `client` would with this one;
        otherwise this one is refused (`Unavailable`). So a flood cannot lock the others out."""
        held = collections.Counter(self._waiting.values())
        if self.max_waiting_per_client is not None and held[client] >= self.max_waiting_per_client:
            raise Unavailable(f"{held[client]} of your requests are waiting for a slot, the most this server queues "
                              f"for one client (max_waiting_per_client {self.max_waiting_per_client}); try again later")
        if self.max_waiting is None or len(self._waiting) < self.max_waiting:
            return None
        top, most = held.most_common(1)[0]
        if most <= held[client] + 1:
            raise Unavailable(f"{len(self._waiting)} requests are waiting for a slot, the most this server queues "
                              f"(max_waiting {self.max_waiting}); try again later")
        return max(request_id for request_id, holder in self._waiting.items() if holder == top)

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

    def _check_allowed(self, allowed_token_ids: list[int], banned_at_first: tuple[int, ...]) -> None:
        """The ids a request may sample: in the vocabulary, and not only ids it may not pick yet."""
        vocab_size = self.engine.config.vocab_size
        for position, token in enumerate(allowed_token_ids):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                raise ValueError(f"allowed_token_ids[{position}] = {token!r} is outside the vocabulary "
                                 f"(0..{vocab_size - 1})")
        if allowed_token_ids and set(allowed_token_ids) <= set(banned_at_first):
            raise ValueError(f"allowed_token_ids = {list(allowed_token_ids)!r}: only end-of-sequence ids, which "
                             "min_tokens forbids at first")

    @staticmethod
    def _check_eos_rule(ignore_eos: bool, min_tokens: int, max_tokens: int) -> None:
        if not isinstance(ignore_eos, bool):
            raise ValueError(f"ignore_eos = {ignore_eos!r}: must be true or false")
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or not 0 <= min_tokens <= max_tokens:
            raise ValueError(f"min_tokens = {min_tokens!r}: must be a whole number in 0..max_tokens ({max_tokens})")

    # The loop's reports (from its thread, or the thread reading its process's reports)

    def _take_report(self, report: LoopReport) -> None:
        """Hand each reported token to its stream, then its finish reason; count them."""
        if report.failure is not None:
            return self._fail(report.failure)
        moment = self.now()
        if report.num_scheduled:
            if self.last_report is not None and self.last_report.num_scheduled:
                self._step_gaps.append(moment - self.last_report_at)
            self.step_sizes.append(report.num_scheduled)
        self.last_report, self.last_report_at = report, moment
        handed = []
        with self._lock:
            for request_id in report.admitted:
                self._waiting.pop(request_id, None)
            for request_id in report.preempted:
                if request_id in self._streams:
                    self._waiting[request_id] = self._streams[request_id].client
            for request_id, token_ids, finish_reason in report.outputs:
                stream = self._streams.get(request_id)
                if stream is None:  # its client left
                    continue
                for token in token_ids:
                    self._observe(stream, moment)
                    handed.append((stream, token))
                if finish_reason:
                    del self._streams[request_id]
                    self._waiting.pop(request_id, None)  # (an abort at stop may find it waiting)
                    handed.append((stream, finish_reason))
                    self.num_aborted_at_stop += finish_reason == "abort"  # only a stop aborts in the loop
        hand_over(handed)
        self._publish(report)

    def _fail(self, problem: Exception) -> None:
        """Tell every request in flight that the engine failed, and take none again."""
        with self._lock:
            if self.failure is not None:  # the first failure is the cause
                return
            self.failure = problem
            streams, self._streams, self._waiting = self._streams, {}, {}
        hand_over([(stream, "error") for stream in streams.values()])
        if self.metrics:
            self.metrics.set_state(0, 0, 0.0)  # nothing runs or waits any more

    def _observe(self, stream: Stream, moment: float) -> None:
        """Count a token sent, and its latency: from arrival for the first, from the last one after."""
        if self.metrics:
            first = stream.last_sent_at is None
            latency = self.metrics.ttft if first else self.metrics.itl
            latency.observe(moment - (stream.submitted_at if first else stream.last_sent_at))
            self.metrics.generation_tokens.inc()
        stream.last_sent_at = moment

    def _publish(self, report: LoopReport) -> None:
        if self.metrics:
            self.metrics.preemptions.inc(len(report.preempted))
            self.metrics.set_state(report.num_in_slots, report.num_waiting, report.num_blocks_used / report.num_blocks)
