"""labkit.exercises: problems with instant feedback, for every lesson's check yourself.

    from labkit.exercises import q1
    q1.check(answer)     # prints a verdict and returns it: truthy only when correct
    q1.hint(); q1.solution()

    from labkit.exercises.lesson04 import q1   # lessons 01 to 06 have questions of their own

q1–q5 ask to predict a number or a choice (labkit.exercises.predict); q6 asks for the
refill step of continuous batching as a function, graded against `lk.Continuous` in the
simulator and on the engine (labkit.exercises.policy_question); q7 asks how long a step
takes with and without overlap scheduling (labkit.exercises.lanes_question); q8 asks for the
factor a headline multiplier leaves to the implementation
(labkit.exercises.multiplier_question); q9 asks what the order of the waiting queue does to
latency (labkit.exercises.ordering_question). A module named `<topic>_question` asks about
the topic whose home is the module `<topic>` (`labkit.analysis.lanes`, `labkit.sched.policy`,
...). `lesson01` to `lesson06` and `lesson09` hold those lessons' check-yourself questions (iterations
and utilization, a gain's size, block counts, a KV crossover, a weight-bound step, chunked
prefill; a chunked prompt's first token at an idle server), built from the same question types.

Invariants:

- every expected answer is computed by labkit itself (simulate, theory, metrics, the
  engine) when a check runs; no result is written down;
- `check` never raises, whatever the answer: wrong types, strings, NaN, a function that
  raises or returns garbage all get a verdict that names what was wrong and shows it;
- None and Ellipsis (and a refill with no body) read as "not attempted";
- a layer above sched, theory and traffic: importing it loads numpy only; the engine
  (torch) is imported when q6 grades on it.
"""

from labkit.exercises.feedback import Verdict
from labkit.exercises.lanes_question import q7
from labkit.exercises.multiplier_question import q8
from labkit.exercises.ordering_question import q9
from labkit.exercises.policy_question import PolicyError, as_policy, q6
from labkit.exercises.predict import q1, q2, q3, q4, q5

__all__ = ["PolicyError", "Verdict", "as_policy", "q1", "q2", "q3", "q4", "q5", "q6", "q7", "q8", "q9"]
