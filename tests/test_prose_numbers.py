"""Every number a lesson's prose states is printed by a cell whose output nbval checks.

A "stated number" is a number in a markdown cell that is in bold, that has a decimal
point ("0.94 and 1.13"), or that carries a unit: a percentage, a multiplier (×), a time
(ms, µs, s, seconds), a size (KB, MB, GB), a rate (tokens/s, requests/s) or a count of
something the lesson counts (tokens, iterations, steps, blocks, requests, slots,
preemptions). A number word for a ratio ("twice", "three times", "half", "a fifth") is a
stated number too. Numbers inside inline code, LaTeX, links and a model's name ("Llama 3.1
8B") are left out: they are code, notation or names, not claims.

Each number must equal a number printed by a checked cell of the same notebook (one whose
source has no NBVAL_IGNORE_OUTPUT), compared as values, so "1.40×" matches a printed
"1.40x" and "1,105" a printed "1105". A number word is an approximation, so it must lie
within 10% of a printed value, or of a printed percentage ("half" and a printed 51.2%).
A number that defines the lesson's setup rather than reporting a result ("300 requests",
"a 25 ms iteration", a year in a citation, "run it twice") goes in the notebook's own
allowlist, `metadata["labkit"]["definitional_numbers"]`, which maps each such number (or
number word) to the reason it needs no output.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "solutions").glob("*.ipynb"))  # the instructor copies
NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
UNITS = (r"%|×|ms\b|µs\b|s\b|seconds?\b|[KMG]B\b|tokens/s\b|requests/s\b|tokens?\b|iterations?\b|steps?\b"
         r"|blocks?\b|requests?\b|slots?\b|preemptions?\b")
WITH_UNIT = re.compile(rf"(?<![\w.,])({NUMBER})(?:-token|\s*(?:{UNITS}))")
DECIMAL = re.compile(r"(?<![\w.,-])(\d{1,3}(?:,\d{3})*\.\d+|\d+\.\d+)(?!\w|\.\d)")  # not in 2.13.0 or BY-4.0
NUMBER_WORDS = {"twice": 2, "half": 1 / 2, "a third": 1 / 3, "a quarter": 1 / 4, "a fifth": 1 / 5, "a tenth": 1 / 10}
NUMBER_WORDS |= {f"{word} times": n for n, word in enumerate(("two", "three", "four", "five", "six", "seven", "eight",
                                                             "nine", "ten"), start=2)}
WORD = re.compile(rf"\b({'|'.join(NUMBER_WORDS)})\b", re.I)
WORD_TOLERANCE = 0.1  # a number word is an approximation: within 10% of a printed value
BOLD = re.compile(r"\*\*(.+?)\*\*", re.S)
NOT_PROSE = re.compile(r"`[^`]*`|\$[^$]*\$|\]\([^)]*\)|<[^>]+>|Llama [\d.]+ \d+B")  # a model's name is no claim


def value(number: str) -> float:
    return float(number.replace(",", ""))


def stated_numbers(markdown: str) -> list[tuple[str, str]]:
    """(number, context) for each number the markdown states, in order; a number word as it is written."""
    prose = NOT_PROSE.sub(" ", markdown)
    found = [(m.group(1), m.start(1)) for pattern in (WITH_UNIT, DECIMAL, WORD) for m in pattern.finditer(prose)]
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


def is_printed(number: str, printed: set[float]) -> bool:
    """A number equal to a printed one; a number word within WORD_TOLERANCE of a printed value or percentage."""
    if number.lower() not in NUMBER_WORDS:
        return value(number) in printed
    ratio = NUMBER_WORDS[number.lower()]
    return any(abs(p - ratio) <= WORD_TOLERANCE * ratio or abs(p - 100 * ratio) <= WORD_TOLERANCE * 100 * ratio
               for p in printed)


def is_allowed(number: str, allowlist: dict) -> bool:
    if number.lower() in NUMBER_WORDS:
        return number.lower() in {key.lower() for key in allowlist}
    return value(number) in {value(key) for key in allowlist if re.fullmatch(NUMBER, key)}


def unprinted(notebook: dict) -> list[str]:
    """Stated numbers that no checked cell prints and the allowlist does not name, with context."""
    printed = printed_numbers(notebook)
    allowlist = notebook["metadata"].get("labkit", {}).get("definitional_numbers", {})
    missing = []
    for cell in notebook["cells"]:
        if cell["cell_type"] == "markdown":
            for number, context in stated_numbers("".join(cell["source"])):
                if not is_printed(number, printed) and not is_allowed(number, allowlist):
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
        assert re.fullmatch(NUMBER, number) or number.lower() in NUMBER_WORDS, f"{number!r} is not a number"
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


def test_a_models_name_is_not_a_claim_but_a_number_beside_it_is():
    markdown = "an H200 serving Llama 3.1 8B at **1.03×**; Llama 3.1 took 3.1 ms"
    assert [number for number, _ in stated_numbers(markdown)] == ["1.03", "3.1", "3.1"]


def test_bare_decimals_sizes_and_number_words_count_too():
    markdown = ("between 0.94 and 1.13 times, 14.2 MB of weights in a 50 MB cache, twice as long, "
                "Three times the rate, half of them, a fifth; not 3 apples, not behalf, 2.13.0 or CC-BY-4.0")
    assert [number for number, _ in stated_numbers(markdown)] == [
        "0.94", "1.13", "14.2", "50", "twice", "Three times", "half", "a fifth"]


def test_a_number_word_needs_a_printed_value_near_it():
    printed = {2.06, 51.2, 0.9}
    assert is_printed("twice", printed) and is_printed("half", printed)  # 2.06 is within 10% of 2; 51.2% of 50%
    assert not is_printed("three times", printed) and not is_printed("a fifth", printed)  # negative control
    assert is_allowed("Twice", {"twice": "runs it twice: a setup choice"}) and not is_allowed("half", {"2": "x"})
