"""Execute lessons in place, top to bottom, and drop widget state before they are committed.

Usage: python tools/run_notebooks.py [solutions/01_*.ipynb ...]   (default: every lesson)

It runs the instructor copies in solutions/; `tools/make_student.py` then writes the
student copies in notebooks/ from them (`make notebooks` does both).

Committed lessons keep outputs and execution counts (nbval compares them) but no
`metadata.widgets`, which would store megabytes of widget JavaScript. nbstripout removes it
(and the run's timestamps) with the flags of the pre-commit hook, so the hook leaves a freshly
run lesson as it is.
"""

import subprocess
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
STRIP_FLAGS = ["--keep-output", "--keep-count", "--keep-id"]  # as in .pre-commit-config.yaml


def run(path: Path) -> float:
    notebook = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    seconds = time.perf_counter() - start
    nbformat.write(notebook, path)
    subprocess.run([sys.executable, "-m", "nbstripout", *STRIP_FLAGS, str(path)], check=True)
    return seconds


def main(paths: list[str]) -> None:
    for path in [Path(p) for p in paths] or sorted((ROOT / "solutions").glob("*.ipynb")):
        print(f"{path.name}: executed in {run(path):.1f} s, {path.stat().st_size / 1000:.0f} KB")


if __name__ == "__main__":
    main(sys.argv[1:])
