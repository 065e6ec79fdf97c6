"""`labkit.Fair`: the engine shared between clients by their virtual token counters (Sheng et
al., OSDI 2024). Exact schedules worked by hand, the counters in closed form, the lift of a
client that comes back, and, with one client, exactly `Continuous` (a Hypothesis property;
tests/test_fastforward.py checks the fast-forward against the plain loop with clients)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import labkit as lk
from labkit.sched.driver import drive, next_batch, start_run
from labkit.sched.simulator import FixedStepTime
from labkit.sched.state import OUTPUT_WEIGHT, PROMPT_WEIGHT, Request, SchedulerState
from strategies import knobs, prompted_traces

# Client 0 sends four requests, then client 1 one, all at t = 0, three tokens each; two slots.
FLOOD_THEN_ONE = lk.Trace.from_lengths([3, 3, 3, 3, 3]).with_clients([0, 0, 0, 0, 1])


def steps(trace: lk.Trace, policy) -> dict[str, list[int]]:
    log = drive(trace, policy, FixedStepTime(1.0))
    return {"admit": log.admit_step.tolist(), "finish": log.finish_step.tolist()}


def test_first_come_first_served_makes_the_lone_request_wait_for_the_flood():
    """The control: Continuous admits in arrival order, so client 1 starts only at step 6."""
    assert steps(FLOOD_THEN_ONE, lk.Continuous(num_slots=2)) == {"admit": [0, 0, 3, 3, 6], "finish": [2, 2, 5, 5, 8]}


def test_fair_admits_the_lone_client_beside_the_flood():
    """Both counters are 0 at step 0: request 0 (client 0, first come) is admitted and its one
    prompt token (the begin-of-sequence token) charged, so client 1's counter is now the least
    and request 4 takes the second slot. Both finish at step 2; client 0's other three follow."""
    assert steps(FLOOD_THEN_ONE, lk.Fair(num_slots=2)) == {"admit": [0, 3, 3, 6, 0], "finish": [2, 5, 5, 8, 2]}


def test_a_counter_is_its_clients_weighted_tokens():
    """Each request processes one prompt token (its begin-of-sequence token) and emits three outputs."""
    scheduler, pending, _ = start_run(FLOOD_THEN_ONE, lk.Fair(num_slots=2), None)
    while not all(request.is_finished for request in scheduler.state.by_id.values()):
        scheduler.postprocess(next_batch(scheduler, pending))
    per_request = PROMPT_WEIGHT * 1 + OUTPUT_WEIGHT * 3
    assert scheduler.state.service == {0: 4 * per_request, 1: per_request}


def test_the_simulator_agrees():
    assert lk.simulate(FLOOD_THEN_ONE, lk.Fair(num_slots=2)).admit_step.tolist() == [0, 3, 3, 6, 0]


def waiting_state(service: dict[int, float], waiting_clients: list[int], last_admitted: int | None) -> SchedulerState:
    state = SchedulerState(2, [], counts_service=True)
    state.service = dict(service)
    state.last_admitted_client = last_admitted
    state.waiting.extend(Request(i, i, 0.0, 0, 1, client=client) for i, client in enumerate(waiting_clients))
    return state


def test_a_client_that_comes_back_starts_from_the_least_waiting_counter():
    state = waiting_state({0: 10.0, 1: 25.0, 2: 1.0}, waiting_clients=[0, 1], last_admitted=None)
    state.arrive([Request(9, 9, 1.0, 0, 1, client=2)])
    assert state.service == {0: 10.0, 1: 25.0, 2: 10.0}  # lifted to client 0's, the least that waits


def test_a_client_already_waiting_or_ahead_is_not_lifted():
    state = waiting_state({0: 10.0, 2: 1.0}, waiting_clients=[0, 2], last_admitted=None)
    state.arrive([Request(9, 9, 1.0, 0, 1, client=2)])  # client 2 waits already: it keeps its counter
    assert state.service[2] == 1.0
    state.arrive([Request(10, 10, 1.0, 0, 1, client=3)])  # a new client starts from the least that waits
    assert state.service[3] == 1.0


def test_with_nobody_waiting_a_client_starts_from_the_last_admitted_clients_counter():
    state = waiting_state({0: 10.0, 2: 4.0}, waiting_clients=[], last_admitted=0)
    state.arrive([Request(9, 9, 1.0, 0, 1, client=2)])
    assert state.service[2] == 10.0
    state = waiting_state({0: 10.0, 2: 40.0}, waiting_clients=[], last_admitted=0)
    state.arrive([Request(9, 9, 1.0, 0, 1, client=2)])
    assert state.service[2] == 40.0  # never lowered


def test_without_the_lift_a_returning_client_would_be_owed_its_time_away():
    """Client 0 is served alone for 6 steps (its counter 1 + 6 x 2 = 13); then client 1 sends three
    requests and client 0 one more, at t = 6.5. Client 1, lifted to 13 (nobody waited: the last
    admitted client's counter), ties with client 0 and goes first (first come); its counter is then
    20 to client 0's 13, so client 0 goes next, and client 1's other two follow. The negative
    control, a state that never lifts: client 1 starts from 0 and is admitted twice (7, then 14)
    before client 0 (13) gets its turn."""
    trace = lk.Trace.from_lengths([6, 3, 3, 3, 3], arrivals=[0, 6.5, 6.5, 6.5, 6.5]).with_clients([0, 1, 1, 1, 0])
    lifted = steps(trace, lk.Fair(num_slots=1))
    assert lifted["admit"] == [0, 6, 12, 15, 9]  # after r0: client 1, client 0, client 1, client 1

    original = SchedulerState._lift
    SchedulerState._lift = lambda self, client: None
    try:
        unlifted = steps(trace, lk.Fair(num_slots=1))
    finally:
        SchedulerState._lift = original
    assert unlifted["admit"] == [0, 6, 9, 15, 12]  # after r0: client 1 twice, client 0, client 1


@settings(max_examples=100, deadline=None)
@given(trace=prompted_traces(), policy=knobs())
def test_with_one_client_fair_schedules_exactly_as_continuous(trace, policy):
    fair = lk.Fair(**{name: getattr(policy, name) for name in policy.__dataclass_fields__})
    try:
        expected = lk.simulate(trace, policy, fast_forward=False, step_time=0.1)
    except ValueError:  # a request that can never fit this policy is refused up front
        return
    got = lk.simulate(trace, fair, fast_forward=False, step_time=0.1)
    for field in ("slots", "num_queued", "blocked", "admit_step", "finish_step", "num_blocks_used"):
        assert np.array_equal(getattr(got, field), getattr(expected, field)), field


@settings(max_examples=60, deadline=None)
@given(trace=prompted_traces(with_clients=True), num_slots=st.integers(1, 4))
def test_every_client_is_served_in_full(trace, num_slots):
    log = lk.simulate(trace, lk.Fair(num_slots=num_slots))
    assert (log.finish_step >= 0).all() and log.num_output_tokens == trace.output_lengths.sum()
