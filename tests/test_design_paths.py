"""DESIGN.md's reading order and path counts are measured from the code: every function the
reading order names exists and runs on the path it is named for, and the counts DESIGN.md
states are those this file measures (by the rule DESIGN.md states)."""

import ast
import importlib
import inspect
import re
import sys
import textwrap
from pathlib import Path

import pytest

import labkit as lk
from labkit.engine import Engine, ModelConfig
from labkit.sched.driver import drive
from labkit.sched.simulator import FixedStepTime

DESIGN = (Path(__file__).resolve().parents[1] / "DESIGN.md").read_text()
DECISION_PATH_MODULES = ("labkit.sched.policy", "labkit.sched.state", "labkit.sched.scheduler", "labkit.sched.driver")
STEP_PATH_MODULES = ("labkit.engine.model_runner", "labkit.engine.model")
TINY = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=128)


def reading_order() -> list[tuple[str, str]]:
    """(file, qualified name) for each function the numbered reading order names."""
    section = DESIGN.split("reads, in order", 1)[1].split("\n\n", 2)[1]
    named, current_file = [], None
    for token in re.findall(r"`([^`]+)`", section):
        if token.endswith(".py"):
            current_file = token
        elif current_file and re.fullmatch(r"[A-Za-z_]\w*(\.\w+)?", token):
            named.append((current_file, token))
    return named


def resolve(file: str, name: str):
    obj = importlib.import_module("labkit." + file.removesuffix(".py").replace("/", "."))
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def code_of(obj):
    """The code a call of `obj` runs: a function's, a property's getter's, a class's __init__'s."""
    obj = obj.fget if isinstance(obj, property) else obj.__init__ if inspect.isclass(obj) else obj
    return inspect.unwrap(obj).__code__  # TinyGPT.forward is wrapped by torch.no_grad


class Calls:
    """The code objects of every labkit function called while recording (any thread started inside)."""

    def __init__(self, start_at: str | None = None, stop_at: str | None = None):
        self.codes: dict = {}  # code object -> the name of its module
        self.recording = start_at is None
        self.start_at, self.stop_at = start_at, stop_at

    def __call__(self, frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        if event != "call" or not module.startswith("labkit"):
            return
        name = frame.f_code.co_name
        self.recording = (self.recording or name == self.start_at) and name != self.stop_at
        if self.recording and not name.startswith("<"):
            self.codes[frame.f_code] = module

    def __enter__(self):
        sys.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


def lines_of_code(code) -> int:
    """A function's lines, without its docstring, comments and blank lines."""
    source = textwrap.dedent(inspect.getsource(code))
    function = ast.parse(source).body[0]
    docstring = set()
    if ast.get_docstring(function) is not None:
        docstring = set(range(function.body[0].lineno, function.body[0].end_lineno + 1))
    return sum(1 for number, line in enumerate(source.splitlines(), 1)
               if number not in docstring and line.strip() and not line.strip().startswith("#"))


def path_count(codes, modules) -> tuple[int, int]:
    """(lines of code, functions) of the recorded functions in `modules`, each counted once."""
    chosen = [code for code, module in codes.items() if module in modules and _has_source(code)]
    return sum(lines_of_code(code) for code in chosen), len(chosen)


def _has_source(code) -> bool:
    try:
        inspect.getsource(code)
    except OSError:  # a dataclass's generated __init__
        return False
    return True


def decision_path():
    """Every function `drive` runs for its steps (from the first `next_batch` to `finish_run`,
    and `drive` itself), serving the toy trace under lk.Continuous(num_slots=2)."""
    with Calls("next_batch", "finish_run") as calls:
        drive(lk.Trace.toy(), lk.Continuous(num_slots=2), FixedStepTime(1.0))
    return {**calls.codes, drive.__code__: drive.__module__}


def engine_path(fused: bool):
    """Every function `Engine.run` runs serving the toy trace under lk.Continuous(num_slots=2),
    on the fast path (`FusedTinyGPT`, the default) or the plain one (`TinyGPT.forward`)."""
    with Calls() as calls:
        Engine(TINY, device="cpu", seed=0, threads=1, fused=fused).run(lk.Trace.toy(), lk.Continuous(num_slots=2),
                                                                      progress=False)
    return calls.codes


def stated(what: str) -> tuple[int, int]:
    """(lines, functions) DESIGN.md states for `what` ("decision path" or "step path")."""
    found = re.search(rf"The {what} is \*\*(\d+)\*\* lines of code in \*\*(\d+)\*\* functions", DESIGN)
    assert found, f"DESIGN.md states no count for the {what}"
    return int(found[1]), int(found[2])


@pytest.fixture(scope="module")
def engine_codes():
    """What the plain path runs, and what the fast path runs."""
    return {**engine_path(fused=False), **engine_path(fused=True)}


@pytest.fixture(scope="module")
def plain_step_codes():
    return engine_path(fused=False)


def test_the_reading_order_names_functions_that_exist():
    named = reading_order()
    assert len(named) >= 10
    for file, name in named:
        resolve(file, name)  # raises if the file or the function is gone


def test_every_function_the_reading_order_names_runs_on_its_path(engine_codes):
    """The engine's run (plain or fast) for every name but the server's loop, which the online test runs."""
    off_path = [f"{file} {name}" for file, name in reading_order()
                if not file.startswith("serve/") and code_of(resolve(file, name)) not in engine_codes]
    assert off_path == []


def test_a_function_off_the_path_is_caught(engine_codes):
    """Negative control: a function that exists but that Engine.run never calls is found."""
    assert code_of(lk.simulate) not in engine_codes


def test_the_decision_path_count_is_what_design_states():
    assert path_count(decision_path(), DECISION_PATH_MODULES) == stated("decision path")


def test_the_step_path_count_is_what_design_states(plain_step_codes):
    assert path_count(plain_step_codes, STEP_PATH_MODULES) == stated("step path")
