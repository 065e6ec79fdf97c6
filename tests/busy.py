"""Busy neighbours: other processes that keep the cores busy, as a notebook server, a browser
and a second job do on a shared laptop. Lessons that time the engine run under strict nbval
beside three of them (see conftest.py) on this 2-core machine, so a checked cell that flips
under load fails `make test`."""

import subprocess
import sys
from pathlib import Path

NUM_BUSY_LOOPS = 3  # on a 2-core machine: more busy processes than cores, as on a loaded laptop
TIMING_MARKERS = ("Engine(", "lk.replay(")  # a lesson that times the engine, or a server through the replay


def times_the_engine(path: Path) -> bool:
    """Whether the lesson at `path` measures wall-clock time on the engine or a server."""
    text = path.read_text()
    return any(marker in text for marker in TIMING_MARKERS)


def start_busy_loops(count: int = NUM_BUSY_LOOPS) -> list[subprocess.Popen]:
    """`count` Python processes, each spinning on a core until it is stopped."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
        process.wait()
