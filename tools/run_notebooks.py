"""Execute lessons in place, top to bottom, and drop widget state before they are committed.

Usage: python tools/run_notebooks.py [solutions/01_*.ipynb ...]   (default: every lesson)

A re-run that changes what a checked cell printed (a code cell without NBVAL_IGNORE_OUTPUT,
whose output nbval compares, as sanitized by tests/nbval_sanitize.cfg) says which cell and
which lines, so that a flipped claim is read before it is committed.

It runs the instructor copies in solutions/; `tools/make_student.py` then writes the
student copies in notebooks/ from them (`make notebooks` does both).

Committed lessons keep outputs and execution counts (nbval compares them) but no
`metadata.widgets`, which would store megabytes of widget JavaScript. nbstripout removes it
(and the run's timestamps) with the flags of the pre-commit hook, so the hook leaves a freshly
run lesson as it is.
"""

import configparser
import difflib
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
STRIP_FLAGS = ["--keep-output", "--keep-count", "--keep-id"]  # as in .pre-commit-config.yaml
SANITIZE = ROOT / "tests" / "nbval_sanitize.cfg"


def run(path: Path) -> float:
    notebook = nbformat.read(path, as_version=4)
    before = checked_text(notebook)
    start = time.perf_counter()
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    seconds = time.perf_counter() - start
    nbformat.write(notebook, path)
    subprocess.run([sys.executable, "-m", "nbstripout", *STRIP_FLAGS, str(path)], check=True)
    for line in changed_checked_lines(before, checked_text(notebook)):
        print(f"{path.name}: {line}")
    return seconds


def sanitizers() -> list[tuple[re.Pattern, str]]:
    config = configparser.ConfigParser()
    config.read(SANITIZE, encoding="utf-8")
    return [(re.compile(config[name]["regex"]), config[name]["replace"]) for name in config.sections()]


def checked_text(notebook) -> dict[str, tuple[int, list[str]]]:
    """(index, printed lines) of each checked code cell, by cell id, sanitized as nbval compares them."""
    rules = sanitizers()
    texts = {}
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code" or "NBVAL_IGNORE_OUTPUT" in cell.source:
            continue
        text = "".join(output.get("text", "") or output.get("data", {}).get("text/plain", "")
                       for output in cell.outputs)
        for pattern, replacement in rules:
            text = pattern.sub(replacement, text)
        texts[cell.id] = (index, text.splitlines())
    return texts


def changed_checked_lines(before: dict, after: dict) -> list[str]:
    """A report of each checked cell whose printed lines changed: its index, then the lines, - then +."""
    report = []
    for cell_id, (index, lines) in after.items():
        old = before.get(cell_id, (None, None))[1]
        if old is None or old == lines:
            continue
        report.append(f"checked cell {index} now prints otherwise:")
        report.extend(f"    {line}" for line in difflib.unified_diff(old, lines, lineterm="", n=0)
                      if line[:1] in "-+" and not line.startswith(("---", "+++")))
    return report


def main(paths: list[str]) -> None:
    for path in [Path(p) for p in paths] or sorted((ROOT / "solutions").glob("*.ipynb")):
        print(f"{path.name}: executed in {run(path):.1f} s, {path.stat().st_size / 1000:.0f} KB")


if __name__ == "__main__":
    main(sys.argv[1:])
