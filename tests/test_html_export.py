"""Lesson 01 exported to HTML, as nbviewer renders it, still carries its kernel-free animation;
the offline export also carries plotly.js, so the animation plays with no network.

tests/test_browser.py plays the plain export in Chromium, with plotly.js served locally; the
last test here plays the offline export with every request refused.
"""

import json
import re
from pathlib import Path

import nbformat
import pytest
from nbconvert import HTMLExporter
from plotly.offline import get_plotlyjs

from labkit.viz.animation import export_offline_html

NOTEBOOKS = Path(__file__).resolve().parents[1] / "solutions"  # the copies that keep their outputs, for reading online
LESSON = NOTEBOOKS / "01_static_vs_continuous.ipynb"
CHROMIUM = Path("/usr/bin/chromium")
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


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    return export_offline_html(LESSON, tmp_path_factory.mktemp("offline") / "lesson01.html")


def test_a_plain_export_loads_plotly_js_from_its_cdn(html):
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


def stored_figures(path: Path) -> int:
    """How many outputs of the notebook at `path` hold a plotly figure."""
    notebook = json.loads(path.read_text(encoding="utf-8"))
    return sum("application/vnd.plotly.v1+json" in output.get("data", {})
               for cell in notebook["cells"] if cell["cell_type"] == "code" for output in cell["outputs"])


def test_the_offline_export_holds_plotly_js_once_and_no_cdn_tag_for_it(offline, html):
    page = offline.read_text(encoding="utf-8")
    assert not PLOTLY_SCRIPT.search(page)
    assert page.count(get_plotlyjs()) == 1
    assert added_frames(page) == added_frames(html)


def test_the_offline_export_draws_every_stored_figure(offline, html):
    page = offline.read_text(encoding="utf-8")
    assert page.count("Plotly.newPlot(") == stored_figures(LESSON) > 1
    assert html.count("Plotly.newPlot(") == 1  # negative control: nbconvert alone draws the animation only


def test_a_lesson_with_figures_in_plotly_s_mime_type_only_is_drawn_too(tmp_path):
    lesson_02 = NOTEBOOKS / "02_how_much_it_buys.ipynb"  # plotly mime outputs only, no CDN tag
    page = export_offline_html(lesson_02, tmp_path / "lesson02.html").read_text(encoding="utf-8")
    assert page.count("Plotly.newPlot(") == stored_figures(lesson_02) > 0
    assert page.count(get_plotlyjs()) == 1


def test_a_student_copy_is_refused_with_the_copy_that_keeps_outputs(tmp_path):
    student = NOTEBOOKS.parent / "notebooks" / LESSON.name
    with pytest.raises(ValueError, match=r"stores no outputs .* export the instructor copy, solutions/01_static"):
        export_offline_html(student, tmp_path / "lesson01.html")
    assert not (tmp_path / "lesson01.html").exists()


def test_a_notebook_without_figures_is_refused(tmp_path):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1)")])
    notebook.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
    path = tmp_path / "plain.ipynb"
    nbformat.write(notebook, path)
    with pytest.raises(ValueError, match="plain.ipynb.*no output holds a plotly figure"):
        export_offline_html(path, tmp_path / "plain.html")


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no Chromium at {CHROMIUM}: apt-get install -y chromium")
def test_the_offline_export_plays_with_every_request_refused(offline, html, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright for Python is not installed")
    plain = tmp_path / "plain.html"
    plain.write_text(html, encoding="utf-8")
    refused = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        page.route(re.compile(r"^https?://"), lambda route: (refused.append(route.request.url), route.abort()))
        page.goto(plain.as_uri())
        assert page.evaluate("typeof window.Plotly") == "undefined"  # negative control: the plain export can't
        page.goto(offline.as_uri())
        titles = page.locator(".js-plotly-plot:has(.slider-container) .annotation-text")
        sync_api.expect(titles.first).to_contain_text("step 23 of 23", timeout=60_000)
        page.locator(".updatemenu-button").first.click()  # ▶
        sync_api.expect(titles.first).to_contain_text("step 3 of 23", timeout=60_000)
        sync_api.expect(page.locator(".js-plotly-plot")).to_have_count(stored_figures(LESSON))  # every one drawn
        browser.close()
    assert any("plot.ly" in url for url in refused), "the plain export asks the CDN"
    assert len([url for url in refused if "plot.ly" in url]) == 1, "the offline export must not"
