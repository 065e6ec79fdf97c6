"""Write the student edition of every lesson that holds solutions.

Usage: python tools/make_student.py [notebooks/06_exercises.ipynb ...]   (default: every lesson)

In code cells, each region from a `### BEGIN SOLUTION` line to a `### END SOLUTION` line
(markers on their own lines, as nbgrader writes them) is removed with its markers, so the
stub before it (`answer = None`) is what the student starts from. Outputs, execution
counts and widget state are cleared. Copies go to build/student/, which git ignores;
lessons without a solution region are skipped.
"""

import copy
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
STUDENT_DIR = ROOT / "build" / "student"
BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"


def strip_solutions(source: str) -> str:
    """`source` without its solution regions; a ValueError names an unpaired marker's line."""
    kept, inside = [], False
    for number, line in enumerate(source.splitlines(), start=1):
        marker = line.strip()
        if marker == BEGIN and inside:
            raise ValueError(f"line {number}: {BEGIN!r} inside a solution region")
        if marker == END and not inside:
            raise ValueError(f"line {number}: {END!r} without {BEGIN!r} before it")
        if marker in (BEGIN, END):
            inside = marker == BEGIN
        elif not inside:
            kept.append(line)
    if inside:
        raise ValueError(f"{BEGIN!r} without {END!r} after it")
    return "\n".join(kept)


def has_solutions(notebook) -> bool:
    return any(cell.cell_type == "code" and BEGIN in cell.source for cell in notebook.cells)


def student_copy(notebook):
    """A copy of `notebook` without solution regions, outputs, execution counts or widget state."""
    student = copy.deepcopy(notebook)
    for index, cell in enumerate(student.cells):
        if cell.cell_type != "code":
            continue
        try:
            cell.source = strip_solutions(cell.source)
        except ValueError as error:
            raise ValueError(f"cell {index}: {error}") from None
        cell.outputs = []
        cell.execution_count = None
    student.metadata.pop("widgets", None)
    return student


def main(paths: list[str]) -> None:
    lessons = [Path(p) for p in paths] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    STUDENT_DIR.mkdir(parents=True, exist_ok=True)
    if not paths:  # a lesson that lost its solutions, or was renamed, leaves no stale copy
        for stale in STUDENT_DIR.glob("*.ipynb"):
            stale.unlink()
    for path in lessons:
        notebook = nbformat.read(path, as_version=4)
        if not has_solutions(notebook):
            continue
        try:
            student = student_copy(notebook)
        except ValueError as error:
            sys.exit(f"{path}: {error}")
        target = STUDENT_DIR / path.name
        nbformat.write(student, target)
        print(f"{path.name}: student edition in {target}")


if __name__ == "__main__":
    main(sys.argv[1:])
