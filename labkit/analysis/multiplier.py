"""Where a headline multiplier comes from: a serving setup's throughput over a baseline's,
taken apart into a product of factors, each the ratio of two runs that differ in one thing.

Every run serves the same trace within the same KV memory (`Memory`): a pool of
`pool_tokens`, in which a system without paging reserves `reserve_tokens` for every
request, so it holds at most B = pool_tokens // reserve_tokens at once. The baseline ran a
static batch of B0 <= B (B0 = B unless `baseline_slots` says otherwise). The runs:

    baselines    older implementations running the static schedule at B0 (e.g. transformers' generate)
    static       Static(B0) on the implementation under test
    full static  Static(B): the batch the reserved pool allows; only when B0 < B
    continuous   Continuous(B): the same slots and memory, refilled before every step
    paged        Continuous with a paged pool: as many requests as the pool's blocks hold

Every run produces the same useful tokens, so a throughput ratio is a ratio of durations,
and the headline (baseline's duration / paged's duration) telescopes into:

    implementation  duration(baseline) / duration(static): one schedule, two implementations
    baseline batch  steps(static) / steps(full static): the baseline's batch below what its
                    memory allows; left out (1) when B0 = B
    refill          steps(full static) / steps(continuous): the slot-steps lesson 02's theory predicts
    memory          steps(continuous) / steps(paged): more requests per step in the same pool
    step cost       (s/step of static) / (s/step of paged): what is left. Fewer steps carry the
                    trace's own work (its prompts, each token's reads) in larger pieces, so it
                    falls below 1 even where the paged run spends fewer seconds on that work

Invariants:

- the product of the factors equals the total, up to float rounding, by construction;
- baseline batch, refill and memory count steps, so on any back end they equal `simulate`'s
  for the same policies; implementation and step cost are the only factors a clock decides;
- with every step priced the same (`simulate`'s `step_time`), step cost is 1, up to rounding;
- the paged pool holds whole blocks, at least one request of `reserve_tokens`, so every
  request that `check_fits` passes runs on every schedule.

The topic's other parts: `labkit.viz.multiplier_figures` draws a `Multiplier`, and
`labkit.exercises.multiplier_question` asks lesson 10's question (q8) about one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

from labkit.sched.blocks import num_blocks_for
from labkit.checks import whole_number
from labkit.analysis.metrics import format_table
from labkit.sched.cost import StepPrice
from labkit.sched.policy import Continuous, Static
from labkit.sched.simulator import simulate
from labkit.traffic import Trace

KINDS = ("implementation", "baseline batch", "refill", "memory", "step cost")
SCHEDULES = ("static", "full static", "continuous", "paged")  # the runs `Memory.policies` names


@dataclass(frozen=True)
class Memory:
    """The KV memory every run shares: `pool_tokens` of cache; `reserve_tokens` per request
    for a system that reserves a whole sequence up front (the model's longest, say);
    `max_slots` requests at most for the paged system (vLLM's `max_num_seqs`).

    baseline_slots: the baseline's static batch B0 when something other than memory caps
    it (a latency target, a benchmark's setting); None: as many requests as the pool holds
    when each reserves `reserve_tokens`. The continuous run always uses what the pool holds.
    """

    pool_tokens: int
    reserve_tokens: int
    max_slots: int = 256
    block_size: int = 16
    baseline_slots: int | None = None

    def __post_init__(self):
        for name in ("pool_tokens", "reserve_tokens", "max_slots", "block_size"):
            whole_number(name, getattr(self, name))
        whole_number("baseline_slots", self.baseline_slots, or_none=True)
        if self.pool_tokens < self.reserve_tokens:
            raise ValueError(f"pool_tokens = {self.pool_tokens}: holds not one request of "
                             f"reserve_tokens = {self.reserve_tokens}")
        need = num_blocks_for(self.reserve_tokens, self.block_size)
        if self.num_blocks < need:
            raise ValueError(f"pool_tokens = {self.pool_tokens}: its {self.num_blocks} whole blocks of block_size = "
                             f"{self.block_size} cannot hold one request of reserve_tokens = {self.reserve_tokens} "
                             f"({need} blocks)")
        fits = self.num_memory_slots
        if self.baseline_slots is not None and self.baseline_slots > fits:
            raise ValueError(f"baseline_slots = {self.baseline_slots}: the pool holds only {fits} requests of "
                             f"reserve_tokens = {self.reserve_tokens}")
        if self.max_slots < fits:
            raise ValueError(f"max_slots = {self.max_slots}: fewer than the {fits} requests the pool holds "
                             "without paging; paging would then run fewer at once, not more")

    @property
    def num_reserved_slots(self) -> int:
        """B0: requests the baseline's static batch holds at once, each reserving `reserve_tokens`."""
        return int(self.baseline_slots or self.num_memory_slots)

    @property
    def num_memory_slots(self) -> int:
        """B: requests the pool holds when each reserves `reserve_tokens`; the continuous run's slots."""
        return int(self.pool_tokens // self.reserve_tokens)

    @property
    def num_blocks(self) -> int:
        return int(self.pool_tokens // self.block_size)

    def policies(self) -> dict[str, Static | Continuous]:
        """The schedules: static at B0; static at B when B0 < B ("full static"); continuous at
        B; and continuous on the paged pool."""
        full = self.num_memory_slots
        below = {"full static": Static(num_slots=full)} if self.num_reserved_slots < full else {}
        return {
            "static": Static(num_slots=self.num_reserved_slots),
            **below,
            "continuous": Continuous(num_slots=full),
            "paged": Continuous(num_slots=int(self.max_slots), num_blocks=self.num_blocks,
                                block_size=int(self.block_size)),
        }

    def check_fits(self, trace: Trace) -> None:
        """A ValueError if a request of `trace` needs more than `reserve_tokens`."""
        need = trace.prompt_lengths + trace.output_lengths
        longest = int(need.argmax())
        if need[longest] > self.reserve_tokens:
            raise ValueError(
                f"reserve_tokens = {self.reserve_tokens}: request {trace.ids[longest]} needs {need[longest]} tokens "
                f"(prompt {trace.prompt_lengths[longest]} + output {trace.output_lengths[longest]}); "
                "reserve at least the longest request")


@dataclass(frozen=True)
class Factor:
    """One factor of a multiplier: its kind (one of KINDS), a name, its value, and the ratio
    of the two runs' durations, steps or seconds a step that it is."""

    kind: str
    name: str
    value: float
    ratio: str


class Multiplier:
    """A measured or predicted headline and its factors. `runs` maps each run's name to its
    log, baselines first, then "static", "full static" (only when the baseline ran below
    its memory), "continuous" and "paged"."""

    def __init__(self, runs: dict, factors: tuple[Factor, ...]):
        self.runs, self.factors = runs, factors
        self.baseline = next(iter(runs))
        self.total = runs[self.baseline].duration / runs["paged"].duration

    def __repr__(self) -> str:
        return (f"Multiplier({self.total:.2f}x over {self.baseline}: "
                + " × ".join(f"{f.name} {f.value:.2f}" for f in self.factors) + ")")

    def __str__(self) -> str:
        return self.factor_table() + "\n\n" + self.run_table()

    def factor(self, kind: str) -> float:
        """The product of the factors of one kind (implementation may have several; a kind
        with none, such as baseline batch when B0 = B, is 1)."""
        if kind not in KINDS:
            raise ValueError(f"kind = {kind!r}: choose one of {KINDS}")
        return math.prod(f.value for f in self.factors if f.kind == kind)

    def log_share(self, kind: str) -> float:
        """The share of the headline a kind of factor carries on a log scale, ln(factor) / ln(total):
        a factor of 4 in a total of 16 carries half. NaN when the total is 1."""
        return _log_share(self.factor(kind), self.total)

    def factor_table(self) -> str:
        shares = [_log_share(f.value, self.total) for f in self.factors]
        rows = [[f.name, f"{f.value:.2f}×", "-" if math.isnan(share) else f"{share:.0%}", f.ratio]
                for f, share in zip(self.factors, shares)]
        durations = (self.runs[self.baseline].duration, self.runs["paged"].duration)
        rows.append(["total", f"{self.total:.2f}×", "100%", " / ".join(map(_seconds, durations))])
        return format_table(["factor", "value", "log share", "ratio"], rows)

    def run_table(self) -> str:
        rows = []
        for name, log in self.runs.items():
            steps = getattr(log, "num_steps", None)
            rows.append([name, f"{steps:,}" if steps else "-",
                         f"{log.num_output_tokens / steps:.1f}" if steps else "-",
                         f"{1e3 * log.duration / steps:.3g}" if steps else "-",
                         f"{log.tokens_per_second:,.0f}", f"{self.runs[self.baseline].duration / log.duration:.2f}×"])
        return format_table(["run", "steps", "tokens/step", "ms/step", "tokens/s", "× baseline"], rows)



@dataclass(frozen=True)
class RecordedRun:
    """A run as a benchmark recorded it: its steps, its seconds and the tokens it served."""

    num_steps: int
    duration: float
    num_output_tokens: int

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.duration


def from_record(record: dict, name: str = "batched") -> Multiplier:
    """The `Multiplier` of one configuration `benchmarks/bench_multiplier.py` recorded: its
    "runs" ({run: {"steps", "duration_s"}}, baselines first), "output_tokens" and "factors".
    The factors are recomputed from the runs (`name`: the implementation under test, as the
    benchmark named it); a ValueError if they differ from the recorded ones."""
    runs = {run: RecordedRun(int(logged["steps"]), float(logged["duration_s"]), int(record["output_tokens"]))
            for run, logged in record["runs"].items()}
    multiplier = Multiplier(runs, _factors(runs, name))
    recomputed = {f.name: f.value for f in multiplier.factors}
    recorded = record["factors"]
    if recomputed.keys() != recorded.keys() or not all(
            math.isclose(value, recorded[factor], rel_tol=1e-9) for factor, value in recomputed.items()):
        raise ValueError(f"record['factors'] = {recorded}: the runs give {recomputed}")
    return multiplier


def take_apart(trace: Trace, memory: Memory, run: Callable, baselines: dict[str, Callable] | None = None,
               name: str = "labkit") -> Multiplier:
    """Run `trace` every way the decomposition needs and return its factors.

    run(trace, policy) -> log: the system under test, e.g. `lk.simulate`,
        `partial(lk.simulate, cost=model)` or `partial(engine.run, progress=False)`.
    baselines: {name: run} of older implementations, oldest first, each given the static
        policy; the first is the headline's baseline. None: the static run is the baseline.
    name: what to call the implementation under test in the last implementation factor.
    A log needs `duration` and `num_output_tokens`; the three schedules' logs also `num_steps`.
    """
    memory.check_fits(trace)
    policies = memory.policies()
    runs = {name: serve(trace, policies["static"]) for name, serve in (baselines or {}).items()}
    if set(runs) & set(SCHEDULES):
        raise ValueError(f"baselines = {list(runs)}: {sorted(set(runs) & set(SCHEDULES))} names a schedule's run")
    runs.update({name: run(trace, policy) for name, policy in policies.items()})
    _check_runs(trace, runs)
    return Multiplier(runs, _factors(runs, name))


def predict(trace: Trace, memory: Memory, cost: StepPrice, baseline_costs: dict[str, StepPrice] | None = None,
            name: str = "labkit") -> Multiplier:
    """`take_apart` on the simulator: steps priced by `cost`, each baseline's by its own model."""
    baselines = {baseline: partial(simulate, cost=model) for baseline, model in (baseline_costs or {}).items()}
    return take_apart(trace, memory, partial(simulate, cost=cost), baselines, name)


def memory_first(trace: Trace, multiplier: Multiplier) -> dict[str, float]:
    """Refill and memory taken in the other order: first the batch paging lets a request
    count grow to (static batches as large as the paged run's mean number of running
    requests, memory assumed not to bind), then refill at that batch. Counted in steps, as
    in `take_apart`, so the two still multiply to refill × memory: both chains run from the
    full static run to the paged one."""
    runs = multiplier.runs
    start, paged = runs.get("full static", runs["static"]), runs["paged"]
    batch = round(float((paged.slots >= 0).sum(axis=1).mean()))
    grown = simulate(trace, Static(num_slots=batch)).num_steps
    return {"batch paging holds": batch, "memory": start.num_steps / grown, "refill": grown / paged.num_steps}


def _check_runs(trace: Trace, runs: dict) -> None:
    """Every run served every token, and each baseline ran the static schedule's steps."""
    expected = int(trace.output_lengths.sum())
    for name, log in runs.items():
        if log.num_output_tokens != expected:
            raise ValueError(f"run {name!r} served {log.num_output_tokens} tokens, not the trace's {expected}")
        steps = getattr(log, "num_steps", runs["static"].num_steps)
        if name not in ("full static", "continuous", "paged") and steps != runs["static"].num_steps:
            raise ValueError(f"baseline {name!r} ran {steps} steps, static {runs['static'].num_steps}: "
                             "an implementation factor needs the same schedule")


def _factors(runs: dict, name: str) -> tuple[Factor, ...]:
    """Implementation per pair of successive static runs, then baseline batch (when the
    baseline ran below its memory), refill, memory and step cost."""
    static, continuous, paged = runs["static"], runs["continuous"], runs["paged"]
    full = runs.get("full static", static)
    names = list(runs)[: list(runs).index("static") + 1]
    implementation = tuple(
        Factor("implementation", f"{old} → {name if new == 'static' else new}", runs[old].duration / runs[new].duration,
               f"{_seconds(runs[old].duration)} / {_seconds(runs[new].duration)}")
        for old, new in zip(names, names[1:]))
    per_step = {name: log.duration / log.num_steps for name, log in (("static", static), ("paged", paged))}
    below = () if full is static else (
        Factor("baseline batch", "baseline batch", static.num_steps / full.num_steps,
               f"{static.num_steps:,} / {full.num_steps:,} steps"),)
    return implementation + below + (
        Factor("refill", "refill", full.num_steps / continuous.num_steps,
               f"{full.num_steps:,} / {continuous.num_steps:,} steps"),
        Factor("memory", "memory", continuous.num_steps / paged.num_steps,
               f"{continuous.num_steps:,} / {paged.num_steps:,} steps"),
        Factor("step cost", "step cost", per_step["static"] / per_step["paged"],
               f"{1e3 * per_step['static']:.3g} / {1e3 * per_step['paged']:.3g} ms a step"),
    )


def _log_share(value: float, total: float) -> float:
    return math.log(value) / math.log(total) if total != 1 else math.nan


def _seconds(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds < 1000 else f"{seconds:,.0f} s"
