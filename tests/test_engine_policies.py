"""The engine under the policies that admit out of arrival order (`labkit.sched.ordered`):
every request gets exactly the tokens it gets alone, and the engine's slots are the
simulator's, step for step. The control: on these traces both policies admit in another
order than first come, first served, so a policy that fell back to FCFS would fail here.

fp32 on the CPU, a tiny model, one thread: the whole file takes a few seconds."""

import numpy as np
import pytest

import labkit as lk
from labkit.engine import Engine
from tests.test_engine import GROWING, MIXED, TINY, solo_outputs

PRIORITIZED = GROWING.with_priorities([3, 2, 1, 0, 0])  # the first in the trace come last

RUNS = [
    (PRIORITIZED, lk.Priority(num_slots=4, num_blocks=9, block_size=4)),  # preempts
    (PRIORITIZED, lk.Priority(num_slots=3, num_blocks=7, block_size=4, max_tokens_per_step=4,
                              chunked_prefill=True)),  # preempts, and chunks prompts
    (PRIORITIZED, lk.ShortestPredictedFirst(num_slots=3, num_blocks=9, block_size=4, noise=1.0)),  # preempts
    (MIXED, lk.ShortestPredictedFirst(num_slots=2)),
    (MIXED, lk.ShortestPredictedFirst(num_slots=2, noise=1.0)),
]
PREEMPTING = RUNS[0]


@pytest.fixture(scope="module")
def engine():
    return Engine(TINY, device="cpu", seed=0, threads=1)


@pytest.fixture(scope="module")
def solo(engine):
    """Each request run alone, per trace: the tokens every batched run must reproduce."""
    return {trace: solo_outputs(engine, trace) for trace in (PRIORITIZED, MIXED)}


@pytest.fixture(scope="module")
def logs(engine):
    return {repr(policy): engine.run(trace, policy, progress=False) for trace, policy in RUNS}


@pytest.mark.parametrize("trace, policy", RUNS, ids=[repr(policy) for _, policy in RUNS])
def test_ordered_policies_give_solo_tokens_and_the_simulator_slots(logs, solo, trace, policy):
    log, predicted = logs[repr(policy)], lk.simulate(trace, policy)
    assert log.outputs == solo[trace]
    assert log.slots.tolist() == predicted.slots.tolist()
    assert log.prefill_tokens.tolist() == predicted.prefill_tokens.tolist()
    assert log.num_queued.tolist() == predicted.num_queued.tolist()
    assert log.num_preemptions == predicted.num_preemptions


def test_the_compared_runs_preempt(logs):
    for _, policy in RUNS[:3]:
        assert logs[repr(policy)].num_preemptions > 0 and logs[repr(policy)].recomputed_tokens > 0, policy


def test_the_overlapped_engine_gives_the_same_tokens_and_slots(solo):
    trace, policy = PREEMPTING
    log = Engine(TINY, device="cpu", seed=0, threads=1, overlap=True).run(trace, policy, progress=False)
    assert log.num_preemptions > 0
    assert log.outputs == solo[trace]
    assert log.slots.tolist() == lk.simulate(trace, policy).slots.tolist()  # everyone arrived: no step of lag


def admission_order(log) -> list[int]:
    """Request ids in the order of their admission (one slot, no preemption: each is admitted once)."""
    return log.trace.ids[np.argsort(log.admit_step, kind="stable")].tolist()


ORDERS = [
    (PRIORITIZED, lk.Priority(num_slots=1), [3, 4, 2, 1, 0]),  # priorities [3, 2, 1, 0, 0]
    (MIXED, lk.ShortestPredictedFirst(num_slots=1), [1, 5, 3, 0, 4, 2]),  # outputs [5, 1, 9, 3, 7, 2]
    (MIXED, lk.ShortestPredictedFirst(num_slots=1, noise=1.0), [1, 5, 3, 2, 0, 4]),  # predicted 5.7 1.1 4.9 2.3 7.5 1.8
]


@pytest.mark.parametrize("trace, policy, expected", ORDERS, ids=[repr(policy) for _, policy, _ in ORDERS])
def test_the_engine_admits_in_the_policy_order_not_first_come(engine, trace, policy, expected):
    """Negative control of the comparisons above: first come, first served admits in trace order."""
    fcfs = engine.run(trace, lk.Continuous(num_slots=1), progress=False)
    assert admission_order(fcfs) == trace.ids.tolist()
    log = engine.run(trace, policy, progress=False)
    assert log.num_preemptions == 0
    assert admission_order(log) == expected != trace.ids.tolist()
