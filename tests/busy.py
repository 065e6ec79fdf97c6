"""A busy neighbour: another process that keeps one core busy, as a notebook server, a browser
or a second job does on a shared laptop. Lessons that time the engine run under strict nbval
beside one (see conftest.py), so a checked cell that flips under load fails `make test`."""

import subprocess
import sys
from pathlib import Path

TIMING_MARKERS = ("Engine(", "lk.replay(")  # a lesson that times the engine, or a server through the replay


def times_the_engine(path: Path) -> bool:
    """Whether the lesson at `path` measures wall-clock time on the engine or a server."""
    text = path.read_text()
    return any(marker in text for marker in TIMING_MARKERS)


def start_busy_loop() -> subprocess.Popen:
    """A Python process spinning on one core until it is stopped."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def cpu_seconds(process: subprocess.Popen) -> float:
    """User and system CPU seconds `process` has used so far (Linux /proc)."""
    fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime, stime in clock ticks of 1/100 s
