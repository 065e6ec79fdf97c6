"""Lesson 01 exported to HTML, as nbviewer renders it, still carries its kernel-free animation.

tests/test_browser.py plays the same export in Chromium.
"""

import json
import re
from pathlib import Path

import pytest
from nbconvert import HTMLExporter

LESSON = Path(__file__).resolve().parents[1] / "notebooks" / "01_static_vs_continuous.ipynb"
# The lesson's other figures carry plotly's mime type only, which nbconvert cannot draw.
IGNORE_UNDRAWN_PLOTLY = pytest.mark.filterwarnings("ignore:Your element with mimetype.*vnd.plotly:UserWarning")
pytestmark = IGNORE_UNDRAWN_PLOTLY
PLOTLY_SCRIPT = re.compile(r'<script [^>]*src="https://cdn\.plot\.ly/plotly-[\d.]+\.min\.js"')


def export_html(path: Path = LESSON) -> str:
    """The committed notebook (outputs as they are, nothing executed) as one HTML page."""
    return HTMLExporter().from_filename(str(path))[0]


def added_frames(html: str) -> list[list[dict]]:
    """The frames of each plotly figure on the page, parsed from its `Plotly.addFrames(id, [...])` call."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(html, call.end())[0] for call in re.finditer(r"Plotly\.addFrames\('[^']+', ", html)]


@pytest.fixture(scope="module")
def html():
    return export_html()


def test_the_export_loads_plotly_js(html):
    assert PLOTLY_SCRIPT.search(html)


def test_the_export_holds_one_animation_with_a_frame_per_step_and_its_counters(html):
    (frames,) = added_frames(html)
    assert [frame["name"] for frame in frames] == [str(step) for step in range(24)]
    assert [annotation["text"] for annotation in frames[17]["layout"]["annotations"]] == [
        "Static(num_slots=2) · step 17 of 23 · 24 tokens · utilization 70.6% · 2 waiting",
        "Continuous(num_slots=2) · step 17 of 17 · 32 tokens · utilization 94.1% · 0 waiting",
    ]


def test_the_export_has_the_slider_and_the_play_button(html):
    figure_call = html[: html.index("Plotly.addFrames")]
    assert '"sliders":[{"active":23' in figure_call
    assert '"label":"\\u25b6","method":"animate"' in figure_call
