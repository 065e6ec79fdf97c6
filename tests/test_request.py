"""One request object: a `Request` holds its tokens and its stop rule, and
`Scheduler.postprocess(batch, tokens)` takes each sampled token into its request, in row
order, and ends a request at an end-of-sequence id after its `min_tokens`."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import labkit as lk
from labkit.sched.scheduler import Scheduler
from labkit.sched.state import Request

EOS = 7


def test_take_appends_and_stops_only_after_min_tokens():
    request = Request(0, 0, 0.0, prompt_len=2, output_len=5, token_ids=[1, 2, 3], eos_token_ids=(EOS,), min_tokens=1)
    request.num_generated = 1
    request.take(EOS)  # the first output: not past min_tokens
    assert request.output_ids == [EOS] and not request.is_stopped and request.finish_reason == ""
    request.num_generated = 2
    request.take(EOS)
    assert request.output_ids == [EOS, EOS] and request.is_stopped
    assert request.output_len == 2 and request.finish_reason == "stop"


def test_a_request_without_tokens_counts_but_keeps_none():
    """The simulator's requests: no tokens, the same counters."""
    scheduler = Scheduler(lk.Continuous(num_slots=1), [Request(0, 0, 0.0, prompt_len=1, output_len=2)])
    scheduler.state.waiting.extend(scheduler.state.by_id.values())
    for _ in range(2):
        scheduler.postprocess(scheduler.schedule())
    (request,) = scheduler.state.by_id.values()
    assert request.is_finished and request.token_ids == [] and request.finish_reason == "length"


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 8), st.integers(0, 3)), min_size=1, max_size=6),
       slots=st.integers(1, 3), budget=st.sampled_from([None, 3, 8]), seed=st.integers(0, 2**16))
def test_postprocess_takes_each_token_into_its_request_and_applies_the_stop_rule(lengths, slots, budget, seed):
    """Tokens drawn from a seeded stream (EOS among them) for every emitting row: each request
    holds exactly its first tokens and then the tokens its rows were given, in order, and it
    stopped exactly where it was given an EOS past its min_tokens."""
    requests = [Request(i, i, 0.0, prompt_len, max_tokens, token_ids=[0] * (1 + prompt_len), eos_token_ids=(EOS,),
                        min_tokens=min(min_tokens, max_tokens))
                for i, (prompt_len, max_tokens, min_tokens) in enumerate(lengths)]
    scheduler = Scheduler(lk.Continuous(num_slots=slots, max_tokens_per_step=budget, chunked_prefill=True), requests)
    scheduler.state.waiting.extend(requests)
    given_tokens = {request.id: [] for request in requests}
    rng = np.random.default_rng(seed)
    while not all(request.is_finished for request in requests):
        batch = scheduler.schedule()
        emitting = [request for request, n in batch.rows if n == request.num_uncomputed]
        tokens = rng.integers(5, 10, len(emitting)).tolist()  # ids 5..9: EOS is 7
        for request, token in zip(emitting, tokens):
            given_tokens[request.id].append(token)
        scheduler.postprocess(batch, tokens)
    scheduler.release_finished()
    for request in requests:
        given = given_tokens[request.id]
        assert request.token_ids == [0] * (1 + request.prompt_len) + given
        stops = [k + 1 for k, token in enumerate(given) if token == EOS and k + 1 > request.min_tokens]
        assert request.is_stopped == bool(stops)
        assert request.num_generated == (stops[0] if stops else len(given)) == len(given)
    assert scheduler.state.num_free_slots() == slots


def test_tokens_in_the_wrong_row_order_would_be_caught():
    """Negative control: the property compares each request's tokens with its own rows', so
    tokens handed over in another order than the batch's rows are seen."""
    requests = [Request(i, i, 0.0, prompt_len=1, output_len=2, token_ids=[0, 0]) for i in range(2)]
    scheduler = Scheduler(lk.Continuous(num_slots=2), requests)
    scheduler.state.waiting.extend(requests)
    batch = scheduler.schedule()
    given = [5, 6]  # one per row, in row order
    scheduler.postprocess(batch, given[::-1])
    assert [request.output_ids for request in requests] != [[token] for token in given]
