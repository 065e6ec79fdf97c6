"""The online engine with its loop in a process of its own (`own_process=True`, what `labkit
serve` runs on a CPU): the tokens `Engine.run` gives, from the weights of the server's own
model, its metrics, and a step that raises in the process, or the process's death, reported
to every stream. (tests/test_online.py runs the same loop in a thread, where a test can reach
into it, and the stop rule, aborts and shutdown in both.)"""

import asyncio
import re
import time

import pytest
import torch

import labkit as lk
from labkit.engine import Engine
from labkit.serve import online as online_module
from labkit.serve.online import OnlineEngine, Unavailable
from labkit.serve.prometheus import ServerMetrics
from tests.test_online import ENGINE, PROMPTS, REFERENCE, TINY, TRACE, drained, read_items, serve

PREEMPTING = lk.Continuous(num_slots=2, num_blocks=11, block_size=4, victim="longest")  # preempts once


def started(policy=lk.Continuous(num_slots=2), engine: Engine = ENGINE, **options) -> OnlineEngine:
    online = OnlineEngine(engine, policy, own_process=True, **options)
    online.start_thread()
    return online


def every_request() -> list[tuple[list[int], int, dict]]:
    return [(prompt, int(n), {}) for prompt, n in zip(PROMPTS, TRACE.output_lengths)]


def hang(seconds: float) -> None:
    """A step's host work that never ends (as far as a test can tell)."""
    time.sleep(3600)


def boom(seconds: float) -> None:
    """A step's host work that fails (the process finds it by name: it is picklable)."""
    raise RuntimeError("boom")


def test_the_process_serves_the_tokens_of_engine_run_and_counts_them():
    metrics = ServerMetrics("tiny")
    online = started(PREEMPTING, metrics=metrics)
    try:
        items = serve(online, every_request())
    finally:
        assert online.stop() == 0
    assert items == [[*REFERENCE[int(rid)], "length"] for rid in TRACE.ids]
    assert drained(online) and not online.is_running()
    assert metrics.generation_tokens._value.get() == TRACE.output_lengths.sum()
    assert metrics.preemptions._value.get() == 1  # its one preemption, counted from the process's reports


def test_the_process_runs_the_servers_weights():
    """Negative control: the same engine with its output matrix negated in the server's process,
    before the loop starts, gives other tokens: the process computes with the weights it was given."""
    changed = Engine(TINY, device="cpu", seed=0, threads=1)
    with torch.no_grad():
        changed.model.lm_head.weight.neg_()
    online = started(PREEMPTING, engine=changed)
    try:
        items = serve(online, every_request())
    finally:
        online.stop()
    assert items != [[*REFERENCE[int(rid)], "length"] for rid in TRACE.ids]


def test_a_step_that_raises_in_the_process_ends_every_request_with_its_error():
    failing = Engine(TINY, device="cpu", seed=0, threads=1, extra_host_seconds=1e-6, extra_host_work=boom)
    online = started(engine=failing)
    (items,) = serve(online, [(PROMPTS[0], 4, {})])
    assert items == ["error"]
    assert isinstance(online.failure, RuntimeError) and str(online.failure) == "boom"
    with pytest.raises(Unavailable, match=re.escape("the engine stopped after an error (RuntimeError)")):
        online.submit(PROMPTS[0], 1)
    online.stop()
    assert not online.is_running()


def test_a_process_that_dies_ends_every_request_with_an_error():
    online = started()

    async def kill_it_mid_request():
        _, stream = online.submit(PROMPTS[0], 100)
        assert isinstance(await asyncio.wait_for(stream.get(), 60), int)
        online.core._process.kill()
        return (await asyncio.wait_for(read_items(stream), 20))[-1]

    assert asyncio.run(kill_it_mid_request()) == "error"
    assert str(online.failure) == "the engine's process ended (exit code -9)" and not online.is_running()
    online.stop()


def test_a_stuck_step_is_seen_and_stop_kills_the_process(monkeypatch):
    """A step that never returns: the loop falls silent with a request in flight, `stuck` says so
    once STUCK_AFTER_S has passed, and `stop` kills the process after STOP_TIMEOUT_S, ending the
    request it held ("abort", counted)."""
    monkeypatch.setattr(online_module, "STUCK_AFTER_S", 0.5)
    monkeypatch.setattr(online_module, "STOP_TIMEOUT_S", 1.0)
    hanging = Engine(TINY, device="cpu", seed=0, threads=1, extra_host_seconds=1e-6, extra_host_work=hang)
    online = started(engine=hanging)

    async def stuck_then_stopped():
        _, stream = online.submit(PROMPTS[0], 4)
        while online.stuck() is None:
            await asyncio.sleep(0.1)
        silent, usual = online.stuck()
        num_aborted = await asyncio.to_thread(online.stop)
        return silent, usual, num_aborted, await asyncio.wait_for(read_items(stream), 20)

    silent, usual, num_aborted, items = asyncio.run(stuck_then_stopped())
    assert silent > 0.5 and usual == 0.0  # no step has ended: none to compare with
    assert num_aborted == 1 and items == ["abort"] and not online.core.is_alive()


def test_health_says_the_engine_is_starting_until_its_process_has_reported():
    """/health answers 200 only once the engine's process runs its loop (it imports torch first,
    for a second or more), so a client that waits for health does not time a server still starting."""
    from fastapi.testclient import TestClient

    from labkit.serve.server import build_server

    app, online = build_server(ENGINE, lk.Continuous(num_slots=2), "tiny", own_process=True)
    with TestClient(app) as client:  # its lifespan starts the process
        starting = client.get("/health")
        deadline = time.monotonic() + 60
        while online.last_report is None and time.monotonic() < deadline:
            time.sleep(0.05)
        running = client.get("/health")
    assert (starting.status_code, starting.json()["message"]) == (503, "the engine is starting")
    assert running.status_code == 200


def test_a_stopped_server_process_says_so_when_waited_for():
    """A lesson cell run again after the server was stopped gets a sentence, not a closed file."""
    from labkit.serve.processes import start_labkit_serve

    server = start_labkit_serve("--device", "cpu", "--threads", "1")
    assert server.wait_until_healthy() is server  # the control: running, it answers
    server.stop()
    with pytest.raises(RuntimeError, match=r"^labkit serve at http://127\.0\.0\.1:\d+ was stopped \(stop\(\)\); "
                                           r"start another to use one$"):
        server.wait_until_healthy()
