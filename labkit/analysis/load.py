"""Load set from measured capacity: how many requests per second a server can take, and a
trace stretched to arrive at a fraction of that.

An experiment set in requests per second is in another regime on a slower or busier
machine: 20 requests/s may be half of what one laptop serves and more than another can.
So a real-time experiment first measures capacity, the rate at which `run` serves the
trace's requests when all of them wait at t = 0, and then sets its arrivals as a fraction
of it: below capacity (0.5), near it, over it (2). The regime is then the same on a fast
laptop, a busy classroom server and the simulator.

    served = capacity(trace, lk.Continuous(num_slots=8), run=partial(engine.run, progress=False))
    below = trace.at_rate(0.5 * served)

Invariant: capacity is the trace's requests over the backlog's duration, a number > 0.
(`Trace.at_rate` then keeps every request, its lengths, its order and the shape of its
bursts, and changes only the clock.)
"""

from __future__ import annotations

from collections.abc import Callable

from labkit.sched import StepLog, simulate
from labkit.traffic import Trace


def capacity(trace: Trace, policy, run: Callable[..., StepLog] = simulate, **options) -> float:
    """Requests per second `run(trace, policy, **options)` serves when every request of
    `trace` waits at t = 0 (`lk.simulate` by default; `cost=` prices its steps)."""
    log = run(trace.backlogged(), policy, **options)
    return len(trace) / log.duration

