"""No test asserts a wall-clock margin: on a loaded machine, anything may take longer than a bound.

A test may check that something took at least a time (a sleep only grows under load), and a loop
that waits for something may give up at a deadline; but an assert must not bound elapsed wall-clock
time from above. The scan reads every test module's syntax tree and reports an assert that compares
as the smaller side

- a difference involving a wall-clock reading (`time.perf_counter() - start < 0.9`), a name bound
  to one (`elapsed = time.monotonic() - started`), or the result of a function returning one;
- or a time, against a wall-clock reading plus a margin (`received < before + 0.55`);

unless the assert sits in a `while` loop: a wait's give-up time. CPU time (`time.thread_time()`)
is not wall-clock time: a loaded machine gives a thread less of it, never more.
Checks that replace a margin: events and their order, counts, and stand-in delays (a stalled
stream, a far arrival) much longer than a watchdog that turns waiting into a failure message.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
WALL_CLOCKS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns"}
READS_A_CLOCK = re.compile(r"perf_counter|monotonic|\btime(_ns)?\(")  # what a module without a reading lacks
UPPER = (ast.Lt, ast.LtE)  # left < right: left is bounded from above
LOWER = (ast.Gt, ast.GtE)  # left > right: right is bounded from above


def is_clock_reading(node: ast.AST) -> bool:
    """`time.perf_counter()`, `time.monotonic()`, `time.time()`, or `perf_counter()` imported bare."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr in WALL_CLOCKS and isinstance(func.value, ast.Name) and func.value.id == "time"
    return isinstance(func, ast.Name) and func.id in WALL_CLOCKS - {"time"}


class Clocks:
    """What a module knows about wall-clock values: functions that return an elapsed time, and, per
    function, names bound to a reading (`stamps`) or to an elapsed time (`elapsed`)."""

    def __init__(self, tree: ast.Module):
        self.stamps: set[str] = set()
        self.elapsed: set[str] = set()
        self.timers: set[str] = set()
        self.timers = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and self._returns_elapsed(f)}

    def _returns_elapsed(self, function: ast.FunctionDef) -> bool:
        self.learn(function)
        return any(isinstance(n, ast.Return) and n.value is not None and self.has_elapsed(n.value)
                   for n in ast.walk(function))

    def learn(self, function: ast.AST) -> None:
        """The names `function` binds to readings (or a reading plus a margin) and to elapsed times."""
        self.stamps, self.elapsed = set(), set()
        for node in ast.walk(function):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    for name, value in pairs(target, node.value):
                        self._bind(name, value)

    def _bind(self, name: str, value: ast.AST) -> None:
        if self.has_elapsed(value) or self.is_timer_call(value):
            self.elapsed.add(name)
        elif self.has_reading(value):
            self.stamps.add(name)

    def is_timer_call(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.timers

    def has_reading(self, node: ast.AST) -> bool:
        return any(is_clock_reading(n) or (isinstance(n, ast.Name) and n.id in self.stamps) for n in ast.walk(node))

    def has_elapsed(self, node: ast.AST) -> bool:
        """Whether `node` holds a difference of wall-clock readings, or a name or call that gives one."""
        for n in ast.walk(node):
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub) and self.has_reading(n):
                return True
            if (isinstance(n, ast.Name) and n.id in self.elapsed) or self.is_timer_call(n):
                return True
        return False

    def is_deadline(self, node: ast.AST) -> bool:
        """A reading plus a margin: `before + 0.55`."""
        return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and self.has_reading(node)

    def bounds_from_above(self, smaller: ast.AST, larger: ast.AST) -> bool:
        return self.has_elapsed(smaller) or self.is_deadline(larger)


def pairs(target: ast.AST, value: ast.AST):
    """(name, value) for each name `target = value` binds; every name of an unpacking gets the whole value
    unless the value is a tuple of the same length."""
    if isinstance(target, ast.Name):
        yield target.id, value
    elif isinstance(target, ast.Tuple):
        values = value.elts if isinstance(value, ast.Tuple) and len(value.elts) == len(target.elts) else None
        for k, element in enumerate(target.elts):
            yield from pairs(element, values[k] if values else value)


def comparisons(test: ast.AST):
    """The comparisons an assert's test makes, through `and`."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        for value in test.values:
            yield from comparisons(value)
    elif isinstance(test, ast.Compare):
        sides = [test.left, *test.comparators]
        for k, op in enumerate(test.ops):
            yield sides[k], op, sides[k + 1]


def margin_asserts(source: str) -> list[int]:
    """Line numbers of the asserts in `source` that bound wall-clock time from above."""
    if not READS_A_CLOCK.search(source):
        return []  # most modules: no need to walk their trees
    tree = ast.parse(source)
    clocks = Clocks(tree)
    found = []
    for function in [tree, *(f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        clocks.learn(function)
        for node in asserts_outside_wait_loops(function):
            for left, op, right in comparisons(node.test):
                if (isinstance(op, UPPER) and clocks.bounds_from_above(left, right)) or (
                        isinstance(op, LOWER) and clocks.bounds_from_above(right, left)):
                    found.append(node.lineno)
                    break
    return sorted(set(found))


def asserts_outside_wait_loops(node: ast.AST):
    """The asserts of `node`'s own body (not of the functions it defines), outside `while` loops."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Assert):
            yield child
        elif not isinstance(child, (ast.While, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            yield from asserts_outside_wait_loops(child)


def test_no_test_asserts_a_wall_clock_margin():
    found = {path.name: lines for path in sorted(TESTS.glob("*.py")) if (lines := margin_asserts(path.read_text()))}
    assert found == {}, f"asserts that bound wall-clock time from above (file: lines): {found}"


FLAGGED = {
    "elapsed difference": "start = time.perf_counter()\nwork()\nassert time.perf_counter() - start < 0.9",
    "chained": "started = time.monotonic()\nwork()\nassert 0.4 < time.monotonic() - started < 3",
    "elapsed name": "t0 = time.time()\nwork()\nelapsed = time.time() - t0\nassert ok and elapsed <= 1",
    "bound on the left": "from time import perf_counter\nt0 = perf_counter()\nassert 2 > perf_counter() - t0",
    "timer function": ("def exchange():\n    started = time.monotonic()\n    return b'', time.monotonic() - started\n"
                       "def test():\n    answer, seconds = exchange()\n    assert answer == b'' and seconds < 2"),
    "deadline": "before = time.perf_counter()\nreceived = send()\nassert received < before + 0.55",
}
ALLOWED = {
    "lower bound": "start = time.perf_counter()\nwork()\nassert time.perf_counter() - start >= 0.2",
    "lower deadline": "before = time.perf_counter()\nreceived = send()\nassert received >= before + 0.1",
    "cpu time": "start = time.thread_time()\nwork()\nassert time.thread_time() - start < 0.02",
    "wait loop": ("deadline = time.monotonic() + 10\nwhile not started():\n"
                  "    assert time.monotonic() < deadline, 'did not start'"),
    "no clock": "log = run()\nassert log.duration - 1 < 2",
}


@pytest.mark.parametrize("source", FLAGGED.values(), ids=FLAGGED.keys())
def test_the_scan_finds_an_upper_bound_on_wall_clock_time(source):
    assert margin_asserts(source) == [source.count("\n") + 1]


@pytest.mark.parametrize("source", ALLOWED.values(), ids=ALLOWED.keys())
def test_the_scan_allows_lower_bounds_cpu_time_and_a_wait_s_deadline(source):
    assert margin_asserts(source) == []
