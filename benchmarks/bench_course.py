"""Time what a teacher waits for: each lesson run top to bottom, and the test commands.

1. Every instructor copy (solutions/) executed in a fresh kernel, as `make notebooks` runs
   it but without saving: the seconds each lesson takes on this machine, which the README's
   course plan states; and its length, from which the plan's self-paced minutes come (a
   reader's 150 words a minute of prose, and a minute for each code cell to predict, run
   and read).
2. `make check` (the unit and property tests) and, with `--with-test`, `make test` (every
   test, every lesson under nbval, then the student copies): their wall-clock seconds.
3. With `--with-install`, the first `make lab`'s install: a fresh clone's
   `make .venv/.installed TORCH=torch==2.13.0` (as CI's), its seconds and the size of the
   `.venv` it makes. pip's cache is whatever this machine has; the README says so.

Results go to benchmarks/results/course-cpu.json with `--save`, and tests/test_readme.py
holds every duration the README states to within 25% of them. On a 2-core machine, idle
(other programs running make every number larger). Run:
`python benchmarks/bench_course.py --save` (about 5 minutes; add `--with-test` for about 10 more,
`--with-install` for about one).
"""

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "course-cpu.json"
WORDS_PER_MINUTE = 150  # reading technical prose
MINUTES_PER_CODE_CELL = 1  # predict, run, read the output


def self_paced_minutes(path: Path) -> dict:
    """The lesson's prose words, code cells and the minutes a learner needs to work through it alone."""
    notebook = nbformat.read(path, as_version=4)
    words = sum(len(re.findall(r"\w+", cell.source)) for cell in notebook.cells if cell.cell_type == "markdown")
    code_cells = sum(cell.cell_type == "code" for cell in notebook.cells)
    minutes = words / WORDS_PER_MINUTE + MINUTES_PER_CODE_CELL * code_cells
    return {"words": words, "code_cells": code_cells, "self_paced_minutes": round(minutes)}


def lesson_seconds(path: Path) -> float:
    """Seconds to execute the lesson at `path` top to bottom in a fresh kernel, kernel start included."""
    notebook = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return time.perf_counter() - start


def command_seconds(command: list[str], cwd: Path = ROOT) -> float:
    """Seconds `command` takes to run in `cwd`. A failure is reported, not raised: `make check`
    runs tests/test_readme.py, which compares the README with the very file this script writes,
    so the first measurement fails there; every test still runs, which is what is timed."""
    start = time.perf_counter()
    status = subprocess.run(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    seconds = time.perf_counter() - start
    if status:
        print(f"{' '.join(command)}: exit status {status} (timed all the same)")
    return seconds


def install() -> dict:
    """A fresh clone's install, as the first `make lab` runs it: seconds, and the venv's size in GB."""
    with tempfile.TemporaryDirectory() as folder:
        clone = Path(folder) / "labkit"
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
        start = time.perf_counter()
        subprocess.run(["make", ".venv/.installed", "TORCH=torch==2.13.0"], cwd=clone, check=True,
                       stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - start
        size = sum(path.stat().st_size for path in (clone / ".venv").rglob("*") if path.is_file() and not path.is_symlink())
        shutil.rmtree(clone)
    return {"seconds": round(seconds, 1), "venv_gb": round(size / 1e9, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", action="store_true", help=f"write {RESULTS.relative_to(ROOT)}")
    parser.add_argument("--with-test", action="store_true", help="also time `make test` (about 10 minutes)")
    parser.add_argument("--with-install", action="store_true", help="also time a fresh clone's install")
    args = parser.parse_args()
    lessons, lengths = {}, {}
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        lessons[path.stem] = round(lesson_seconds(path), 1)
        lengths[path.stem] = self_paced_minutes(path)
        print(f"{path.stem:45s} {lessons[path.stem]:6.1f} s   {lengths[path.stem]['self_paced_minutes']:3d} min self-paced")
    commands = {"make check": round(command_seconds(["make", "check"]), 1)}
    if args.with_test:
        commands["make test"] = round(command_seconds(["make", "test"]), 1)
    for name, seconds in commands.items():
        print(f"{name:45s} {seconds:6.1f} s")
    record = {"machine": f"{platform.machine()}, {platform.processor() or 'CPU'}, Python {sys.version.split()[0]}",
              "lesson_seconds": lessons, "lesson_lengths": lengths, "command_seconds": commands}
    if args.with_install:
        record["install"] = install()
        print(f"{'install (fresh clone)':45s} {record['install']['seconds']:6.1f} s, {record['install']['venv_gb']} GB")
    if args.save:
        RESULTS.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        print(f"saved {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
