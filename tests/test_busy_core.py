"""The busy neighbours (conftest.py, tests/busy.py) are started for exactly the lessons that
time the engine or a server. (Whether the machine then gives them a core is the machine's
business, not the project's, so nothing here times them.)"""

from pathlib import Path

from tests.busy import times_the_engine

SOLUTIONS = sorted((Path(__file__).resolve().parents[1] / "solutions").glob("*.ipynb"))


def test_the_lessons_that_time_the_engine_are_the_ones_that_build_one_or_replay():
    timed = {path.name[:2] for path in SOLUTIONS if times_the_engine(path)}
    assert "03" in timed and "01" not in timed and "02" not in timed
