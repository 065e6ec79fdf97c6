"""A headline multiplier taken apart: exact factors on the toy trace, a baseline below its
memory, the product invariant, factors built independently from the policies, bad memory,
the check-yourself question, and the two figures."""

import math
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import labkit as lk
from labkit.sched.blocks import num_blocks_for
from labkit.engine import Engine, ModelConfig
from labkit.analysis.multiplier import KINDS, Memory, Multiplier, from_record, memory_first, predict, take_apart
from labkit.viz.multiplier_figures import MARKER_OFFSET, THIN

TOY = lk.Trace.from_lengths([2, 6, 3, 8, 2, 4, 5, 2])
TOY_MEMORY = Memory(pool_tokens=16, reserve_tokens=8, max_slots=8, block_size=1)  # B0 = 2; the paged pool holds 16
TOY_BELOW = Memory(pool_tokens=16, reserve_tokens=8, max_slots=8, block_size=1, baseline_slots=1)  # B0 = 1 < B = 2
COST = lk.CostModel(overhead=2e-3, per_prefill_token=1e-4, per_decode_token=3e-4, per_kv_token=2e-7)
TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=64)


def product(m: Multiplier) -> float:
    return math.prod(f.value for f in m.factors)


def by_hand(trace, memory, run=lk.simulate):
    """The schedules' logs (static at B0, static at B, continuous at B, paged), from policies
    built here rather than by `Memory.policies`."""
    full = memory.pool_tokens // memory.reserve_tokens
    b0 = memory.baseline_slots or full
    return (run(trace, lk.Static(num_slots=b0)), run(trace, lk.Static(num_slots=full)),
            run(trace, lk.Continuous(num_slots=full)),
            run(trace, lk.Continuous(num_slots=memory.max_slots, num_blocks=memory.pool_tokens // memory.block_size,
                                     block_size=memory.block_size)))


def static_steps(lengths, batch):
    """Static batching's steps by hand: each batch of `batch` requests, in order, runs as long as its longest."""
    return sum(max(lengths[i : i + batch]) for i in range(0, len(lengths), batch))


# the toy trace: the lab's canonical numbers


def test_toy_refill_is_23_over_17_and_step_cost_is_one():
    m = take_apart(TOY, TOY_MEMORY, lk.simulate)
    assert m.baseline == "static"
    # no older implementation and a baseline at the batch its memory allows: no such factors
    assert [f.kind for f in m.factors] == ["refill", "memory", "step cost"]
    assert m.factor("baseline batch") == 1  # the empty product
    assert {name: log.num_steps for name, log in m.runs.items()} == {"static": 23, "continuous": 17, "paged": 8}
    assert m.factor("refill") == 23 / 17
    assert m.factor("memory") == 17 / 8
    assert m.factor("implementation") == 1  # the empty product
    assert math.isclose(m.factor("step cost"), 1.0, rel_tol=1e-12)
    assert math.isclose(m.total, m.factor("refill") * m.factor("memory"), rel_tol=1e-12)
    assert math.isclose(product(m), m.total, rel_tol=1e-12)


def test_step_cost_is_exactly_one_when_step_times_sum_exactly():
    """A step time of 1 s sums without rounding, so every ratio is exact."""
    m = take_apart(TOY, TOY_MEMORY, partial(lk.simulate, step_time=1.0))
    assert m.factor("step cost") == 1.0
    assert m.total == 23 / 8
    assert m.factor("refill") * m.factor("memory") == 23 / 8


# a baseline below its memory: the toy trace at one slot, where its reservations allow two


def test_a_baseline_below_its_memory_gets_its_own_factor():
    lengths = [int(n) for n in TOY.output_lengths]
    one, two = static_steps(lengths, 1), static_steps(lengths, 2)
    assert (one, two) == (sum(lengths), 23)  # one slot: a step per token; two: lesson 01's 23
    m = take_apart(TOY, TOY_BELOW, partial(lk.simulate, step_time=1.0))
    assert list(m.runs) == ["static", "full static", "continuous", "paged"]
    assert [f.kind for f in m.factors] == ["baseline batch", "refill", "memory", "step cost"]
    assert m.factor("baseline batch") == one / two
    assert m.factor("refill") == 23 / 17  # refill is measured at the batch memory allows, as before
    assert m.factor("memory") == 17 / 8
    assert m.factor("step cost") == 1.0
    assert m.total == one / 8
    assert math.isclose(product(m), m.total, rel_tol=1e-12)


def test_the_baseline_batch_factor_is_what_the_old_memory_factor_lumped_in():
    """Split out, not added: a baseline below its memory totals its baseline batch times what a
    baseline at its memory totals, against the same paged run."""
    below, at = take_apart(TOY, TOY_BELOW, lk.simulate), take_apart(TOY, TOY_MEMORY, lk.simulate)
    assert below.runs["paged"].num_steps == at.runs["paged"].num_steps
    assert math.isclose(below.total, below.factor("baseline batch") * at.total, rel_tol=1e-12)


def test_a_baseline_at_its_memory_has_no_baseline_batch_factor():
    """Negative control: the factor appears only when the baseline ran fewer than the pool holds,
    and its value moves with the baseline's batch."""
    at = take_apart(TOY, Memory(pool_tokens=16, reserve_tokens=8, max_slots=8, block_size=1, baseline_slots=2),
                    lk.simulate)
    assert "full static" not in at.runs and at.factor("baseline batch") == 1
    wide = Memory(pool_tokens=32, reserve_tokens=8, max_slots=8, block_size=1)  # holds 4
    lengths = [int(n) for n in TOY.output_lengths]
    values = {b0: take_apart(TOY, Memory(32, 8, max_slots=8, block_size=1, baseline_slots=b0), lk.simulate)
              .factor("baseline batch") for b0 in (1, 2, 3)}
    assert values == {b0: static_steps(lengths, b0) / static_steps(lengths, 4) for b0 in (1, 2, 3)}
    assert len(set(values.values())) == 3
    assert take_apart(TOY, wide, lk.simulate).factor("baseline batch") == 1


def test_the_toy_factors_depend_on_the_slots():
    """Negative control: the step counts the factors are built from change with the baseline's slots."""
    assert lk.simulate(TOY, lk.Continuous(num_slots=3)).num_steps != 17
    wider = take_apart(TOY, Memory(pool_tokens=24, reserve_tokens=8, max_slots=8, block_size=1), lk.simulate)
    assert wider.factor("refill") != 23 / 17


def test_a_step_cost_model_moves_step_cost_off_one():
    """Negative control of step cost == 1: priced by work, the paged run's fuller steps cost more."""
    m = take_apart(TOY, TOY_MEMORY, partial(lk.simulate, cost=COST))
    assert m.factor("step cost") < 1
    assert m.factor("refill") == 23 / 17 and m.factor("memory") == 17 / 8  # steps do not depend on prices
    assert math.isclose(product(m), m.total, rel_tol=1e-12)


def test_policies_are_the_schedules():
    assert TOY_MEMORY.policies() == {
        "static": lk.Static(num_slots=2),
        "continuous": lk.Continuous(num_slots=2),
        "paged": lk.Continuous(num_slots=8, num_blocks=16, block_size=1),
    }
    capped = Memory(pool_tokens=64, reserve_tokens=8, max_slots=8, block_size=4, baseline_slots=3)
    assert capped.num_reserved_slots == 3 and capped.num_memory_slots == 8 and capped.num_blocks == 16
    assert capped.policies() == {
        "static": lk.Static(num_slots=3),
        "full static": lk.Static(num_slots=8),
        "continuous": lk.Continuous(num_slots=8),
        "paged": lk.Continuous(num_slots=8, num_blocks=16, block_size=4),
    }


# the product and the independently built factors, on random traces and pools


@st.composite
def cases(draw):
    n = draw(st.integers(1, 30))
    outputs = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    prompts = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    trace = lk.Trace.from_lengths(outputs, prompt_lengths=prompts)
    longest = max(o + p for o, p in zip(outputs, prompts))
    reserve = draw(st.integers(longest, longest + 20))
    block_size = draw(st.integers(1, 8))
    # a pool of whole blocks, so the paged pool holds any request that fits `reserve`
    pool = block_size * draw(st.integers(num_blocks_for(reserve, block_size), num_blocks_for(reserve * 8, block_size)))
    b0 = pool // reserve
    baseline_slots = draw(st.one_of(st.none(), st.integers(1, b0)))
    max_slots = draw(st.integers(b0, b0 + 12))  # paging holds at least what reservations do
    return trace, Memory(pool, reserve, max_slots=max_slots, block_size=block_size, baseline_slots=baseline_slots)


@settings(max_examples=60, deadline=None)
@given(case=cases(), priced=st.booleans())
def test_factors_multiply_to_the_total_and_equal_the_hand_built_ratios(case, priced):
    trace, memory = case
    run = partial(lk.simulate, cost=COST) if priced else lk.simulate
    m = take_apart(trace, memory, run)
    assert math.isclose(product(m), m.total, rel_tol=1e-12)
    static, full, continuous, paged = by_hand(trace, memory, run)
    assert m.total == static.duration / paged.duration
    assert m.factor("baseline batch") == static.num_steps / full.num_steps
    assert m.factor("refill") == full.num_steps / continuous.num_steps
    assert m.factor("memory") == continuous.num_steps / paged.num_steps
    assert m.factor("step cost") == ((static.duration / static.num_steps) / (paged.duration / paged.num_steps))
    assert m.factor("refill") >= 1  # refilling never takes more steps than waiting, at the same slots
    if abs(math.log(m.total)) > 1e-6:  # a total within rounding of 1 has no meaningful shares
        assert math.isclose(sum(m.log_share(kind) for kind in KINDS), 1.0, rel_tol=1e-6)
    if not priced:
        assert math.isclose(m.factor("step cost"), 1.0, rel_tol=1e-12)


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 30), prompt=st.integers(0, 10), b0=st.integers(1, 6), num_batches=st.integers(1, 5))
def test_equal_lengths_gain_nothing_from_refill(length, prompt, b0, num_batches):
    trace = lk.Trace.from_lengths([length] * (b0 * num_batches), prompt_lengths=[prompt] * (b0 * num_batches))
    memory = Memory(pool_tokens=b0 * (length + prompt), reserve_tokens=length + prompt, block_size=1)
    m = take_apart(trace, memory, lk.simulate)
    assert m.factor("refill") == 1
    assert m.runs["static"].num_steps == num_batches * length


def test_unequal_lengths_do_gain_from_refill():
    """Negative control: one longer request in the first batch, and refill gains."""
    trace = lk.Trace.from_lengths([9, 3, 3, 3])
    assert take_apart(trace, Memory(pool_tokens=18, reserve_tokens=9, block_size=1), lk.simulate).factor("refill") > 1


# implementation factors


def test_a_three_times_slower_baseline_is_an_implementation_factor_of_three():
    m = predict(TOY, TOY_MEMORY, COST, {"slow": COST.scaled(3)})
    assert m.baseline == "slow" and list(m.runs) == ["slow", "static", "continuous", "paged"]
    assert [(f.kind, f.name) for f in m.factors][0] == ("implementation", "slow → labkit")
    assert math.isclose(m.factor("implementation"), 3, rel_tol=1e-12)
    static, _, _, paged = by_hand(TOY, TOY_MEMORY, partial(lk.simulate, cost=COST))
    slow = lk.simulate(TOY, lk.Static(num_slots=2), cost=COST.scaled(3))
    assert m.total == slow.duration / paged.duration
    assert math.isclose(m.total, 3 * static.duration / paged.duration, rel_tol=1e-12)
    assert math.isclose(product(m), m.total, rel_tol=1e-12)


def test_implementation_multiplies_every_hop():
    m = predict(TOY, TOY_MEMORY, COST, {"oldest": COST.scaled(6), "older": COST.scaled(2)}, name="mine")
    hops = [f for f in m.factors if f.kind == "implementation"]
    assert [f.name for f in hops] == ["oldest → older", "older → mine"]
    assert math.isclose(hops[0].value, 3, rel_tol=1e-12) and math.isclose(hops[1].value, 2, rel_tol=1e-12)
    assert math.isclose(m.factor("implementation"), 6, rel_tol=1e-12)
    assert math.isclose(product(m), m.total, rel_tol=1e-12)
    assert m.baseline == "oldest"


def test_a_baseline_log_without_steps_is_accepted():
    """transformers' log need not count steps: it is taken to run the static schedule."""
    def timed(trace, policy):
        log = lk.simulate(trace, policy)
        return SimpleNamespace(duration=2 * log.duration, num_output_tokens=log.num_output_tokens,
                               tokens_per_second=log.num_output_tokens / (2 * log.duration))

    m = take_apart(TOY, TOY_MEMORY, lk.simulate, {"hf": timed})
    assert math.isclose(m.factor("implementation"), 2, rel_tol=1e-12)
    assert "hf" in m.run_table()


def test_a_baseline_on_another_schedule_is_refused():
    """Negative control of the implementation factor: a baseline that ignores the static policy."""
    def other_schedule(trace, policy):
        return lk.simulate(trace, lk.Static(num_slots=1))

    with pytest.raises(ValueError, match="same schedule"):
        take_apart(TOY, TOY_MEMORY, lk.simulate, {"other": other_schedule})


def test_a_run_that_serves_fewer_tokens_is_refused():
    def short(trace, policy):
        return lk.simulate(lk.Trace.from_lengths(np.maximum(trace.output_lengths - 1, 1)), policy)

    with pytest.raises(ValueError, match="served 24 tokens, not the trace's 32"):
        take_apart(TOY, TOY_MEMORY, short)
    with pytest.raises(ValueError, match="run 'short' served 24 tokens"):
        take_apart(TOY, TOY_MEMORY, lk.simulate, {"short": short})


@pytest.mark.parametrize("name", ["static", "full static", "continuous", "paged"])
def test_a_baseline_named_after_a_schedule_is_refused(name):
    with pytest.raises(ValueError, match="names a schedule's run"):
        take_apart(TOY, TOY_MEMORY, lk.simulate, {name: lk.simulate})


# bad memory


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Memory(pool_tokens=7, reserve_tokens=8), "pool_tokens = 7"),
        (lambda: Memory(pool_tokens=16, reserve_tokens=8, baseline_slots=3), "baseline_slots = 3: the pool holds only 2"),
        (lambda: Memory(pool_tokens=16, reserve_tokens=8, max_slots=1), "max_slots = 1"),
        (lambda: Memory(pool_tokens=64, reserve_tokens=8, max_slots=4, baseline_slots=5), "max_slots = 4"),
        (lambda: Memory(pool_tokens=64, reserve_tokens=8, max_slots=4, baseline_slots=2),
         "max_slots = 4: fewer than the 8 requests the pool holds without paging"),
        (lambda: Memory(pool_tokens=16.0, reserve_tokens=8), "pool_tokens = 16.0"),
        (lambda: Memory(pool_tokens=16, reserve_tokens=True), "reserve_tokens = True"),
        (lambda: Memory(pool_tokens=16, reserve_tokens="8"), "reserve_tokens = '8'"),
        (lambda: Memory(pool_tokens=0, reserve_tokens=8), "pool_tokens = 0"),
        (lambda: Memory(pool_tokens=16, reserve_tokens=0), "reserve_tokens = 0"),
        (lambda: Memory(pool_tokens=16, reserve_tokens=8, block_size=0), "block_size = 0"),
        (lambda: Memory(pool_tokens=16, reserve_tokens=8, max_slots=False), "max_slots = False"),
        (lambda: Memory(pool_tokens=16, reserve_tokens=8, baseline_slots=0), "baseline_slots = 0"),
        (lambda: Memory(pool_tokens=16, reserve_tokens=8, baseline_slots=1.5), "baseline_slots = 1.5"),
        (lambda: take_apart(TOY, Memory(pool_tokens=16, reserve_tokens=7), lk.simulate),
         r"reserve_tokens = 7: request 3 needs 8 tokens \(prompt 0 \+ output 8\)"),
        (lambda: Memory(pool_tokens=64, reserve_tokens=10).check_fits(
            lk.Trace.from_lengths([3, 6], prompt_lengths=[2, 5])), r"reserve_tokens = 10: request 1 needs 11 tokens"),
        (lambda: take_apart(TOY, TOY_MEMORY, lk.simulate).factor("speed"), "kind = 'speed'"),
    ],
)
def test_bad_input_names_the_field_and_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_request_that_just_fits_is_accepted():
    Memory(pool_tokens=64, reserve_tokens=11).check_fits(lk.Trace.from_lengths([3, 6], prompt_lengths=[2, 5]))


# reading it


def test_log_shares_sum_to_one_and_the_tables_fit_a_line():
    m = predict(TOY, TOY_BELOW, COST, {"hf": COST.scaled(3), "older": COST.scaled(2)})
    assert math.isclose(sum(m.log_share(kind) for kind in KINDS), 1.0, rel_tol=1e-12)
    assert math.isclose(m.log_share("refill"), math.log(23 / 17) / math.log(m.total), rel_tol=1e-12)
    text = str(m)
    assert max(map(len, text.splitlines())) <= 100
    assert len(repr(m)) <= 200 and repr(m).startswith(f"Multiplier({m.total:.2f}x over hf")
    for factor in m.factors:
        assert factor.name in text and f"{factor.value:.2f}×" in text
    assert f"{m.total:.2f}×" in m.factor_table()
    rows = m.run_table().splitlines()[-len(m.runs):]
    assert len(m.runs) == 6 and all(row.startswith(f"{name} ") for row, name in zip(rows, m.runs))


def test_a_total_of_one_has_no_log_shares():
    m = take_apart(lk.Trace.from_lengths([4]), Memory(pool_tokens=4, reserve_tokens=4, max_slots=1, block_size=1), lk.simulate)
    assert m.total == 1
    assert all(math.isnan(m.log_share(kind)) for kind in KINDS)
    assert "-" in m.factor_table()


# the check-yourself question: the implementation factor is what the others leave


def test_the_missing_factor_is_the_implementation_take_apart_measures():
    from labkit.exercises.multiplier_question import MissingFactor

    m = predict(TOY, TOY_BELOW, COST, {"hf": COST.scaled(3)})
    given = {kind.replace(" ", "_"): m.factor(kind) for kind in KINDS if kind != "implementation"}
    question = MissingFactor(total=m.total, **given)
    assert math.isclose(question.expected(), m.factor("implementation"), rel_tol=1e-12)
    assert math.isclose(m.factor("implementation"), 3, rel_tol=1e-12)
    assert question.verdict(3.0) and f"{m.factor('baseline batch'):g} × " in str(question.verdict(3.0))
    # negative control: an answer that leaves out the baseline's batch is not it
    forgot = m.total / (m.factor("refill") * m.factor("memory") * m.factor("step cost"))
    assert not math.isclose(forgot, 3, rel_tol=0.05) and not question.verdict(forgot)


# the engine: steps equal the simulator's, seconds are measured


def test_the_engine_counts_the_simulators_steps():
    trace = lk.Trace.sample(12, output="exponential", mean_output=6, max_output=20, prompt="equal", mean_prompt=4,
                            seed=0)
    memory = Memory(pool_tokens=72, reserve_tokens=24, max_slots=12, block_size=4, baseline_slots=2)  # B = 3
    engine = Engine(TINY, device="cpu", seed=0, threads=1)
    m = take_apart(trace, memory, partial(engine.run, progress=False))
    predicted = take_apart(trace, memory, lk.simulate)
    counted = ("baseline batch", "refill", "memory")
    assert [m.factor(kind) for kind in counted] == [predicted.factor(kind) for kind in counted]
    assert {k: log.num_steps for k, log in m.runs.items()} == {k: log.num_steps for k, log in predicted.runs.items()}
    static, paged = m.runs["static"], m.runs["paged"]
    assert m.factor("step cost") == (static.duration / static.num_steps) / (paged.duration / paged.num_steps)
    assert m.total == static.duration / paged.duration
    assert math.isclose(product(m), m.total, rel_tol=1e-12)
    # negative control: another trace's steps give other factors
    other = take_apart(lk.Trace.from_lengths(trace.output_lengths[::-1], trace.prompt_lengths), memory, lk.simulate)
    assert (other.factor("refill"), other.factor("memory")) != (m.factor("refill"), m.factor("memory"))


# figures


def test_the_waterfall_climbs_factor_by_factor_to_the_total():
    m = predict(TOY, TOY_BELOW, COST, {"hf": COST.scaled(3)})
    assert [f.kind for f in m.factors] == list(KINDS)  # one bar of each kind
    assert m.factor("step cost") < 1  # one bar points down
    fig = lk.viz.multiplier_waterfall(m)
    assert len(fig.data) == len(m.factors) + 1
    assert [bar.x[0].replace("<br>", " ") for bar in fig.data] == [f.name for f in m.factors] + ["total"]
    running = 1.0
    for bar, factor in zip(fig.data, m.factors):
        ends = sorted([bar.base[0], bar.base[0] + bar.y[0]])
        after = running * factor.value
        assert ends == pytest.approx(sorted([running, after]), rel=1e-12)
        assert bar.text[0] == f"{factor.value:.2f}×"
        running = after
    assert running == pytest.approx(m.total, rel=1e-12)
    total = fig.data[-1]
    assert (total.base[0], total.base[0] + total.y[0]) == pytest.approx((1.0, m.total), rel=1e-12)
    assert fig.layout.yaxis.type == "log"


def test_the_bars_stack_log_factors_to_each_total_and_star_only_published_names():
    ms = {"toy": predict(TOY, TOY_BELOW, COST, {"hf": COST.scaled(3)}),
          "wider": take_apart(TOY, Memory(pool_tokens=24, reserve_tokens=8, max_slots=8, block_size=1), lk.simulate)}
    fig = lk.viz.multiplier_bars(ms, published={"toy": 24.0})
    bars = [t for t in fig.data if t.type == "bar"]
    assert [bar.name for bar in bars] == list(KINDS)
    assert list(fig.layout.xaxis.ticktext) == list(ms) and list(fig.layout.xaxis.tickvals) == [0, 1]
    for i, (name, m) in enumerate(ms.items()):
        assert [bar.x[i] for bar in bars] == [i] * len(KINDS)
        assert [bar.y[i] for bar in bars] == pytest.approx([math.log10(m.factor(kind)) for kind in KINDS], abs=1e-12)
        assert sum(bar.y[i] for bar in bars) == pytest.approx(math.log10(m.total), abs=1e-12)
    total, = (t for t in fig.data if t.name == "total")
    assert list(total.y) == pytest.approx([math.log10(m.total) for m in ms.values()])
    star, = (t for t in fig.data if t.name == "published")
    assert list(star.y) == pytest.approx([math.log10(24.0)])
    # the diamond left of its bar, the star right of it: apart, and each clear of the bar
    half = bars[0].width / 2
    assert list(total.x) == pytest.approx([i - MARKER_OFFSET for i in range(len(ms))])
    assert list(star.x) == pytest.approx([0 + MARKER_OFFSET]) and MARKER_OFFSET > half
    assert fig.layout.barmode == "relative"
    unpublished = lk.viz.multiplier_bars(ms)
    assert "published" not in [t.name for t in unpublished.data]
    assert len(unpublished.data) == len(KINDS) + 1


def test_the_bars_write_each_total_at_its_diamond_and_each_claim_at_its_star_with_its_note():
    fig = lk.viz.multiplier_bars({"a": {"refill": 2.0, "memory": 3.0, "step cost": 0.5}, "b": {"refill": 4.0}},
                                 published={"b": 5.0}, published_notes={"b": "at matched latency"})
    labels = {a.text: (a.x, a.y) for a in fig.layout.annotations}
    assert labels["total<br>3×"] == pytest.approx((0 - MARKER_OFFSET, math.log10(3.0)))  # at the diamond, not the stack
    assert labels["total<br>4×"] == pytest.approx((1 - MARKER_OFFSET, math.log10(4.0)))
    assert labels["published<br>5×"] == pytest.approx((1 + MARKER_OFFSET, math.log10(5.0)))
    assert labels["at matched<br>latency"] == pytest.approx((1 + MARKER_OFFSET, math.log10(5.0)))
    with pytest.raises(ValueError, match=r"published_notes = .*'a'.* has no published figure"):
        lk.viz.multiplier_bars({"a": {"refill": 2.0}}, published_notes={"a": "note"})


def test_a_segment_too_thin_for_its_label_is_labelled_beside_its_bar():
    factors = {"implementation": 1.08, "refill": 2.28, "memory": 2.30, "step cost": 0.60}
    assert math.log10(1.08) < THIN < math.log10(2.28)  # one thin segment, the rest labelled inside
    fig = lk.viz.multiplier_bars({"x": factors})
    inside = {bar.name: bar.text[0] for bar in fig.data if bar.type == "bar"}
    assert inside == {"implementation": "", "baseline batch": "", "refill": "2.28×", "memory": "2.30×",
                      "step cost": "0.60×"}
    beside = [a for a in fig.layout.annotations if not a.text.startswith("total")]
    assert [a.text for a in beside] == ["implementation 1.08×"]  # baseline batch is 1: no segment, no label
    assert beside[0].x == pytest.approx(fig.data[0].width / 2)  # at the bar's right edge
    assert beside[0].y == pytest.approx(math.log10(1.08) / 2)  # the middle of the first segment up from 1x


def test_a_recorded_configuration_gives_back_its_factors():
    m = predict(TOY, TOY_MEMORY, COST, {"hf": COST.scaled(3)}, name="batched")
    record = {"output_tokens": int(TOY.output_lengths.sum()), "factors": {f.name: f.value for f in m.factors},
              "runs": {name: {"steps": log.num_steps, "duration_s": log.duration} for name, log in m.runs.items()}}
    recorded = from_record(record)
    assert [(f.name, f.value) for f in recorded.factors] == [(f.name, f.value) for f in m.factors]
    assert recorded.total == m.total and recorded.runs["paged"].tokens_per_second == m.runs["paged"].tokens_per_second
    record["factors"]["refill"] *= 1.01  # a record whose factors do not follow from its runs
    with pytest.raises(ValueError, match=r"record\['factors'\] = .*the runs give"):
        from_record(record)


def test_the_bars_take_a_recorded_run_s_factors_by_kind():
    m = predict(TOY, TOY_BELOW, COST, {"hf": COST.scaled(3)})
    recorded = {kind: m.factor(kind) for kind in KINDS}
    from_run, from_factors = (lk.viz.multiplier_bars({"x": given}) for given in (m, recorded))
    assert [y for t in from_factors.data for y in t.y] == pytest.approx([y for t in from_run.data for y in t.y],
                                                                        abs=1e-12)
    left_out = lk.viz.multiplier_bars({"x": {"refill": 2.0, "memory": 3.0}})
    total, = (t for t in left_out.data if t.name == "total")
    assert list(total.y) == pytest.approx([math.log10(6.0)])  # a kind left out is 1
    with pytest.raises(ValueError, match=r"multipliers\['x'\].*'paging'.*no kind of factor"):
        lk.viz.multiplier_bars({"x": {"paging": 2.0}})
    with pytest.raises(ValueError, match=r"multipliers\['x'\].*'refill': 0"):
        lk.viz.multiplier_bars({"x": {"refill": 0}})


def test_memory_first_takes_the_other_order_to_the_same_product():
    toy = lk.Trace.from_lengths([2, 6, 3, 8, 2, 4, 5, 2])
    m = take_apart(toy, Memory(pool_tokens=16, reserve_tokens=8, max_slots=8, block_size=1), lk.simulate)
    other = memory_first(toy, m)
    assert other["batch paging holds"] == round(32 / 8)  # 32 request-steps over the paged run's 8 steps
    grown = lk.simulate(toy, lk.Static(num_slots=4)).num_steps
    assert (other["memory"], other["refill"]) == (23 / grown, grown / 8)
    assert other["memory"] * other["refill"] == pytest.approx(m.factor("refill") * m.factor("memory"))
    assert other["refill"] != m.factor("refill")  # negative control: the order moves the split
