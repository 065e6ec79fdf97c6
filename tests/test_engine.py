"""The engine: same policies, same StepLog, real tokens. fp32 on the CPU, tiny configs.

Every test that takes the `engine` fixture runs under both attention layouts."""

from dataclasses import replace

import numpy as np
import pytest
import torch

import labkit as lk
from labkit.engine import Engine, ModelConfig
from labkit.engine.attention import ATTENTION_LAYOUTS
from labkit.engine.engine import sequence_lengths
from labkit.engine.model_runner import ModelRunner
from labkit.sched.driver import drive
from labkit.sched.scheduler import StepOutcome, kv_pool

TINY = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=128)
MIXED = lk.Trace.from_lengths([5, 1, 9, 3, 7, 2], prompt_lengths=[3, 0, 12, 1, 20, 6])


@pytest.fixture(scope="module", params=ATTENTION_LAYOUTS)
def engine(request):
    return Engine(replace(TINY, attention=request.param), device="cpu", seed=0)


@pytest.fixture(scope="module")
def solo(engine):
    """Each request of MIXED run alone: the reference every batched run must reproduce."""
    return solo_outputs(engine, MIXED)


POLICIES = [
    lk.Static(num_slots=1),
    lk.Static(num_slots=2, block_size=4),
    lk.Static(num_slots=4, drop_finished=True),
    lk.Static(num_slots=3, num_blocks=10, block_size=4),
    lk.Continuous(num_slots=2),
    lk.Continuous(num_slots=3, block_size=4),
    lk.Continuous(num_slots=6),
]


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_batched_outputs_equal_solo_outputs(engine, solo, policy):
    log = engine.run(MIXED, policy, progress=False)
    assert log.outputs == solo


def test_the_two_attention_layouts_give_the_same_tokens():
    policy = lk.Continuous(num_slots=3, max_tokens_per_step=8, chunked_prefill=True)
    outputs = [Engine(replace(TINY, attention=layout), device="cpu", seed=0).run(MIXED, policy, progress=False).outputs
               for layout in ATTENTION_LAYOUTS]
    assert outputs[0] == outputs[1]


def test_outputs_have_exactly_the_requested_lengths(solo):
    assert [len(solo[int(rid)]) for rid in MIXED.ids] == MIXED.output_lengths.tolist()


def test_solo_comparison_can_fail(solo):
    """Negative control: another seed's weights and prompts give other tokens."""
    other = Engine(TINY, device="cpu", seed=1)
    log = other.run(MIXED, lk.Continuous(num_slots=3), progress=False)
    assert log.outputs != solo


def test_a_wrong_block_table_breaks_the_equality(engine, solo, monkeypatch):
    """Negative control: reading a request's K/V through a corrupted block table changes its tokens."""
    from labkit.engine import model_runner

    build = model_runner.ModelInputs.build

    def reversed_tables(new_tokens, starts, tables, block_size, device):
        return build(new_tokens, starts, [table[::-1] for table in tables], block_size, device)

    monkeypatch.setattr(model_runner.ModelInputs, "build", reversed_tables)
    log = engine.run(MIXED, lk.Continuous(num_slots=3), progress=False)
    assert log.outputs != solo


@pytest.mark.parametrize(
    "policy", [lk.Static(num_slots=2), lk.Continuous(num_slots=2), lk.Dynamic(num_slots=3, timeout=1.0)], ids=repr
)
def test_engine_slots_equal_the_simulator_slots(engine, policy):
    trace = lk.Trace.toy()
    run = engine.run(trace, policy, progress=False)
    predicted = lk.simulate(trace, policy)
    assert run.slots.tolist() == predicted.slots.tolist()
    assert run.prefill_tokens.tolist() == predicted.prefill_tokens.tolist()
    assert run.num_queued.tolist() == predicted.num_queued.tolist()


def test_engine_twin_on_a_sampled_backlog(engine):
    trace = lk.Trace.sample(12, output="exponential", mean_output=6, mean_prompt=5, seed=4)
    for policy in (lk.Static(num_slots=3), lk.Continuous(num_slots=3)):
        assert engine.run(trace, policy, progress=False).slots.tolist() == lk.simulate(trace, policy).slots.tolist()


def test_prompt_ids_come_from_the_trace_when_it_has_them(engine, solo):
    """A trace that carries the very prompt ids the engine would draw gives the same tokens;
    other ids give other tokens."""
    drawn = [engine.prompt_ids(int(rid), int(n))[1:] for rid, n in zip(MIXED.ids, MIXED.prompt_lengths)]
    same = lk.Trace.from_lengths(MIXED.output_lengths, prompt_tokens=drawn)
    assert engine.run(same, lk.Continuous(num_slots=3), progress=False).outputs == solo
    other = lk.Trace.from_lengths(MIXED.output_lengths, prompt_tokens=[[(t + 1) % 97 for t in p] for p in drawn])
    assert engine.run(other, lk.Continuous(num_slots=3), progress=False).outputs != solo


GROWING = lk.Trace.from_lengths([12, 10, 14, 9, 11], prompt_lengths=[6, 7, 5, 8, 3])


def solo_outputs(engine, trace):
    return {int(rid): engine.run(trace.select([i]), lk.Continuous(num_slots=1), progress=False).outputs[int(rid)]
            for i, rid in enumerate(trace.ids)}


@pytest.mark.parametrize("victim", ["newest", "longest"])
@pytest.mark.parametrize("num_blocks", [6, 9, 12])
def test_preempted_requests_recompute_to_the_same_tokens(engine, victim, num_blocks):
    """A pool so small that running requests are preempted and recomputed, token for token."""
    policy = lk.Continuous(num_slots=4, num_blocks=num_blocks, block_size=4, victim=victim)
    log = engine.run(GROWING, policy, progress=False)
    assert log.num_preemptions > 0 and log.recomputed_tokens > 0
    assert log.outputs == solo_outputs(engine, GROWING)
    assert log.slots.tolist() == lk.simulate(GROWING, policy).slots.tolist()


@pytest.mark.parametrize("budget", [1, 4, 16])
def test_chunked_prefill_gives_the_same_tokens(engine, solo, budget):
    policy = lk.Continuous(num_slots=3, max_tokens_per_step=budget, chunked_prefill=True)
    log = engine.run(MIXED, policy, progress=False)
    assert log.outputs == solo
    assert log.prefill_tokens.max() <= budget
    assert log.slots.tolist() == lk.simulate(MIXED, policy).slots.tolist()


def test_preemption_and_chunking_together(engine):
    policy = lk.Continuous(num_slots=4, num_blocks=7, block_size=4, max_tokens_per_step=4, chunked_prefill=True,
                           victim="longest")
    log = engine.run(GROWING, policy, progress=False)
    assert log.num_preemptions > 0 and log.outputs == solo_outputs(engine, GROWING)
    assert log.slots.tolist() == lk.simulate(GROWING, policy).slots.tolist()


def test_prefill_marks_the_prompt_tokens(engine):
    log = engine.run(MIXED, lk.Continuous(num_slots=6), progress=False)
    assert log.prefill_tokens[0].tolist() == (1 + MIXED.prompt_lengths).tolist()  # BOS + prompt
    assert log.prefill_tokens[1:].sum() == 0


@pytest.mark.parametrize("policy", [lk.Static(num_slots=2, block_size=4), lk.Continuous(num_slots=3, block_size=4)],
                         ids=repr)
def test_the_clock_free_runner_gives_the_timed_engines_tokens(engine, solo, policy):
    """`ModelRunner.run` under the shared loop, with a fixed step time and no clock, log or
    timer: the tokens of the timed engine."""
    blocks = kv_pool(policy, int(sequence_lengths(MIXED).max()))
    runner = engine.model_runner(blocks)

    class Untimed:
        def execute(self, batch):
            return StepOutcome(runner.run(batch), 1.0)

    prompts = [engine.prompt(MIXED, index) for index in range(len(MIXED))]
    with torch.inference_mode():
        log = drive(MIXED, policy, Untimed(), blocks=blocks, prompts=prompts)
    assert log.outputs == solo


def test_measured_steps_are_split_into_phases(engine):
    log = engine.run(lk.Trace.toy(), lk.Continuous(num_slots=2), progress=False)
    phases = log.phase_seconds
    assert set(phases) == {"schedule", "prepare", "forward", "sample"}
    assert all(len(values) == log.num_steps for values in phases.values())
    assert np.allclose(sum(phases.values()), log.step_seconds)
    assert np.all(np.diff(log.step_start) > 0)


def test_on_step_sees_the_log_grow(engine):
    seen = []
    engine.run(lk.Trace.toy(), lk.Static(num_slots=2), on_step=lambda log: seen.append(log.num_steps), progress=False)
    assert seen == list(range(1, 24))


def test_drop_finished_computes_fewer_rows_with_the_same_schedule(engine, monkeypatch):
    rows, forward = [], ModelRunner.forward
    monkeypatch.setattr(ModelRunner, "forward", lambda self, inputs: rows.append(inputs.num_requests) or forward(self, inputs))
    padded = engine.run(lk.Trace.toy(), lk.Static(num_slots=2), progress=False)
    padded_rows, rows[:] = sum(rows), []
    dropped = engine.run(lk.Trace.toy(), lk.Static(num_slots=2, drop_finished=True), progress=False)
    assert padded.slots.tolist() == dropped.slots.tolist() and padded.outputs == dropped.outputs
    assert (padded_rows, sum(rows)) == (46, 32)  # every slot-step computed vs only the useful ones
    assert (padded.num_rows.sum(), dropped.num_rows.sum()) == (46, 32)  # and the log counts what ran


@pytest.mark.parametrize("drop_finished", [False, True])
def test_the_simulator_prices_the_rows_the_engine_computes(engine, drop_finished):
    trace = lk.Trace.from_lengths([2, 6, 3, 8, 2, 4, 5, 2], prompt_lengths=[3, 1, 4, 1, 5, 9, 2, 6])
    policy = lk.Static(num_slots=3, drop_finished=drop_finished)
    ran = engine.run(trace, policy, progress=False)
    priced = lk.simulate(trace, policy, cost=lk.CostModel())
    for work in ("num_prefill_tokens", "num_decode_tokens", "num_kv_tokens", "num_rows", "num_padded_rows"):
        assert getattr(ran, work).tolist() == getattr(priced, work).tolist(), work
    # negative control: priced with the other setting, the work differs
    other = lk.simulate(trace, lk.Static(num_slots=3, drop_finished=not drop_finished), cost=lk.CostModel())
    assert other.num_kv_tokens.tolist() != ran.num_kv_tokens.tolist()


def test_arrivals_are_served_on_the_measured_clock(engine):
    trace = lk.Trace.from_lengths([3, 3], prompt_lengths=[2, 2], arrivals=[0.0, 1000.0])
    log = engine.run(trace, lk.Continuous(num_slots=1), progress=False)
    assert log.admit_step.tolist() == [0, 3]
    assert log.step_start[3] == 1000.0  # the clock jumps over idle time instead of sleeping
    assert log.ttft[1] == pytest.approx(log.step_seconds[3])


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Engine(TINY, device="gpu"), "device = 'gpu': must be one of auto, cpu, cuda, mps"),
        (
            lambda: Engine(TINY, device="cpu").run(lk.Trace.from_lengths([100], prompt_lengths=[40]), lk.Static(1)),
            "request 0: prompt 40 \\+ output 100 tokens exceed max_seq_len 128",
        ),
        (
            lambda: Engine(TINY, device="cpu").run(lk.Trace.from_lengths([2], prompt_tokens=[[5, 97]]), lk.Static(1)),
            r"request 0: prompt token id 97 at position 1 is outside the vocabulary \(0..96\)",
        ),
        (
            lambda: Engine(TINY, device="cpu").run(MIXED, lk.Continuous(2, num_blocks=6, block_size=4)),
            "request 4: prompt 20 \\+ output 7 tokens need 7 blocks of 4, more than the whole pool of num_blocks = 6",
        ),
        (
            lambda: Engine(TINY, device="cpu").run(MIXED, lk.Continuous(2, max_tokens_per_step=16)),
            "request 2: its prompt can take 13 tokens|request 4: its prompt can take 21 tokens",
        ),
        (lambda: Engine(TINY, device="cpu", threads=0), "threads = 0: must be a whole number >= 1"),
        (lambda: Engine(TINY, device="cpu", threads=1.5), "threads = 1.5: must be a whole number >= 1"),
        (lambda: Engine(TINY, device="cpu", dtype="fp8"), "dtype = 'fp8': must be one of float32, bfloat16, float16"),
    ],
)
def test_bad_input_fails_before_any_work(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_threads_are_set_only_while_the_engine_works():
    before = torch.get_num_threads()
    inside = []
    engine = Engine(TINY, device="cpu", threads=before + 1)
    engine.run(lk.Trace.toy(), lk.Continuous(2), on_step=lambda log: inside.append(torch.get_num_threads()),
               progress=False)
    assert set(inside) == {before + 1}
    assert torch.get_num_threads() == before


def test_the_default_leaves_one_cpu_free():
    import os

    from labkit.engine.device import default_threads

    assert default_threads() == max(1, len(os.sched_getaffinity(0)) - 1)
    assert Engine(TINY, device="cpu").threads == default_threads()


def test_a_bfloat16_engine_serves_every_token():
    engine = Engine(TINY, device="cpu", dtype="bfloat16")
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    log = engine.run(MIXED, lk.Continuous(num_slots=3), progress=False)
    assert [len(log.outputs[int(rid)]) for rid in MIXED.ids] == MIXED.output_lengths.tolist()


def test_cuda_graphs_are_for_cuda_only():
    assert not Engine(TINY, device="cpu", cuda_graphs=True).cuda_graphs
