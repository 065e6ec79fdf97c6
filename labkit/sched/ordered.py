"""Three policies that admit out of arrival order: `Continuous`, with the waiting queue sorted
another way, or read another way.

- `Priority` serves lower `priority` values first, as vLLM's priority scheduling does.
  By default the first waiting request it cannot admit pushes lower-priority running
  requests out, as vLLM's V0 scheduler did (`_schedule_priority_preemption` in
  `vllm/core/scheduler.py`, PR #5958); with `preempt_for_waiting=False` a waiting request
  only waits, and preemption happens only when a running request runs out of blocks, as
  in vLLM's V1 scheduler (`Scheduler.schedule` in `vllm/v1/core/sched/scheduler.py`).
- `ShortestPredictedFirst` admits the shortest predicted output first. A perfect
  predictor knows each output length; a noisy one is off by a factor e^(noise * z).
- `Fair` shares the engine between clients: it admits next from the client that has been
  served the fewest weighted tokens, its virtual token counter (Sheng et al., "Fairness in
  Serving Large Language Models", OSDI 2024; the state keeps the counters,
  `SchedulerState.counts_service`). With one client it is `Continuous`, step for step.

Invariants:

- each request's place in the queue is fixed from its arrival (its priority, or its
  prediction, drawn once from the policy's seed and the request id), so a decision still
  depends only on the state, as `labkit.sched.policy` requires;
- none `admits_in_order`: an arrival may go straight to the head of the queue, so for
  the fast-forward every arrival is an event;
- `Fair` keeps the queue first come, first served and tries the waiting requests in the
  order of their clients' counters, least first, first come among equals; each one it
  admits adds its prompt tokens to its client's counter for the rest of the decision, as
  the step will;
- `Priority` (unless `preempt_for_waiting=False`) preempts for the first waiting request
  it cannot admit, and only when that gives it a slot and its blocks beside those admitted
  before it, and never a request of its priority or higher. During a run of decode steps that request stays first, the
  free slots stay, and the free blocks plus those of lower-priority requests only
  shrink: so if it could not make room at the run's start, it cannot at any step of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from labkit.checks import flag, number, whole_number
from labkit.sched.policy import NO_BLOCKS, NO_SLOT, Continuous, StepPlan
from labkit.sched.state import PROMPT_WEIGHT, Decision, Request, SchedulerState
from labkit.traffic import Trace


@dataclass(frozen=True, repr=False)
class Priority(Continuous):
    """Continuous batching by priority: lower `priority` first, then first come. A running
    request that runs out of blocks preempts the lowest-priority one. With
    `preempt_for_waiting` (the default, vLLM V0), when the first waiting request it cannot
    admit has no slot or no blocks, running requests of lower priority are preempted to
    make room, lowest priority and newest first; without it (vLLM V1), it waits."""

    preempt_for_waiting: bool = field(default=True, kw_only=True)
    admits_in_order = False

    def __post_init__(self):
        super().__post_init__()
        flag("preempt_for_waiting", self.preempt_for_waiting)

    @property
    def may_preempt(self) -> bool:
        return self.preempt_for_waiting or super().may_preempt

    def queue_order(self, request: Request) -> int:
        return request.priority

    def choose_victim(self, candidates: list[Request]) -> Request:
        return max(candidates, key=lambda r: (r.priority, r.admitted_order))

    def schedule(self, state: SchedulerState) -> Decision:
        plan = StepPlan(state, self.token_budget)
        decision = self.fill(plan)
        if self.preempt_for_waiting and decision.blocked in (NO_SLOT, NO_BLOCKS) and not decision.preempt:
            victims = self.victims_for(plan, state.waiting[len(plan.admitted)])
            if victims:  # decide again, with them out: a preempting step admits nobody
                room = StepPlan(state, self.token_budget)
                for victim in victims:
                    room.preempt(victim)
                return replace(self.fill(room), blocked=decision.blocked)  # why the head still waits
        return decision

    def victims_for(self, plan: StepPlan, head: Request) -> list[Request]:
        """Lower-priority running requests whose slots and blocks would let `head` in beside
        those `plan` admits before it, lowest priority and newest first; none if all would not."""
        lower = [r for r in plan.state.running() if r.priority > head.priority]
        num_new_blocks = self.blocks_to_admit(plan.state, head, head.num_uncomputed)
        victims, slots, blocks = [], plan.free_slots, plan.free_blocks
        while lower and not (slots and blocks >= num_new_blocks):
            victim = self.choose_victim(lower)
            lower.remove(victim)
            victims.append(victim)
            scheduled_blocks = plan.state.num_new_blocks(victim, plan.num_tokens.get(victim.id, 0))
            slots, blocks = slots + 1, blocks + victim.num_blocks_held + scheduled_blocks
        return victims if slots and blocks >= num_new_blocks else []


@dataclass(frozen=True, repr=False)
class ShortestPredictedFirst(Continuous):
    """Continuous batching that admits the shortest predicted output first. The prediction
    is the true length times e^(noise * z), z a standard normal drawn from (seed, request
    id): noise 0 is a perfect predictor, noise 1 is typically off by a factor of e."""

    noise: float = field(default=0.0, kw_only=True)
    seed: int = field(default=0, kw_only=True)
    admits_in_order = False

    def __post_init__(self):
        super().__post_init__()
        number("noise", self.noise, or_equal=True)
        whole_number("seed", self.seed, 0)

    def predicted_output_len(self, request: Request) -> float:
        return self._predict(request.id, request.output_len)

    def predicted_lengths(self, trace: Trace) -> np.ndarray:
        """Each request's predicted output length, in the trace's order: what the queue is sorted by."""
        return np.array([self._predict(int(rid), int(length)) for rid, length in zip(trace.ids, trace.output_lengths)])

    def _predict(self, request_id: int, output_len: int) -> float:
        z = np.random.default_rng([self.seed, request_id]).standard_normal()
        return output_len * math.exp(self.noise * z)

    def queue_order(self, request: Request) -> float:
        return self.predicted_output_len(request)


@dataclass(frozen=True, repr=False)
class Fair(Continuous):
    """Continuous batching that shares the engine between clients (a request's `client`):
    waiting requests are tried for admission from the client whose virtual token counter is
    least, first come within a client and among equals, while slots, blocks and budget
    last. A client's counter grows by the work its requests get (`SchedulerState.serve`),
    so a client that sends many requests at once waits its turn behind one that sends few,
    and a lone client is served exactly as by `Continuous`."""

    counts_service = True
    admits_in_order = False

    def candidates(self, plan: StepPlan):
        """The waiting requests, least-served client first, each admission charged its prompt."""
        counters = dict(plan.state.service)
        untried = list(plan.state.waiting)
        while untried:
            request = min(untried, key=lambda r: counters.get(r.client, 0.0))  # the first least: first come
            yield request
            untried.remove(request)
            if request.id in plan.num_tokens:  # admitted: the step will process its tokens
                counters[request.client] = counters.get(request.client, 0.0) + PROMPT_WEIGHT * plan.num_tokens[request.id]
