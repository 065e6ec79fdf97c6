"""House rules that make a lesson one a teacher can hand out, each with a negative control.

- A prediction is not answered on screen: a markdown cell that asks the reader to
  **Predict** has its answer in a `<details>` reveal, in the same cell after the prompt or
  at the start of the next markdown cell; and the student copies (notebooks/) store no
  code output, so running a cell is how the learner sees what it prints.
- Every lesson ends the same way: a `## Check yourself` section, then, as its last cell,
  `## What to take away` with at least three points.
- Every "lesson NN" a lesson mentions names a lesson that exists, and each lesson's title
  carries the number of its file.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
STUDENT_COPIES = sorted((ROOT / "notebooks").glob("*.ipynb"))
PROMPT = re.compile(r"\bPredict\b")
CHECK_YOURSELF, TAKE_AWAY = "## Check yourself", "## What to take away"
LESSON_REFERENCE = re.compile(r"\b[Ll]essons? (\d{2})(?:(?:,| and| or| to|–|-) ?(\d{2}))*")
LESSON_NUMBER = re.compile(r"\d{2}")


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def source(cell: dict) -> str:
    return "".join(cell["source"])


def markdown_cells(notebook: dict) -> list[tuple[int, str]]:
    return [(index, source(cell)) for index, cell in enumerate(notebook["cells"]) if cell["cell_type"] == "markdown"]


# A prediction is not answered on screen ------------------------------------------------------


def unrevealed_predictions(notebook: dict) -> list[int]:
    """Indices of markdown cells with a Predict prompt whose answer is not in a reveal."""
    markdown = markdown_cells(notebook)
    unrevealed = []
    for position, (index, text) in enumerate(markdown):
        prompt = PROMPT.search(text)
        if not prompt or "<details>" in text[prompt.end():]:
            continue
        after = markdown[position + 1][1] if position + 1 < len(markdown) else ""
        if not after.lstrip().startswith("<details>"):
            unrevealed.append(index)
    return unrevealed


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_every_prediction_is_answered_in_a_reveal(path):
    assert not unrevealed_predictions(load(path)), (
        "cells whose Predict prompt is answered on screen: put the answer in a <details> reveal")


def test_an_answer_on_screen_is_caught():
    notebook = {"cells": [
        {"cell_type": "markdown", "source": ["**Predict** how many steps it takes."]},
        {"cell_type": "code", "source": ["print(23)"]},
        {"cell_type": "markdown", "source": ["It takes 23 steps."]},
        {"cell_type": "markdown", "source": ["Predict again.\n\n<details><summary>Answer</summary>\n\n17\n\n</details>"]},
    ]}
    assert unrevealed_predictions(notebook) == [0]
    notebook["cells"][2]["source"] = ["<details><summary>Answer</summary>\n\nIt takes 23 steps.\n\n</details>"]
    assert unrevealed_predictions(notebook) == []


def code_outputs(notebook: dict) -> list[int]:
    return [i for i, cell in enumerate(notebook["cells"]) if cell["cell_type"] == "code" and cell.get("outputs")]


@pytest.mark.parametrize("path", STUDENT_COPIES, ids=lambda p: p.name)
def test_no_student_copy_stores_a_code_output(path):
    assert not code_outputs(load(path)), "run tools/make_student.py: the learner runs the cells"


def test_a_stored_output_is_caught():
    notebook = load(STUDENT_COPIES[0])
    first_code = next(cell for cell in notebook["cells"] if cell["cell_type"] == "code")
    first_code["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["23\n"]}]
    assert code_outputs(notebook)


# Every lesson ends the same way --------------------------------------------------------------


def ending_problems(notebook: dict) -> list[str]:
    """What keeps a lesson from ending with Check yourself, then the take-aways as its last cell."""
    headings = [(index, line) for index, text in markdown_cells(notebook) for line in text.splitlines()
                if line.startswith("## ")]
    problems = []
    checks = [index for index, line in headings if line.strip() == CHECK_YOURSELF]
    if not checks:
        problems.append(f"no '{CHECK_YOURSELF}' section")
    elif any(index > checks[-1] and line.strip() not in (CHECK_YOURSELF, TAKE_AWAY) for index, line in headings):
        problems.append(f"a section after '{CHECK_YOURSELF}' other than '{TAKE_AWAY}'")
    last = notebook["cells"][-1]
    lines = source(last).splitlines()
    if last["cell_type"] != "markdown" or not lines or lines[0].strip() != TAKE_AWAY:
        problems.append(f"the last cell is not '{TAKE_AWAY}'")
    elif sum(line.startswith("- ") for line in lines) < 3:
        problems.append(f"'{TAKE_AWAY}' has fewer than three points")
    return problems


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_every_lesson_ends_with_check_yourself_then_the_take_aways(path):
    assert not ending_problems(load(path))


def test_a_lesson_that_ends_otherwise_is_caught():
    check = {"cell_type": "markdown", "source": [f"{CHECK_YOURSELF}\n\n1. Why?"]}
    take_away = {"cell_type": "markdown", "source": [f"{TAKE_AWAY}\n\n- one\n- two\n- three"]}
    assert ending_problems({"cells": [check, take_away]}) == []
    assert ending_problems({"cells": [take_away, check]}) == [f"the last cell is not '{TAKE_AWAY}'"]
    assert ending_problems({"cells": [take_away]}) == [f"no '{CHECK_YOURSELF}' section"]
    late = {"cell_type": "markdown", "source": ["## One more thing"]}
    assert ending_problems({"cells": [check, late, take_away]}) == [
        f"a section after '{CHECK_YOURSELF}' other than '{TAKE_AWAY}'"]


# Every "lesson NN" names a lesson that exists -----------------------------------------------


def referenced_lessons(text: str) -> list[int]:
    return [int(number) for match in LESSON_REFERENCE.finditer(text) for number in LESSON_NUMBER.findall(match[0])]


def bad_references(notebook: dict, lessons: dict[int, str]) -> list[str]:
    return [f"cell {index}: lesson {number:02}" for index, cell in enumerate(notebook["cells"])
            for number in referenced_lessons(source(cell)) if number not in lessons]


def lessons_by_number() -> dict[int, str]:
    return {int(path.name[:2]): path.name for path in SOLUTIONS}


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_every_lesson_reference_names_a_lesson_that_exists(path):
    assert not bad_references(load(path), lessons_by_number())


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_each_lesson_title_carries_its_file_number(path):
    title = source(load(path)["cells"][0]).splitlines()[0]
    assert title.startswith(f"# Lesson {path.name[:2]} · "), title


SUMMARY_REFERENCE = re.compile(r"[Ll]esson (\d{2})\b[^.;,]*?\b30(?:-| )seconds?\b")


def summary_references(text: str) -> list[int]:
    """The lessons named as the one that puts it all into 30 seconds: 'lesson 11 asks you to ... 30 seconds'."""
    return [int(number) for number in SUMMARY_REFERENCE.findall(text)]


def test_the_30_second_summary_is_the_last_lesson_and_named_so_everywhere():
    last = max(lessons_by_number())
    assert "30_seconds" in lessons_by_number()[last]
    for path in SOLUTIONS:
        for index, cell in enumerate(load(path)["cells"]):
            assert set(summary_references(source(cell))) <= {last}, f"{path.name} cell {index}"


def test_a_reference_to_a_missing_lesson_is_caught():
    assert referenced_lessons("as lessons 01 and 02 showed, and lesson 05; lessons 01–07") == [1, 2, 5, 1, 7]
    notebook = {"cells": [{"cell_type": "markdown", "source": ["See lesson 03 and lesson 42."]}]}
    assert bad_references(notebook, {1: "a", 3: "b"}) == ["cell 0: lesson 42"]
    assert summary_references("lesson 08 takes your traffic to a server, and lesson 09\nasks you to put "
                              "all of it into 30 seconds; the 30-second summary") == [9]
