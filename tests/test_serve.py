"""`labkit serve`: the online engine behind the OpenAI-compatible API, on loopback.

A server runs in-process (uvicorn in a thread, a tiny TinyGPT) for the module; each test
stops by itself, and the load test is bounded in requests and time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time

import httpx
import numpy as np
import pytest

import labkit as lk
from labkit.engine import Engine, ModelConfig
from labkit.serve import tokenizer
from labkit.serve.guards import make_server
from labkit.serve.limits import Limits
from labkit.serve.processes import answers_health, free_port
from labkit.serve.server import build_server

TINY = ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=128)
POLICY = lk.Continuous(num_slots=4, num_blocks=64, block_size=4, max_tokens_per_step=32, chunked_prefill=True)
MODEL = "tiny"
QUICK_STOP = Limits(shutdown_grace=0.5)  # a test that stops its server waits half a second for what is in flight


class Served:
    """A labkit server on a free loopback port, in a thread, as `labkit serve` runs it; `stop` ends it."""

    def __init__(self, policy=POLICY, config: ModelConfig = TINY, limits: Limits = QUICK_STOP):
        self.engine = Engine(config, device="cpu", seed=0, threads=1)
        app, self.online = build_server(self.engine, policy, MODEL, limits=limits)
        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = make_server(app, self.online, limits, port=port)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        assert not self.thread.is_alive()

    def pool_is_full(self) -> bool:
        blocks = self.online.core.blocks
        return blocks.num_free_blocks == blocks.num_blocks


@pytest.fixture(scope="module")
def served():
    server = Served()
    yield server
    server.stop()


def complete(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body}, timeout=30)


def stream_tokens(url: str, **body) -> tuple[list[int], dict]:
    """The token ids of a streamed completion, and its usage chunk."""
    tokens, usage = [], {}
    payload = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, **body}
    with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=30) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    tokens += choice["token_ids"]
    return tokens, usage


def with_bos(prompt: list[int]) -> list[int]:
    """A token-id prompt as a server takes it, used as given: the model's begin-of-sequence id first,
    as `Engine.run` feeds it."""
    return [TINY.bos_token_id, *prompt]


def reference_tokens(engine: Engine, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Engine.run's greedy tokens for the same prompts (after its begin-of-sequence token)."""
    trace = lk.Trace.from_lengths(lengths, prompt_tokens=[np.array(p) for p in prompts])
    log = engine.run(trace, lk.Continuous(num_slots=4), progress=False)
    return [log.outputs[int(rid)] for rid in trace.ids]


PROMPTS = [[5, 6, 7], [9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [30, 31]]
LENGTHS = [6, 3, 9, 4]


def test_streamed_and_whole_completions_give_engine_run_tokens(served):
    expected = reference_tokens(served.engine, PROMPTS, LENGTHS)
    for prompt, length, tokens in zip(map(with_bos, PROMPTS), LENGTHS, expected):
        streamed, usage = stream_tokens(served.url, prompt=prompt, max_tokens=length)
        assert streamed == tokens
        assert usage == {"prompt_tokens": len(prompt), "completion_tokens": length, "total_tokens": len(prompt) + length}
        whole = complete(served.url, prompt=prompt, max_tokens=length).json()
        assert whole["choices"][0]["token_ids"] == tokens and whole["choices"][0]["finish_reason"] == "length"


def test_a_string_prompt_goes_through_the_byte_tokenizer(served):
    as_text = complete(served.url, prompt="hi", max_tokens=3).json()["choices"][0]
    as_ids = complete(served.url, prompt=[0, *tokenizer.encode("hi")], max_tokens=3).json()["choices"][0]
    assert as_text["token_ids"] == as_ids["token_ids"] and tokenizer.prompt_ids("hi") == [0, 105, 106]
    # negative control: without the begin-of-sequence token the byte tokenizer adds, the tokens differ
    assert complete(served.url, prompt=[105, 106], max_tokens=3).json()["choices"][0]["token_ids"] != as_ids["token_ids"]
    assert as_text["text"] == tokenizer.decode(as_text["token_ids"])


def test_concurrent_requests_share_steps_and_keep_their_tokens(served):
    expected = reference_tokens(served.engine, PROMPTS, LENGTHS)
    before = len(served.online.step_sizes)

    async def all_at_once():
        async with httpx.AsyncClient(timeout=30) as client:
            answers = await asyncio.gather(*(client.post(f"{served.url}/v1/completions", json={
                "model": MODEL, "prompt": with_bos(p), "max_tokens": n}) for p, n in zip(PROMPTS, LENGTHS)))
        return [answer.json()["choices"][0]["token_ids"] for answer in answers]

    assert asyncio.run(all_at_once()) == expected
    assert max(served.online.step_sizes[before:]) > 1  # the server's own step record: steps were shared


@pytest.mark.parametrize("body, message", [
    (dict(prompt=[1] * 120, max_tokens=20), "prompt of 120 tokens \\+ max_tokens 20 exceed the model's max_seq_len 128"),
    (dict(prompt=[5, 300], max_tokens=2), "prompt token 300 at position 1 is outside the vocabulary \\(0..299\\)"),
    (dict(prompt=[5], max_tokens=0), "max_tokens: Input should be greater than or equal to 1 \\(got 0\\)"),
    (dict(prompt=[5], max_tokens="four"), "max_tokens: Input should be a valid integer"),
    (dict(max_tokens=2), "prompt: Field required"),
    (dict(prompt=[5], max_tokens=2, priority=1.5), "priority: Input should be a valid integer \\(got 1.5\\)"),
    (dict(prompt=[5], max_tokens=2, priority="high"), "priority: Input should be a valid integer \\(got 'high'\\)"),
    (dict(prompt=[5], max_tokens=2, priority=True), "priority: Input should be a valid integer \\(got True\\)"),
])
def test_bad_input_gets_an_openai_error_and_the_server_serves_on(served, body, message):
    answer = complete(served.url, **body)
    assert answer.status_code == 400
    error = answer.json()
    assert error["object"] == "error" and error["code"] == 400
    assert re.search(message, error["message"]), error["message"]
    assert len(complete(served.url, prompt=[5], max_tokens=2).json()["choices"][0]["token_ids"]) == 2


def test_a_body_that_is_not_json_is_a_400(served):
    answer = httpx.post(f"{served.url}/v1/completions", content=b"{not json", timeout=10,
                        headers={"content-type": "application/json"})
    assert answer.status_code == 400 and "not valid JSON" in answer.json()["message"]


def wait_until(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def scrape(url: str) -> dict[str, float]:
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:")}


def test_a_client_that_leaves_mid_stream_frees_its_slot_and_blocks(served):
    payload = {"model": MODEL, "prompt": [5, 6], "max_tokens": 100, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=payload, timeout=30) as answer:
        received = 0
        for line in answer.iter_lines():
            received += line.startswith("data: ")
            if received == 3:
                break  # leave: the stream closes with the block
    assert wait_until(lambda: served.pool_is_full() and not served.online.core.state.by_id)
    assert wait_until(lambda: scrape(served.url)["vllm:kv_cache_usage_perc"] == 0.0)
    assert scrape(served.url)["vllm:num_requests_running"] == 0.0


def test_metrics_use_vllm_names_and_count_tokens(served):
    before = scrape(served.url)
    complete(served.url, prompt=[5, 6, 7], max_tokens=4)
    after = scrape(served.url)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 4
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 3
    for name in ("vllm:num_requests_waiting", "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count"):
        assert name in after
    assert httpx.get(f"{served.url}/health").status_code == 200
    assert httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"] == MODEL


def test_two_hundred_concurrent_streams_all_finish_and_every_block_returns():
    server = Served(lk.Continuous(num_slots=16, num_blocks=48, block_size=4))  # small pool: preemption under load
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 9, 200).tolist()
    prompts = [rng.integers(1, 300, rng.integers(1, 9)).tolist() for _ in lengths]

    async def one(client, prompt, length):
        tokens = []
        payload = {"model": MODEL, "prompt": prompt, "max_tokens": length, "stream": True}
        async with client.stream("POST", f"{server.url}/v1/completions", json=payload) as answer:
            async for line in answer.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    tokens += json.loads(line[6:])["choices"][0]["token_ids"] if "usage" not in line else []
        return tokens

    async def everyone():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    try:
        received = asyncio.run(asyncio.wait_for(everyone(), 120))
        assert [len(tokens) for tokens in received] == lengths  # none lost, none short
        assert wait_until(server.pool_is_full)
        assert not server.online.core.state.by_id and max(server.online.step_sizes) > 1
    finally:
        server.stop()


def test_stopping_the_server_aborts_what_is_in_flight():
    server = Served()
    finished = []

    def long_stream():
        payload = {"model": MODEL, "prompt": [5], "max_tokens": 120, "stream": True}
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=payload, timeout=30) as answer:
                finished.append(sum(line.startswith("data: ") for line in answer.iter_lines()))
        except httpx.HTTPError as problem:
            finished.append(problem)

    client = threading.Thread(target=long_stream)
    client.start()
    assert wait_until(lambda: server.online.step_sizes)
    server.stop()  # uvicorn lets the stream finish or ends it; the engine aborts what is left
    client.join(timeout=30)
    assert not client.is_alive() and finished
    assert server.pool_is_full() and not server.online.core.state.by_id


# lk.replay against labkit serve


def test_a_replay_gets_every_token_engine_run_would_and_scrapes_the_server(served):
    trace = lk.Trace.sample(12, output="exponential", mean_output=6, prompt="uniform", mean_prompt=8, rate=40.0,
                            seed=4)
    log = lk.replay(trace, url=served.url, model=MODEL, vocab_size=TINY.vocab_size, progress=False)
    reference = served.engine.run(trace, lk.Continuous(num_slots=4), progress=False)
    assert not log.failures
    assert {rid: len(tokens) for rid, tokens in log.outputs.items()} == dict(
        zip(trace.ids.tolist(), trace.output_lengths.tolist()))
    assert log.outputs == reference.outputs  # greedy tokens, the same whoever shares the steps
    summary = lk.metrics.summary(log)
    assert summary["tokens/s"] > 0 and summary["TTFT p99 (s)"] > 0 and not np.isnan(summary["ITL p50 (ms)"])
    assert len(log.server) > 0  # scraped while it ran (a tiny model finishes between scrapes, so no count is asserted)
    assert wait_until(served.pool_is_full)


def test_a_server_killed_mid_replay_leaves_failures_not_a_hang(tmp_path):
    import subprocess
    import sys

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "labkit", "serve", "--port", str(port), "--slots", "2",
                               "--device", "cpu", "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: answers_health(url), 60), "labkit serve did not start"
        trace = lk.Trace.from_lengths([1500] * 6, prompt_lengths=[8] * 6)  # seconds each: all cut short
        killer = threading.Timer(1.5, server.kill)
        killer.start()
        log = lk.replay(trace, url=url, model="tinygpt", progress=False, read_timeout=60)
        broke = rf"{re.escape(url)}: request {{}}: the stream broke after \d+ of 1500 tokens \(.+\)"
        assert [request for request, _ in log.failures] == list(range(len(trace)))  # every request cut short
        for request, message in log.failures:  # when the server died, not after waiting out the read timeout
            assert re.fullmatch(broke.format(request), message, re.DOTALL), message
    finally:
        server.kill()
        server.wait(timeout=10)


def test_the_replay_command_prints_prediction_beside_measurement(capsys):
    from labkit.cli import main

    server = Served(lk.Fair(num_slots=4), config=ModelConfig())  # labkit serve's default model and policy
    try:
        assert main(["replay", "exponential", "--url", server.url, "--model", MODEL, "--requests", "6",
                     "--rate", "50", "--slots", "4", "--no-progress"]) == 0
    finally:
        server.stop()
    out = capsys.readouterr().out
    assert "predicted with Fair(num_slots=4), CostModel fit on" in out  # the server's default policy
    header = next(line for line in out.splitlines() if "predicted" in line and "measured" in line)
    assert header.split() == ["predicted", "measured"]
    assert "failed: 0 of 6 requests" in out


def test_a_free_port_lies_below_the_ephemeral_range_where_no_outgoing_connection_takes_it():
    import socket

    from labkit.serve.processes import ephemeral_ports, free_port

    low, high = ephemeral_ports()
    ports = [free_port() for _ in range(20)]
    assert all(1024 <= port < low for port in ports) and len(set(ports)) > 1  # drawn at random
    for port in ports:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))  # free
    with socket.socket() as client:  # the negative control: a client's own port is an ephemeral one
        client.bind(("127.0.0.1", 0))
        assert low <= client.getsockname()[1] <= high


def test_the_lesson_s_azure_command_runs_as_written(capsys):
    """Lesson 09's `labkit replay azure-conv ... --requests 24 --max-tokens 32 --load 2` against
    TinyGPT served with the lesson's knobs: three of the first 27 requests are longer than its
    2,048-token context, so the command leaves them out, says so, and every request finishes."""
    from labkit.cli import main

    lesson = lk.Continuous(num_slots=8, num_blocks=512, max_tokens_per_step=256, chunked_prefill=True)
    server = Served(lesson, config=ModelConfig())  # labkit serve's default model, TinyGPT
    command = ["replay", "azure-conv", "--url", server.url, "--model", MODEL, "--requests", "24", "--max-tokens", "32",
               "--load", "2", "--no-progress"]
    try:
        assert main(command) == 0
        out = capsys.readouterr().out
        with pytest.raises(SystemExit):  # the negative control: a context above the server's, so the first 24 go
            main([*command, "--max-model-len", "8192"])
    finally:
        server.stop()
    assert ("azure-conv: the first 24 requests, outputs cut to 32 tokens, with BOS + prompt + output <= 2048 tokens (the "
            "server's max_model_len; 3 longer ones left out), at their own arrival times") in out
    assert "failed: 0 of 24 requests" in out and "2 × the server's capacity" in out
    assert "argument --load: the capacity probe failed 2 of 24 requests" in capsys.readouterr().err  # 13 and 23


def test_sigterm_stops_labkit_serve_cleanly():
    import signal
    import subprocess
    import sys

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "labkit", "serve", "--port", str(port), "--device", "cpu",
                               "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: answers_health(url), 60), "labkit serve did not start"
        received = []
        client = threading.Thread(target=lambda: received.append(_count_streamed(url, 1500)))
        client.start()
        time.sleep(0.5)  # the stream is under way
        server.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught, as a server should
        assert server.wait(timeout=30) in (0, -signal.SIGTERM)
        assert "labkit serve: stopped after" in server.stdout.read()  # the engine's own shutdown ran
        client.join(timeout=30)
        assert not client.is_alive() and 0 < received[0] <= 1500  # cut short, or finished in the grace period
    finally:
        server.kill()
        server.wait(timeout=10)


def _count_streamed(url: str, max_tokens: int) -> int:
    tokens = 0
    payload = {"model": "tinygpt", "prompt": [5], "max_tokens": max_tokens, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=30) as answer:
            for line in answer.iter_lines():
                tokens += line.startswith("data: {") and '"token_ids": [' in line and '"token_ids": []' not in line
    except httpx.HTTPError:
        pass
    return tokens


# Policies that admit out of arrival order, and the `priority` field


def serve_args(*argv: str):
    from labkit.cli import build_parser

    parser, _ = build_parser()
    return parser.parse_args(["serve", *argv])


@pytest.mark.parametrize("argv, expected", [
    (["--policy", "priority", "--slots", "2", "--blocks", "40", "--block-size", "4", "--budget", "64",
      "--chunked-prefill"],
     lk.Priority(num_slots=2, num_blocks=40, block_size=4, max_tokens_per_step=64, chunked_prefill=True)),
    (["--policy", "spf", "--slots", "3", "--budget", "32", "--noise", "0.5", "--predictor-seed", "7"],
     lk.ShortestPredictedFirst(num_slots=3, max_tokens_per_step=32, noise=0.5, seed=7)),
    (["--policy", "spf", "--noise", "0"], lk.ShortestPredictedFirst(num_slots=8)),
    (["--policy", "continuous"], lk.Continuous(num_slots=8)),
    ([], lk.Fair(num_slots=8)),  # the default
], ids=lambda value: " ".join(value) if isinstance(value, list) else None)
def test_policy_from_builds_the_policy_with_its_knobs(argv, expected):
    from labkit.serve.server import policy_from

    policy = policy_from(serve_args(*argv))
    assert type(policy) is type(expected) and policy == expected


@pytest.mark.parametrize("argv, message", [
    (["--policy", "static", "--noise", "0.5"], "--noise and --predictor-seed apply to --policy spf, not static"),
    (["--policy", "priority", "--predictor-seed", "3"], "--noise and --predictor-seed apply to --policy spf, not priority"),
    (["--policy", "continuous", "--noise", "0"], "--noise and --predictor-seed apply to --policy spf, not continuous"),
    (["--policy", "dynamic", "--budget", "8"],
     "--budget and --chunked-prefill apply to --policy continuous, priority, spf, fair, not dynamic"),
])
def test_policy_from_refuses_the_knobs_of_another_policy(argv, message):
    from labkit.serve.server import policy_from

    with pytest.raises(ValueError) as problem:
        policy_from(serve_args(*argv))
    assert str(problem.value) == message


@pytest.mark.parametrize("argv, message", [
    (["--policy", "static", "--noise", "1"], "--noise and --predictor-seed apply to --policy spf, not static"),
    (["--policy", "spf", "--noise", "-1"], "argument --noise: '-1': must be a number >= 0"),
    (["--policy", "spf", "--noise", "nan"], "argument --noise: 'nan': must be a number >= 0"),
    (["--policy", "spf", "--predictor-seed", "-2"], "argument --predictor-seed: '-2': must be a whole number >= 0"),
    (["--policy", "fifo"], "argument --policy: invalid choice: 'fifo'"),
])
def test_labkit_serve_refuses_a_bad_policy_knob_in_one_error_line(argv, message, capsys):
    from labkit.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--device", "cpu", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("labkit serve: error: ") and message in err.splitlines()[-1], err


class StepGate:
    """Holds an online engine's first step until `go` is set (`held` is set once it is held), and
    records the request ids that work in every step: the server's own account of who ran when."""

    def __init__(self, online):
        self.held, self.go, self.steps = threading.Event(), threading.Event(), []
        run = online.core.runner.run

        def gated(batch):
            self.held.set()
            self.go.wait(timeout=20)
            self.steps.append([request.id for request, _ in batch.rows])
            return run(batch)

        online.core.runner.run = gated

    def first_step_order(self) -> list[int]:
        """Request ids in the order of the first step each worked in."""
        return list(dict.fromkeys(request_id for step in self.steps for request_id in step))


ONE_SLOT_PROMPTS, ONE_SLOT_LENGTHS, ONE_SLOT_PRIORITIES = [[5, 6], [9], [30, 31]], [24, 4, 4], [0, 5, 1]


def serve_in_one_slot(policy: str, users=(None, None, None)) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """Request 0 (priority 0, 24 tokens) holds the only slot; while it runs, request 1 (priority 5)
    is sent, then request 2 (priority 1), each with its `user` field if one is given. Returns the
    ids in the order they first ran, the tokens each received, and Engine.run's tokens for the
    same prompts."""
    from labkit.serve.server import policy_from

    server = Served(policy_from(serve_args("--policy", policy, "--slots", "1")))
    gate = StepGate(server.online)
    try:
        with httpx.Client(timeout=30) as client, contextlib.ExitStack() as streams:
            answers = []
            for prompt, length, priority, user in zip(ONE_SLOT_PROMPTS, ONE_SLOT_LENGTHS, ONE_SLOT_PRIORITIES, users):
                payload = {"model": MODEL, "prompt": with_bos(prompt), "max_tokens": length, "priority": priority,
                           "stream": True, **({"user": user} if user else {})}
                # entered once the server has queued the request: they are sent one after the other
                answers.append(streams.enter_context(client.stream("POST", f"{server.url}/v1/completions", json=payload)))
                assert gate.held.wait(timeout=20)  # request 0 is in the slot, its first step held
            gate.go.set()
            received = [streamed_token_ids(answer) for answer in answers]
    finally:
        server.stop()
    return gate.first_step_order(), received, reference_tokens(server.engine, ONE_SLOT_PROMPTS, ONE_SLOT_LENGTHS)


def streamed_token_ids(answer: httpx.Response) -> list[int]:
    assert answer.status_code == 200
    tokens = []
    for line in answer.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            tokens += json.loads(line[6:])["choices"][0]["token_ids"]
    return tokens


def test_under_policy_priority_a_later_request_with_a_better_priority_runs_first():
    order, received, expected = serve_in_one_slot("priority")
    assert order == [0, 2, 1]  # request 1 came first but waits: request 2's priority 1 beats its 5
    assert received == expected


def test_first_come_first_served_ignores_the_priority_field():
    """The control: the same requests, with the same priorities, under --policy continuous."""
    order, received, expected = serve_in_one_slot("continuous")
    assert order == [0, 1, 2]
    assert received == expected


def test_under_policy_fair_a_second_client_goes_before_the_first_ones_second_request():
    """Requests 0 and 1 come from user "flood", request 2 from user "polite". Request 2 arrives while
    only request 1 waits, so its counter starts at flood's then, 0 (request 0's first step is still
    held); once request 0 has run (3 prompt tokens and 24 outputs: 51), polite's 0 is the least."""
    order, received, expected = serve_in_one_slot("fair", users=("flood", "flood", "polite"))
    assert order == [0, 2, 1]
    assert received == expected


def test_under_policy_fair_one_client_is_served_first_come_first_served():
    """Without a user field every request is its address's, one client: the order is continuous's."""
    order, received, expected = serve_in_one_slot("fair")
    assert order == [0, 1, 2]
    assert received == expected


def test_a_replay_names_each_requests_client_when_the_trace_has_several(served, monkeypatch):
    submitted = {}  # max_tokens -> client, as the server's engine received them
    submit = served.online.submit

    def recording(prompt_ids, max_tokens, priority=0, client="", **eos_rule):
        submitted[max_tokens] = client
        return submit(prompt_ids, max_tokens, priority, client=client, **eos_rule)

    monkeypatch.setattr(served.online, "submit", recording)
    trace = lk.Trace.from_lengths([3, 2, 4], prompt_lengths=[2, 3, 1])
    for clients, expected in (([0, 1, 0], {3: "user client 0", 2: "user client 1", 4: "user client 0"}),
                              (None, {3: "address 127.0.0.1", 2: "address 127.0.0.1", 4: "address 127.0.0.1"})):
        log = lk.replay(trace.with_clients(clients), url=served.url, model=MODEL, vocab_size=TINY.vocab_size,
                        progress=False)
        assert not log.failures and submitted == expected  # one client (the control): no user field


def test_a_replay_sends_each_request_its_trace_priority(served, monkeypatch):
    submitted = {}  # max_tokens -> priority, as the server's engine received them
    submit = served.online.submit

    def recording(prompt_ids, max_tokens, priority=0, **eos_rule):
        submitted[max_tokens] = priority
        return submit(prompt_ids, max_tokens, priority, **eos_rule)

    monkeypatch.setattr(served.online, "submit", recording)
    trace = lk.Trace.from_lengths([3, 2, 4], prompt_lengths=[2, 3, 1]).with_priorities([0, 2, -1])
    log = lk.replay(trace, url=served.url, model=MODEL, vocab_size=TINY.vocab_size, progress=False)
    assert not log.failures
    assert submitted == {3: 0, 2: 2, 4: -1}
    assert log.outputs == served.engine.run(trace, lk.Continuous(num_slots=4), progress=False).outputs


# One streamed request's path

def test_a_streamed_request_crosses_four_modules_and_the_engine_calls_none_of_the_server():
    """Every labkit function that runs while one request streams, by thread: the engine's thread
    runs only the engine and the scheduler (and `online`'s loop), never the HTTP side (no
    callback into the server); the HTTP side hands the request through guards, api and online,
    and it becomes a `Request` (sched/state.py): four modules hand it on. On the way it is
    checked (its numbers, and `policy.check_fits` with the policy's shape and block size) and
    its tokens become text (the tokenizer). The step it joins is the decision path, counted in
    DESIGN.md."""
    modules: dict[str, set[str]] = {}
    recording = threading.Event()

    def profile(frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        if recording.is_set() and event == "call" and module.startswith("labkit"):
            side = "engine" if threading.current_thread().name == "labkit-engine" else "http"
            modules.setdefault(side, set()).add(module)

    threading.setprofile(profile)  # threads started from here on: the server's and the engine's
    try:
        server = Served()
    finally:
        threading.setprofile(None)
    try:
        payload = {"model": MODEL, "prompt": [0, 5, 6], "max_tokens": 4, "stream": True}
        httpx.post(f"{server.url}/v1/completions", json=payload, timeout=30).raise_for_status()  # warm up
        recording.set()
        with httpx.stream("POST", f"{server.url}/v1/completions", json=payload, timeout=30) as answer:
            events = [line for line in answer.iter_lines() if line.startswith("data: ")]
        assert len(events) == 4 + 2  # four tokens, the finish, [DONE]
        recording.clear()
    finally:
        server.stop()
    hops = {"labkit.serve.guards", "labkit.serve.api", "labkit.serve.online", "labkit.sched.state"}
    checks = {"labkit.checks", "labkit.sched.policy", "labkit.sched.shape", "labkit.sched.blocks"}  # check_fits
    assert modules["http"] == hops | checks | {"labkit.serve.tokenizer"}
    engine_side = {module.rsplit(".", 1)[0] for module in modules["engine"]} - {"labkit.serve"}
    assert engine_side == {"labkit.sched", "labkit.engine"}
    assert modules["engine"] & {"labkit.serve.api", "labkit.serve.guards", "labkit.serve.tokenizer"} == set()


# The chat API

CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": CONVERSATION, **body}, timeout=30)


def test_a_chat_completion_is_the_plain_conversation_s_completion(served):
    """TinyGPT has no chat template: the conversation is `plain_chat`'s text, tokenized as a text
    prompt is. The answer is the assistant's message, with the tokens of the same prompt sent to
    /v1/completions (the control: the same ids through the other API)."""
    from labkit.serve.tokenizer import plain_chat

    text = plain_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert text == "system: be brief\nuser: hi\nassistant: "
    answer = chat(served.url, max_tokens=5).json()
    same = complete(served.url, prompt=text, max_tokens=5).json()["choices"][0]
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": same["text"]}
    assert answer["choices"][0]["token_ids"] == same["token_ids"] and answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["prompt_tokens"] == len(text) + 1  # its bytes and the begin-of-sequence id


def test_a_streamed_chat_says_the_role_once_then_sends_text_deltas(served):
    payload = {"model": MODEL, "messages": CONVERSATION, "max_completion_tokens": 3, "stream": True,
               "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=payload, timeout=30) as answer:
        chunks = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: {")]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert [sorted(delta) for delta in deltas] == [["content", "role"]] + [["content"]] * 3
    assert deltas[0]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 3
    whole = chat(served.url, max_tokens=3).json()["choices"][0]["message"]["content"]
    assert "".join(delta["content"] for delta in deltas) == whole


def test_without_a_limit_a_chat_may_fill_the_models_context(served):
    answer = chat(served.url).json()
    assert answer["usage"]["total_tokens"] == TINY.max_seq_len and answer["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("messages, message", [
    ([], "messages: List should have at least 1 item after validation, not 0 (got [])"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages.0.content: part 0 is {'image_url': {'url': 'x'}, 'type': 'image_url'}: labkit serve reads text parts "
     "only ({\"type\": \"text\", \"text\": ...}), not 'image_url'"),
    ([{"role": "user", "content": 5}], "messages.0.content: must be a string or a list of text parts, not 5"),
])
def test_a_chat_the_model_cannot_read_is_a_400(served, messages, message):
    answer = httpx.post(f"{served.url}/v1/chat/completions", json={"model": MODEL, "messages": messages}, timeout=30)
    assert answer.status_code == 400 and answer.json()["message"] == message


def test_the_model_list_says_when_it_was_created(served):
    (model,) = httpx.get(f"{served.url}/v1/models").json()["data"]
    assert isinstance(model["created"], int) and model["created"] <= time.time()
