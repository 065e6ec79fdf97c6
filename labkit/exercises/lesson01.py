"""Lesson 01's check yourself: lengths [1, 1, 1, 9] on 2 slots, iterations and utilization."""

from labkit.exercises.predict import IterationCounts, Utilizations

q1 = IterationCounts(lengths=(1, 1, 1, 9), num_slots=2)
q2 = Utilizations(lengths=(1, 1, 1, 9), num_slots=2)
