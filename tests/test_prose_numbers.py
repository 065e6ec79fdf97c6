"""Every number a lesson's prose states is printed by a cell whose output nbval checks.

A "stated number" is a number in a markdown cell that is in bold, or that carries a unit:
a percentage, a multiplier (×), a time (ms, µs, s, seconds), a rate (tokens/s,
requests/s) or a count of something the lesson counts (tokens, iterations, steps, blocks,
requests, slots, preemptions). Numbers inside inline code, LaTeX and links are left out:
they are code or notation, not claims.

Each must equal a number printed by a checked cell of the same notebook (one whose source
has no NBVAL_IGNORE_OUTPUT), compared as values, so "1.40×" matches a printed "1.40x" and
"1,105" a printed "1105". A number that defines the lesson's setup rather than reporting a
result ("300 requests", "a 25 ms iteration", a year in a citation) goes in the notebook's
own allowlist, `metadata["labkit"]["definitional_numbers"]`, which maps each such number to
the reason it needs no output.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "solutions").glob("*.ipynb"))  # the instructor copies
NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
UNITS = (r"%|×|ms\b|µs\b|s\b|seconds?\b|tokens/s\b|requests/s\b|tokens?\b|iterations?\b|steps?\b|blocks?\b"
         r"|requests?\b|slots?\b|preemptions?\b")
WITH_UNIT = re.compile(rf"(?<![\w.,])({NUMBER})(?:-token|\s*(?:{UNITS}))")
BOLD = re.compile(r"\*\*(.+?)\*\*", re.S)
NOT_PROSE = re.compile(r"`[^`]*`|\$[^$]*\$|\]\([^)]*\)|<[^>]+>")


def value(number: str) -> float:
    return float(number.replace(",", ""))


def stated_numbers(markdown: str) -> list[tuple[str, str]]:
    """(number, context) for each number the markdown states, in order."""
    prose = NOT_PROSE.sub(" ", markdown)
    found = [(m.group(1), m.start()) for m in WITH_UNIT.finditer(prose)]
    for bold in BOLD.finditer(prose):
        found += [(m.group(0), bold.start(1) + m.start()) for m in re.finditer(rf"(?<![\w.,]){NUMBER}", bold.group(1))]
    unique = {(number, start) for number, start in found}
    return [(number, " ".join(prose[max(0, start - 50) : start + 30].split())) for number, start in sorted(
        unique, key=lambda pair: pair[1])]


def printed_numbers(notebook: dict) -> set[float]:
    """Every number in the outputs of the cells nbval checks."""
    texts = []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code" or "NBVAL_IGNORE_OUTPUT" in "".join(cell["source"]):
            continue
        for output in cell.get("outputs", []):
            texts.append("".join(output.get("text", "")) + "".join(output.get("data", {}).get("text/plain", "")))
    return {value(number) for number in re.findall(NUMBER, "\n".join(texts))}


def unprinted(notebook: dict) -> list[str]:
    """Stated numbers that no checked cell prints and the allowlist does not name, with context."""
    printed = printed_numbers(notebook)
    allowed = {value(n) for n in notebook["metadata"].get("labkit", {}).get("definitional_numbers", {})}
    missing = []
    for cell in notebook["cells"]:
        if cell["cell_type"] == "markdown":
            for number, context in stated_numbers("".join(cell["source"])):
                if value(number) not in printed and value(number) not in allowed:
                    missing.append(f"{number}: ...{context}...")
    return missing


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_stated_number_is_printed_by_a_checked_cell(path):
    missing = unprinted(json.loads(path.read_text()))
    assert not missing, f"{len(missing)} numbers in the prose that no checked cell prints:\n" + "\n".join(missing)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_allowlist_gives_a_reason_for_each_number(path):
    allowlist = json.loads(path.read_text())["metadata"].get("labkit", {}).get("definitional_numbers", {})
    for number, reason in allowlist.items():
        assert re.fullmatch(NUMBER, number), f"{number!r} is not a number"
        assert isinstance(reason, str) and len(reason) > 5, f"{number}: say why it needs no output"


def test_an_edited_prose_number_fails():
    """Negative control: change one number the prose of lesson 01 states, and the check finds it."""
    notebook = json.loads(NOTEBOOKS[0].read_text())
    assert not unprinted(notebook)
    for cell in notebook["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and "69.6%" in source:
            cell["source"] = source.replace("69.6%", "69.9%", 1)
            break
    else:
        pytest.fail("lesson 01 no longer states 69.6%")
    assert [line.split(":")[0] for line in unprinted(notebook)] == ["69.9"]


def test_what_counts_as_a_stated_number():
    markdown = ("Static takes **23** iterations at 69.6% utilization, 1.40× the rate, 25 ms a step, a "
                "**1,500-token** prompt; not `num_slots=2`, not $H_8$, not [v0.6](https://x.org/v0.6) or list item 3.")
    assert [number for number, _ in stated_numbers(markdown)] == ["23", "69.6", "1.40", "25", "1,500"]
