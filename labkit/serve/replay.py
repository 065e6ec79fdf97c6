"""Replay a trace against any OpenAI-compatible server (`labkit serve`, vLLM), as `vllm bench
serve` does, and keep what it measured in a `ReplayLog` that `labkit.metrics` reads like a StepLog.

Invariants:

- times are seconds on the trace's clock: 0 is the moment the replay starts, and request i
  is sent at or after its arrival (`log.trace.arrivals[i]`, the trace's own divided by
  `rate_scale`), never before; TTFT and latency count from that arrival, so time spent
  waiting for the client's `max_concurrency` counts as queueing, as a slot does in the simulator;
- every request ends one way or the other: it finished (it streamed exactly its output length
  in tokens, then `[DONE]`) or it is in `failures` with a message that names the URL and the
  request id. A failed request has NaN first-token and finish times, and none of its tokens
  count in `num_tokens`, `token_times()` or the duration;
- `tokens_at[i]` holds the time of each streamed chunk that carried tokens: one per token on a
  server that streams one token per chunk (labkit's, vLLM's); ITL is read from these times,
  and a token count from the final usage when the server sends one;
- a request whose trace priority is not 0 is sent with it (vLLM's `priority` field);
- at most `max_concurrency` requests are in flight; once one cannot connect, the server is
  unreachable and every request not yet sent fails at once instead of waiting for its arrival;
- the replay's event loop always runs in a worker thread, so it runs the same way in a script
  and in Jupyter (whose loop already runs in the caller's thread); Ctrl-C cancels it, and the
  log keeps what was measured, with every request that had not finished failed as "interrupted".

Imports httpx, numpy, tqdm, prometheus_client and labkit.traffic, never torch or fastapi.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
from dataclasses import dataclass, replace

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from tqdm.auto import tqdm

from labkit.sched.steplog import RequestTimes
from labkit.traffic import Trace

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def prompt_ids(request_id: int, prompt_len: int, seed: int = 0, vocab_size: int = 512) -> list[int]:
    """The prompt ids labkit's engine draws for a request without prompt tokens (its
    `Engine.prompt_ids` without the begin-of-sequence token, which the engine adds)."""
    return np.random.default_rng([seed, request_id]).integers(1, vocab_size, prompt_len).tolist()


@dataclass(frozen=True, eq=False)
class ScrapedSeries:
    """The server's own gauges, scraped from /metrics during a replay: requests running and
    waiting, and the share of KV cache in use (0..1), each at `times` (s, the trace's clock).
    Empty when the server has no /metrics."""

    times: np.ndarray
    running: np.ndarray
    waiting: np.ndarray
    kv_usage: np.ndarray

    @classmethod
    def from_samples(cls, samples: list[tuple[float, float, float, float]]) -> ScrapedSeries:
        """From (time, running, waiting, KV usage) samples, in time order."""
        columns = np.array(samples, float).reshape(-1, 4).T
        return cls(*columns)

    def __len__(self) -> int:
        return len(self.times)


def parse_metrics(text: str, model: str) -> tuple[float, float, float] | None:
    """(requests running, requests waiting, KV cache usage) for `model` from a Prometheus text
    exposition with vLLM's names: counts summed and usage averaged over the samples (one per
    engine), or None when a gauge is missing."""
    values: dict[str, list[float]] = {name: [] for name in GAUGES}
    for family in text_string_to_metric_families(text):
        if family.name in values:
            values[family.name] += [s.value for s in family.samples if s.labels.get("model_name", model) == model]
    running, waiting, kv_usage = values.values()
    if not (running and waiting and kv_usage):
        return None
    return sum(running), sum(waiting), float(np.mean(kv_usage))


class ReplayLog(RequestTimes):
    """What a replay measured. Per request, indexed like `trace` (the replayed requests, in
    order, arrivals already scaled): `sent_at`, `first_token_at`, `finished_at` and `tokens_at`
    in seconds on the trace's clock, and `ttft` and `latency` from arrival. `outputs` holds the
    token ids each request received (when the server sends them), `failures` (request id,
    message) pairs, and `server` the gauges scraped from the server while it ran."""

    def __init__(self, trace: Trace, url: str, sent_at: np.ndarray, tokens_at: list[np.ndarray],
                 outputs: dict[int, list[int]], failures: list[tuple[int, str]], server: ScrapedSeries):
        self.trace, self.url, self.sent_at, self.tokens_at = trace, url, sent_at, tokens_at
        self.outputs, self.failures, self.server = outputs, failures, server
        self.is_finished = ~np.isin(trace.ids, [request for request, _ in failures])
        self.first_token_at = np.array([t[0] if done else np.nan for t, done in zip(tokens_at, self.is_finished)])
        self.finished_at = np.array([t[-1] if done else np.nan for t, done in zip(tokens_at, self.is_finished)])
        self.num_tokens = int(trace.output_lengths[self.is_finished].sum())

    def __repr__(self) -> str:
        return (f"ReplayLog({self.url}: {len(self.trace)} requests, {len(self.failures)} failed, "
                f"{self.num_tokens} tokens in {self.duration:.2f} s)")

    @property
    def duration(self) -> float:
        """Seconds from the first request sent to the last token of a finished request."""
        return float(np.nanmax(self.finished_at) - np.nanmin(self.sent_at)) if self.is_finished.any() else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.duration if self.duration else 0.0

    def token_times(self) -> tuple[np.ndarray, np.ndarray]:
        """(request ids, times) of every token chunk of the finished requests, grouped by request."""
        finished = np.flatnonzero(self.is_finished)
        times = [self.tokens_at[i] for i in finished]
        ids = np.repeat(self.trace.ids[finished], [len(t) for t in times])
        return ids, np.concatenate([np.zeros(0), *times])


def replay(
    trace: Trace,
    *,
    url: str,
    model: str,
    rate_scale: float = 1.0,
    max_concurrency: int | None = None,
    requests: int | None = None,
    progress: bool = True,
    seed: int = 0,
    vocab_size: int = 512,
    connect_timeout: float = 5.0,
    read_timeout: float = 300.0,
    scrape_interval: float = 0.1,
) -> ReplayLog:
    """Send `trace`'s requests to the OpenAI-compatible server at `url` at their arrival times,
    stream every answer, and return what was measured.

    url: the server's base URL, e.g. http://127.0.0.1:8000 (`labkit serve`'s default).
    model: the served model's name. rate_scale: 2 sends twice as fast (arrivals / 2).
    max_concurrency: at most this many requests in flight (None: no limit).
    requests: replay only the first this many requests. progress: a progress bar of tokens.
    seed, vocab_size: draw the prompt ids of a trace without prompt tokens as labkit's engine
    does. connect_timeout: seconds to connect; read_timeout: seconds to wait for the next bytes
    of an answer (the first token included). scrape_interval: seconds between scrapes of /metrics.
    """
    _check_arguments(trace, model, url, max_concurrency, requests, seed, vocab_size, rate_scale=rate_scale,
                     connect_timeout=connect_timeout, read_timeout=read_timeout, scrape_interval=scrape_interval)
    if requests is not None:
        trace = trace.select(np.arange(min(requests, len(trace))))
    trace = replace(trace, arrivals=trace.arrivals / rate_scale)
    prompts = ([p.tolist() for p in trace.prompt_tokens] if trace.prompt_tokens else
               [prompt_ids(int(i), int(n), seed, vocab_size) for i, n in zip(trace.ids, trace.prompt_lengths)])
    run = _Replay(trace, prompts, url.rstrip("/"), model, max_concurrency,
                  httpx.Timeout(connect_timeout, read=read_timeout, pool=None), scrape_interval)
    with tqdm(total=int(trace.output_lengths.sum()), unit="tok", disable=not progress, leave=False) as bar:
        _run_in_worker_thread(run, bar)
    return run.log()


def _check_arguments(trace, model, url, max_concurrency, requests, seed, vocab_size, **positive) -> None:
    """A ValueError (a TypeError for the trace) naming the first bad argument and its value."""
    if not isinstance(trace, Trace):
        raise TypeError(f"trace = {trace!r}: must be a labkit Trace (lk.Trace.toy(), lk.Trace.sample(...), ...)")
    if not isinstance(model, str) or not model:
        raise ValueError(f"model = {model!r}: must be the served model's name, as GET /v1/models lists it")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"url = {url!r}: must start with http:// or https://")
    for name, value in positive.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} = {value!r}: must be a number > 0")
    for name, value in (("max_concurrency", max_concurrency), ("requests", requests)):
        if value is not None:
            _check_whole_number(name, value, 1, hint=", or None")
    _check_whole_number("seed", seed, 0)
    _check_whole_number("vocab_size", vocab_size, 2)


def _check_whole_number(name: str, value, minimum: int, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} = {value!r}: must be a whole number >= {minimum}{hint}")


class _Failed(Exception):
    """A request that cannot finish, and why."""


class _Replay:
    """One replay's plan and what it has measured so far: the event loop's thread writes it,
    the caller reads it once that thread has ended."""

    def __init__(self, trace: Trace, prompts: list[list[int]], url: str, model: str,
                 max_concurrency: int | None, timeout: httpx.Timeout, scrape_interval: float):
        self.trace, self.prompts, self.url, self.model = trace, prompts, url, model
        self.max_concurrency, self.timeout, self.scrape_interval = max_concurrency, timeout, scrape_interval
        self.sent_at = np.full(len(trace), np.nan)
        self.tokens_at: list[list[float]] = [[] for _ in range(len(trace))]
        self.token_ids: list[list[int]] = [[] for _ in range(len(trace))]
        self.num_received = np.zeros(len(trace), np.int64)
        self.is_finished = np.zeros(len(trace), bool)
        self.failures: dict[int, str] = {}  # position in the trace -> message
        self.scrapes: list[tuple[float, float, float, float]] = []
        self.unreachable = asyncio.Event()  # set when a request cannot connect
        self.origin = time.perf_counter()  # reset when the loop starts: the trace's time 0

    def now(self) -> float:
        return time.perf_counter() - self.origin

    # The event loop's side

    async def run(self, bar: tqdm) -> None:
        """Send every request at its arrival and scrape /metrics until all have ended."""
        self.origin = time.perf_counter()
        slots = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else contextlib.nullcontext()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=self.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits) as client:
            scraper = asyncio.create_task(self._scrape(client))
            try:
                await asyncio.gather(*(self._request(client, i, slots, bar) for i in range(len(self.trace))))
            finally:
                scraper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await scraper

    async def _request(self, client: httpx.AsyncClient, i: int, slots, bar: tqdm) -> None:
        await self._wait_for_arrival(self.trace.arrivals[i])
        async with slots:
            if self.unreachable.is_set():
                self._fail(i, "not sent: an earlier request could not connect")
                return
            self.sent_at[i] = self.now()
            try:
                async with client.stream("POST", f"{self.url}/v1/completions", json=self._body(i)) as response:
                    await self._read(i, response, bar)
            except (httpx.ConnectError, httpx.ConnectTimeout) as error:
                self.unreachable.set()
                self._fail(i, f"cannot connect ({type(error).__name__}: {str(error) or 'no answer'})")
            except httpx.ReadTimeout:
                self._fail(i, f"no bytes for read_timeout = {self.timeout.read:g} s after "
                              f"{self.num_received[i]} of {self.trace.output_lengths[i]} tokens")
            except httpx.HTTPError as error:
                self._fail(i, f"the stream broke after {self.num_received[i]} of {self.trace.output_lengths[i]} "
                              f"tokens ({type(error).__name__}: {error})")
            except _Failed as failure:
                self._fail(i, str(failure))
            except (KeyError, TypeError, AttributeError, ValueError) as error:
                self._fail(i, f"a malformed answer ({type(error).__name__}: {error})")

    async def _wait_for_arrival(self, arrival: float) -> None:
        """Sleep until `arrival` on the trace's clock, or until the server is found unreachable."""
        while (left := arrival - self.now()) > 0 and not self.unreachable.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.unreachable.wait(), left)

    def _body(self, i: int) -> dict:
        """Request i's completion body; its `priority` only when not 0, the default of every server
        that knows the field (vLLM's, labkit's), so a server that does not is never sent it."""
        length, priority = int(self.trace.output_lengths[i]), int(self.trace.priorities[i])
        body = {"model": self.model, "prompt": self.prompts[i], "max_tokens": length, "min_tokens": length,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        return {**body, "priority": priority} if priority else body

    async def _read(self, i: int, response: httpx.Response, bar: tqdm) -> None:
        """Record each chunk's tokens as it arrives; finish at [DONE], or raise _Failed."""
        if response.is_error:
            await response.aread()
            raise _Failed(f"HTTP {response.status_code}: {_error_text(response.text)}")
        usage = None
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments and event names
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                return self._finish(i, usage)
            chunk = _chunk(data)
            usage = chunk.get("usage") or usage
            self._record(i, chunk.get("choices") or [], bar)
        raise _Failed(f"the stream ended without [DONE] after {self.num_received[i]} of "
                      f"{self.trace.output_lengths[i]} tokens")

    def _record(self, i: int, choices: list[dict], bar: tqdm) -> None:
        """Count a chunk's tokens: its token_ids when given, else one per non-empty text."""
        for choice in choices:
            ids = choice.get("token_ids")
            count = len(ids) if ids is not None else int(bool(choice.get("text")))
            if count:
                self.tokens_at[i].append(self.now())
                self.token_ids[i] += ids or []
                self.num_received[i] += count
                bar.update(count)

    def _finish(self, i: int, usage: dict | None) -> None:
        received = int(usage.get("completion_tokens", self.num_received[i]) if usage else self.num_received[i])
        expected = int(self.trace.output_lengths[i])
        if received != expected:
            raise _Failed(f"received {received} tokens, asked for {expected} "
                          "(does the server honour ignore_eos and min_tokens?)")
        self.is_finished[i] = True

    def _fail(self, i: int, reason: str) -> None:
        self.failures[i] = f"{self.url}: request {int(self.trace.ids[i])}: {reason}"

    async def _scrape(self, client: httpx.AsyncClient) -> None:
        """Sample the server's gauges every scrape_interval; stop for good at a 404."""
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):  # a failed scrape leaves a gap
                response = await client.get(f"{self.url}/metrics", timeout=self.timeout.connect)
                if response.status_code == 404:
                    return
                sample = parse_metrics(response.text, self.model) if response.is_success else None
                if sample:
                    self.scrapes.append((self.now(), *sample))
            await asyncio.sleep(self.scrape_interval)

    # The caller's side, once the loop has ended

    def log(self) -> ReplayLog:
        """The ReplayLog of what was measured; a request neither finished nor failed was interrupted."""
        for i in np.flatnonzero(~self.is_finished):
            if i not in self.failures:
                self._fail(i, "interrupted")
        ids = self.trace.ids.tolist()
        return ReplayLog(
            trace=self.trace,
            url=self.url,
            sent_at=self.sent_at,
            tokens_at=[np.array(times, float) for times in self.tokens_at],
            outputs={ids[i]: tokens for i, tokens in enumerate(self.token_ids) if tokens},
            failures=[(ids[i], self.failures[i]) for i in sorted(self.failures)],
            server=ScrapedSeries.from_samples(self.scrapes),
        )


def _chunk(data: str) -> dict:
    """One streamed chunk as a dict; an error the server streams, or bad JSON, raises _Failed."""
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        raise _Failed(f"a chunk is not JSON: {data[:80]!r}") from None
    if not isinstance(chunk, dict):
        raise _Failed(f"a chunk is not a JSON object: {data[:80]!r}")
    if "error" in chunk or chunk.get("object") == "error":
        raise _Failed(f"the server streamed an error: {_error_text(data)}")
    return chunk


def _error_text(body: str) -> str:
    """The message of an error body, {"message": ...} or {"error": {"message": ...}}, else the body itself."""
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        inner = payload.get("error")
        message = (inner if isinstance(inner, dict) else payload).get("message")
        if message:
            return str(message)
    return body.strip()[:200] or "no message"


def _run_in_worker_thread(run: _Replay, bar: tqdm) -> None:
    """Run the replay's event loop in a thread of its own and wait for it; Ctrl-C cancels the
    replay, waits until the loop has let go of its connections, and returns normally."""
    loop = asyncio.new_event_loop()
    task = loop.create_task(run.run(bar))
    errors: list[BaseException] = []

    def work() -> None:
        try:
            loop.run_until_complete(task)
        except asyncio.CancelledError:
            pass
        except BaseException as error:  # handed to the caller's thread
            errors.append(error)
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    worker = threading.Thread(target=work, name="labkit-replay", daemon=True)
    worker.start()
    try:
        worker.join()
    except KeyboardInterrupt:
        with contextlib.suppress(RuntimeError):  # the loop may have closed meanwhile
            loop.call_soon_threadsafe(task.cancel)
        worker.join()
    if errors:
        raise errors[0]
