"""What the scheduler itself costs: the CPU time of one `policy.schedule` call.

`schedule_seconds` builds a state in which `num_running` requests decode in their slots
and `num_waiting` wait for one, then times the policy's decision on it. A decision
changes nothing (policies decide, they never act), so the same state serves every call.

Invariants: the time is the median, over `repeats` rounds, of the CPU time of this
thread per call, so other processes on the machine do not count; the state is the same
in every round.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from labkit.sched.blocks import num_blocks_for
from labkit.sched.blocks import BlockPool
from labkit.sched.policy import check_policy
from labkit.sched.state import Decision, Request, SchedulerState

PROMPT_LEN = 32  # tokens of each request's prompt, already in the cache
OUTPUT_LEN = 10_000  # long enough that nobody finishes


def decoding_state(num_running: int, num_waiting: int, num_blocks: int | None, block_size: int) -> SchedulerState:
    """`num_running` requests decoding in as many slots (their prompts computed), `num_waiting` queued."""
    requests = [Request(i, i, 0.0, PROMPT_LEN, OUTPUT_LEN) for i in range(num_running + num_waiting)]
    blocks = BlockPool(num_blocks, block_size) if num_blocks is not None else None
    state = SchedulerState(num_running, requests, blocks)
    state.arrive(requests)
    state.apply(Decision(admit=tuple(range(num_running))))
    prefill = state.batch(Decision())
    state.allocate(prefill)
    state.complete(prefill)
    return state


def schedule_seconds(policy, num_running: int, num_waiting: int, repeats: int = 7, calls: int = 20) -> float:
    """Median CPU seconds of `policy.schedule` with `num_running` requests decoding and
    `num_waiting` waiting. The policy is given `num_running` slots, so nobody is admitted;
    a KV pool, if it has one, is made big enough for everyone's next blocks."""
    check_policy(policy)
    num_blocks = None
    if policy.num_blocks is not None:
        per_request = num_blocks_for(PROMPT_LEN + 2, policy.block_size)
        num_blocks = max(policy.num_blocks, (num_running + 1) * per_request)
    policy = replace(policy, num_slots=num_running, num_blocks=num_blocks)
    state = decoding_state(num_running, num_waiting, num_blocks, policy.block_size)
    rounds = []
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            policy.schedule(state)
        rounds.append((time.thread_time() - start) / calls)
    return float(np.median(rounds))
