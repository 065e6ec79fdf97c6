"""Replay a trace against any OpenAI-compatible server (`labkit serve`, vLLM, `transformers serve`),
as `vllm bench serve` does, and keep what it measured in a `ReplayLog` that `labkit.metrics`
reads like a StepLog.

Invariants:

- times are seconds on the trace's clock: 0 is the moment the replay starts, and request i
  is sent at or after its arrival (`log.trace.arrivals[i]`, the trace's own divided by
  `rate_scale`), never before; TTFT and latency count from that arrival, so time spent
  waiting for the client's `max_concurrency` counts as queueing, as a slot does in the simulator;
- every request ends one way or the other: it finished or it is in `failures` with a message
  that names the URL and the request id. A request finishes at `[DONE]`, or when its stream ends
  after a chunk that gave a `finish_reason` (`transformers serve` sends no `[DONE]`), having
  received exactly its output length in tokens while the server takes `ignore_eos` and
  `min_tokens`, or between 1 and that length once the server refused either of them (a shorter
  answer is then what the server chose, not a failure). A failed request has NaN first-token and
  finish times, and none of its tokens count in `num_output_tokens`, `token_times()` or the duration;
- the metrics count what came back: `log.trace` holds each finished request's output length as
  received (the final usage's `completion_tokens` when the server sends it, else its counted
  tokens), and `log.asked_lengths` what the trace asked for;
- `tokens_at[i]` holds the time of each streamed chunk that carried tokens, and `chunk_sizes[i]`
  how many tokens each carried: its `token_ids`, or one per chunk of text on a server that
  streams text without ids (`transformers serve` sends none for a token that decodes to nothing
  yet); a request that finished without such a chunk gets one time, when its stream ended, for
  all its tokens. `token_times()` gives one time per token: a chunk's n tokens share the gap
  since the chunk before evenly, as if they had streamed one by one (vLLM packs several
  tokens into one chunk under load, and a gap per chunk would make ITL near 0 and
  meaningless); the extra tokens of a request's first chunk have no gap to share and count at
  its time;
- every server is sent the same ids: the model's begin-of-sequence id first when one is known
  (`bos_token_id`, or the tokenizer's), then the trace's prompt, as `Engine.run` feeds the
  model, so a zero-length prompt is a one-token request everywhere and greedy tokens can be
  compared across servers. With no begin-of-sequence id known, a server that refuses an
  empty prompt (vLLM) has such prompts sent as one drawn token instead, once, as a fallback;
- each request asks for its tokens' ids with vLLM's `return_token_ids` (vLLM streams a chunk's
  `token_ids` only when asked; labkit's server always does), so `outputs` can be compared with
  another run's; a server that streams text without ids leaves `outputs` empty;
- a server's refusal is read from its answer, once for the whole replay: an HTTP 400 or 422 whose
  body names `ignore_eos`, `min_tokens`, `return_token_ids` or `priority`, and the request carried
  it, drops that field; one that says a prompt must be a string sends text prompts (exactly each prompt's
  length with a `tokenizer`, else labkit's byte-level text, one ASCII byte per token; an empty
  prompt as one token; the server's tokenizer adds its own begin-of-sequence token, if any);
  one that refuses an empty token-id prompt sends those as one token.
  The first refusal switches the replay's mode, says so once (`log.notes`, on stderr as it
  happens) and is listed in `log.fallbacks`; a refused request is sent again, as is any request
  in flight that the server refused for the same reason. A request is sent again only when its
  refusal names a fallback it was not sent with, so it is sent at most once per fallback, and a
  request refused in the fallback mode fails with the server's message. A resent request keeps
  its first `sent_at`: the refused round trip counts in its TTFT;
- every request asks for greedy decoding (`temperature: 0`, OpenAI's field): a server whose
  model sets no temperature samples at 1.0 by default (vLLM does), and its tokens would then
  match no other run's;
- a request whose trace priority is not 0 is sent with it (vLLM's `priority` field);
- in a trace of several clients, each request is sent with its client as OpenAI's `user`
  field ("client 0", "client 1", ...), which `labkit serve --policy fair` shares the engine by;
- at most `max_concurrency` requests are in flight; once one cannot connect, the server is
  unreachable and every request not yet sent fails at once instead of waiting for its arrival;
- a server without /metrics (HTTP 404), or without vLLM's gauges there, leaves `log.server`
  empty, says so once and fails nothing;
- the replay's event loop always runs in a worker thread, so it runs the same way in a script
  and in Jupyter (whose loop already runs in the caller's thread); Ctrl-C cancels it, and the
  log keeps what was measured, with every request that had not finished failed as "interrupted".

Imports httpx, numpy, tqdm, prometheus_client, labkit.traffic and labkit.serve.tokenizer, never
fastapi; transformers (which loads torch) only to load a `tokenizer` given as a directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from tqdm.auto import tqdm

from labkit.checks import number, whole_number
from labkit.sched.steplog import RequestTimes
from labkit.serve.tokenizer import decode as byte_decode
from labkit.serve.tokenizer import encode as byte_encode
from labkit.traffic import Trace

ONE_TOKEN_PROMPTS = "one-token prompts"  # the fallback for a server that refuses an empty prompt
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
OPTIONAL_FIELDS = ("ignore_eos", "min_tokens", "return_token_ids", "priority")  # vLLM's, which another server may refuse
LENGTH_FIELDS = ("ignore_eos", "min_tokens")  # what holds a server to exactly max_tokens
TEXT_PROMPTS = "text prompts"  # the fallback for a server that takes no token ids
REFUSAL_STATUSES = (400, 422)
PRINTABLE_IDS = range(byte_encode(" ")[0], byte_encode("~")[0] + 1)  # labkit's ids of printable ASCII
MAX_PIECES = 256  # plain tokens a tokenizer's prompt texts are built from
MAX_TEXT_ROUNDS = 16  # decode-encode rounds to reach an exact token count
NOTE_WIDTH = 100  # characters per line of a note, which a terminal or a notebook shows whole


def prompt_ids(request_id: int, prompt_len: int, seed: int = 0, vocab_size: int = 512) -> list[int]:
    """The prompt ids labkit's engine draws for a request without prompt tokens (its
    `Engine.prompt_ids` without the begin-of-sequence token, which the engine adds)."""
    return np.random.default_rng([seed, request_id]).integers(1, vocab_size, prompt_len).tolist()


def per_token_times(chunk_times: np.ndarray, chunk_sizes: np.ndarray) -> np.ndarray:
    """One time per token of a request's stream: the n tokens of a chunk share the gap since the
    chunk before evenly, the k-th at previous + k/n of it; the first chunk's tokens all count at
    its time (no gap before it to share)."""
    previous = np.concatenate([chunk_times[:1], chunk_times[:-1]])  # (chunks,)
    chunk_of_token = np.repeat(np.arange(len(chunk_sizes)), chunk_sizes)  # (tokens,)
    first_token_of_chunk = np.cumsum(chunk_sizes) - chunk_sizes
    share = (np.arange(len(chunk_of_token)) - first_token_of_chunk[chunk_of_token] + 1) / chunk_sizes[chunk_of_token]
    start = previous[chunk_of_token]
    return start + share * (chunk_times[chunk_of_token] - start)


def without(field: str) -> str:
    """The name of the fallback that stops sending `field`, as `ReplayLog.fallbacks` lists it."""
    return f"no {field}"


# Prompts as text, for a server that takes no token ids


def byte_text(ids: list[int]) -> str:
    """labkit's byte-level text of prompt ids: printable ASCII ids as they are, any other id
    folded into them, so the text has one byte, one token of `labkit.serve.tokenizer`, per id."""
    return byte_decode([i if i in PRINTABLE_IDS else PRINTABLE_IDS[i % len(PRINTABLE_IDS)] for i in ids])


def load_tokenizer(tokenizer):
    """None, a Hugging Face tokenizer object as it is (`encode(text, add_special_tokens=False)`,
    `decode(ids)`, `len()`), or one loaded offline from a local directory with transformers'
    AutoTokenizer; anything else is a ValueError that names it."""
    if tokenizer is None or (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")):
        return tokenizer
    if not isinstance(tokenizer, (str, os.PathLike)):
        raise ValueError(f"tokenizer = {tokenizer!r}: must be a tokenizer directory, a Hugging Face tokenizer or None")
    if not os.path.isdir(tokenizer):
        raise ValueError(f"tokenizer = {str(tokenizer)!r}: no such directory (must be a local Hugging Face "
                         "tokenizer directory)")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    except (ImportError, OSError, ValueError) as error:
        raise ValueError(f"tokenizer = {str(tokenizer)!r}: AutoTokenizer cannot load it ({error})") from None


def plain_pieces(tokenizer) -> list[int]:
    """Up to MAX_PIECES token ids, lowest first, that each decode on their own to printable ASCII
    which encodes back to that one id: prompt texts built from them split no character."""
    special, pieces = set(getattr(tokenizer, "all_special_ids", ())), []
    for token in range(len(tokenizer)):
        text = tokenizer.decode([token])
        if (token not in special and text.isascii() and text.isprintable() and text
                and tokenizer.encode(text, add_special_tokens=False) == [token]):
            pieces.append(token)
            if len(pieces) == MAX_PIECES:
                break
    if not pieces:
        raise ValueError(f"tokenizer {_tokenizer_name(tokenizer)}: no token decodes on its own to plain ASCII "
                         "that encodes back to it, so no prompt text of an exact length can be built")
    return pieces


def text_of_length(tokenizer, ids: list[int], pieces: list[int]) -> str:
    """Text that `tokenizer` encodes (without special tokens) to exactly len(ids) tokens: the plain
    pieces the ids pick, decoded and encoded again, cut where pieces split into more tokens and
    topped up where they merged into fewer, until the count holds."""
    length = len(ids)
    tokens = [pieces[i % len(pieces)] for i in ids]
    for round_ in range(MAX_TEXT_ROUNDS):
        text = tokenizer.decode(tokens)
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == length:
            return text
        tokens = encoded[:length] + [pieces[(round_ + k) % len(pieces)] for k in range(length - len(encoded))]
    raise ValueError(f"tokenizer {_tokenizer_name(tokenizer)}: no text of exactly {length} tokens "
                     f"after {MAX_TEXT_ROUNDS} rounds of decoding and encoding")


def _tokenizer_name(tokenizer) -> str:
    return repr(getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__)


class PromptTexts:
    """Each request's prompt as text: exactly its length in `tokenizer`'s tokens (special tokens,
    such as a begin-of-sequence token the server may add, not counted), or without a tokenizer
    labkit's byte-level text, one ASCII byte per prompt token. An empty prompt goes as one token
    (the tokenizer's first plain piece, or a space): servers refuse an empty text prompt, and
    `transformers serve`'s worker dies on one when its tokenizer adds no begin-of-sequence token."""

    def __init__(self, tokenizer=None):
        self.tokenizer = load_tokenizer(tokenizer)
        self.pieces = plain_pieces(self.tokenizer) if self.tokenizer is not None else []
        self.empty = self.tokenizer.decode(self.pieces[:1]) if self.tokenizer is not None else " "

    def __call__(self, ids: list[int]) -> str:
        if not ids:
            return self.empty
        return text_of_length(self.tokenizer, ids, self.pieces) if self.tokenizer is not None else byte_text(ids)

    def describe(self) -> str:
        """How the texts are built, for the note that says the replay sends them."""
        if self.tokenizer is not None:
            return f"text of exactly each prompt's length in the tokens of {_tokenizer_name(self.tokenizer)}"
        return ("labkit's byte-level text, one ASCII byte per prompt token: prompt lengths are approximate "
                "unless the server's tokenizer is byte-level (tokenizer=, or --tokenizer DIR, makes them exact)")


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
    order, arrivals already scaled, each finished request's output length as received):
    `sent_at`, `first_token_at`, `finished_at` and `tokens_at` in seconds on the trace's clock,
    and `ttft` and `latency` from arrival; `asked_lengths` the output lengths the trace asked for.
    By request id: `outputs` holds the token ids each request received (when the server sends
    them), `texts` its text (when the server sends text) and `usage` the server's final usage
    (when it sends one). `failures` holds (request id, message) pairs, `server` the gauges
    scraped from the server while it ran, `fallbacks` what the replay stopped sending because
    the server refused it ("no ignore_eos", "no min_tokens", "no return_token_ids", "no priority",
    "text prompts"), in the order it did, and `notes` what it said once along the way."""

    def __init__(self, trace: Trace, url: str, sent_at: np.ndarray, tokens_at: list[np.ndarray],
                 outputs: dict[int, list[int]], failures: list[tuple[int, str]], server: ScrapedSeries, *,
                 asked_lengths: np.ndarray | None = None, texts: dict[int, str] | None = None,
                 usage: dict[int, dict] | None = None, fallbacks: tuple[str, ...] = (), notes: tuple[str, ...] = (),
                 chunk_sizes: list[np.ndarray] | None = None):
        self.trace, self.url, self.sent_at, self.tokens_at = trace, url, sent_at, tokens_at
        self.chunk_sizes = chunk_sizes or [np.ones(len(t), np.int64) for t in tokens_at]  # tokens per chunk
        self.outputs, self.failures, self.server = outputs, failures, server
        self.asked_lengths = trace.output_lengths if asked_lengths is None else asked_lengths
        self.texts, self.usage = texts or {}, usage or {}
        self.fallbacks, self.notes = fallbacks, notes
        self.is_finished = ~np.isin(trace.ids, [request for request, _ in failures])
        self.first_token_at = np.array([t[0] if done else np.nan for t, done in zip(tokens_at, self.is_finished)])
        self.finished_at = np.array([t[-1] if done else np.nan for t, done in zip(tokens_at, self.is_finished)])
        self.num_output_tokens = int(trace.output_lengths[self.is_finished].sum())

    def __repr__(self) -> str:
        return (f"ReplayLog({self.url}: {len(self.trace)} requests, {len(self.failures)} failed, "
                f"{self.num_output_tokens} tokens in {self.duration:.2f} s)")

    @property
    def duration(self) -> float:
        """Seconds from the first request sent to the last token of a finished request."""
        return float(np.nanmax(self.finished_at) - np.nanmin(self.sent_at)) if self.is_finished.any() else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.duration if self.duration else 0.0

    def token_times(self) -> tuple[np.ndarray, np.ndarray]:
        """(request ids, times) of every token of the finished requests, grouped by request: a
        chunk of several tokens spread over the gap before it (`per_token_times`)."""
        finished = np.flatnonzero(self.is_finished)
        times = [per_token_times(self.tokens_at[i], self.chunk_sizes[i]) for i in finished]
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
    tokenizer=None,
    bos_token_id: int | None = 0,
    api_key: str | None = None,
    connect_timeout: float = 5.0,
    read_timeout: float = 300.0,
    scrape_interval: float = 0.1,
) -> ReplayLog:
    """Send `trace`'s requests to the OpenAI-compatible server at `url` at their arrival times,
    stream every answer, and return what was measured.

    url: the server's base URL, e.g. http://127.0.0.1:8000 (`labkit serve`'s default).
    model: the served model's name, as GET /v1/models lists it (for `transformers serve DIR`, DIR
    as given). rate_scale: 2 sends twice as fast (arrivals / 2).
    max_concurrency: at most this many requests in flight (None: no limit).
    requests: replay only the first this many requests. progress: a progress bar of tokens.
    seed, vocab_size: draw the prompt ids of a trace without prompt tokens as labkit's engine
    does. bos_token_id: the served model's begin-of-sequence id, sent before every token-id
    prompt (labkit's TinyGPT's is 0; a `tokenizer` given brings its own, which wins; None: none
    known). tokenizer: for a server that refuses token-id prompts (`transformers serve`), a local
    Hugging Face tokenizer directory (loaded offline with AutoTokenizer) or tokenizer object, the
    server's own: each prompt is then sent as text of exactly its length in those tokens; without
    one, as labkit's byte-level text, of approximate length. api_key: sent as a Bearer token, for
    a server started with an API key (`labkit serve --api-key`, `vllm serve --api-key`).
    connect_timeout: seconds to connect;
    read_timeout: seconds to wait for the next bytes of an answer (the first token included).
    scrape_interval: seconds between scrapes of /metrics.
    """
    _check_arguments(trace, model, url, max_concurrency, requests, seed, vocab_size, rate_scale=rate_scale,
                     connect_timeout=connect_timeout, read_timeout=read_timeout, scrape_interval=scrape_interval)
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError(f"api_key = {api_key!r}: must be a non-empty string, or None for no key")
    whole_number("bos_token_id", bos_token_id, 0, or_none=True)
    texts = PromptTexts(tokenizer)
    if texts.tokenizer is not None:
        bos_token_id = getattr(texts.tokenizer, "bos_token_id", None)
    if requests is not None:
        trace = trace.select(np.arange(min(requests, len(trace))))
    trace = replace(trace, arrivals=trace.arrivals / rate_scale)
    prompts = ([p.tolist() for p in trace.prompt_tokens] if trace.prompt_tokens else
               [prompt_ids(int(i), int(n), seed, vocab_size) for i, n in zip(trace.ids, trace.prompt_lengths)])
    draw = functools.partial(prompt_ids, seed=seed, vocab_size=vocab_size)
    run = _Replay(trace, prompts, draw, bos_token_id, texts, base_url(url), model, max_concurrency,
                  httpx.Timeout(connect_timeout, read=read_timeout, pool=None), scrape_interval,
                  {"Authorization": f"Bearer {api_key}"} if api_key else {})
    with tqdm(total=int(trace.output_lengths.sum()), unit="tok", disable=not progress, leave=False) as bar:
        _run_in_worker_thread(run, bar)
    return run.log()


def refusals(status: int, body_text: str, body: dict) -> list[str]:
    """The fallbacks an error answer to `body` calls for: an HTTP 400 or 422 whose body names an
    optional field the request carried, says that its prompt, token ids, must be a string, or
    refuses its prompt, an empty list."""
    if status not in REFUSAL_STATUSES:
        return []
    text = body_text.lower()
    named = [without(field) for field in OPTIONAL_FIELDS if field in body and field in text]
    if not isinstance(body["prompt"], str) and "prompt" in text and "string" in text:
        named.append(TEXT_PROMPTS)
    elif body["prompt"] == [] and "prompt" in text:
        named.append(ONE_TOKEN_PROMPTS)
    return named


def served_max_model_len(url: str, model: str, api_key: str | None = None, timeout: float = 5.0) -> int | None:
    """The context, in tokens, that the server at `url` reports for `model` in GET /v1/models
    (vLLM's and labkit's `max_model_len`), or None when it reports none or cannot be asked."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        listed = httpx.get(f"{base_url(url)}/v1/models", headers=headers, timeout=timeout).json()["data"]
        length = next(entry.get("max_model_len") for entry in listed if entry.get("id") == model)
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError, StopIteration):
        return None
    return length if type(length) is int and length > 0 else None


def base_url(url: str) -> str:
    """The server's address without a trailing slash or /v1 (as OpenAI clients take it), to
    which the replay adds /v1/completions and the others."""
    url = url.rstrip("/")
    return url.removesuffix("/v1") if url.endswith("/v1") else url


def _check_arguments(trace, model, url, max_concurrency, requests, seed, vocab_size, **positive) -> None:
    """A ValueError (a TypeError for the trace) naming the first bad argument and its value."""
    if not isinstance(trace, Trace):
        raise TypeError(f"trace = {trace!r}: must be a labkit Trace (lk.Trace.toy(), lk.Trace.sample(...), ...)")
    if not isinstance(model, str) or not model:
        raise ValueError(f"model = {model!r}: must be the served model's name, as GET /v1/models lists it")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"url = {url!r}: must start with http:// or https://")
    for name, value in positive.items():
        number(name, value)
    whole_number("max_concurrency", max_concurrency, or_none=True)
    whole_number("requests", requests, or_none=True)
    whole_number("seed", seed, 0)
    whole_number("vocab_size", vocab_size, 2)


class _Failed(Exception):
    """A request that cannot finish, and why."""


class _Replay:
    """One replay's plan and what it has measured so far: the event loop's thread writes it,
    the caller reads it once that thread has ended."""

    def __init__(self, trace: Trace, prompts: list[list[int]], draw: Callable[[int, int], list[int]],
                 bos_token_id: int | None, texts: PromptTexts, url: str, model: str, max_concurrency: int | None, timeout: httpx.Timeout, scrape_interval: float,
                 headers: dict[str, str]):
        self.trace, self.prompts, self.texts, self.url, self.model = trace, prompts, texts, url, model
        self.draw = draw  # (request id, length) -> prompt ids, as labkit's engine draws them
        self.bos = [] if bos_token_id is None else [bos_token_id]  # sent before every token-id prompt
        self.max_concurrency, self.timeout, self.scrape_interval = max_concurrency, timeout, scrape_interval
        self.headers = headers  # sent with every request: the API key, if any
        self.several_clients = len(np.unique(trace.clients)) > 1  # then each request names its client
        self.sent_at = np.full(len(trace), np.nan)
        self.tokens_at: list[list[float]] = [[] for _ in range(len(trace))]
        self.token_ids: list[list[int]] = [[] for _ in range(len(trace))]
        self.chunk_sizes: list[list[int]] = [[] for _ in range(len(trace))]  # tokens in each chunk timed
        self.received_text: list[list[str]] = [[] for _ in range(len(trace))]
        self.num_received = np.zeros(len(trace), np.int64)
        self.usage: dict[int, dict] = {}  # position in the trace -> the server's final usage
        self.is_finished = np.zeros(len(trace), bool)
        self.failures: dict[int, str] = {}  # position in the trace -> message
        self.fallbacks: list[str] = []  # in the order the server's refusals called for them
        self.notes: list[str] = []
        self.scrapes: list[tuple[float, float, float, float]] = []
        self.unreachable = asyncio.Event()  # set when a request cannot connect
        self.origin = time.perf_counter()  # reset when the loop starts: the trace's time 0

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def note(self, text: str) -> None:
        """Say `text` once, on stderr beside the progress bar, and keep it for the log."""
        if text not in self.notes:
            self.notes.append(text)
            tqdm.write(textwrap.fill(f"labkit replay: {text}", NOTE_WIDTH, subsequent_indent="  "), file=sys.stderr)

    # The event loop's side

    async def run(self, bar: tqdm) -> None:
        """Send every request at its arrival and scrape /metrics until all have ended."""
        self.origin = time.perf_counter()
        slots = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else contextlib.nullcontext()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=self.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits, headers=self.headers) as client:
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
                while not await self._send(client, i, bar):
                    pass  # refused for what a fallback now avoids: sent again, at most once per fallback
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

    async def _send(self, client: httpx.AsyncClient, i: int, bar: tqdm) -> bool:
        """Send request i with the fallbacks taken so far and read its answer; False when the server
        refused something of this request that a fallback avoids (the replay then takes it)."""
        body = self._body(i, set(self.fallbacks))
        async with client.stream("POST", f"{self.url}/v1/completions", json=body) as response:
            if response.is_error:
                await response.aread()
                reason = f"HTTP {response.status_code}: {_error_text(response.text)}"
                refused = refusals(response.status_code, response.text, body)
                if not refused:
                    raise _Failed(reason)
                self._fall_back(refused, reason)
                return False
            await self._read(i, response, all(field in body for field in LENGTH_FIELDS), bar)
            return True

    def _body(self, i: int, fallbacks: set[str]) -> dict:
        """Request i's completion body without what `fallbacks` drop; its `priority` only when not 0,
        the default of every server that knows the field (vLLM's, labkit's), so a server that
        does not is never sent it."""
        length, priority = int(self.trace.output_lengths[i]), int(self.trace.priorities[i])
        body = {"model": self.model, "prompt": self._prompt(i, fallbacks), "max_tokens": length, "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                **({"user": f"client {self.trace.clients[i]}"} if self.several_clients else {})}
        extensions = {"min_tokens": length, "ignore_eos": True, "return_token_ids": True,
                      **({"priority": priority} if priority else {})}
        return {**body, **{field: value for field, value in extensions.items() if without(field) not in fallbacks}}

    def _prompt(self, i: int, fallbacks: set[str]) -> list[int] | str:
        """Request i's prompt: the begin-of-sequence id and its token ids (an empty one as one
        drawn token once the server refused it), or its text once the server refused token ids."""
        if TEXT_PROMPTS not in fallbacks:
            ids = [*self.bos, *self.prompts[i]]
            if not ids and ONE_TOKEN_PROMPTS in fallbacks:
                return self.draw(int(self.trace.ids[i]), 1)
            return ids
        try:
            return self.texts(self.prompts[i])
        except ValueError as error:
            raise _Failed(f"no text prompt: {error}") from None

    def _fall_back(self, refused: list[str], reason: str) -> None:
        """Take the fallbacks a refusal calls for, for the rest of the replay; say so for new ones."""
        new = [fallback for fallback in refused if fallback not in self.fallbacks]
        if not new:
            return
        self.fallbacks += new
        dropped = [field for field in OPTIONAL_FIELDS if without(field) in new]
        effects = [f"requests go without {_listed(dropped)}"] if dropped else []
        if set(dropped) & set(LENGTH_FIELDS):
            effects.append("an answer may stop before its output length, and counts as it came back, not as a failure")
        if "return_token_ids" in dropped:
            effects.append("a chunk that carries text and no token ids counts as one token")
        if "priority" in dropped:
            effects.append("the server does not see the trace's priorities")
        if TEXT_PROMPTS in new:
            effects.append(f"prompts go as {self.texts.describe()}")
        if ONE_TOKEN_PROMPTS in new:
            effects.append("an empty prompt goes as one drawn token (no begin-of-sequence id is known: "
                           "give bos_token_id, or --bos-token-id, to send the model's)")
        self.note(f"{self.url} refused a request ({reason}); from now on {'; '.join(effects)}")

    async def _read(self, i: int, response: httpx.Response, exact: bool, bar: tqdm) -> None:
        """Record each chunk's tokens as it arrives; finish at [DONE], or at the end of a stream
        that gave a finish_reason (transformers serve sends no [DONE]); else raise _Failed."""
        usage, finish_reason = None, None
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments and event names
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                return self._finish(i, usage, exact)
            chunk = _chunk(data)
            usage = chunk.get("usage") or usage
            choices = chunk.get("choices") or []
            finish_reason = next((c["finish_reason"] for c in choices if c.get("finish_reason")), finish_reason)
            self._record(i, choices, bar)
        if finish_reason:
            return self._finish(i, usage, exact)
        raise _Failed(f"the stream ended without [DONE] after {self.num_received[i]} of "
                      f"{self.trace.output_lengths[i]} tokens")

    def _record(self, i: int, choices: list[dict], bar: tqdm) -> None:
        """Count a chunk's tokens: its token_ids when given, else one per non-empty text."""
        for choice in choices:
            ids, text = choice.get("token_ids"), choice.get("text") or ""
            count = len(ids) if ids is not None else int(bool(text))
            if count:
                self.tokens_at[i].append(self.now())
                self.chunk_sizes[i].append(count)
                self.token_ids[i] += ids or []
                self.received_text[i].append(text)
                self.num_received[i] += count
                bar.update(count)

    def _finish(self, i: int, usage: dict | None, exact: bool) -> None:
        """Request i ended well: check its token count (exact while the server honours ignore_eos
        and min_tokens, 1 up to its output length once it refused them) and keep it."""
        received = int(usage.get("completion_tokens", self.num_received[i]) if usage else self.num_received[i])
        asked = int(self.trace.output_lengths[i])
        if exact and received != asked:
            raise _Failed(f"received {received} tokens, asked for {asked} "
                          "(does the server honour ignore_eos and min_tokens?)")
        if not 1 <= received <= asked:
            raise _Failed(f"received {received} tokens, asked for {asked}")
        if not self.tokens_at[i]:
            self.tokens_at[i].append(self.now())  # its tokens came in chunks without text: timed at the end
            self.chunk_sizes[i].append(received)
        self.num_received[i], self.is_finished[i] = received, True
        if usage:
            self.usage[i] = usage

    def _fail(self, i: int, reason: str) -> None:
        self.failures[i] = f"{self.url}: request {int(self.trace.ids[i])}: {reason}"

    async def _scrape(self, client: httpx.AsyncClient) -> None:
        """Sample the server's gauges every scrape_interval; stop for good, and say so, when the
        server has no /metrics (a 404) or no vLLM gauges there."""
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):  # a failed scrape leaves a gap
                response = await client.get(f"{self.url}/metrics", timeout=self.timeout.connect)
                if response.status_code == 404:
                    return self.note(f"{self.url}/metrics: HTTP 404, so no gauge series (log.server is empty)")
                sample = parse_metrics(response.text, self.model) if response.is_success else None
                if response.is_success and sample is None:
                    return self.note(f"{self.url}/metrics lacks vLLM's gauges ({', '.join(GAUGES)}) for model "
                                     f"{self.model!r}, so no gauge series (log.server is empty)")
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
            trace=replace(self.trace, output_lengths=np.where(self.is_finished, self.num_received,
                                                              self.trace.output_lengths)),
            url=self.url,
            sent_at=self.sent_at,
            tokens_at=[np.array(times, float) for times in self.tokens_at],
            chunk_sizes=[np.array(sizes, np.int64) for sizes in self.chunk_sizes],
            outputs={ids[i]: tokens for i, tokens in enumerate(self.token_ids) if tokens},
            failures=[(ids[i], self.failures[i]) for i in sorted(self.failures)],
            server=ScrapedSeries.from_samples(self.scrapes),
            asked_lengths=self.trace.output_lengths,
            texts={ids[i]: "".join(pieces) for i, pieces in enumerate(self.received_text) if any(pieces)},
            usage={ids[i]: usage for i, usage in sorted(self.usage.items())},
            fallbacks=tuple(self.fallbacks),
            notes=tuple(self.notes),
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


def _listed(names: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return " and ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} and {names[-1]}"


def _error_text(body: str) -> str:
    """The message of an error body, {"message": ...}, {"error": {"message": ...}}, {"error": ...} or
    {"detail": ...} (a string); else the body itself, an HTML page's title (or its text, its tags
    dropped), on one line and at most 200 characters."""
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        inner = payload.get("error")
        fields = inner if isinstance(inner, dict) else payload
        message = inner if isinstance(inner, str) else fields.get("message") or fields.get("detail")
        if isinstance(message, str) and message:
            return message
    title = re.search(r"<title[^>]*>(.*?)</title>", body, re.IGNORECASE | re.DOTALL)
    text = title.group(1) if title else re.sub(r"<[^>]+>", " ", body)
    return " ".join(text.split())[:200] or "no message"


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
