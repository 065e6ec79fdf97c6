"""tools/run_notebooks.py says which checked cell a re-run changed, and ignores what nbval ignores."""

from pathlib import Path

import nbformat
from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
run_notebooks = load_script("tools/run_notebooks.py")


def lesson(*printed: str):
    """A notebook: a markdown cell, a checked cell per text, then an unchecked one printing the last."""
    cells = [nbformat.v4.new_markdown_cell("# A lesson")]
    for index, text in enumerate(printed):
        cell = nbformat.v4.new_code_cell(f"print({index})")
        cell.id = f"cell-{index}"
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
        cells.append(cell)
    ignored = nbformat.v4.new_code_cell("# NBVAL_IGNORE_OUTPUT\nprint('time')")
    ignored.id = "ignored"
    ignored.outputs = [nbformat.v4.new_output("stream", name="stdout", text=printed[-1])]
    cells.append(ignored)
    return nbformat.v4.new_notebook(cells=cells)


def report(before, after) -> list[str]:
    return run_notebooks.changed_checked_lines(run_notebooks.checked_text(before),
                                               run_notebooks.checked_text(after))


def test_a_flipped_checked_line_is_reported_with_its_cell():
    before = lesson("gain: 2.10x\nholds under both prices: True\n", "same\n")
    after = lesson("gain: 2.10x\nholds under both prices: False\n", "same\n")
    assert report(before, after) == ["checked cell 1 now prints otherwise:",
                                     "    -holds under both prices: True", "    +holds under both prices: False"]


def test_an_unchanged_rerun_and_what_nbval_ignores_report_nothing():
    before = lesson("a step of 3 ms per step\n", "at 0x7f00aa\n")
    after = lesson("a step of 4 ms per step\n", "at 0x7f00bb\n")  # sanitized: a timing and an address
    assert report(before, after) == []
    changed_unchecked = lesson("a\n", "b\n")
    changed_unchecked.cells[-1].outputs[0].text = "c\n"
    assert report(lesson("a\n", "b\n"), changed_unchecked) == []
