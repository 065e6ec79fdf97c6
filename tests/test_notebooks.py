"""Lesson hygiene: the instructor copies (solutions/) are executed, small, in order, and free
of widget state and run timestamps; the student copies (notebooks/) are small and stateless too.

nbval (run by `make test` on solutions/) checks that their outputs are reproduced.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "solutions").glob("*.ipynb"))
EVERY_COPY = NOTEBOOKS + sorted((ROOT / "notebooks").glob("*.ipynb"))
MAX_BYTES = 300_000


def test_the_lessons_exist():
    names = [path.name for path in NOTEBOOKS]
    assert "01_static_vs_continuous.ipynb" in names
    assert "02_how_much_it_buys.ipynb" in names
    assert "07_exercises.ipynb" in names
    assert "08_when_the_cpu_shows.ipynb" in names
    assert "09_your_traffic_on_a_real_server.ipynb" in names
    assert "10_where_multipliers_come_from.ipynb" in names
    assert "11_who_goes_first.ipynb" in names
    assert names[-1] == "12_in_30_seconds.ipynb"  # the 30-second summary stays last


@pytest.mark.parametrize("path", EVERY_COPY, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_notebook_is_small_and_holds_no_widget_state(path):
    assert path.stat().st_size <= MAX_BYTES
    assert "widgets" not in json.loads(path.read_text())["metadata"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_cells_were_executed_top_to_bottom(path):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    counts = [c["execution_count"] for c in cells]
    assert counts == list(range(1, len(cells) + 1)), "re-run the notebook top to bottom before committing"


@pytest.mark.parametrize("path", EVERY_COPY, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_notebook_cells_keep_no_run_timestamps(path):
    stamped = [i for i, c in enumerate(json.loads(path.read_text())["cells"]) if "execution" in c["metadata"]]
    assert not stamped, f"cells {stamped} keep metadata.execution: run tools/run_notebooks.py, which strips it"


def test_the_30_second_model_answer_fits_30_seconds():
    """About 80 words, spoken in 30 seconds, with the source text's three beats."""
    summary = json.loads(NOTEBOOKS[-1].read_text())
    answer = next("".join(c["source"]) for c in summary["cells"] if "<b>Model answer</b>" in "".join(c["source"]))
    body = re.sub(r"<[^>]+>|\*\*", " ", answer.split("</summary>", 1)[1].split("</details>")[0])
    assert len(body.split()) <= 90
    for beat in ("79%", "flattened", "per sequence", "KV memory", "prefill"):
        assert beat in body


MAX_OUTPUT_WIDTH = 100  # characters: a notebook's width on a laptop


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_printed_lines_fit_a_laptop_screen(path):
    too_wide = []
    for index, cell in enumerate(json.loads(path.read_text())["cells"]):
        for output in cell.get("outputs", []):
            text = "".join(output.get("text", "")) + "".join(output.get("data", {}).get("text/plain", ""))
            too_wide += [f"cell {index}: {len(line)} characters" for line in text.splitlines() if len(line) > MAX_OUTPUT_WIDTH]
    assert not too_wide, too_wide
