"""Hypothesis strategies the scheduling tests share: traces and policies with every knob."""

import numpy as np
from hypothesis import strategies as st

import labkit as lk

TIMINGS = [  # a constant step, a cost model whose steps differ by their work, and its roofline (ridge near 4 rows)
    {"step_time": 0.1},
    {"cost": lk.CostModel(overhead=0.01, per_prefill_token=0.002, per_decode_token=0.003, per_kv_token=1e-4)},
    {"cost": lk.CostModel(overhead=0.01, per_prefill_token=0.002, per_decode_token=0.003, per_kv_token=1e-4,
                          roofline=True)},
]


@st.composite
def traces(draw, spread=True):
    """Up to 25 requests without prompts, all at t=0 or spread out."""
    lengths = draw(st.lists(st.integers(1, 25), min_size=1, max_size=25))
    if spread and draw(st.booleans()):
        gaps = draw(st.lists(st.sampled_from([0.0, 0.05, 0.1, 0.25, 1.0]), min_size=len(lengths), max_size=len(lengths)))
        return lk.Trace.from_lengths(lengths, arrivals=np.cumsum(gaps))
    return lk.Trace.from_lengths(lengths)


@st.composite
def prompted_traces(draw, with_priorities=False, with_clients=False):
    """Up to 12 requests with prompts and spread arrivals, and priorities 0..2 and clients 0..2 if asked."""
    num_requests = draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(1, 12), min_size=num_requests, max_size=num_requests))
    prompts = draw(st.lists(st.integers(0, 12), min_size=num_requests, max_size=num_requests))
    gaps = draw(st.lists(st.sampled_from([0.0, 0.05, 0.3]), min_size=num_requests, max_size=num_requests))
    trace = lk.Trace.from_lengths(lengths, prompt_lengths=prompts, arrivals=np.cumsum(gaps))
    if with_priorities:
        trace = trace.with_priorities(draw(st.lists(st.integers(0, 2), min_size=num_requests, max_size=num_requests)))
    if with_clients:
        trace = trace.with_clients(draw(st.lists(st.integers(0, 2), min_size=num_requests, max_size=num_requests)))
    return trace


@st.composite
def shapes(draw, num_slots):
    """An engine's execution shape: decode sizes (or any), and a most tokens per step (or none)."""
    sizes = draw(st.one_of(st.none(), st.lists(st.integers(1, 8), min_size=1, max_size=4)))
    max_num_tokens = draw(st.one_of(st.none(), st.integers(num_slots, 40)))
    return lk.ExecutionShape(decode_sizes=sizes, max_num_tokens=max_num_tokens)


@st.composite
def knobs(draw, kinds=(lk.Continuous,), num_blocks=st.one_of(st.none(), st.integers(8, 40))):
    """A Continuous-like policy (or Priority, ShortestPredictedFirst) with every knob drawn."""
    kind = draw(st.sampled_from(kinds))
    extra = {}
    if kind is lk.ShortestPredictedFirst:
        extra["noise"] = draw(st.sampled_from([0.0, 0.5, 2.0]))
    if kind is lk.Priority:
        extra["preempt_for_waiting"] = draw(st.booleans())
    num_slots = draw(st.integers(1, 5))
    return kind(
        num_slots,
        num_blocks=draw(num_blocks),
        block_size=draw(st.integers(1, 6)),
        max_tokens_per_step=draw(st.one_of(st.none(), st.integers(1, 40))),
        chunked_prefill=draw(st.booleans()),
        victim=draw(st.sampled_from(["newest", "longest"])),
        reserve=draw(st.sampled_from(["on_demand", "whole"])),
        shape=draw(shapes(num_slots)),
        min_shape_fill=draw(st.sampled_from([0.0, 0.5, 1.0])),
        **extra,
    )


@st.composite
def static_knobs(draw, kinds=(lk.Static, lk.Dynamic), num_blocks=st.one_of(st.none(), st.integers(8, 40))):
    """A Static or Dynamic policy with every knob drawn: slots, pool, shape, padded rows, timeout."""
    kind = draw(st.sampled_from(kinds))
    extra = {"timeout": draw(st.sampled_from([0.0, 0.5, 3.0]))} if kind is lk.Dynamic else {}
    num_slots = draw(st.integers(1, 5))
    return kind(
        num_slots,
        num_blocks=draw(num_blocks),
        block_size=draw(st.integers(1, 6)),
        shape=draw(shapes(num_slots)),
        drop_finished=draw(st.booleans()),
        **extra,
    )


KINDS = (lk.Static, lk.Dynamic, lk.Continuous, lk.Priority, lk.ShortestPredictedFirst, lk.Fair)  # every policy labkit ships


def policies_of(kind, num_blocks=st.one_of(st.none(), st.integers(8, 40))):
    """A policy of `kind` (one of KINDS) with every knob drawn."""
    return (static_knobs if issubclass(kind, lk.Static) else knobs)(kinds=(kind,), num_blocks=num_blocks)
