"""Lesson 03's check yourself: the backlog's first 16 requests on 4 slots, iterations under
static and continuous batching."""

from labkit.exercises.predict import IterationCounts
from labkit.traffic import Trace

BACKLOG = Trace.sample(32, output="exponential", mean_output=32, prompt="uniform", mean_prompt=16, seed=0)  # the lesson's

q1 = IterationCounts(lengths=tuple(int(n) for n in BACKLOG.output_lengths[:16]), num_slots=4)
