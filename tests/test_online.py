"""The online engine without HTTP: the same three calls as `drive`, requests that arrive while
it runs, their stop rule, aborts, failures and shutdown, its loop in a thread (and, for the
stop rule, aborts and shutdown, in a process of its own too: those runs are `integration`,
as tests/test_engine_process.py is). (tests/test_serve.py drives it through the HTTP API, in
a server of its own.)"""

import asyncio
import re
import threading

import pytest

import labkit as lk
from labkit.engine import Engine, ModelConfig
from labkit.serve.prometheus import ServerMetrics
from labkit.serve.online import OnlineEngine, Unavailable

TINY = ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=128)
ENGINE = Engine(TINY, device="cpu", seed=0, threads=1)
TRACE = lk.Trace.from_lengths([5, 1, 9, 3, 7, 2], prompt_lengths=[3, 0, 12, 1, 20, 6])
PROMPTS = [ENGINE.prompt_ids(int(rid), int(n)) for rid, n in zip(TRACE.ids, TRACE.prompt_lengths)]  # BOS first
REFERENCE = ENGINE.run(TRACE, lk.Continuous(num_slots=3), progress=False).outputs


IN_A_THREAD_OR_A_PROCESS = [pytest.param(False, id="thread"),
                            pytest.param(True, id="own process", marks=pytest.mark.integration)]


def started(policy=lk.Continuous(num_slots=2), **options) -> OnlineEngine:
    online = OnlineEngine(ENGINE, policy, **options)
    online.start_thread()
    return online


def serve(online: OnlineEngine, requests: list[tuple[list[int], int, dict]]) -> list[list]:
    """Submit each (prompt ids, max_tokens, options) at once; every item each stream brings:
    its tokens, then its finish reason."""

    async def all_streams():
        streams = [online.submit(prompt, max_tokens, **options)[1] for prompt, max_tokens, options in requests]
        return [await asyncio.wait_for(read_items(stream), 20) for stream in streams]

    return asyncio.run(all_streams())


async def read_items(stream) -> list:
    items = [await stream.get()]
    while not isinstance(items[-1], str):
        items.append(await stream.get())
    return items


def pool_is_full(online: OnlineEngine) -> bool:
    return online.core.blocks.num_free_blocks == online.core.blocks.num_blocks


def drained(online: OnlineEngine) -> bool:
    """The loop's latest report (a loop in a process of its own, too): nobody holds a slot or
    waits, and every KV block is free."""
    report = online.last_report
    return report.num_in_slots == report.num_waiting == report.num_blocks_used == 0


@pytest.mark.parametrize("policy", [
    lk.Static(num_slots=2),
    lk.Static(num_slots=3, num_blocks=20, block_size=4),
    lk.Dynamic(num_slots=4, timeout=0.05),
    lk.Continuous(num_slots=2, num_blocks=11, block_size=4, victim="longest"),  # preempts once
], ids=repr)
def test_every_policy_serves_online_with_engine_run_tokens(policy):
    online = started(policy)
    try:
        items = serve(online, [(prompt, int(n), {}) for prompt, n in zip(PROMPTS, TRACE.output_lengths)])
    finally:
        online.stop()
    assert items == [[*REFERENCE[int(rid)], "length"] for rid in TRACE.ids]
    assert pool_is_full(online) and not online.core.state.by_id  # released requests are forgotten


@pytest.mark.parametrize("own_process", IN_A_THREAD_OR_A_PROCESS)
def test_an_eos_ends_a_request_there_and_frees_its_slot(own_process):
    """Request 2's greedy outputs, with its fourth output as the model's EOS id: it stops at
    the first time it samples that id, which is its last token; `ignore_eos` runs it to the end."""
    outputs = REFERENCE[2]
    eos = outputs[3]
    first = outputs.index(eos)
    online = started(eos_token_ids=(eos,), own_process=own_process)
    try:
        stopped, ignored = serve(online, [(PROMPTS[2], 9, {}), (PROMPTS[2], 9, {"ignore_eos": True})])
    finally:
        online.stop()
    assert stopped == [*outputs[: first + 1], "stop"]
    assert ignored == [*outputs, "length"]  # the control
    assert drained(online)


def test_min_tokens_masks_the_eos_until_then():
    """With min_tokens past the EOS's first place, that place samples the next best id instead,
    so the outputs differ from there on: the mask is applied, not just the stop rule delayed."""
    outputs = REFERENCE[2]
    eos = outputs[0]
    online = started(eos_token_ids=(eos,))
    try:
        (masked,) = serve(online, [(PROMPTS[2], 9, {"min_tokens": 2})])
    finally:
        online.stop()
    assert masked[0] != eos and masked[1] != eos  # never sampled before 2 outputs
    assert masked[-1] in ("stop", "length") and len(masked) >= 3


@pytest.mark.parametrize("own_process", IN_A_THREAD_OR_A_PROCESS)
def test_an_abort_frees_the_slot_and_ends_the_stream(own_process):
    metrics = ServerMetrics("tiny")
    online = started(lk.Continuous(num_slots=1), metrics=metrics, own_process=own_process)

    async def abort_the_first():
        request_id, stream = online.submit(PROMPTS[0], 100)
        _, waiting = online.submit(PROMPTS[4], 3)
        first = await asyncio.wait_for(stream.get(), 60)  # a process takes seconds to start
        online.abort(request_id)
        return first, await asyncio.wait_for(read_items(stream), 20), await asyncio.wait_for(read_items(waiting), 20)

    try:
        first, rest, waiting = asyncio.run(abort_the_first())
    finally:
        assert online.stop() == 0  # the client that left is not counted
    assert isinstance(first, int) and rest[-1] == "abort" and len(rest) < 100  # what was on its way, then the end
    assert all(isinstance(token, int) for token in rest[:-1])
    assert waiting == [*REFERENCE[4][:3], "length"]  # greedy: the first 3 of its 7 outputs
    assert drained(online)
    assert [gauge._value.get() for gauge in (metrics.running, metrics.waiting, metrics.kv_usage)] == [0, 0, 0]


@pytest.mark.parametrize("own_process", IN_A_THREAD_OR_A_PROCESS)
def test_stop_aborts_what_is_in_flight_and_counts_it(own_process):
    online = started(lk.Continuous(num_slots=1), own_process=own_process)

    async def stop_with_two_in_flight():
        running, waiting = online.submit(PROMPTS[0], 100)[1], online.submit(PROMPTS[4], 100)[1]
        assert isinstance(await asyncio.wait_for(running.get(), 60), int)
        num_aborted = await asyncio.to_thread(online.stop)
        with pytest.raises(Unavailable, match="shutting down"):
            online.submit(PROMPTS[0], 1)
        return num_aborted, (await read_items(running))[-1], await read_items(waiting)

    assert asyncio.run(stop_with_two_in_flight()) == (2, "abort", ["abort"])
    assert online.stop() == 2 and drained(online) and not online.is_running()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread re-raises
def test_a_step_that_raises_ends_every_request_with_an_error(monkeypatch):
    metrics = ServerMetrics("tiny")
    online = OnlineEngine(ENGINE, lk.Continuous(num_slots=2), metrics=metrics)

    def broken(batch):
        raise RuntimeError("boom")

    monkeypatch.setattr(online.core.runner, "run", broken)
    online.start_thread()
    (items,) = serve(online, [(PROMPTS[0], 4, {})])
    assert items == ["error"] and isinstance(online.failure, RuntimeError)
    assert metrics.running._value.get() == 0  # the gauges do not keep the request the step held
    with pytest.raises(Unavailable, match=re.escape("the engine stopped after an error (RuntimeError)")):
        online.submit(PROMPTS[0], 1)
    online.stop()  # joins the thread, so its traceback is this test's (and filtered), not the next one's
    assert not online.is_running()


def test_metrics_count_the_prompt_and_every_token_sent():
    metrics = ServerMetrics("tiny")
    online = started(metrics=metrics)
    try:
        items = serve(online, [(PROMPTS[0], 5, {}), (PROMPTS[4], 7, {})])
    finally:
        online.stop()
    assert [len(stream) - 1 for stream in items] == [5, 7]
    assert metrics.generation_tokens._value.get() == 12
    assert metrics.prompt_tokens._value.get() == len(PROMPTS[0]) + len(PROMPTS[4])
    assert metrics.ttft._sum.get() > 0 and metrics.itl._sum.get() > 0


def test_submit_refuses_a_priority_that_is_not_a_whole_number():
    online = OnlineEngine(ENGINE, lk.Priority(num_slots=1))
    for bad in (1.5, "1", True, None):
        with pytest.raises(ValueError, match=f"^priority = {re.escape(repr(bad))}: must be a whole number"):
            online.submit([5], 2, priority=bad)
    assert not online.core.state.by_id and not online.num_in_flight()  # nothing was queued


def test_a_full_queue_sheds_the_newest_request_of_the_client_that_holds_the_most():
    """One slot, three waiting at most. Client "flood" holds the slot and fills the queue; its
    fourth request is refused (it holds the most). A "polite" request then takes the place of
    flood's newest waiting one, whose stream ends with "shed"; a second polite request is
    refused, since shedding would leave flood no more than polite (2 against 2)."""
    online = started(lk.Continuous(num_slots=1), max_waiting=3)

    async def flood_then_polite():
        _, running = online.submit(PROMPTS[0], 40, client="flood")
        first = await asyncio.wait_for(running.get(), 20)  # admitted: it holds the slot
        flood = [online.submit(PROMPTS[1], 1, client="flood")[1] for _ in range(3)]  # the queue is full
        with pytest.raises(Unavailable, match="^3 requests are waiting for a slot"):
            online.submit(PROMPTS[1], 1, client="flood")
        _, polite = online.submit(PROMPTS[4], 3, client="polite")
        with pytest.raises(Unavailable, match="^3 requests are waiting for a slot"):
            online.submit(PROMPTS[4], 3, client="polite")
        ends = [await asyncio.wait_for(read_items(stream), 20) for stream in (running, *flood, polite)]
        return [first, *ends[0]], ends[1:]

    try:
        running, (flood_1, flood_2, flood_3, polite) = asyncio.run(flood_then_polite())
    finally:
        online.stop()
    assert running[:5] == REFERENCE[0] and len(running) == 41 and running[-1] == "length"  # greedy: its first 5 as ever
    assert flood_3 == ["shed"] and flood_1[-1] == flood_2[-1] == "length"
    assert polite == [*REFERENCE[4][:3], "length"]


def test_one_client_may_hold_only_its_share_of_the_queue():
    online = started(lk.Continuous(num_slots=1), max_waiting=10, max_waiting_per_client=2)

    async def three_each():
        _, running = online.submit(PROMPTS[0], 40, client="a")
        await asyncio.wait_for(running.get(), 20)
        streams = [online.submit(PROMPTS[1], 1, client="a")[1] for _ in range(2)]
        with pytest.raises(Unavailable, match=re.escape("2 of your requests are waiting for a slot, the most this "
                                                        "server queues for one client (max_waiting_per_client 2)")):
            online.submit(PROMPTS[1], 1, client="a")
        streams.append(online.submit(PROMPTS[1], 1, client="b")[1])  # the control: another client is taken
        return [(await asyncio.wait_for(read_items(stream), 20))[-1] for stream in streams]

    try:
        assert asyncio.run(three_each()) == ["length"] * 3
    finally:
        online.stop()


def test_a_loop_silent_far_past_its_usual_step_is_stuck(monkeypatch):
    """Five steps run, then the sixth does not return: `stuck` gives the silence and the usual step
    (the median gap between step reports, measured), once the silence passes STUCK_AFTER_S (0.3 s
    here) and STUCK_FACTOR usual steps; before that, and with nothing in flight, None."""
    from labkit.serve import online as online_module

    monkeypatch.setattr(online_module, "STUCK_AFTER_S", 0.3)
    online = OnlineEngine(ENGINE, lk.Continuous(num_slots=1))
    release, run, calls = threading.Event(), online.core.runner.run, []

    def sixth_hangs(batch):
        calls.append(batch.size)
        if len(calls) == 6:
            release.wait(60)
        return run(batch)

    monkeypatch.setattr(online.core.runner, "run", sixth_hangs)
    online.start_thread()

    async def until_stuck():
        assert online.stuck() is None  # nothing in flight
        _, stream = online.submit(PROMPTS[0], 10)
        for _ in range(5):
            assert isinstance(await asyncio.wait_for(stream.get(), 20), int)
        while online.stuck() is None:
            await asyncio.sleep(0.05)
        return online.stuck()

    try:
        silent, usual = asyncio.run(until_stuck())
    finally:
        release.set()
        online.stop()
    assert 0 < usual < silent / online_module.STUCK_FACTOR and silent > 0.3
