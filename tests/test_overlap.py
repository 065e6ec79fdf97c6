"""Overlap scheduling: the loop one step ahead (labkit.sched.overlap) and the engine's
device lane with placeholders (labkit.engine.overlap). The overlapped engine must give
the plain engine's tokens and slots, and every comparison has a control that fails."""

import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import labkit as lk
from labkit.engine import Engine, ModelConfig
from labkit.engine.model_runner import busy_native, sleep_holding_lock
from labkit.engine.overlap import OverlappedSteps
from labkit.sched.driver import drive
from labkit.sched.overlap import FixedLanding, drive_overlapped
from labkit.sched.simulator import FixedStepTime
from labkit.sched.blocks import BlockPool

TINY = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=128)
MIXED = lk.Trace.from_lengths([5, 1, 9, 3, 7, 2], prompt_lengths=[3, 0, 12, 1, 20, 6])
POLICIES = [
    lk.Static(num_slots=2, block_size=4),
    lk.Static(num_slots=4, drop_finished=True),
    lk.Static(num_slots=3, num_blocks=10, block_size=4),
    lk.Dynamic(num_slots=4, timeout=0.01),
    lk.Continuous(num_slots=3),
    lk.Continuous(num_slots=3, max_tokens_per_step=8, chunked_prefill=True),
    lk.Continuous(num_slots=4, num_blocks=12, block_size=4),  # preempts
    lk.Continuous(num_slots=4, num_blocks=9, block_size=4, max_tokens_per_step=6, chunked_prefill=True, victim="longest"),
]


# The loop, without torch


@settings(max_examples=60, deadline=None)
@given(
    output_lengths=st.lists(st.integers(1, 12), min_size=1, max_size=10),
    prompt_lengths=st.data(),
    policy=st.sampled_from(POLICIES),
)
def test_with_everyone_arrived_the_overlapped_loop_schedules_as_the_plain_one(output_lengths, prompt_lengths, policy):
    prompts = prompt_lengths.draw(st.lists(st.integers(0, 12), min_size=len(output_lengths), max_size=len(output_lengths)))
    trace = lk.Trace.from_lengths(output_lengths, prompts)
    plain = drive(trace, policy, FixedStepTime(1.0))
    overlapped = drive_overlapped(trace, policy, FixedLanding(1.0))
    assert overlapped.slots.tolist() == plain.slots.tolist()
    assert overlapped.prefill_tokens.tolist() == plain.prefill_tokens.tolist()
    assert overlapped.finish_step.tolist() == plain.finish_step.tolist()
    np.testing.assert_allclose(overlapped.step_start, plain.step_start)
    assert overlapped.num_preemptions == plain.num_preemptions


def test_an_arrival_joins_one_step_later():
    """The negative control of the slot comparisons: request B arrives 1.5 s in, during step 1 (steps take 1 s). The plain loop admits it at
    step 2; the overlapped loop decided step 2 at the start of step 1, so B joins at step 3."""
    trace = lk.Trace.from_lengths([6, 2], arrivals=[0.0, 1.5])
    policy = lk.Continuous(num_slots=2)
    plain = drive(trace, policy, FixedStepTime(1.0))
    overlapped = drive_overlapped(trace, policy, FixedLanding(1.0))
    assert plain.admit_step.tolist() == [0, 2]
    assert overlapped.admit_step.tolist() == [0, 3]
    assert overlapped.ttft[1] - plain.ttft[1] == pytest.approx(1.0)  # one step of TTFT
    assert overlapped.overlap and overlapped.overlap_extra_rows == 2 and plain.overlap_extra_rows == 0


def test_an_idle_device_starts_a_step_at_its_decision():
    trace = lk.Trace.from_lengths([2, 2], arrivals=[0.0, 10.0])
    log = drive_overlapped(trace, lk.Continuous(num_slots=2), FixedLanding(1.0))
    assert log.step_start.tolist() == [0.0, 1.0, 10.0, 11.0]


@pytest.mark.parametrize("run", [
    lambda policy: lk.simulate(MIXED, policy),
    lambda policy: drive_overlapped(MIXED, policy, FixedLanding(1.0)),
    lambda policy: Engine(TINY, device="cpu").run(MIXED, policy),
])
@pytest.mark.parametrize("policy", ["continuous", lk.Continuous, None, 8])
def test_anything_but_a_policy_is_a_type_error(run, policy):
    with pytest.raises(TypeError, match=f"policy = {policy!r} is not a scheduling policy .*labkit.Continuous"):
        run(policy)


# The engine


@pytest.fixture(scope="module")
def plain():
    engine = Engine(TINY, device="cpu", seed=0, threads=1)
    return {repr(policy): engine.run(MIXED, policy, progress=False) for policy in POLICIES}


@pytest.fixture(scope="module")
def overlapped():
    engine = Engine(TINY, device="cpu", seed=0, threads=1, overlap=True)
    return {repr(policy): engine.run(MIXED, policy, progress=False) for policy in POLICIES}


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_overlap_gives_the_same_tokens_and_slots(plain, overlapped, policy):
    mine, reference = overlapped[repr(policy)], plain[repr(policy)]
    assert mine.outputs == reference.outputs
    assert mine.slots.tolist() == reference.slots.tolist()
    assert mine.num_preemptions == reference.num_preemptions
    assert mine.num_blocks_used.tolist() == reference.num_blocks_used.tolist()


def test_the_runs_compared_preempt_and_chunk(overlapped):
    assert overlapped[repr(POLICIES[6])].num_preemptions > 0
    assert overlapped[repr(POLICIES[7])].num_preemptions > 0
    chunked = overlapped[repr(POLICIES[5])]
    assert ((chunked.slots == 4) & (chunked.prefill_tokens > 0)).sum() > 1  # request 4's prompt ran in chunks


def test_a_stale_token_in_place_of_a_placeholder_breaks_the_equality(plain, monkeypatch):
    """Negative control: a token in flight stands in its sequence as the request's previous
    token, which the host has, instead of as its placeholder."""

    def stale(emitting):
        return [request.token_ids[-1] for request in emitting]

    monkeypatch.setattr(OverlappedSteps, "placeholders", staticmethod(stale))
    policy = POLICIES[4]
    log = Engine(TINY, device="cpu", seed=0, threads=1, overlap=True).run(MIXED, policy, progress=False)
    assert log.outputs != plain[repr(policy)].outputs


def test_arrivals_spread_over_the_run_keep_the_tokens():
    """Who joins when depends on the measured clock, and overlap makes arrivals join a step
    later (the exact case is `test_an_arrival_joins_one_step_later`); the tokens never change."""
    trace = replace(MIXED, arrivals=np.linspace(0.0, 0.02, len(MIXED)))
    policy = lk.Continuous(num_slots=3)
    logs = [Engine(TINY, device="cpu", seed=0, threads=1, overlap=overlap).run(trace, policy, progress=False)
            for overlap in (False, True)]
    assert logs[0].outputs == logs[1].outputs


def test_a_leaked_block_is_caught(monkeypatch):
    """Negative control for "every KV block comes back": the first release keeps one block."""
    deallocate, leaked = BlockPool.deallocate, []

    def leaky(self, block_table):
        if not leaked:
            leaked.append(block_table.pop())
        deallocate(self, block_table)

    monkeypatch.setattr(BlockPool, "deallocate", leaky)
    with pytest.raises(AssertionError, match="every KV block"):
        Engine(TINY, device="cpu", threads=1, overlap=True).run(MIXED, lk.Continuous(num_slots=3), progress=False)


@pytest.mark.parametrize("overlap", [False, True])
def test_every_step_is_split_into_host_and_device_time(overlap):
    log = Engine(TINY, device="cpu", threads=1, overlap=overlap).run(MIXED, lk.Continuous(num_slots=3), progress=False)
    host, device = log.host_seconds, log.device_seconds
    assert host.shape == device.shape == (log.num_steps,)
    assert (device > 0).all() and (host > 0).all()
    assert 0 < log.device_idle_fraction < 1
    host_stretches_per_step = 2 if overlap else 1  # overlapped: before the wait and after it
    assert len(log.lanes["device"]) == log.num_steps
    assert len(log.lanes["host"]) == host_stretches_per_step * log.num_steps
    if not overlap:
        np.testing.assert_allclose(host + device, log.step_seconds)
        assert log.device_idle_fraction == pytest.approx(host.sum() / log.step_seconds.sum())


def test_overlap_must_be_a_bool():
    with pytest.raises(ValueError, match="overlap = 'yes': must be True or False"):
        Engine(TINY, device="cpu", overlap="yes")


def test_extra_host_work_shows_in_the_host_time_and_not_the_tokens(plain):
    policy = POLICIES[4]
    log = Engine(TINY, device="cpu", seed=0, threads=1, extra_host_seconds=0.002).run(MIXED, policy, progress=False)
    assert log.outputs == plain[repr(policy)].outputs
    assert (log.host_seconds >= 0.002).all()


@pytest.mark.parametrize("work", [time.sleep, busy_native, sleep_holding_lock],
                         ids=["sleep", "busy_native", "sleep_holding_lock"])
@pytest.mark.parametrize("overlap", [False, True])
def test_every_kind_of_extra_host_work_adds_host_time_and_changes_no_token(plain, work, overlap):
    policy = POLICIES[4]
    engine = Engine(TINY, device="cpu", seed=0, threads=1, overlap=overlap, extra_host_seconds=0.002,
                    extra_host_work=work)
    log = engine.run(MIXED, policy, progress=False)
    assert log.outputs == plain[repr(policy)].outputs
    assert np.median(log.host_seconds) >= 0.002
    assert f"extra_host_work={work.__name__}" in repr(engine)


def test_busy_native_work_keeps_a_core_busy_and_sleep_does_not():
    start = time.thread_time()
    busy_native(0.1)
    busy = time.thread_time() - start
    start = time.thread_time()
    time.sleep(0.1)
    assert busy > 0.02 > time.thread_time() - start  # a loaded machine gives a busy thread less than its 0.1 s


def test_sleeping_holding_the_lock_stops_every_other_thread_and_keeps_no_core_busy():
    import threading

    ticks, done = [], threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.02)
    start, cpu = time.perf_counter(), time.thread_time()
    sleep_holding_lock(0.2)
    end, cpu = time.perf_counter(), time.thread_time() - cpu
    done.set()
    ticker.join()
    assert end - start >= 0.2 and cpu < 0.02
    assert not [t for t in ticks if start + 0.01 < t < end - 0.01]  # the ticker could not run while it slept


def test_extra_host_work_must_be_a_function():
    with pytest.raises(ValueError, match="extra_host_work = 'sleep': must be a function of seconds"):
        Engine(TINY, device="cpu", extra_host_work="sleep")


@pytest.mark.parametrize("value", [-0.001, 1.0, "0.1", True])
def test_extra_host_seconds_must_be_a_small_number(value):
    with pytest.raises(ValueError, match=f"extra_host_seconds = {value!r}: must be a number of seconds in"):
        Engine(TINY, device="cpu", extra_host_seconds=value)


def test_an_overlapped_run_restores_the_lock_hand_over_interval():
    import sys

    before = sys.getswitchinterval()
    Engine(TINY, device="cpu", threads=1, overlap=True).run(MIXED, POLICIES[4], progress=False)
    assert sys.getswitchinterval() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_on_cuda_overlap_gives_the_plain_tokens_and_slots(cuda_graphs):
    engines = [Engine(TINY, device="cuda", seed=0, cuda_graphs=cuda_graphs, overlap=overlap) for overlap in (False, True)]
    for policy in POLICIES:
        plain_log, overlapped_log = (engine.run(MIXED, policy, progress=False) for engine in engines)
        assert overlapped_log.outputs == plain_log.outputs
        assert overlapped_log.slots.tolist() == plain_log.slots.tolist()
        assert (overlapped_log.device_seconds > 0).all()
