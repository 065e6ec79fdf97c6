"""The busy neighbour that timed lessons run beside (conftest.py, tests/busy.py) really
keeps a core busy, and it is started for exactly the lessons that time the engine."""

import time
from pathlib import Path

from tests.busy import cpu_seconds, start_busy_loop, times_the_engine

SOLUTIONS = sorted((Path(__file__).resolve().parents[1] / "solutions").glob("*.ipynb"))


def test_the_busy_loop_takes_most_of_a_core():
    process = start_busy_loop()
    try:
        time.sleep(0.2)  # past the interpreter's start
        before, start = cpu_seconds(process), time.perf_counter()
        time.sleep(1.0)
        used = (cpu_seconds(process) - before) / (time.perf_counter() - start)
    finally:
        process.kill()
        process.wait()
    assert used > 0.5, f"the busy loop used {used:.0%} of a core"


def test_an_idle_process_is_told_apart():
    """Negative control: a sleeping process uses almost no CPU by the same measure."""
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        time.sleep(0.3)
        before = cpu_seconds(process)
        time.sleep(0.5)
        assert cpu_seconds(process) - before < 0.1
    finally:
        process.kill()
        process.wait()


def test_the_lessons_that_time_the_engine_are_the_ones_that_build_one_or_replay():
    timed = {path.name[:2] for path in SOLUTIONS if times_the_engine(path)}
    assert "03" in timed and "01" not in timed and "02" not in timed
