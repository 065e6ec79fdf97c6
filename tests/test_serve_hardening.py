"""`labkit serve` shared by a class: requests checked strictly, an API key, limits on the queue,
the body, connections and slowness, a log that does not flood, a shutdown that ends open
requests with an error, /health that notices a dead engine, and a load test with clients
that leave. In-process servers (as in test_serve.py) for most; one `labkit serve` process
for what needs a real process (an open-file limit, signals)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

import labkit as lk
from labkit.engine import Engine, ModelConfig
from labkit.serve import online as online_module
from labkit.serve.guards import QuietRepeats
from labkit.serve.limits import Limits
from labkit.serve.processes import answers_health
from tests.test_serve import (MODEL, Served, StepGate, free_port, reference_tokens, scrape, serve_args,
                              wait_until)

KEY = "class-key"
AUTH = {"authorization": f"Bearer {KEY}"}
BODY_LIMIT = 64 * 1024
GUARDED = Limits(api_key=KEY, max_body_bytes=BODY_LIMIT, read_timeout=0.5, shutdown_grace=0.5)


@pytest.fixture(scope="module")
def guarded():
    server = Served(limits=GUARDED)
    yield server
    server.stop()


def post(url: str, timeout: float = 30, headers: dict | None = None, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body}, timeout=timeout,
                      headers=AUTH if headers is None else headers)


def post_raw(url: str, content: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", content=content, timeout=10,
                      headers={**AUTH, "content-type": "application/json"})


def assert_error(answer: httpx.Response, status: int, kind: str, message: str, param: str | None = None) -> None:
    assert answer.status_code == status, answer.text
    assert answer.json() == {"object": "error", "message": message, "type": kind, "param": param, "code": status}


def slow_steps(server: Served, monkeypatch, seconds: float) -> None:
    """Each of the server's steps takes at least `seconds`, so a request lasts long enough to leave."""
    run = server.online.core.runner.run

    def slow(batch):
        time.sleep(seconds)
        return run(batch)

    monkeypatch.setattr(server.online.core.runner, "run", slow)


def generated(server: Served) -> float:
    return scrape(server.url)["vllm:generation_tokens_total"]


# 1. A whole (non-streaming) completion whose client leaves is aborted


def test_a_whole_completion_whose_client_leaves_is_aborted(guarded, monkeypatch):
    slow_steps(guarded, monkeypatch, 0.02)  # 120 tokens: at least 2.4 s
    before = generated(guarded)
    with pytest.raises(httpx.ReadTimeout):
        post(guarded.url, prompt=[5], max_tokens=120, timeout=0.3)
    assert wait_until(lambda: not guarded.online.core.state.by_id and guarded.pool_is_full(), 5)
    assert generated(guarded) - before < 60  # cut short: the engine stopped working for it

    # the control: a client that waits gets every token
    before = generated(guarded)
    assert len(post(guarded.url, prompt=[5], max_tokens=20).json()["choices"][0]["token_ids"]) == 20
    assert generated(guarded) - before == 20


# 2. Sampling fields and types, checked strictly

GREEDY = "not supported, labkit serve decodes greedily; leave it out or send"
NOT_IMPLEMENTED = "not supported, labkit serve does not implement it; leave it out or send"


@pytest.mark.parametrize("body, param, message", [
    (dict(temperature="hot"), "temperature", f"temperature = 'hot': {GREEDY} 0 or null"),
    (dict(temperature=0.7), "temperature", f"temperature = 0.7: {GREEDY} 0 or null"),
    (dict(temperature=False), "temperature", f"temperature = False: {GREEDY} 0 or null"),
    (dict(top_p=0.9), "top_p", f"top_p = 0.9: {GREEDY} 1 or null"),
    (dict(top_k=5), "top_k", f"top_k = 5: {GREEDY} -1 or 0 or null"),
    (dict(n=2), "n", f"n = 2: {GREEDY} 1 or null"),
    (dict(best_of=3), "best_of", f"best_of = 3: {GREEDY} 1 or null"),
    (dict(logprobs=1), "logprobs", f"logprobs = 1: {GREEDY} null"),
    (dict(echo=True), "echo", f"echo = True: {GREEDY} false or null"),
    (dict(stop=["\n"]), "stop", f"stop = ['\\n']: {GREEDY} [] or null"),
    (dict(stop="x"), "stop", f"stop = 'x': {GREEDY} [] or null"),
    (dict(suffix="s"), "suffix", f"suffix = 's': {GREEDY} null"),
    (dict(logit_bias={"5": 10}), "logit_bias", f"logit_bias = {{'5': 10}}: {GREEDY} {{}} or null"),
    (dict(presence_penalty=0.5), "presence_penalty", f"presence_penalty = 0.5: {GREEDY} 0 or null"),
    (dict(frequency_penalty=1), "frequency_penalty", f"frequency_penalty = 1: {GREEDY} 0 or null"),
    (dict(response_format={"type": "json_object"}), "response_format",
     f"response_format = {{'type': 'json_object'}}: {NOT_IMPLEMENTED} {{\"type\": \"text\"}} or null"),
    (dict(guided_choice=["a", "b"]), "guided_choice", f"guided_choice = ['a', 'b']: {NOT_IMPLEMENTED} null"),
    (dict(guided_json={}), "guided_json", f"guided_json = {{}}: {NOT_IMPLEMENTED} null"),
    (dict(structured_outputs={"choice": ["a"]}), "structured_outputs",
     f"structured_outputs = {{'choice': ['a']}}: {NOT_IMPLEMENTED} null"),
    (dict(bad_words=["x"]), "bad_words", f"bad_words = ['x']: {NOT_IMPLEMENTED} [] or null"),
    (dict(use_beam_search=True), "use_beam_search", f"use_beam_search = True: {NOT_IMPLEMENTED} false or null"),
    (dict(allowed_token_ids=[]), "allowed_token_ids",
     "allowed_token_ids: List should have at least 1 item after validation, not 0 (got [])"),
    (dict(allowed_token_ids=[5, 10**6]), None,  # checked by the engine, as the prompt's ids are
     "allowed_token_ids[1] = 1000000 is outside the vocabulary (0..299)"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens",
     "truncate_prompt_tokens: Input should be greater than or equal to 1 (got 0)"),
    (dict(seed=1.5), "seed", "seed: Input should be a valid integer (got 1.5)"),
    (dict(max_tokens=True), "max_tokens", "max_tokens: Input should be a valid integer (got True)"),
    (dict(max_tokens=-1), "max_tokens", "max_tokens: Input should be greater than or equal to 1 (got -1)"),
    (dict(min_tokens=-1), "min_tokens", "min_tokens: Input should be greater than or equal to 0 (got -1)"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens", "min_tokens = 5 exceeds max_tokens = 2"),
    (dict(stream="yes"), "stream", "stream: Input should be a valid boolean (got 'yes')"),
    (dict(prompt=[True, False]), "prompt", "prompt: position 0 holds True, not a token id (a whole number)"),
    (dict(prompt=[5, 6.0]), "prompt", "prompt: position 1 holds 6.0, not a token id (a whole number)"),
    (dict(prompt=5), "prompt", "prompt: must be a string or a list of token ids, not 5"),
    (dict(max_tokens="x" * 60_000), "max_tokens",  # a long bad value is shown by a short prefix, never echoed
     "max_tokens: Input should be a valid integer (got 'xxxxxxxxxxxxxxxxxxxxxxxxxxx...xxxxxxxxxxxxxxxxxxxxxxxxxxxx')"),
], ids=lambda value: None if isinstance(value, dict) else "")
def test_what_the_greedy_engine_cannot_honour_is_a_400_naming_the_field(guarded, body, param, message):
    answer = post(guarded.url, **{"prompt": [5], "max_tokens": 2, **body})
    assert_error(answer, 400, "BadRequestError", message, param)
    assert len(answer.content) < 400


def test_allowed_token_ids_are_the_only_ids_sampled(guarded):
    """The greedy outputs without a mask, then with the mask of two ids none of them is: every
    token is one of the two, so the mask changed what was sampled (the plain run is the control)."""
    plain = post(guarded.url, prompt=[0, 5, 6], max_tokens=6).json()["choices"][0]["token_ids"]
    allowed = [token for token in range(1, 300) if token not in plain][:2]
    masked = post(guarded.url, prompt=[0, 5, 6], max_tokens=6, allowed_token_ids=allowed).json()
    assert set(masked["choices"][0]["token_ids"]) <= set(allowed) and len(masked["choices"][0]["token_ids"]) == 6


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(guarded):
    whole = post(guarded.url, prompt=[0, 5, 6, 7, 8], max_tokens=4).json()
    cut = post(guarded.url, prompt=[0, 5, 6, 7, 8], max_tokens=4, truncate_prompt_tokens=2).json()
    tail = post(guarded.url, prompt=[7, 8], max_tokens=4).json()
    assert cut["choices"][0]["token_ids"] == tail["choices"][0]["token_ids"]
    assert cut["usage"]["prompt_tokens"] == 2 and whole["usage"]["prompt_tokens"] == 5


def test_the_values_that_mean_greedy_are_accepted_and_change_nothing(guarded):
    plain = post(guarded.url, prompt=[0, 5, 6], max_tokens=4).json()["choices"][0]["token_ids"]
    greedy = dict(temperature=0, top_p=1.0, top_k=-1, min_p=0, n=1, best_of=1, logprobs=None, echo=False, stop=[],
                  stop_token_ids=None, suffix=None, logit_bias={}, presence_penalty=0, frequency_penalty=0.0,
                  repetition_penalty=1, seed=7, user="student-3", stream_options=None)
    answer = post(guarded.url, prompt=[0, 5, 6], max_tokens=4, **greedy)
    assert answer.status_code == 200 and answer.json()["choices"][0]["token_ids"] == plain
    assert plain == reference_tokens(guarded.engine, [[5, 6]], [4])[0]


def test_token_ids_are_used_as_given_and_an_empty_list_is_refused(guarded):
    """As vLLM: token ids are the sequence as given (no begin-of-sequence token added), so a
    zero-length prompt of the lab's traces is sent as the BOS alone; an empty list is refused,
    and an empty text still starts from the BOS the byte-level tokenizer adds."""
    expected = reference_tokens(guarded.engine, [[]], [3])[0]
    for bos_alone in ([0], ""):
        assert post(guarded.url, prompt=bos_alone, max_tokens=3).json()["choices"][0]["token_ids"] == expected
    assert_error(post(guarded.url, prompt=[], max_tokens=3), 400, "BadRequestError",
                 "prompt = []: give at least one token id; token ids are used as given, so start with the "
                 "model's begin-of-sequence id (0) if it has one")


@pytest.mark.parametrize("content, param, message", [
    (b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt",
     "prompt: character 1 is '\\ud800', a lone surrogate, which is not valid Unicode"),
    (b'{"model": "tiny", "prompt": "\xff\xfe", "max_tokens": 2}', "body",
     "the body is not valid JSON: it is not UTF-8 (invalid start byte at byte 29)"),
    (b"[" * 5000 + b"]" * 5000, "body", "the body is not valid JSON: it is nested too deeply"),
    (b'{"model": "tiny", ', "body", "the body is not valid JSON: Expecting property name enclosed in double quotes"),
], ids=["lone surrogate", "not UTF-8", "nested 5000 deep", "cut short"])
def test_a_body_that_cannot_be_read_is_an_openai_400(guarded, content, param, message):
    assert_error(post_raw(guarded.url, content), 400, "BadRequestError", message, param)


def test_unknown_models_routes_and_methods_are_openai_errors(guarded):
    assert_error(post(guarded.url, prompt=[5], model="gpt-4"), 404, "NotFoundError",
                 "model = 'gpt-4': this server serves 'tiny'", "model")
    assert_error(httpx.get(f"{guarded.url}/v1/nothing", headers=AUTH), 404, "NotFoundError",
                 "GET '/v1/nothing': Not Found")
    assert_error(httpx.get(f"{guarded.url}/v1/completions", headers=AUTH), 405, "MethodNotAllowedError",
                 "GET '/v1/completions': Method Not Allowed")
    assert post(guarded.url, prompt=[5], max_tokens=1).status_code == 200  # the control


# 3. A shared server: the API key, the queue, slow and idle connections, open connections, the log


def test_the_api_key_guards_every_path_but_health_and_metrics(guarded):
    missing = "this server needs an API key: send the header 'Authorization: Bearer KEY'"
    for headers, message in [({}, missing), ({"authorization": KEY}, missing),
                             ({"authorization": f"Basic {KEY}"}, missing),
                             ({"authorization": "Bearer wrong-key"}, "the API key is not valid")]:
        answer = post(guarded.url, prompt=[5], max_tokens=1, headers=headers)
        assert_error(answer, 401, "AuthenticationError", message)
        assert answer.headers["www-authenticate"] == "Bearer"
        assert httpx.get(f"{guarded.url}/v1/models", headers=headers).status_code == 401
    assert httpx.get(f"{guarded.url}/health").status_code == 200  # open, as in vLLM
    assert "vllm:num_requests_running" in httpx.get(f"{guarded.url}/metrics").text
    assert httpx.get(f"{guarded.url}/v1/models", headers=AUTH).json()["data"][0]["id"] == MODEL
    assert post(guarded.url, prompt=[5], max_tokens=1).status_code == 200


def test_a_replay_sends_the_api_key_it_is_given(guarded):
    trace = lk.Trace.from_lengths([2, 3])
    keyed = lk.replay(trace, url=guarded.url, model=MODEL, api_key=KEY, progress=False)
    assert keyed.failures == [] and keyed.num_output_tokens == 5
    keyless = lk.replay(trace, url=guarded.url, model=MODEL, progress=False)  # the control
    assert [request for request, _ in keyless.failures] == [0, 1]
    assert "HTTP 401: this server needs an API key" in keyless.failures[0][1]
    with pytest.raises(ValueError, match="api_key = '': must be a non-empty string, or None for no key"):
        lk.replay(trace, url=guarded.url, model=MODEL, api_key="")


def test_a_request_beyond_max_waiting_gets_a_503_and_the_rest_are_served():
    server = Served(lk.Continuous(num_slots=1), limits=Limits(max_waiting=2, shutdown_grace=0.5))
    gate = StepGate(server.online)
    lengths = [3, 2, 4]
    try:
        with httpx.Client(timeout=30) as client:
            with contextlib.ExitStack() as open_streams:
                streams = []
                for length in lengths:  # the first holds the only slot (its step held); the others wait
                    payload = {"model": MODEL, "prompt": [5], "max_tokens": length, "stream": True}
                    # entered once the server has queued the request
                    streams.append(open_streams.enter_context(client.stream("POST", f"{server.url}/v1/completions",
                                                                            json=payload)))
                    assert gate.held.wait(timeout=20)
                refused = client.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [5],
                                                                           "max_tokens": 1})
                gate.go.set()
                received = [sum(line.startswith("data: {") for line in answer.iter_lines()) for answer in streams]
            after = client.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 1})
    finally:
        server.stop()
    assert_error(refused, 503, "ServiceUnavailableError", "2 requests are waiting for a slot, the most this server "
                 "queues (max_waiting 2); try again later")
    assert refused.headers["retry-after"] == "5"  # so a client that honours it backs off
    assert received == [length + 1 for length in lengths]  # a chunk per token, then the finish
    assert after.status_code == 200  # the queue drained: the next request is served


def test_one_address_may_hold_only_its_share_of_the_connections():
    server = Served(limits=Limits(max_connections_per_client=3, shutdown_grace=0.5))
    host, port = server.url.removeprefix("http://").split(":")
    try:
        held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(3)]
        with socket.create_connection((host, int(port)), timeout=5) as fourth:
            assert fourth.recv(1) == b""  # closed by the server as soon as it was accepted
        held.pop().close()
        assert wait_until(lambda: answers_health(server.url), 5)  # the control: a third connection is served
    finally:
        for connection in held:
            connection.close()
        server.stop()


def exchange(url: str, data: bytes, seconds: float = 30.0) -> tuple[bytes, float]:
    """Send `data` on a new connection and read until the server closes it: (its answer, seconds taken).
    A server that keeps it open longer than `seconds`, far beyond any timeout the tests set, raises
    socket.timeout: so a test needs no upper bound on the time taken."""
    host, port = url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=seconds) as connection:
        connection.sendall(data)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    return answer, time.monotonic() - started


def test_half_sent_requests_and_idle_connections_are_closed_after_the_read_timeout(guarded):
    for half_sent in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):
        answer, seconds = exchange(guarded.url, half_sent)
        assert answer == b"" and seconds > 0.4  # closed by the server, after --read-timeout 0.5 s
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n"
    answer, seconds = exchange(guarded.url, head.encode() + b'{"model": ')
    assert answer.startswith(b"HTTP/1.1 408 ") and seconds > 0.4
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["message"] == "the body did not arrive within 0.5 s"
    answer, _ = exchange(guarded.url, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 ")  # the control: a whole request is answered, not timed out


def test_a_connection_beyond_max_connections_is_closed_at_once():
    server = Served(limits=Limits(max_connections=3, read_timeout=120, shutdown_grace=0.5))
    host, port = server.url.removeprefix("http://").split(":")
    held = [socket.create_connection((host, int(port))) for _ in range(3)]
    try:
        assert wait_until(lambda: len(server.server.server_state.connections) == 3)
        answer, _ = exchange(server.url, b"")  # gives up after 30 s: the read timeout is 120 s
        assert answer == b""  # closed when accepted
    finally:
        for connection in held:
            connection.close()
    try:
        assert wait_until(lambda: not server.server.server_state.connections)
        assert httpx.get(f"{server.url}/health").status_code == 200  # the control: room again
    finally:
        server.stop()


def test_a_repeated_log_message_is_let_through_once_a_minute_with_a_count():
    quiet = QuietRepeats(interval=60)

    def record(message: str, at: float) -> logging.LogRecord:
        entry = logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, message, (7,), None)
        entry.created = at
        return entry

    passed = [entry for at in np.arange(0, 30, 0.01) if quiet.filter(entry := record("refused: %d open", at))]
    assert len(passed) == 1  # 3,000 in 30 s: one line
    other = record("another message %d", 30.0)
    assert quiet.filter(other)  # a different message has its own count
    later = record("refused: %d open", 61.0)
    assert quiet.filter(later) and later.getMessage() == "refused: 7 open [2999 more like it in the last 61 s]"


CLOSED_LISTENER_SCRIPT = """
import asyncio, contextlib, resource, socket, sys
from labkit.serve.guards import quiet_log
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

async def main():
    loop = asyncio.get_running_loop()
    server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
    hogs = []
    with contextlib.suppress(OSError):
        while True:
            hogs.append(socket.socket())
    hogs.pop().close()  # one descriptor left: the client takes it, so the server's accept() fails
    client = socket.socket()
    client.setblocking(False)
    client.connect_ex(server.sockets[0].getsockname())
    await asyncio.sleep(0.3)  # asyncio stops listening and retries in 1 s
    server.close()  # the shutdown, within that second
    await asyncio.sleep(1.5)

with quiet_log() if sys.argv[1] == "quiet" else contextlib.nullcontext():
    asyncio.run(main())
"""


@pytest.mark.parametrize("log", ["quiet", "plain"])
def test_a_shutdown_while_accept_waits_for_descriptors_logs_nothing(log):
    """asyncio logs the accept() that failed for want of descriptors (a real failure, kept), then
    a ValueError when its retry finds the socket closed (nothing failed): the server's log drops
    the second. The control, without the server's filters, shows it."""
    finished = subprocess.run([sys.executable, "-c", CLOSED_LISTENER_SCRIPT, log], capture_output=True,
                              text=True, timeout=30)
    assert finished.returncode == 0, finished.stderr
    assert "socket.accept() out of system resource" in finished.stderr  # the failure that is real
    stale_retry = "ValueError: Invalid file descriptor: -1"
    assert (stale_retry in finished.stderr) == (log == "plain"), finished.stderr


def test_the_limit_flags_make_the_limits():
    from labkit.serve.server import limits_from

    args = serve_args("--api-key", "k", "--max-waiting", "3", "--max-waiting-per-client", "2", "--max-body-bytes",
                      "1000", "--max-connections", "9", "--max-connections-per-client", "4", "--read-timeout", "2.5")
    assert limits_from(args) == Limits(api_key="k", max_waiting=3, max_waiting_per_client=2, max_body_bytes=1000,
                                       max_connections=9, max_connections_per_client=4, read_timeout=2.5)
    assert limits_from(serve_args()) == Limits()  # the control: no flag, the defaults


@pytest.mark.parametrize("argv, message", [
    (["--max-waiting", "0"], "argument --max-waiting: '0': must be a whole number >= 1"),
    (["--max-body-bytes", "4MB"], "argument --max-body-bytes: '4MB': must be a whole number >= 1"),
    (["--max-connections", "-5"], "argument --max-connections: '-5': must be a whole number >= 1"),
    (["--read-timeout", "0"], "argument --read-timeout: '0': must be a number > 0"),
    (["--api-key", ""], "api_key = '': must be a non-empty string, or None for no key"),
])
def test_a_bad_limit_flag_is_one_error_line(argv, message, capsys):
    from labkit.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--device", "cpu", *argv])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"labkit serve: error: {message}"


def test_weights_that_do_not_fit_in_shared_memory_are_one_error_line(monkeypatch, capsys):
    """The engine's process gets the weights through /dev/shm: where they do not fit (a default
    container has 64 MB), the server says so and how to fix it, before it starts."""
    from labkit.cli import main
    from labkit.serve import server

    room = Engine(ModelConfig(), device="cpu", seed=0, threads=1)
    server.check_shared_memory(room)  # the control: this machine's /dev/shm holds TinyGPT
    monkeypatch.setattr(server.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(64 << 20, 63 << 20, 1 << 20))
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--device", "cpu", "--threads", "1"])
    assert exit_info.value.code == 2
    assert re.fullmatch(r"labkit serve: error: the model's weights \(\d+ MiB\) do not fit in /dev/shm \(1 MiB free\), "
                        r"through which the engine's process gets them: give it more room \(docker run --shm-size 4g\) "
                        r"or pass --engine-in-thread", capsys.readouterr().err.splitlines()[-1])


@pytest.mark.parametrize("field, value, message", [
    ("max_waiting", 0, "max_waiting = 0: must be a whole number >= 1"),
    ("max_body_bytes", True, "max_body_bytes = True: must be a whole number >= 1, or None"),  # None: the model's
    ("read_timeout", float("nan"), "read_timeout = nan: must be a number of seconds > 0"),
    ("shutdown_grace", -1.0, "shutdown_grace = -1.0: must be a number of seconds > 0"),
    ("api_key", 5, "api_key = 5: must be a non-empty string, or None for no key"),
])
def test_limits_refuse_what_a_server_cannot_honour(field, value, message):
    with pytest.raises(ValueError) as problem:
        Limits(**{field: value})
    assert str(problem.value) == message


# 4. Body size, before parsing


def test_a_body_over_the_limit_is_a_413_before_it_is_read(guarded):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\n")
    answer, _ = exchange(guarded.url, f"{head}Content-Length: 100000000\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 413 ")  # from the declared length, not a 408 after waiting for the body
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {
        "object": "error", "message": f"the body is 100000000 bytes; this server takes at most {BODY_LIMIT}",
        "type": "RequestTooLargeError", "param": None, "code": 413}


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit(guarded):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (16384, b" " * 16384)
    answer, _ = exchange(guarded.url, head.encode() + chunk * 5)  # 80 KiB of a body that never ends
    assert answer.startswith(b"HTTP/1.1 413 ")  # not 408: the server did not wait for the end
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["message"] == (
        f"the body is more than {BODY_LIMIT} bytes, the most this server takes")


def test_the_default_body_limit_takes_the_longest_prompt_the_model_does_and_no_more():
    """TinyGPT's default limit (README states it): a prompt of its whole context as control
    characters, each escaped as six bytes of JSON (the worst a byte-level prompt can be), fits and
    is served; a body one byte over the limit gets 413."""
    server = Served(lk.Continuous(num_slots=1), config=ModelConfig(), limits=Limits(shutdown_grace=0.5))
    limit = Limits().for_model(server.engine.config.max_seq_len, server.engine.config.vocab_size).max_body_bytes
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    longest = {"model": MODEL, "prompt": "\x01" * (server.engine.config.max_seq_len - 2), "max_tokens": 1}
    content = json.dumps(longest).encode()
    try:
        served = httpx.post(f"{server.url}/v1/completions", content=content, timeout=30,
                            headers={"content-type": "application/json"})
        over = httpx.post(f"{server.url}/v1/completions", content=content + b" " * (limit + 1 - len(content)),
                          timeout=30, headers={"content-type": "application/json"})
    finally:
        server.stop()
    assert f"(TinyGPT: {limit:,})" in readme
    assert len(content) < limit and served.status_code == 200 and over.status_code == 413


def test_a_body_within_the_limit_is_read(guarded):
    answer = post(guarded.url, prompt="a" * 60_000, max_tokens=2)  # 60 kB: parsed, then refused by the model
    assert_error(answer, 400, "BadRequestError",
                 "prompt of 60001 tokens + max_tokens 2 exceed the model's max_seq_len 128")  # BOS + 60,000 bytes


# 5. Shutdown, and an engine that dies


def read_stream(answer: httpx.Response) -> list[str]:
    return [line for line in answer.iter_lines() if line.startswith("data: ")]


def test_stopping_ends_open_requests_with_an_error_and_counts_them(monkeypatch, capsys):
    server = Served(lk.Continuous(num_slots=8), limits=Limits(shutdown_grace=1.5))  # a slot for every request
    slow_steps(server, monkeypatch, 0.05)  # 120 tokens: at least 6 s; 4 tokens: at least 0.2 s
    endings = {}

    def client(name: str, max_tokens: int, stream: bool = True, leave: bool = False):
        payload = {"model": MODEL, "prompt": [5], "max_tokens": max_tokens, "stream": stream}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=payload, timeout=30) as answer:
            if not leave:
                endings[name] = (answer.status_code, read_stream(answer) if stream else json.loads(answer.read()))

    clients = [threading.Thread(target=client, args=(f"long {i}", 120)) for i in range(3)]
    clients += [threading.Thread(target=client, args=("whole", 120, False)),
                threading.Thread(target=client, args=("short", 4)),
                threading.Thread(target=client, args=("left", 120, True, True))]
    for thread in clients:
        thread.start()
    assert wait_until(lambda: len(server.online.step_sizes) > 1 and server.online.num_in_flight() == 5)
    server.stop()  # the grace period (1.5 s) lets the short one finish; the engine aborts the other four
    for thread in clients:
        thread.join(timeout=20)
    out = capsys.readouterr().out
    assert re.search(r"labkit serve: stopped after \d+ steps; 4 requests cut short at shutdown\n", out), out
    status, lines = endings["short"]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    for name in ("long 0", "long 1", "long 2"):
        status, lines = endings[name]
        error = json.loads(lines[-2][6:])["error"]
        assert status == 200 and lines[-1] == "data: [DONE]"
        assert error == {"object": "error", "type": "ServiceUnavailableError", "param": None, "code": 503,
                         "message": f"the server is shutting down: the request ended after {len(lines) - 2} tokens"}
    status, body = endings["whole"]
    assert status == 503 and body["type"] == "ServiceUnavailableError"
    assert re.fullmatch(r"the server is shutting down: the request ended after \d+ tokens", body["message"])
    assert server.pool_is_full() and not server.online.core.state.by_id


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine's thread dies
def test_when_the_engine_dies_health_fails_and_requests_end_with_an_error(monkeypatch):
    server = Served()
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200  # the control

        def broken(batch):
            raise RuntimeError("boom")

        monkeypatch.setattr(server.online.core.runner, "run", broken)
        payload = {"model": MODEL, "prompt": [5], "max_tokens": 5, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=payload, timeout=10) as answer:
            lines = read_stream(answer)
        assert lines == ['data: {"error": {"object": "error", "message": "the engine stopped after an error: the '
                         'request ended after 0 tokens", "type": "ServiceUnavailableError", "param": null, '
                         '"code": 503}}', "data: [DONE]"]
        assert_error(httpx.get(f"{server.url}/health"), 503, "ServiceUnavailableError",
                     "the engine stopped after an error: RuntimeError('boom')")
        assert_error(post(server.url, headers={}, prompt=[5], max_tokens=1), 503, "ServiceUnavailableError",
                     "the engine stopped after an error (RuntimeError); restart the server")
    finally:
        server.stop()


# The load test: 300 streams at once, 30 of them leaving at random points

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def test_three_hundred_streams_with_thirty_leaving_end_with_empty_gauges_and_every_block_free(monkeypatch):
    server = Served(lk.Continuous(num_slots=16, num_blocks=48, block_size=4))  # a small pool: preemption too
    slow_steps(server, monkeypatch, 0.004)  # a leaver's 100 tokens take at least 0.4 s: it leaves before the end
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 9, 300).tolist()
    prompts = [rng.integers(1, 300, rng.integers(0, 9)).tolist() for _ in lengths]  # sent after the BOS
    leave_after = {int(i): int(rng.integers(1, 6)) for i in rng.choice(300, 30, replace=False)}  # tokens read
    for i in leave_after:
        lengths[i] = 100

    async def one(client: httpx.AsyncClient, i: int) -> list[int]:
        tokens = []
        payload = {"model": MODEL, "prompt": [0, *prompts[i]], "max_tokens": lengths[i], "stream": True}
        async with client.stream("POST", f"{server.url}/v1/completions", json=payload) as answer:
            async for line in answer.aiter_lines():
                if line.startswith("data: {"):
                    tokens += json.loads(line[6:])["choices"][0]["token_ids"]
                    if len(tokens) == leave_after.get(i):
                        return tokens  # leaves mid-stream: the connection closes with the block
        return tokens

    async def everyone() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=300)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(300)))

    try:
        before = generated(server)
        received = asyncio.run(asyncio.wait_for(everyone(), 120))
        stayed = [i for i in range(300) if i not in leave_after]
        expected = reference_tokens(server.engine, [prompts[i] for i in stayed], [lengths[i] for i in stayed])
        assert [received[i] for i in stayed] == expected  # every token, the same as Engine.run's
        assert all(len(received[i]) == count for i, count in leave_after.items())
        assert wait_until(lambda: server.pool_is_full() and not server.online.core.state.by_id)
        assert wait_until(lambda: [scrape(server.url)[gauge] for gauge in GAUGES] == [0.0, 0.0, 0.0])
        assert generated(server) - before < sum(lengths)  # the leavers were cut short, not served to the end
        assert max(server.online.step_sizes) > 1
    finally:
        server.stop()


# `labkit serve` in its own process: an open-file limit, and signals


@pytest.fixture(scope="module")
def serve_process(tmp_path_factory):
    """`labkit serve` under an open-file limit of 256 (so at most 256 - 64 = 192 connections), with a
    1 s read timeout, its stdout and stderr in one log file: (process, url, log path)."""
    port, log_path = free_port(), tmp_path_factory.mktemp("serve") / "log.txt"
    with open(log_path, "w") as log:  # bash's ulimit -n sets the soft and the hard limit: the server cannot raise it
        process = subprocess.Popen(["bash", "-c", 'ulimit -n 256 && exec "$@"', "bash", sys.executable, "-m", "labkit",
                                    "serve", "--port", str(port), "--device", "cpu", "--threads", "1",
                                    "--read-timeout", "1"], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: answers_health(url), 60), "labkit serve did not start"
        yield process, url, log_path
    finally:
        process.kill()
        process.wait(timeout=10)


def test_a_flood_of_half_open_sockets_neither_locks_the_server_out_nor_fills_its_log(serve_process):
    process, url, log_path = serve_process
    host, port = url.removeprefix("http://").split(":")
    flood = []
    try:
        for _ in range(300):  # more than the open-file limit: accept() fails until the server closes some
            connection = socket.create_connection((host, int(port)), timeout=5)
            flood.append(connection)
            try:
                connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
            except OSError:
                pass  # refused already
        assert wait_until(lambda: answers_health(url), 15)  # answered while the flood's sockets are still open
    finally:
        for connection in flood:
            connection.close()
    log = log_path.read_text()
    assert log.count("refused a connection: 192 are open, the most this server keeps") == 1
    assert log.count("Too many open files") <= 1
    assert len(log) < 3000, log[:3000]


def test_a_second_ctrl_c_ends_open_streams_with_an_error_and_the_process_cleanly(serve_process):
    process, url, log_path = serve_process
    log_before = len(log_path.read_text())
    endings, num_started = [], threading.Semaphore(0)

    def stream():
        lines = []
        payload = {"model": "tinygpt", "prompt": [5], "max_tokens": 1500, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=30) as answer:
            for line in answer.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 1:
                        num_started.release()
        endings.append(lines)

    clients = [threading.Thread(target=stream) for _ in range(2)]
    for thread in clients:
        thread.start()
    assert num_started.acquire(timeout=30) and num_started.acquire(timeout=30)
    process.send_signal(signal.SIGINT)  # the grace period begins: 1,500 tokens take longer than 5 s
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)  # and ends
    assert process.wait(timeout=20) == 0
    for thread in clients:
        thread.join(timeout=10)
    for lines in endings:
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["message"].startswith("the server is shutting down")
    assert len(endings) == 2
    assert re.fullmatch(r"labkit serve: stopped after \d+ steps; 2 requests cut short at shutdown\n",
                        log_path.read_text()[log_before:])


def test_a_stuck_step_turns_health_to_503_and_shutdown_still_ends_the_stream(monkeypatch):
    """A step that does not return: /health says so once the loop has been silent STUCK_AFTER_S
    (0.5 s here) with a request in flight; at shutdown the loop's thread gets STOP_TIMEOUT_S
    (1 s here), and the stream it held still ends, with the shutdown's error chunk."""
    monkeypatch.setattr(online_module, "STUCK_AFTER_S", 0.5)
    monkeypatch.setattr(online_module, "STOP_TIMEOUT_S", 1.0)
    server = Served(limits=Limits(shutdown_grace=0.2))
    release = threading.Event()
    run = server.online.core.runner.run

    def stuck(batch):
        release.wait(60)
        return run(batch)

    monkeypatch.setattr(server.online.core.runner, "run", stuck)
    lines = []

    def stream():
        payload = {"model": MODEL, "prompt": [5], "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=payload, timeout=60) as answer:
            lines.extend(line for line in answer.iter_lines() if line.startswith("data: "))

    client = threading.Thread(target=stream)
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200  # the control: nothing in flight yet
        client.start()
        assert wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 503, 20)
        message = httpx.get(f"{server.url}/health").json()["message"]
        assert re.fullmatch(r"the engine's loop has been silent for \d+\.\d s with requests in flight \(no step has "
                            r"ended yet\): a step may be stuck", message)
        server.stop()
        client.join(timeout=20)
    finally:
        release.set()
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["message"].startswith(
        "the server is shutting down")


def children_of(pid: int) -> list[int]:
    """The process ids of `pid`'s children (Linux)."""
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_ctrl_c_to_the_whole_group_lets_the_engines_process_finish_open_streams(tmp_path):
    """Ctrl-C reaches every process of the terminal's group, the engine's process too: it ignores
    it, so an open stream still gets every token in the grace period; then the server's process
    exits cleanly and leaves no child behind. (The test runs it in a group of its own.)"""
    port, log_path = free_port(), tmp_path / "log.txt"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "labkit", "serve", "--port", str(port), "--device", "cpu",
                                    "--threads", "1"], stdout=log, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: answers_health(url), 60), "labkit serve did not start"
        children = children_of(process.pid)
        assert children  # the engine's process, at least
        payload = {"model": "tinygpt", "prompt": [0, 5, 6], "max_tokens": 300, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=30) as answer:
            lines = answer.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            os.killpg(process.pid, signal.SIGINT)
            rest = [line for line in lines if line.startswith("data: ")]
        assert process.wait(timeout=20) == 0
    finally:
        process.kill()
    assert "in a process of its own" in log_path.read_text()
    tokens = [json.loads(line[6:])["choices"][0]["token_ids"] for line in [first, *rest[:-1]]]
    served = Engine(ModelConfig(), device="cpu", seed=0, threads=1, fused=True)  # what the server runs
    assert sum(tokens, []) == reference_tokens(served, [[5, 6]], [300])[0] and rest[-1] == "data: [DONE]"
    assert wait_until(lambda: not any(Path(f"/proc/{child}").exists() for child in children), 10)
