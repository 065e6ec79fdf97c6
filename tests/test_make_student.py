"""The student edition: solution regions go, stubs stay, the copy runs with every check
saying "not attempted", and the committed copies in notebooks/ are exactly what
tools/make_student.py writes from solutions/."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISES = ROOT / "solutions" / "07_exercises.ipynb"
make_student = load_script("tools/make_student.py")

CELL = """answer = None  # your answer
### BEGIN SOLUTION
answer = (23, 17)
### END SOLUTION
q1.check(answer)"""

FUNCTION = '''def refill(state):
    """Docstring stays."""
    ### BEGIN SOLUTION
    return lk.Decision()
    ### END SOLUTION


q6.check(refill)'''


def test_a_solution_region_goes_and_its_stub_stays():
    assert make_student.strip_solutions(CELL) == "answer = None  # your answer\nq1.check(answer)"


def test_an_indented_region_goes_with_its_markers():
    stripped = make_student.strip_solutions(FUNCTION)
    assert stripped == 'def refill(state):\n    """Docstring stays."""\n\n\nq6.check(refill)'
    compile(stripped, "cell", "exec")


def test_the_runs_that_answer_a_prediction_are_tagged_for_the_reveal():
    cells = [nbformat.v4.new_markdown_cell("**Predict** how many steps."), nbformat.v4.new_code_cell("run()"),
             nbformat.v4.new_code_cell("plot()"), nbformat.v4.new_markdown_cell("<details>17</details>"),
             nbformat.v4.new_code_cell("more()"), nbformat.v4.new_markdown_cell("Predicted? No prompt here."),
             nbformat.v4.new_code_cell("other()")]
    make_student.tag_answering_runs(cells)
    make_student.tag_answering_runs(cells)  # a second pass adds nothing
    assert [cell.metadata.get("tags") for cell in cells] == [
        None, ["labkit-answer"], ["labkit-answer"], None, None, None, None]


def test_an_exercise_after_a_prompt_stays_in_view():
    cells = [nbformat.v4.new_markdown_cell("Predict which trace gains more."),
             nbformat.v4.new_code_cell("print(q3.traces)"), nbformat.v4.new_code_cell("answer = None\nq3.check(answer)")]
    make_student.tag_answering_runs(cells)
    assert [cell.metadata.get("tags") for cell in cells] == [None, None, None]


def test_code_without_markers_is_unchanged():
    assert make_student.strip_solutions("x = 1\n\ny = 2") == "x = 1\n\ny = 2"


@pytest.mark.parametrize("source, message", [
    ("### BEGIN SOLUTION\nx = 1", "without '### END SOLUTION' after it"),
    ("x = 1\n### END SOLUTION", "line 2: '### END SOLUTION' without"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", "line 2: '### BEGIN SOLUTION' inside"),
])
def test_unpaired_markers_are_refused_with_their_line(source, message):
    with pytest.raises(ValueError, match=message):
        make_student.strip_solutions(source)


@pytest.fixture(scope="module")
def lessons():
    return nbformat.read(EXERCISES, as_version=4), nbformat.read(EXERCISES, as_version=4)


def test_the_student_copy_of_06_has_stubs_and_no_solutions(lessons):
    instructor, pristine = lessons
    student = make_student.student_copy(instructor)
    assert instructor == pristine  # the lesson itself is untouched
    solved = [i for i, cell in enumerate(instructor.cells) if make_student.BEGIN in cell.source]
    assert len(solved) == 7
    for index in solved:
        source = student.cells[index].source
        assert make_student.BEGIN not in source and make_student.END not in source
        assert "check(" in source
    assert "answer = None" in student.cells[solved[0]].source
    assert "answer = (18, 12)" not in student.cells[solved[0]].source
    assert "waiting_head" not in student.cells[solved[-1]].source
    for cell in student.cells:  # every output goes: the learner runs the cells
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
    assert [c.source for c in student.cells if c.cell_type == "markdown"] == [
        c.source for c in instructor.cells if c.cell_type == "markdown"]


def test_make_student_writes_a_copy_of_every_lesson_and_drops_stale_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(make_student, "STUDENT_DIR", tmp_path)
    (tmp_path / "renamed_lesson.ipynb").write_text("{}")
    make_student.main([])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in SOLUTIONS)


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_the_committed_student_copy_is_what_make_student_writes(solution):
    """What a learner opens (notebooks/) follows the instructor copy: after editing a lesson in
    solutions/, run `make notebooks` (or tools/make_student.py)."""
    expected = make_student.student_copy(nbformat.read(solution, as_version=4))
    assert nbformat.read(ROOT / "notebooks" / solution.name, as_version=4) == expected


def test_a_stale_student_copy_is_caught(lessons):
    """Negative control: a student copy of an older instructor copy is not the one make_student writes."""
    instructor, _ = lessons
    older = make_student.student_copy(instructor)
    older.cells[0].source += "\nAn edit the student copy never got."
    assert older != make_student.student_copy(instructor)


def test_the_student_copy_of_06_runs_and_every_check_says_not_attempted(lessons):
    instructor, _ = lessons
    student = make_student.student_copy(instructor)
    NotebookClient(student, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(EXERCISES.parent)}}).execute()  # raises if a cell fails
    solved = [i for i, cell in enumerate(instructor.cells) if make_student.BEGIN in cell.source]
    for index in solved:
        text = "".join(output.get("text", "") for output in student.cells[index].outputs)
        assert text.startswith("⏳ Not attempted yet."), text
    errors = [o for cell in student.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
    assert errors == []
