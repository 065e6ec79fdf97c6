"""lk.replay against a stand-in server on the loopback: tokens, times, concurrency, scraping,
failures of every kind, Ctrl-C, a running event loop, and the `labkit replay` command.

The stand-in follows the server contract (a chunk per token, token ids counting up from 0, a
usage chunk, [DONE], /metrics with vLLM's gauges) and misbehaves on request: each test picks
which output lengths get an HTTP 500, a dropped stream or a short answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from labkit.sched import metrics
from labkit.serve.replay import ScrapedSeries, parse_metrics, prompt_ids, replay
from labkit.serve.replay_cli import add_replay_parser, replay_command

MODEL = "stand-in"
TOKEN_SECONDS = 0.004  # the stand-in's pause before each token


@dataclass
class Behaviour:
    """What the stand-in does, and what it saw."""

    fail: set[int] = field(default_factory=set)  # output lengths answered with HTTP 500
    drop: set[int] = field(default_factory=set)  # output lengths whose stream breaks after two tokens
    short: set[int] = field(default_factory=set)  # output lengths answered with one token too few
    no_done: set[int] = field(default_factory=set)  # output lengths whose stream ends without [DONE]
    stall: set[int] = field(default_factory=set)  # output lengths whose stream pauses for 1 s after two tokens
    inject: dict[int, str] = field(default_factory=dict)  # output length -> a raw chunk sent after the first token
    text_only: bool = False  # chunks without token_ids
    has_metrics: bool = True
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
            return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

        @app.get("/metrics")
        async def exposition():
            if not self.behaviour.has_metrics:
                return PlainTextResponse("Not Found", status_code=404)
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
            if body["max_tokens"] in self.behaviour.fail:
                return JSONResponse({"object": "error", "message": "stand-in failure", "type": "InternalServerError",
                                     "code": 500}, status_code=500)
            return StreamingResponse(self.stream(body["max_tokens"]), media_type="text/event-stream")

        return app

    async def stream(self, max_tokens: int):
        behaviour = self.behaviour
        num_sent = max_tokens - 1 if max_tokens in behaviour.short else max_tokens
        behaviour.streaming += 1
        behaviour.max_streaming = max(behaviour.max_streaming, behaviour.streaming)
        try:
            for k in range(num_sent):
                await asyncio.sleep(TOKEN_SECONDS)
                if k == 2 and max_tokens in behaviour.drop:
                    raise ConnectionAbortedError("the stand-in drops this stream")
                if k == 2 and max_tokens in behaviour.stall:
                    await asyncio.sleep(1)
                if k == 1 and max_tokens in behaviour.inject:
                    yield f"data: {behaviour.inject[max_tokens]}\n\n"
                choice = {"index": 0, "text": f" t{k}", "finish_reason": "length" if k == num_sent - 1 else None}
                if not behaviour.text_only:
                    choice["token_ids"] = [k]
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
    """When the stand-in received each request, by its one-token prompt."""
    return {body["prompt"][0]: at for at, body in stand_in.behaviour.received}


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
    trace = lk.Trace.from_lengths([2, 2, 2, 2], arrivals=[0, 0.2, 0.4, 0.6], prompt_tokens=[[0], [1], [2], [3]])
    before = time.perf_counter()
    log = replay(trace, url=stand_in.url, model=MODEL, rate_scale=2, progress=False)
    assert log.trace.arrivals.tolist() == [0, 0.1, 0.2, 0.3]
    assert (log.sent_at >= log.trace.arrivals).all()
    received = by_prompt(stand_in)
    for i, arrival in enumerate(log.trace.arrivals):
        assert received[i] >= before + arrival
    assert received[3] < before + 0.55  # twice as fast: not at the trace's own 0.6 s


def test_requests_replays_only_the_first_requests(stand_in):
    trace = lk.Trace.from_lengths([2, 3, 4, 5, 6])
    log = replay(trace, url=stand_in.url, model=MODEL, requests=2, progress=False)
    assert log.trace.ids.tolist() == [0, 1] and log.num_tokens == 5
    assert sorted(body["max_tokens"] for _, body in stand_in.behaviour.received) == [2, 3]


def test_every_request_asks_for_exactly_its_length(stand_in):
    replay(lk.Trace.from_lengths([4]), url=stand_in.url, model=MODEL, progress=False)
    [(_, body)] = stand_in.behaviour.received
    assert body == {"model": MODEL, "prompt": [], "max_tokens": 4, "min_tokens": 4, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}


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
    assert sent == sorted(prompt_ids(i, n, seed=2, vocab_size=50) for i, n in enumerate([3, 0, 5]))
    stand_in.behaviour.received.clear()
    own = lk.Trace.from_lengths([1, 1], prompt_tokens=[[9, 8], [7]])
    replay(own, url=stand_in.url, model=MODEL, progress=False)
    assert sorted(body["prompt"] for _, body in stand_in.behaviour.received) == [[7], [9, 8]]


def test_chunks_without_token_ids_count_one_token_each(stand_in):
    stand_in.behaviour.text_only = True
    log = replay(lk.Trace.from_lengths([3, 2]), url=stand_in.url, model=MODEL, progress=False)
    assert log.failures == [] and log.outputs == {}
    assert [len(t) for t in log.tokens_at] == [3, 2] and log.num_tokens == 5


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
    assert (np.diff(series.times) > 0).all() and 0 <= series.times[0] and series.times[-1] <= log.duration + 0.1
    assert series.running.max() >= 1 and set(series.running) <= {0, 1, 2, 3, 4}
    assert (series.waiting == 7).all()
    assert series.kv_usage.tolist() == (series.running / 10).tolist()


def test_a_server_without_metrics_gives_an_empty_series(stand_in):
    stand_in.behaviour.has_metrics = False
    log = replay(lk.Trace.from_lengths([5, 5]), url=stand_in.url, model=MODEL, scrape_interval=0.01, progress=False)
    assert log.failures == [] and len(log.server) == 0 and log.server.running.shape == (0,)


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


def test_an_error_answer_fails_its_request_and_the_others_finish(stand_in):
    stand_in.behaviour.fail = {13}
    log = replay(lk.Trace.from_lengths([3, 13, 4]), url=stand_in.url, model=MODEL, progress=False)
    [(request, message)] = log.failures
    assert request == 1
    assert message == f"{stand_in.url}: request 1: HTTP 500: stand-in failure"
    assert log.is_finished.tolist() == [True, False, True] and log.num_tokens == 7
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
    assert log.num_tokens == 7 and metrics.token_times(log)[0].tolist() == [0, 0, 0, 2, 2, 2, 2]


def test_a_short_answer_fails(stand_in):
    stand_in.behaviour.short = {5}
    log = replay(lk.Trace.from_lengths([5, 2]), url=stand_in.url, model=MODEL, progress=False)
    assert log.failures == [(0, f"{stand_in.url}: request 0: received 4 tokens, asked for 5 "
                                "(does the server honour ignore_eos and min_tokens?)")]


def test_a_stream_that_ends_without_done_fails(stand_in):
    stand_in.behaviour.no_done = {3}
    log = replay(lk.Trace.from_lengths([2, 3]), url=stand_in.url, model=MODEL, progress=False)
    assert log.failures == [(1, f"{stand_in.url}: request 1: the stream ended without [DONE] after 3 of 3 tokens")]


def test_a_stalled_stream_fails_after_the_read_timeout(stand_in):
    stand_in.behaviour.stall = {6}
    start = time.perf_counter()
    log = replay(lk.Trace.from_lengths([6, 3]), url=stand_in.url, model=MODEL, read_timeout=0.2, progress=False)
    assert time.perf_counter() - start < 0.9  # the stand-in would have stalled for 1 s
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
    trace = lk.Trace.from_lengths([2, 2, 2], arrivals=[0, 5, 10])
    start = time.perf_counter()
    log = replay(trace, url=url, model=MODEL, progress=False)
    assert time.perf_counter() - start < 3  # not 10 s: the first refusal ends the wait of the others
    assert [request for request, _ in log.failures] == [0, 1, 2]
    assert log.failures[0][1].startswith(f"{url}: request 0: cannot connect (ConnectError")
    assert log.failures[1][1] == f"{url}: request 1: not sent: an earlier request could not connect"
    assert log.num_tokens == 0 and log.tokens_per_second == 0.0 and np.isnan(log.sent_at[1:]).all()
    assert metrics.summary(log)["failed requests"] == 3


def test_ctrl_c_stops_the_replay_and_keeps_what_was_measured(stand_in):
    trace = lk.Trace.from_lengths([2, 400, 2], arrivals=[0, 0, 3])  # request 1 streams for about 2 s
    interrupt = threading.Timer(0.4, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    start = time.perf_counter()
    interrupt.start()
    log = replay(trace, url=stand_in.url, model=MODEL, progress=False)
    interrupt.join()
    assert time.perf_counter() - start < 1.5
    assert log.failures == [(1, f"{stand_in.url}: request 1: interrupted"),
                            (2, f"{stand_in.url}: request 2: interrupted")]
    assert log.is_finished.tolist() == [True, False, False] and log.num_tokens == 2
    assert 0 < len(log.tokens_at[1]) < 400 and np.isnan(log.sent_at[2])


def test_it_runs_where_an_event_loop_already_runs_as_in_jupyter(stand_in):
    async def notebook_cell():
        return replay(lk.Trace.from_lengths([3, 2]), url=stand_in.url, model=MODEL, progress=False)

    log = asyncio.run(notebook_cell())
    assert log.failures == [] and log.num_tokens == 5


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
    ],
)
def test_bad_arguments_name_the_field_and_value(changes, error):
    arguments = {"url": "http://127.0.0.1:9", "model": MODEL, **changes}  # a closed port: never reached
    with pytest.raises(ValueError, match=error):
        replay(lk.Trace.toy(), **arguments)


def test_a_trace_that_is_not_a_trace_says_so():
    with pytest.raises(TypeError, match=r"trace = \[2, 3\]: must be a labkit Trace"):
        replay([2, 3], url="http://127.0.0.1:9", model=MODEL)


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
    assert replay_command(args, command) == 0
    out = capsys.readouterr().out
    assert f"server: {stand_in.url}, model {MODEL}" in out
    assert "toy: requests A-H" in out
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
    assert sorted(len(body["prompt"]) for _, body in stand_in.behaviour.received) == [2, 4]


@pytest.mark.parametrize(
    "argv, error",
    [
        (["toy", "--url", "localhost:8000"], "labkit replay: error: url = 'localhost:8000': must start with http://"),
        (["toy", "--rate", "3"], "labkit replay: error: argument --rate: only TRACE exponential samples arrivals"),
        (["no-such.csv"], "labkit replay: error: argument TRACE: no-such.csv: no such file"),
        (["toy", "--rate-scale", "0"], "labkit replay: error: argument --rate-scale: '0': must be a number > 0"),
        (["toy", "--max-concurrency", "0"], "argument --max-concurrency: '0': must be a whole number >= 1"),
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
