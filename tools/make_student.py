"""Write the student edition of every lesson: notebooks/ from the instructor copies in solutions/.

Usage: python tools/make_student.py [solutions/07_exercises.ipynb ...]   (default: every lesson)

What a learner opens (`make lab`, Binder, a clone) is notebooks/: the lessons with every
exercise unsolved. The instructor copies in solutions/ are the ones that get edited and
executed; this script derives the student copies from them, and a test checks that the
committed copies are exactly what it writes.

In code cells, each region from a `### BEGIN SOLUTION` line to a `### END SOLUTION` line
(markers on their own lines, as nbgrader writes them) is removed with its markers, so the
stub before it (`answer = None`) is what the student starts from. Every code cell's output
and execution count are cleared: a learner predicts, then runs the cell, and an output
saved in the copy would answer the prediction before it is made. The instructor copies
keep their outputs, for teachers and for reading online. Widget state is dropped.

Voilà (`make present`) runs every cell before it shows the page, so the code cells between a
markdown cell that asks to **Predict** and the next markdown cell (the runs whose output
answers the prediction) are tagged "labkit-answer"; the template in present/ puts them
behind a reveal, as JupyterLab shows the lesson's own answers. An exercise's cells, where a
graded check follows the prompt, stay in view: they are the question, and the check is
the reveal.
"""

import copy
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS_DIR = ROOT / "solutions"
STUDENT_DIR = ROOT / "notebooks"
BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
PROMPT = re.compile(r"\bPredict\b")  # as tests/test_lesson_rules.py finds a prediction
ANSWER_TAG = "labkit-answer"


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
    """A copy of `notebook` without solution regions, code outputs or widget state."""
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
    tag_answering_runs(student.cells)
    student.metadata.pop("widgets", None)
    return student


def tag_answering_runs(cells) -> None:
    """Tag the code cells after a Predict prompt, up to the next markdown cell, as answers;
    not where one of them is a graded check (`.check(`): those cells are the exercise's
    question and its answer box, and the check is the reveal."""
    for run in runs_after_prompts(cells):
        if any(".check(" in cell.source for cell in run):
            continue
        for cell in run:
            tags = cell.metadata.setdefault("tags", [])
            if ANSWER_TAG not in tags:
                tags.append(ANSWER_TAG)


def runs_after_prompts(cells) -> list[list]:
    """The code cells after each markdown cell that asks to Predict, up to the next markdown cell."""
    runs, run = [], None
    for cell in cells:
        if cell.cell_type == "markdown":
            run = [] if PROMPT.search(cell.source) else None
            if run is not None:
                runs.append(run)
        elif run is not None:
            run.append(cell)
    return runs


def main(paths: list[str]) -> None:
    lessons = [Path(p) for p in paths] or sorted(SOLUTIONS_DIR.glob("*.ipynb"))
    STUDENT_DIR.mkdir(parents=True, exist_ok=True)
    if not paths:  # a lesson that was renamed or removed leaves no stale copy
        names = {path.name for path in lessons}
        for stale in STUDENT_DIR.glob("*.ipynb"):
            if stale.name not in names:
                stale.unlink()
    for path in lessons:
        try:
            student = student_copy(nbformat.read(path, as_version=4))
        except ValueError as error:
            sys.exit(f"{path}: {error}")
        target = STUDENT_DIR / path.name
        nbformat.write(student, target)
        print(f"{path.name}: student edition in {target}")


if __name__ == "__main__":
    main(sys.argv[1:])
