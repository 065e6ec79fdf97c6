"""lk.replay against a stand-in server on the loopback: tokens, times, concurrency, scraping,
failures of every kind, the fallbacks for a server that refuses vLLM's extensions or token-id
prompts, text prompts of an exact length, Ctrl-C, a running event loop, and the `labkit replay`
command. (tests/test_replay_transformers_serve.py replays against a real server that refuses them.)

The stand-in follows the server contract as vLLM keeps it (a chunk per token, with token ids counting
up from 0 only when the request asks for them with `return_token_ids`, a usage chunk, [DONE], /metrics
with vLLM's gauges, and its context in /v1/models when a test sets one) and misbehaves on request: each test picks
which output lengths get an HTTP 500, a dropped stream or a short answer, and which fields or
prompts it refuses as `transformers serve` does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

import labkit as lk
from labkit.analysis import metrics
from labkit.serve.replay import (NOTE_WIDTH, PromptTexts, ReplayLog, ScrapedSeries, byte_text, parse_metrics,
                                 per_token_times, plain_pieces, prompt_ids, refusals, replay, text_of_length)
from labkit.serve.replay_cli import add_replay_parser, replay_command

MODEL = "stand-in"
TOKEN_SECONDS = 0.004  # the stand-in's pause before each token
STALL_SECONDS = 60  # how long a stalled stream pauses: far longer than any bound a test checks, so none waits it out
WATCHDOG_SECONDS = 30  # a replay still running this long is sent Ctrl-C, which marks its unfinished requests


@dataclass
class Behaviour:
    """What the stand-in does, and what it saw."""

    fail: set[int] = field(default_factory=set)  # output lengths answered with HTTP 500
    drop: set[int] = field(default_factory=set)  # output lengths whose stream breaks after two tokens
    short: set[int] = field(default_factory=set)  # output lengths answered with one token too few
    no_done: set[int] = field(default_factory=set)  # output lengths whose stream ends without [DONE]
    cut: set[int] = field(default_factory=set)  # output lengths whose stream ends after two tokens, and that is all
    blank: set[int] = field(default_factory=set)  # output lengths whose chunks carry neither text nor token ids
    stall: set[int] = field(default_factory=set)  # output lengths whose stream pauses STALL_SECONDS after two tokens
    interrupt: set[int] = field(default_factory=set)  # output lengths whose stream sends Ctrl-C after two tokens
    inject: dict[int, str] = field(default_factory=dict)  # output length -> a raw chunk sent after the first token
    text_only: bool = False  # chunks without token_ids, even when asked for them
    max_model_len: int | None = None  # reported in GET /v1/models, as vLLM reports it
    has_metrics: bool = True
    foreign_metrics: bool = False  # a /metrics without vLLM's gauges
    refused_fields: set[str] = field(default_factory=set)  # answered with HTTP 422 when sent, as transformers serve
    text_prompts_only: bool = False  # token-id prompts answered with HTTP 400, as transformers serve
    refuse_always: str = ""  # when set, every request is answered with HTTP 422 and this detail
    packed: int = 1  # tokens per chunk, as vLLM packs them under load
    refuse_empty: bool = False  # an empty token-id prompt answered with HTTP 400, as vLLM
    received: list[tuple[float, dict]] = field(default_factory=list)  # (perf_counter, body) per completion
    streaming: int = 0
    max_streaming: int = 0


class StandIn:
    """A FastAPI app that follows the server contract, served by uvicorn in a thread."""

    def __init__(self):
        self.behaviour = Behaviour()
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        config = uvicorn.Config(self.app(), log_level="critical", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> StandIn:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the stand-in server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return PlainTextResponse("")

        @app.get("/v1/models")
        async def models():
            reported = {} if self.behaviour.max_model_len is None else {"max_model_len": self.behaviour.max_model_len}
            return {"object": "list", "data": [{"id": "another-model", "object": "model", "max_model_len": 1},
                                               {"id": MODEL, "object": "model", **reported}]}

        @app.get("/metrics")
        async def exposition():
            if not self.behaviour.has_metrics:
                return PlainTextResponse("Not Found", status_code=404)
            if self.behaviour.foreign_metrics:
                return PlainTextResponse("# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 1\n")
            running = self.behaviour.streaming
            return PlainTextResponse(
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{model_name="{MODEL}"}} {running}\n'
                "# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 7\n'
                "# TYPE vllm:kv_cache_usage_perc gauge\n"
                f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} {running / 10}\n'
            )

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.behaviour.received.append((time.perf_counter(), body))
            refusal = self.refusal(body)
            if refusal:
                return JSONResponse({"detail": refusal[1]}, status_code=refusal[0])
            if body["max_tokens"] in self.behaviour.fail:
                return JSONResponse({"object": "error", "message": "stand-in failure", "type": "InternalServerError",
                                     "code": 500}, status_code=500)
            return StreamingResponse(self.stream(body["max_tokens"], body.get("return_token_ids", False)),
                                     media_type="text/event-stream")

        return app

    def refusal(self, body: dict) -> tuple[int, str] | None:
        """(status, detail) as transformers serve refuses a request, or None."""
        if self.behaviour.refuse_always:
            return 422, self.behaviour.refuse_always
        unexpected = sorted(self.behaviour.refused_fields & set(body))
        if unexpected:
            return 422, f"Unexpected fields in the request: {unexpected}"
        if self.behaviour.text_prompts_only and not isinstance(body["prompt"], str):
            return 400, "prompt must be a string."
        if self.behaviour.refuse_empty and body["prompt"] == []:
            return 400, "You must pass at least one prompt"
        return None

    async def stream(self, max_tokens: int, with_ids: bool):
        behaviour = self.behaviour
        num_sent = max_tokens - 1 if max_tokens in behaviour.short else max_tokens
        behaviour.streaming += 1
        behaviour.max_streaming = max(behaviour.max_streaming, behaviour.streaming)
        pack = []
        try:
            for k in range(num_sent):
                await asyncio.sleep(TOKEN_SECONDS)
                if k == 2 and max_tokens in behaviour.drop:
                    raise ConnectionAbortedError("the stand-in drops this stream")
                if k == 2 and max_tokens in behaviour.interrupt:
                    ctrl_c()
                if k == 2 and max_tokens in behaviour.stall:
                    await asyncio.sleep(STALL_SECONDS)
                if k == 2 and max_tokens in behaviour.cut:
                    return
                if k == 1 and max_tokens in behaviour.inject:
                    yield f"data: {behaviour.inject[max_tokens]}\n\n"
                blank = max_tokens in behaviour.blank
                choice = {"index": 0, "text": "" if blank else f" t{k}",
                          "finish_reason": "length" if k == num_sent - 1 else None}
                if with_ids and not (behaviour.text_only or blank):  # vLLM streams ids only when asked
                    choice["token_ids"] = [k]
                if behaviour.packed > 1:  # one chunk for every `packed` tokens, and one for the rest
                    pack.append(k)
                    if len(pack) < behaviour.packed and k < num_sent - 1:
                        continue
                    choice.update(text="".join(f" t{i}" for i in pack), token_ids=pack)
                    pack = []
                yield _event({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": MODEL,
                              "choices": [choice]})
        finally:
            behaviour.streaming -= 1  # before [DONE]: a client never starts its next request before this
        yield _event({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": MODEL, "choices": [],
                      "usage": {"prompt_tokens": 0, "completion_tokens": num_sent, "total_tokens": num_sent}})
        if max_tokens not in behaviour.no_done:
            yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def ctrl_c() -> None:
    """Press Ctrl-C: SIGINT to the main thread, where `replay` waits for its worker."""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


@contextlib.contextmanager
def watchdog(seconds: float = WATCHDOG_SECONDS):
    """Press Ctrl-C if the block still runs after `seconds`: a replay that waits for what it should
    not ends with its unsent requests "interrupted", which the test's checks of its failures catch."""
    timer = threading.Timer(seconds, ctrl_c)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@pytest.fixture(scope="module")
def server():
    with StandIn() as stand_in:
        yield stand_in


@pytest.fixture
def stand_in(server):
    server.behaviour = Behaviour()
    return server


def closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def by_prompt(stand_in: StandIn) -> dict[int, float]:
    """When the stand-in received each request, by its one-token prompt (after the begin-of-sequence id)."""
    return {body["prompt"][-1]: at for at, body in stand_in.behaviour.received}


# Tokens and times ------------------------------------------------------------------------------


def test_every_request_streams_exactly_its_length_and_metrics_equal_hand_computed_values(stand_in):
    lengths = [3, 5, 1, 4]
    trace = lk.Trace.from_lengths(lengths, prompt_lengths=[2, 0, 3, 1], arrivals=[0, 0.02, 0.04, 0.06])
    log = replay(trace, url=stand_in.url, model=MODEL, progress=False)
    assert log.failures == []
    assert log.outputs == {i: list(range(n)) for i, n in enumerate(lengths)}
    assert [len(t) for t in log.tokens_at] == lengths
    ttft = [t[0] - a for t, a in zip(log.tokens_at, trace.arrivals)]
    latency = [t[-1] - a for t, a in zip(log.tokens_at, trace.arrivals)]
    gaps = np.concatenate([np.diff(t) for t in log.tokens_at])
    tpot = [(t[-1] - t[0]) / (n - 1) for t, n in zip(log.tokens_at, lengths) if n > 1]
    row = metrics.summary(log)
    assert row["tokens"] == 13 and row["failed requests"] == 0
    assert row["tokens/s"] == 13 / (max(t[-1] for t in log.tokens_at) - log.sent_at.min())
    for q in (50, 99):
        assert row[f"TTFT p{q} (s)"] == np.percentile(ttft, q)
        assert row[f"latency p{q} (s)"] == np.percentile(latency, q)
        assert row[f"ITL p{q} (ms)"] == 1000 * np.percentile(gaps, q)
    assert row["TPOT mean (ms)"] == pytest.approx(1000 * np.mean(tpot), rel=1e-12)
    assert len(gaps) == 13 - 4 and (gaps > 0).all()
    assert (np.array(ttft) >= TOKEN_SECONDS).all()  # no token comes before the stand-in's first pause


def test_requests_are_sent_at_their_scaled_arrivals_and_never_before(stand_in):
    trace = lk.Trace.from_lengths([2, 2, 2, 2], arrivals=[0, 40, 80, 120], prompt_tokens=[[0], [1], [2], [3]])
    before = time.perf_counter()
    with watchdog():  # unscaled, the last request would wait 120 s
        log = replay(trace, url=stand_in.url, model=MODEL, rate_scale=400, progress=False)
    assert log.trace.arrivals.tolist() == [0, 0.1, 0.2, 0.3]
    assert log.failures == [] and log.num_output_tokens == 8  # all sent before the watchdog's Ctrl-C
    assert (log.sent_at >= log.trace.arrivals).all()
    received = by_prompt(stand_in)
    for i, arrival in enumerate(log.trace.arrivals):
        assert received[i] >= before + arrival


def test_requests_replays_only_the_first_requests(stand_in):
    trace = lk.Trace.from_lengths([2, 3, 4, 5, 6])
    log = replay(trace, url=stand_in.url, model=MODEL, requests=2, progress=False)
    assert log.trace.ids.tolist() == [0, 1] and log.num_output_tokens == 5
    assert sorted(body["max_tokens"] for _, body in stand_in.behaviour.received) == [2, 3]


def test_every_request_asks_for_exactly_its_length(stand_in):
    replay(lk.Trace.from_lengths([4]), url=stand_in.url, model=MODEL, progress=False)
    [(_, body)] = stand_in.behaviour.received
    assert body == {"model": MODEL, "prompt": [0], "max_tokens": 4, "temperature": 0, "min_tokens": 4,
                    "ignore_eos": True, "return_token_ids": True, "stream": True,
                    "stream_options": {"include_usage": True}}


def test_prompt_ids_equal_the_engine_s():
    from labkit.engine import Engine, ModelConfig

    engine = Engine(ModelConfig(vocab_size=97, d_model=16, n_layers=1, n_heads=2, d_ff=32), seed=3)
    for request_id, length in ((0, 5), (7, 12), (123, 0)):
        assert prompt_ids(request_id, length, seed=3, vocab_size=97) == engine.prompt_ids(request_id, length)[1:]
    assert prompt_ids(7, 12, seed=4, vocab_size=97) != engine.prompt_ids(7, 12)[1:]  # the seed matters


def test_prompts_are_the_trace_s_own_or_drawn_as_the_engine_draws_them(stand_in):
    drawn = lk.Trace.from_lengths([1, 1, 1], prompt_lengths=[3, 0, 5])
    replay(drawn, url=stand_in.url, model=MODEL, seed=2, vocab_size=50, progress=False)
    sent = sorted(body["prompt"] for _, body in stand_in.behaviour.received)
    assert sent == sorted([0, *prompt_ids(i, n, seed=2, vocab_size=50)] for i, n in enumerate([3, 0, 5]))
    stand_in.behaviour.received.clear()
    own = lk.Trace.from_lengths([1, 1], prompt_tokens=[[9, 8], [7]])
    replay(own, url=stand_in.url, model=MODEL, bos_token_id=5, progress=False)
    assert sorted(body["prompt"] for _, body in stand_in.behaviour.received) == [[5, 7], [5, 9, 8]]
    stand_in.behaviour.received.clear()
    replay(own, url=stand_in.url, model=MODEL, bos_token_id=None, progress=False)
    assert sorted(body["prompt"] for _, body in stand_in.behaviour.received) == [[7], [9, 8]]


def test_chunks_without_token_ids_count_one_token_each(stand_in):
    stand_in.behaviour.text_only = True
    log = replay(lk.Trace.from_lengths([3, 2]), url=stand_in.url, model=MODEL, progress=False)
    assert log.failures == [] and log.outputs == {}
    assert [len(t) for t in log.tokens_at] == [3, 2] and log.num_output_tokens == 5


# Concurrency and scraping ------------------------------------------------------------------------


def test_max_concurrency_holds_and_without_it_everyone_streams_at_once(stand_in):
    trace = lk.Trace.from_lengths([25] * 6)  # 0.1 s each: six at once overlap even on a busy machine
    limited = replay(trace, url=stand_in.url, model=MODEL, max_concurrency=2, progress=False)
    assert limited.failures == [] and stand_in.behaviour.max_streaming == 2
    stand_in.behaviour.max_streaming = 0
    replay(trace, url=stand_in.url, model=MODEL, progress=False)
    assert stand_in.behaviour.max_streaming == 6  # the negative control: the limit was what held it


def test_the_server_s_gauges_are_scraped_while_the_replay_runs(stand_in):
    log = replay(lk.Trace.from_lengths([40] * 4), url=stand_in.url, model=MODEL, scrape_interval=0.01,
                 progress=False)
    series = log.server
    assert len(series) >= 3
    assert (np.diff(series.times) > 0).all() and 0 <= series.times[0]
    assert len(series) <= log.duration / 0.01 + 2  # one scrape per interval at most: no clock margin, one-sided
    assert series.running.max() >= 1 and set(series.running) <= {0, 1, 2, 3, 4}
    assert (series.waiting == 7).all()
    assert series.kv_usage.tolist() == (series.running / 10).tolist()


def test_a_server_without_metrics_gives_an_empty_series_and_says_so_once(stand_in, capsys):
    stand_in.behaviour.has_metrics = False
    log = replay(lk.Trace.from_lengths([5, 5]), url=stand_in.url, model=MODEL, scrape_interval=0.01, progress=False)
    assert log.failures == [] and len(log.server) == 0 and log.server.running.shape == (0,)
    note = f"{stand_in.url}/metrics: HTTP 404, so no gauge series (log.server is empty)"
    assert log.notes == (note,) and log.fallbacks == ()
    assert capsys.readouterr().err.replace("\n  ", " ") == f"labkit replay: {note}\n"


def test_a_metrics_page_without_vllm_s_gauges_gives_an_empty_series_and_says_so(stand_in):
    stand_in.behaviour.foreign_metrics = True
    log = replay(lk.Trace.from_lengths([5, 5]), url=stand_in.url, model=MODEL, scrape_interval=0.01, progress=False)
    assert log.failures == [] and len(log.server) == 0
    assert log.notes == (f"{stand_in.url}/metrics lacks vLLM's gauges (vllm:num_requests_running, "
                         f"vllm:num_requests_waiting, vllm:kv_cache_usage_perc) for model '{MODEL}', so no gauge "
                         "series (log.server is empty)",)


def test_parse_metrics_sums_engines_averages_kv_and_keeps_to_the_model():
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2\n'
        'vllm:num_requests_running{engine="0",model_name="other"} 50\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="m"} 4\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75\n'
        "# TYPE vllm:num_preemptions counter\n"
        'vllm:num_preemptions_total{model_name="m"} 9\n'
    )
    assert parse_metrics(text, "m") == (5, 4, 0.5)
    assert parse_metrics(text, "other") is None  # no waiting or KV gauge for it
    assert parse_metrics("", "m") is None


# Failures -------------------------------------------------------------------------------------


def test_a_url_ending_in_v1_is_the_servers_address(stand_in):
    """OpenAI clients take the base URL with /v1 (and a slash): the replay asks for /v1/completions
    once, not /v1/v1/completions."""
    for url in (f"{stand_in.url}/v1", f"{stand_in.url}/v1/", f"{stand_in.url}/"):
        log = replay(lk.Trace.from_lengths([3, 2]), url=url, model=MODEL, progress=False)
        assert not log.failures and log.num_output_tokens == 5


@pytest.mark.parametrize("body, message", [
    ("<!DOCTYPE html><html><head><title>502 Bad\n Gateway</title></head><body><h1>nginx</h1>" + "x" * 5000,
     "502 Bad Gateway"),
    ("<html><body><h1>Service</h1><p>down   for\nmaintenance</p></body></html>", "Service down for maintenance"),
    ('{"error": {"message": "queue full"}}', "queue full"),  # an API's error: its message, as before
])
def test_a_non_api_error_page_is_one_short_line(body, message):
    from labkit.serve.replay import _error_text

    assert _error_text(body) == message


def test_an_error_answer_fails_its_request_and_the_others_finish(stand_in):
    stand_in.behaviour.fail = {13}
    log = replay(lk.Trace.from_lengths([3, 13, 4]), url=stand_in.url, model=MODEL, progress=False)
    [(request, message)] = log.failures
    assert request == 1
    assert message == f"{stand_in.url}: request 1: HTTP 500: stand-in failure"
    assert log.is_finished.tolist() == [True, False, True] and log.num_output_tokens == 7
    assert np.isnan(log.ttft[1]) and not np.isnan(log.ttft[[0, 2]]).any()
    row = metrics.summary(log)
    assert row["failed requests"] == 1 and row["tokens"] == 7
    assert row["TTFT p99 (s)"] == np.percentile(log.ttft[[0, 2]], 99)  # the failed request's NaN is skipped
    assert metrics.meets_slos(log).tolist() == [True, False, True]


def test_a_stream_dropped_midway_fails_with_what_it_had_received(stand_in):
    stand_in.behaviour.drop = {7}
    log = replay(lk.Trace.from_lengths([3, 7, 4]), url=stand_in.url, model=MODEL, progress=False)
    [(request, message)] = log.failures
    assert request == 1 and message.startswith(f"{stand_in.url}: request 1: the stream broke after 2 of 7 tokens (")
    assert log.outputs[1] == [0, 1] and len(log.tokens_at[1]) == 2  # kept, but counted nowhere
    assert log.num_output_tokens == 7 and metrics.token_times(log)[0].tolist() == [0, 0, 0, 2, 2, 2, 2]


def test_a_short_answer_fails(stand_in):
    stand_in.behaviour.short = {5}
    log = replay(lk.Trace.from_lengths([5, 2]), url=stand_in.url, model=MODEL, progress=False)
    assert log.failures == [(0, f"{stand_in.url}: request 0: received 4 tokens, asked for 5 "
                                "(does the server honour ignore_eos and min_tokens?)")]


def test_a_stream_that_ends_without_done_or_a_finish_reason_fails(stand_in):
    stand_in.behaviour.cut = {3}
    log = replay(lk.Trace.from_lengths([2, 3]), url=stand_in.url, model=MODEL, progress=False)
    assert log.failures == [(1, f"{stand_in.url}: request 1: the stream ended without [DONE] after 2 of 3 tokens")]


def test_a_stream_that_gave_its_finish_reason_finishes_without_done_as_transformers_serve_s(stand_in):
    stand_in.behaviour.no_done = {3}
    log = replay(lk.Trace.from_lengths([2, 3]), url=stand_in.url, model=MODEL, progress=False)
    assert log.failures == [] and log.outputs == {0: [0, 1], 1: [0, 1, 2]} and log.num_output_tokens == 5


def test_a_stalled_stream_fails_after_the_read_timeout(stand_in):
    stand_in.behaviour.stall = {6}  # for STALL_SECONDS: without the timeout, it would finish, and not fail
    log = replay(lk.Trace.from_lengths([6, 3]), url=stand_in.url, model=MODEL, read_timeout=0.2, progress=False)
    assert log.failures == [(0, f"{stand_in.url}: request 0: no bytes for read_timeout = 0.2 s after 2 of 6 tokens")]
    assert log.is_finished.tolist() == [False, True]


@pytest.mark.parametrize(
    "chunk, reason",
    [
        ('{"error": {"message": "out of memory", "type": "InternalServerError", "code": 500}}',
         "the server streamed an error: out of memory"),
        ('{"object": "error", "message": "boom", "type": "BadRequestError", "code": 400}',
         "the server streamed an error: boom"),
        ("not json", "a chunk is not JSON: 'not json'"),
        ("[1, 2]", "a chunk is not a JSON object: '[1, 2]'"),
        ('{"choices": [{"index": 0, "token_ids": 7}]}',
         "a malformed answer (TypeError: object of type 'int' has no len())"),
    ],
)
def test_a_bad_chunk_fails_its_request_with_the_reason(stand_in, chunk, reason):
    stand_in.behaviour.inject = {4: chunk}
    log = replay(lk.Trace.from_lengths([4, 3]), url=stand_in.url, model=MODEL, progress=False)
    assert log.failures == [(0, f"{stand_in.url}: request 0: {reason}")]
    assert log.is_finished.tolist() == [False, True]


def test_an_unreachable_server_fails_every_request_fast():
    url = closed_port_url()
    trace = lk.Trace.from_lengths([2, 2, 2], arrivals=[0, 60, 120])
    with watchdog():  # a replay that waited for the arrivals would say "interrupted" below, not "not sent"
        log = replay(trace, url=url, model=MODEL, progress=False)
    assert [request for request, _ in log.failures] == [0, 1, 2]
    assert log.failures[0][1].startswith(f"{url}: request 0: cannot connect (ConnectError")
    assert log.failures[1][1] == f"{url}: request 1: not sent: an earlier request could not connect"
    assert log.num_output_tokens == 0 and log.tokens_per_second == 0.0 and np.isnan(log.sent_at[1:]).all()
    assert metrics.summary(log)["failed requests"] == 3


def test_ctrl_c_stops_the_replay_and_keeps_what_was_measured(stand_in):
    stand_in.behaviour.interrupt = stand_in.behaviour.stall = {400}  # Ctrl-C after two tokens, then a stall
    trace = lk.Trace.from_lengths([2, 400, 2], arrivals=[0, 0, STALL_SECONDS])
    log = replay(trace, url=stand_in.url, model=MODEL, progress=False)  # left alone: the three would finish
    assert log.failures == [(1, f"{stand_in.url}: request 1: interrupted"),
                            (2, f"{stand_in.url}: request 2: interrupted")]
    assert log.is_finished.tolist() == [True, False, False] and log.num_output_tokens == 2
    assert 1 <= len(log.tokens_at[1]) <= 2 and np.isnan(log.sent_at[2])  # the stand-in sent two before Ctrl-C


def test_it_runs_where_an_event_loop_already_runs_as_in_jupyter(stand_in):
    async def notebook_cell():
        return replay(lk.Trace.from_lengths([3, 2]), url=stand_in.url, model=MODEL, progress=False)

    log = asyncio.run(notebook_cell())
    assert log.failures == [] and log.num_output_tokens == 5


@pytest.mark.parametrize(
    "changes, error",
    [
        ({"url": "localhost:8000"}, r"url = 'localhost:8000': must start with http:// or https://"),
        ({"url": "ftp://host"}, r"url = 'ftp://host'"),
        ({"model": ""}, r"model = ''"),
        ({"rate_scale": 0}, r"rate_scale = 0: must be a number > 0"),
        ({"rate_scale": float("nan")}, r"rate_scale = nan"),
        ({"max_concurrency": 0}, r"max_concurrency = 0: must be a whole number >= 1, or None"),
        ({"max_concurrency": 1.5}, r"max_concurrency = 1.5"),
        ({"requests": 0}, r"requests = 0: must be a whole number >= 1, or None"),
        ({"read_timeout": -1}, r"read_timeout = -1"),
        ({"scrape_interval": 0}, r"scrape_interval = 0"),
        ({"requests": True}, r"requests = True"),
        ({"seed": -1}, r"seed = -1: must be a whole number >= 0"),
        ({"vocab_size": 1}, r"vocab_size = 1: must be a whole number >= 2"),
        ({"tokenizer": "/no/such/dir"}, r"tokenizer = '/no/such/dir': no such directory"),
        ({"tokenizer": 3}, r"tokenizer = 3: must be a tokenizer directory, a Hugging Face tokenizer or None"),
    ],
)
def test_bad_arguments_name_the_field_and_value(changes, error):
    arguments = {"url": "http://127.0.0.1:9", "model": MODEL, **changes}  # a closed port: never reached
    with pytest.raises(ValueError, match=error):
        replay(lk.Trace.toy(), **arguments)


def test_a_trace_that_is_not_a_trace_says_so():
    with pytest.raises(TypeError, match=r"trace = \[2, 3\]: must be a labkit Trace"):
        replay([2, 3], url="http://127.0.0.1:9", model=MODEL)


# A server that refuses vLLM's extensions or token-id prompts ------------------------------------


def sends_by_length(stand_in: StandIn) -> dict[int, list[dict]]:
    """Every body the stand-in received, by its max_tokens, in the order it received them."""
    sends = {}
    for _, body in stand_in.behaviour.received:
        sends.setdefault(body["max_tokens"], []).append(body)
    return sends


def test_a_refusal_is_read_from_the_answer_and_only_for_what_the_request_carried():
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 3, "min_tokens": 3, "ignore_eos": True}
    fields = '{"detail":"Unexpected fields in the request: {\'min_tokens\', \'ignore_eos\'}"}'
    assert refusals(422, fields, body) == ["no ignore_eos", "no min_tokens"]
    assert refusals(400, '{"detail":"prompt must be a string."}', body) == ["text prompts"]
    assert refusals(422, '{"detail":[{"loc":["body","prompt"],"msg":"Input should be a valid string"}]}',
                    body) == ["text prompts"]  # pydantic's words for it
    assert refusals(500, fields, body) == []  # only a 400 or a 422 refuses
    assert refusals(422, '{"detail":"Unexpected fields in the request: {\'priority\'}"}', body) == []  # not sent
    assert refusals(400, '{"detail":"prompt must be a string."}', {**body, "prompt": "ab"}) == []  # already text
    assert refusals(400, '{"detail":"The model `x` does not exist."}', body) == []


def test_a_server_that_refuses_the_length_fields_and_token_ids_gets_neither_from_then_on(stand_in, capsys):
    stand_in.behaviour.refused_fields = {"ignore_eos", "min_tokens"}
    stand_in.behaviour.text_prompts_only = True
    stand_in.behaviour.short = {5}  # an answer may stop early once ignore_eos and min_tokens are refused
    lengths, prompt_lengths = [5, 3, 4, 2], [3, 0, 2, 4]
    log = replay(lk.Trace.from_lengths(lengths, prompt_lengths=prompt_lengths), url=stand_in.url, model=MODEL,
                 progress=False)  # all four sent at once: a race for the first refusal
    assert log.failures == []
    assert log.fallbacks == ("no ignore_eos", "no min_tokens", "text prompts")
    assert log.notes == (
        f"{stand_in.url} refused a request (HTTP 422: Unexpected fields in the request: ['ignore_eos', "
        "'min_tokens']); from now on requests go without ignore_eos and min_tokens; an answer may stop before its "
        "output length, and counts as it came back, not as a failure",
        f"{stand_in.url} refused a request (HTTP 400: prompt must be a string.); from now on prompts go as "
        "labkit's byte-level text, one ASCII byte per prompt token: prompt lengths are approximate unless the "
        "server's tokenizer is byte-level (tokenizer=, or --tokenizer DIR, makes them exact)",
    )
    said = "".join(f"labkit replay: {note}\n" for note in log.notes)  # each said once, wrapped to the note width
    err = capsys.readouterr().err
    assert err.replace("\n  ", " ") == said and max(map(len, err.splitlines())) <= NOTE_WIDTH
    assert max(map(len, said.splitlines())) > NOTE_WIDTH  # the control: unwrapped, the lines are longer
    sends = sends_by_length(stand_in)
    first = sends[5][0]  # the first request sent: before any refusal, as to any server
    assert first["prompt"] == [0, *prompt_ids(0, 3)] and first["ignore_eos"] is True and first["min_tokens"] == 5
    prompts = [byte_text(prompt_ids(i, n)) or " " for i, n in enumerate(prompt_lengths)]  # an empty one: a space
    assert [sends[n][-1] for n in lengths] == [
        {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
         "stream_options": {"include_usage": True}, "return_token_ids": True} for prompt, n in zip(prompts, lengths)]
    assert all(1 < len(sends[n]) <= 3 for n in lengths)  # refused at most once per fallback, never in a loop
    # the metrics count what came back: request 0 got 4 of its 5 tokens
    assert log.asked_lengths.tolist() == lengths and log.trace.output_lengths.tolist() == [4, 3, 4, 2]
    assert [len(t) for t in log.tokens_at] == [4, 3, 4, 2] and log.num_output_tokens == 13
    row = metrics.summary(log)
    tpot = [(t[-1] - t[0]) / (n - 1) for t, n in zip(log.tokens_at, [4, 3, 4, 2])]
    assert row["tokens"] == 13 and row["TPOT mean (ms)"] == pytest.approx(1000 * np.mean(tpot), rel=1e-12)


@pytest.mark.integration  # loads transformers (seconds to import): `make test` runs it
def test_with_a_tokenizer_each_text_prompt_is_exactly_its_length_in_its_tokens(stand_in):
    from labkit.engine.peers import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    stand_in.behaviour.text_prompts_only = True
    lengths, prompt_lengths = [3, 2, 4], [6, 0, 9]
    log = replay(lk.Trace.from_lengths(lengths, prompt_lengths=prompt_lengths), url=stand_in.url, model=MODEL,
                 tokenizer=tokenizer, progress=False)
    assert log.failures == [] and log.fallbacks == ("text prompts",)
    assert log.notes == (f"{stand_in.url} refused a request (HTTP 400: prompt must be a string.); from now on "
                         "prompts go as text of exactly each prompt's length in the tokens of "
                         f"'{type(tokenizer).__name__}'",)
    prompts = [sends_by_length(stand_in)[n][-1]["prompt"] for n in lengths]
    assert [len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts] == [6, 1, 9]  # an empty one: 1
    assert all("ignore_eos" in sends_by_length(stand_in)[n][-1] for n in lengths)  # lengths still exact


def test_a_request_refused_again_without_the_field_fails_with_the_server_s_message(stand_in):
    stand_in.behaviour.refuse_always = "Unexpected fields in the request: {'ignore_eos'}"
    log = replay(lk.Trace.from_lengths([2]), url=stand_in.url, model=MODEL, progress=False)
    assert log.fallbacks == ("no ignore_eos",)
    assert log.failures == [(0, f"{stand_in.url}: request 0: HTTP 422: Unexpected fields in the request: "
                                "{'ignore_eos'}")]
    first, second = sends_by_length(stand_in)[2]  # sent as asked, then once without it: never a loop
    assert first["ignore_eos"] is True and "ignore_eos" not in second and second["min_tokens"] == 2


def test_an_error_that_names_nothing_a_fallback_avoids_fails_at_once(stand_in):
    stand_in.behaviour.refuse_always = "The model `stand-in` does not exist."
    log = replay(lk.Trace.from_lengths([2]), url=stand_in.url, model=MODEL, progress=False)
    assert log.fallbacks == () and len(stand_in.behaviour.received) == 1
    assert log.failures == [(0, f"{stand_in.url}: request 0: HTTP 422: The model `stand-in` does not exist.")]


def test_a_server_that_refuses_priority_gets_none_and_lengths_stay_exact(stand_in):
    stand_in.behaviour.refused_fields = {"priority"}
    stand_in.behaviour.short = {3}
    trace = lk.Trace.from_lengths([3, 2]).with_priorities([1, 0])
    log = replay(trace, url=stand_in.url, model=MODEL, progress=False)
    assert log.fallbacks == ("no priority",)
    assert log.notes == (f"{stand_in.url} refused a request (HTTP 422: Unexpected fields in the request: "
                         "['priority']); from now on requests go without priority; the server does not see the "
                         "trace's priorities",)
    assert [body.get("priority") for body in sends_by_length(stand_in)[3]] == [1, None]
    assert log.failures == [(0, f"{stand_in.url}: request 0: received 2 tokens, asked for 3 "
                                "(does the server honour ignore_eos and min_tokens?)")]


def test_a_server_that_refuses_return_token_ids_gets_none_and_counts_a_token_per_chunk(stand_in):
    stand_in.behaviour.refused_fields = {"ignore_eos", "min_tokens", "return_token_ids"}  # transformers serve's
    log = replay(lk.Trace.from_lengths([3, 2]), url=stand_in.url, model=MODEL, progress=False)
    assert log.failures == [] and log.fallbacks == ("no ignore_eos", "no min_tokens", "no return_token_ids")
    assert log.notes == (f"{stand_in.url} refused a request (HTTP 422: Unexpected fields in the request: ['ignore_eos', "
                         "'min_tokens', 'return_token_ids']); from now on requests go without ignore_eos, min_tokens and "
                         "return_token_ids; an answer may stop before its output length, and counts as it came back, "
                         "not as a failure; a chunk that carries text and no token ids counts as one token",)
    assert log.outputs == {} and [len(t) for t in log.tokens_at] == [3, 2] and log.num_output_tokens == 5
    assert all("return_token_ids" not in sends[-1] for sends in sends_by_length(stand_in).values())


def test_an_answer_without_a_token_fails_even_once_lengths_are_free(stand_in):
    stand_in.behaviour.refused_fields = {"min_tokens"}
    stand_in.behaviour.short = {1}
    log = replay(lk.Trace.from_lengths([1, 2]), url=stand_in.url, model=MODEL, progress=False)
    assert log.fallbacks == ("no min_tokens",)
    assert log.failures == [(0, f"{stand_in.url}: request 0: received 0 tokens, asked for 1")]


def test_a_request_whose_chunks_carry_no_text_gets_one_token_time_at_its_end(stand_in):
    stand_in.behaviour.blank = {3}
    log = replay(lk.Trace.from_lengths([3, 2]), url=stand_in.url, model=MODEL, progress=False)
    assert log.failures == [] and [len(t) for t in log.tokens_at] == [1, 2]
    assert log.num_output_tokens == 5 and log.usage[0]["completion_tokens"] == 3  # counted by the usage
    assert log.ttft[0] == log.latency[0] >= 3 * TOKEN_SECONDS and log.texts == {1: " t0 t1"}


def merging_tokenizer():
    """A byte-level BPE tokenizer that merges every pair of lowercase letters, and pairs of ab, cd
    and ef: prompt pieces decoded side by side encode to fewer tokens."""
    import itertools

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {"<s>": 0, **{char: byte + 1 for byte, char in bytes_to_unicode().items()}}
    pairs = [*itertools.product("abcdefghijklmnopqrstuvwxyz", repeat=2), *itertools.product(["ab", "cd", "ef"],
                                                                                            repeat=2)]
    for left, right in pairs:
        vocab[left + right] = len(vocab)
    core = Tokenizer(models.BPE(vocab, merges=pairs))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>")


@pytest.mark.integration  # loads transformers (seconds to import): `make test` runs it
def test_a_text_prompt_encodes_to_exactly_its_length_where_pieces_merge():
    from labkit.engine.peers import byte_level_tokenizer

    def num_tokens(tokenizer, text):
        return len(tokenizer.encode(text, add_special_tokens=False))

    for tokenizer in (byte_level_tokenizer(), merging_tokenizer()):
        pieces = plain_pieces(tokenizer)
        for request_id, length in itertools.product(range(40), (1, 2, 3, 7, 30)):
            assert num_tokens(tokenizer, text_of_length(tokenizer, prompt_ids(request_id, length), pieces)) == length
    tokenizer = merging_tokenizer()
    pieces = plain_pieces(tokenizer)
    naive = [tokenizer.decode([pieces[i % len(pieces)] for i in prompt_ids(r, 7)]) for r in range(40)]
    assert any(num_tokens(tokenizer, text) < 7 for text in naive)  # the negative control: pieces as drawn merge


@pytest.mark.integration  # loads transformers (seconds to import): `make test` runs it
def test_a_tokenizer_directory_loads_offline_and_a_bad_one_says_why(tmp_path):
    from labkit.engine.peers import byte_level_tokenizer

    byte_level_tokenizer().save_pretrained(tmp_path / "tokenizer")
    texts = PromptTexts(tmp_path / "tokenizer")
    assert texts(prompt_ids(0, 12)) == text_of_length(texts.tokenizer, prompt_ids(0, 12), texts.pieces)
    assert len(texts.tokenizer.encode(texts(prompt_ids(0, 12)), add_special_tokens=False)) == 12
    assert texts([]) == " " and PromptTexts()([]) == " "  # an empty prompt goes as one token
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=rf"tokenizer = '{tmp_path / 'empty'}': AutoTokenizer cannot load it \("):
        PromptTexts(tmp_path / "empty")


def test_byte_level_text_has_one_printable_byte_per_id_and_keeps_printable_ones():
    from labkit.serve.tokenizer import encode

    assert byte_text(encode("Hello, world!")) == "Hello, world!"
    text = byte_text(prompt_ids(3, 50))
    assert len(text.encode()) == 50 and text.isascii() and text.isprintable()
    assert byte_text(prompt_ids(4, 50)) != text  # each request its own prompt


# Side by side with a simulation ----------------------------------------------------------------


def test_a_table_and_a_tradeoff_figure_put_a_simulation_beside_a_replay(stand_in):
    from labkit.viz.latency import latency_tradeoff

    trace = lk.Trace.from_lengths([3, 5, 2, 4])
    measured = replay(trace, url=stand_in.url, model=MODEL, progress=False)
    predicted = lk.simulate(trace, lk.Continuous(num_slots=4), step_time=TOKEN_SECONDS)
    lines = metrics.table({"predicted": predicted, "measured": measured}).splitlines()
    cells = {line.split()[0]: line.split()[-2:] for line in lines[1:]}
    assert lines[0].split() == ["predicted", "measured"]
    assert cells["steps"] == ["5", "-"] and cells["tokens"] == ["14", "14"]
    assert lines[-1].split() == ["failed", "requests", "-", "0"]
    assert [line.split()[0] for line in lines[1:]] == [line.split()[0] for line in metrics.table(
        {"measured": measured, "predicted": predicted}).splitlines()[1:]]  # the same rows either way round
    fig = latency_tradeoff({"predicted": predicted, "measured": measured})
    assert sorted(name for data in fig.data for name in data.text) == ["measured", "predicted"]


# The command line ------------------------------------------------------------------------------


def replay_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="labkit")
    commands = parser.add_subparsers(dest="command")
    return parser, add_replay_parser(commands)


def test_the_command_prints_a_table_and_the_failures(stand_in, capsys):
    stand_in.behaviour.fail = {8}
    parser, command = replay_parser()
    args = parser.parse_args(["replay", "toy", "--url", stand_in.url, "--model", MODEL, "--max-concurrency", "3",
                              "--no-progress"])
    assert replay_command(args, command) == 1  # a request failed: the summary, then exit code 1
    out = capsys.readouterr().out
    assert f"server: {stand_in.url}, model {MODEL}" in out
    assert "toy: requests A-H" in out and "\nfallbacks: none\n" in out
    rows = {line.split("  ")[0]: line.split()[-1] for line in out.splitlines() if "  " in line}
    assert rows["tokens"] == "24" and rows["failed requests"] == "1"  # D (8 tokens) failed
    assert "TTFT p99 (s)" in rows and "steps" not in rows
    assert f"failed: 1 of 8 requests\n  {stand_in.url}: request 3: HTTP 500: stand-in failure\n" in out
    assert stand_in.behaviour.max_streaming <= 3


def test_the_command_reads_a_csv_trace_and_sends_its_first_requests(stand_in, capsys, tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 00:00:00.00,4,3\n"
                    "2024-01-01 00:00:00.05,2,2\n2024-01-01 00:00:00.10,1,5\n")
    parser, command = replay_parser()
    args = parser.parse_args(["replay", str(path), "--url", stand_in.url, "--model", MODEL, "--requests", "2",
                              "--no-progress"])
    assert replay_command(args, command) == 0
    assert f"{path}: the first 2 requests, at their own arrival times" in capsys.readouterr().out
    assert sorted(len(body["prompt"]) for _, body in stand_in.behaviour.received) == [3, 5]  # BOS first


@pytest.mark.integration  # loads transformers (seconds to import): `make test` runs it
def test_the_command_takes_a_tokenizer_directory_for_text_prompts(stand_in, capsys, tmp_path):
    from labkit.engine.peers import byte_level_tokenizer

    byte_level_tokenizer().save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "trace.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 00:00:00.00,4,3\n"
                                        "2024-01-01 00:00:00.05,2,2\n2024-01-01 00:00:00.10,9,5\n")
    stand_in.behaviour.text_prompts_only = True
    parser, command = replay_parser()
    args = parser.parse_args(["replay", str(tmp_path / "trace.csv"), "--url", stand_in.url, "--model", MODEL,
                              "--tokenizer", str(tmp_path / "tokenizer"), "--no-progress"])
    assert replay_command(args, command) == 0
    out = capsys.readouterr().out
    assert "\nfallbacks: text prompts\n" in out and "failed: 0 of 3 requests" in out
    prompts = [sends_by_length(stand_in)[n][-1]["prompt"] for n in (3, 2, 5)]
    assert [len(byte_level_tokenizer().encode(p, add_special_tokens=False)) for p in prompts] == [4, 2, 9]


def test_load_sets_the_rate_from_the_capacity_the_server_showed(stand_in, capsys, tmp_path):
    path = tmp_path / "trace.csv"
    rows = "".join(f"2024-01-01 00:00:{second:02d}.00,2,4\n" for second in range(0, 40, 5))  # 8 requests over 35 s
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)
    parser, command = replay_parser()
    args = parser.parse_args(["replay", str(path), "--url", stand_in.url, "--model", MODEL, "--load", "2",
                              "--no-progress"])
    assert replay_command(args, command) == 0
    out = capsys.readouterr().out
    served, sent = (float(x) for x in re.search(r"capacity: ([\d.]+) requests/s with all 8 sent at once, so "
                                                 r"([\d.]+) requests/s", out).groups())
    assert sent == pytest.approx(2 * served, rel=0.01)
    arrivals = sorted(at for at, _ in stand_in.behaviour.received[8:])  # after the 8 of the probe
    assert arrivals[-1] - arrivals[0] < 35 / 2  # the 35 s of the trace, squeezed to the server's pace
    assert len(stand_in.behaviour.received) == 16


def test_the_server_s_context_is_read_from_its_model_list():
    from labkit.serve.replay import served_max_model_len

    with StandIn() as server:
        assert served_max_model_len(server.url, MODEL) is None  # it reports none
        server.behaviour.max_model_len = 10
        assert served_max_model_len(server.url + "/", MODEL) == 10  # the model's own entry, not another's
        assert served_max_model_len(server.url, "no-such-model") is None
    assert served_max_model_len(closed_port_url(), MODEL, timeout=1) is None  # unreachable: the replay says so


def trace_csv(path, rows: list[tuple[int, int]]) -> str:
    """A CSV trace of (prompt, output) rows, a tenth of a second apart."""
    lines = "".join(f"2024-01-01 00:00:00.{k}0,{prompt},{output}\n" for k, (prompt, output) in enumerate(rows))
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + lines)
    return str(path)


def test_the_command_sends_only_what_the_server_s_context_holds_and_says_what_it_left_out(stand_in, capsys,
                                                                                          tmp_path):
    path = trace_csv(tmp_path / "trace.csv", [(4, 3), (9, 5), (2, 2), (8, 3), (1, 5), (3, 3)])  # 7, 14, 4, 11, 6, 6
    stand_in.behaviour.max_model_len = 10
    parser, command = replay_parser()
    argv = ["replay", path, "--url", stand_in.url, "--model", MODEL, "--requests", "3", "--no-progress"]
    assert replay_command(parser.parse_args(argv), command) == 0
    assert (f"{path}: the first 3 requests, with BOS + prompt + output <= 10 tokens (the server's max_model_len; 2 "
            "longer ones left out), at their own arrival times") in capsys.readouterr().out
    assert sorted(len(body["prompt"]) for _, body in stand_in.behaviour.received) == [2, 3, 5]
    # --max-tokens cuts the outputs first, and --max-model-len takes the place of the server's context
    stand_in.behaviour.received.clear()
    assert replay_command(parser.parse_args([*argv, "--max-tokens", "3", "--max-model-len", "12"]), command) == 0
    assert (f"{path}: the first 3 requests, outputs cut to 3 tokens, with BOS + prompt + output <= 12 tokens "
            "(--max-model-len; 1 longer one left out)") in capsys.readouterr().out
    assert sorted((len(body["prompt"]), body["max_tokens"]) for _, body in stand_in.behaviour.received) == [
        (3, 2), (5, 3), (9, 3)]
    # without a begin-of-sequence token, the prompt alone fits
    stand_in.behaviour.received.clear()
    assert replay_command(parser.parse_args([*argv, "--max-tokens", "3", "--max-model-len", "12",
                                             "--bos-token-id", "none"]), command) == 0
    assert "with prompt + output <= 12 tokens (--max-model-len; 0 longer ones left out)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, error", [
    (["toy", "--load", "2"], "argument --load: toy's requests all arrive at once"),
    (["azure-conv", "--load", "2", "--rate-scale", "4"], "argument --load: sets the rate from the server's capacity"),
    (["azure-conv", "--load", "0"], "argument --load: '0': must be a number > 0"),
])
def test_load_refuses_what_it_cannot_do(stand_in, argv, error, capsys):
    parser, command = replay_parser()
    with pytest.raises(SystemExit):
        replay_command(parser.parse_args(["replay", *argv, "--url", stand_in.url, "--model", MODEL, "--no-progress"]),
                       command)
    assert error in capsys.readouterr().err


def test_the_command_exits_1_when_the_server_is_unreachable(capsys):
    url = closed_port_url()
    parser, command = replay_parser()
    assert replay_command(parser.parse_args(["replay", "toy", "--url", url, "--model", MODEL, "--no-progress"]),
                          command) == 1
    out = capsys.readouterr().out
    assert "failed: 8 of 8 requests\n" in out and f"\n  {url}: request 0: cannot connect (ConnectError" in out


def test_the_command_exits_1_when_the_server_refuses_every_request(stand_in, capsys):
    stand_in.behaviour.refuse_always = "Unexpected fields in the request: {'ignore_eos'}"
    parser, command = replay_parser()
    args = parser.parse_args(["replay", "toy", "--url", stand_in.url, "--model", MODEL, "--no-progress"])
    assert replay_command(args, command) == 1
    out = capsys.readouterr().out
    assert "\nfallbacks: no ignore_eos\n" in out and "failed: 8 of 8 requests\n" in out
    assert len(stand_in.behaviour.received) <= 16  # each request sent at most twice


@pytest.mark.parametrize(
    "argv, error",
    [
        (["toy", "--url", "localhost:8000"], "labkit replay: error: url = 'localhost:8000': must start with http://"),
        (["toy", "--rate", "3"], "labkit replay: error: argument --rate: only TRACE exponential samples arrivals"),
        (["no-such.csv"], "labkit replay: error: argument TRACE: no-such.csv: no such file"),
        (["toy", "--rate-scale", "0"], "labkit replay: error: argument --rate-scale: '0': must be a number > 0"),
        (["toy", "--max-concurrency", "0"], "argument --max-concurrency: '0': must be a whole number >= 1"),
        (["toy", "--tokenizer", "no-such-dir"], "labkit replay: error: tokenizer = 'no-such-dir': no such directory"),
        (["toy", "--max-model-len", "1"], "labkit replay: error: argument --max-model-len: 1: no request has "
                                          "BOS + prompt + output <= 1 tokens (the shortest has 3)"),
        (["toy", "--max-model-len", "1", "--bos-token-id", "none"],
         "labkit replay: error: argument --max-model-len: 1: no request has prompt + output <= 1 tokens (the shortest "
         "has 2)"),
        (["toy", "--bos-token-id", "x"], "argument --bos-token-id: 'x': must be a whole number >= 0, or none"),
        (["toy", "--max-tokens", "0"], "argument --max-tokens: '0': must be a whole number >= 1"),
    ],
)
def test_a_bad_option_ends_in_one_error_line(argv, error, capsys):
    parser, command = replay_parser()
    with pytest.raises(SystemExit) as exit_:
        replay_command(parser.parse_args(["replay", *argv, "--model", MODEL]), command)
    assert exit_.value.code == 2
    assert error in capsys.readouterr().err


def test_the_client_loads_neither_torch_nor_the_server_stack_and_the_command_not_even_the_client():
    code = ("import sys, labkit.serve.replay_cli; cli = sorted({'httpx', 'labkit.cli'} & set(sys.modules));"
            "import labkit.serve.replay; print(cli, sorted({'torch', 'fastapi', 'uvicorn', 'plotly'} & set(sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded == "[] []\n"  # the command's module loads no client until it runs, and the client no server


def test_scraped_series_from_no_samples_is_empty():
    series = ScrapedSeries.from_samples([])
    assert len(series) == 0 and series.kv_usage.shape == (0,)


# Chunks that carry several tokens, and servers that refuse an empty prompt


def test_per_token_times_share_each_chunk_s_gap():
    times = per_token_times(np.array([1.0, 2.0, 2.5]), np.array([2, 4, 1]))
    assert times.tolist() == [1.0, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5]  # the first chunk's extra token: no gap to share


def test_itl_is_counted_per_token_when_a_chunk_carries_several(stand_in):
    stand_in.behaviour.packed = 4
    log = replay(lk.Trace.from_lengths([9, 8]), url=stand_in.url, model=MODEL, progress=False)
    assert log.failures == [] and [s.tolist() for s in log.chunk_sizes] == [[4, 4, 1], [4, 4]]
    ids, times = log.token_times()
    assert np.bincount(ids).tolist() == [9, 8]  # one time per token
    itl, tpot = np.median(metrics.itl(log)), np.median(metrics.tpot(log))
    assert tpot / 2 <= itl <= 2 * tpot
    # negative control: a time per chunk, as if each carried one token, puts ITL far from TPOT
    per_chunk = ReplayLog(log.trace, log.url, log.sent_at, log.tokens_at, log.outputs, [], log.server)
    assert not np.median(metrics.itl(per_chunk)) <= 2 * np.median(metrics.tpot(per_chunk))


def test_an_empty_prompt_refused_goes_as_one_token_once_no_bos_is_known(stand_in):
    stand_in.behaviour.refuse_empty = True
    trace = lk.Trace.from_lengths([2, 3], prompt_lengths=[0, 2])
    log = replay(trace, url=stand_in.url, model=MODEL, bos_token_id=None, seed=1, vocab_size=50, progress=False)
    assert log.failures == [] and log.fallbacks == ("one-token prompts",)
    last = {body["max_tokens"]: body["prompt"] for _, body in stand_in.behaviour.received}
    assert last == {2: prompt_ids(0, 1, seed=1, vocab_size=50), 3: prompt_ids(1, 2, seed=1, vocab_size=50)}
    assert "an empty prompt goes as one drawn token" in log.notes[0]
    stand_in.behaviour.received.clear()
    with_bos = replay(trace, url=stand_in.url, model=MODEL, progress=False)  # the BOS first: nothing is empty
    assert with_bos.fallbacks == () and all(body["prompt"][0] == 0 for _, body in stand_in.behaviour.received)
