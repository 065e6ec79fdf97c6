"""Lesson 01 in a real browser: JupyterLab runs it and the A–H stepper plays, Voilà serves it
(when the `present` extra is installed), and its HTML export plays the animation with no kernel.

Needs Chromium at /usr/bin/chromium (Debian's `chromium` package) and Playwright for Python;
skipped with the reason when either is missing. Screenshots go to build/screenshots/.
Run just these with `.venv/bin/python -m pytest -m browser`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import plotly
import pytest

from labkit.serve.processes import free_port
from tests.test_html_export import IGNORE_UNDRAWN_PLOTLY, LESSON, export_html

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCREENSHOTS = ROOT / "build" / "screenshots"
LOCAL_PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
TIMEOUT_MS = 60_000  # any single wait in the page, so nothing hangs
SERVER_START_S = 60
FINAL_COUNTERS = {
    "static": "Static: step 23 of 23 · 32 tokens · utilization 69.6% · 0 waiting",
    "continuous": "Continuous: step 17 of 17 · 32 tokens · utilization 94.1% · 0 waiting",
}
STEP_GOAL_MS = 100  # printed beside the measured time; asserted nowhere, since a loaded machine takes longer

sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright for Python is not installed")
pytestmark = [
    pytest.mark.browser,
    IGNORE_UNDRAWN_PLOTLY,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no Chromium at {CHROMIUM}: apt-get install -y chromium"),
]


# Fixtures: a browser, a page per test, private JupyterLab and Voilà servers -----------------------------


@pytest.fixture(scope="module")
def browser():
    sync_api.expect.set_options(timeout=TIMEOUT_MS)
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=TIMEOUT_MS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    context.set_default_timeout(TIMEOUT_MS)
    yield context.new_page()
    context.close()


LAB_SETTINGS = {
    # render every cell, off-screen ones included, so the test finds the stepper wherever it is
    "notebook-extension/tracker": {"windowingMode": "none"},
    # no news pop-up over the screenshots, and no requests to the internet
    "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}


def write_lab_settings(settings_dir: Path) -> None:
    for name, settings in LAB_SETTINGS.items():
        path = settings_dir / "@jupyterlab" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings))


def wait_until_serving(server: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        assert server.poll() is None, f"{server.args[0]} exited while starting"
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:  # it answered, if only to say "not found"
            return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"{server.args[0]} did not answer at {url} within {SERVER_START_S} s")


@contextlib.contextmanager
def serving(command: list[str], home: Path, **env: str):
    """Run a Jupyter server with private runtime, config and data folders under `home` (so no
    notebook is trusted yet), and `env` added, until the block ends; yields its base URL."""
    port = free_port()
    private_dirs = {f"JUPYTER_{kind.upper()}_DIR": str(home / kind) for kind in ("runtime", "config", "data")}
    with (home / "server.log").open("w") as log:
        server = subprocess.Popen(
            [*command, f"--port={port}"], env=dict(os.environ, **private_dirs, **env), stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until_serving(server, f"{url}/api/status")
            yield url
        finally:
            server.terminate()
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=15)


def copy_of_the_lesson(tmp_path_factory, name: str, lesson: Path = LESSON) -> Path:
    home = tmp_path_factory.mktemp(name)
    (home / "notebooks").mkdir()
    shutil.copy(lesson, home / "notebooks")
    return home


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab with no token and its own settings and workspaces, serving a copy of lesson 01."""
    if not (BIN / "jupyter-lab").exists():
        pytest.skip("JupyterLab is not installed (the `lab` extra)")
    home = copy_of_the_lesson(tmp_path_factory, "lab")
    write_lab_settings(home / "settings")
    command = [
        str(BIN / "jupyter-lab"),
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        "--IdentityProvider.token=",
        "--ServerApp.password=",
        "--allow-root",
        f"--ServerApp.root_dir={home / 'notebooks'}",
        "--LabApp.expose_app_in_browser=True",
        f"--LabApp.user_settings_dir={home / 'settings'}",
        f"--LabApp.workspaces_dir={home / 'workspaces'}",
    ]
    with serving(command, home) as url:
        yield url


@pytest.fixture(scope="module")
def voila(tmp_path_factory):
    """Voilà (`make present`, with its template) serving a copy of lesson 01 as a dashboard."""
    if not (BIN / "voila").exists():
        pytest.skip("Voilà is not installed (`make present` installs the `present` extra)")
    home = copy_of_the_lesson(tmp_path_factory, "voila", ROOT / "notebooks" / LESSON.name)  # what it serves
    command = [str(BIN / "voila"), str(home / "notebooks" / LESSON.name), "--template=labkit", "--no-browser",
               "--Voila.ip=127.0.0.1"]
    with serving(command, home, JUPYTER_PATH=str(ROOT / "present")) as url:
        yield url


def screenshot(target, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    target.screenshot(path=str(SCREENSHOTS / f"{name}.png"))


# In-page helpers --------------------------------------------------------------------------------------

STEP_AND_TIME_JS = """async ([button, counter, figure]) => {
    // Press `button`, then time until both the counter's text and the figure's bars have changed.
    const [counterEl, barsEl] = [document.querySelector(counter), document.querySelector(figure)];
    const [text, bars] = [counterEl.textContent, barsEl.innerHTML];
    const start = performance.now();
    document.querySelector(button).click();
    await new Promise((resolve, reject) => {
        const done = () => counterEl.textContent !== text && barsEl.innerHTML !== bars;
        const observer = new MutationObserver(() => { if (done()) { observer.disconnect(); resolve(); } });
        observer.observe(document.body, {subtree: true, childList: true, characterData: true, attributes: true});
        setTimeout(() => { observer.disconnect(); reject(new Error("no change within 10 s")); }, 10000);
    });
    return performance.now() - start;
}"""


MARK_JS = """selector => {
    // Mark the elements `selector` finds, so a later look can tell whether they were replaced.
    const found = document.querySelectorAll(selector);
    found.forEach(element => { element.labkitMark = true; });
    return found.length;
}"""
COUNT_MARKED_JS = "selector => [...document.querySelectorAll(selector)].filter(el => el.labkitMark === true).length"


def counter_text(page, policy: str) -> str:
    return page.inner_text(f".labkit-counter-{policy}")


def static_bars(page) -> str:
    return page.inner_html(".labkit-figure-static .barlayer")


def wait_for_counters(page, counters: dict[str, str]) -> None:
    for policy, text in counters.items():
        sync_api.expect(page.locator(f".labkit-counter-{policy}")).to_have_text(text)


def time_steps(page, button: str, num_steps: int) -> list[float]:
    """Milliseconds from pressing `button` (step-back or step-forward) to the static view redrawn, per press."""
    arguments = [f".labkit-{button}", ".labkit-counter-static", ".labkit-figure-static .barlayer"]
    return [page.evaluate(STEP_AND_TIME_JS, arguments) for _ in range(num_steps)]


# JupyterLab ------------------------------------------------------------------------------------------


def test_jupyterlab_uses_the_private_settings(lab):
    with urllib.request.urlopen(f"{lab}/lab/api/settings/@jupyterlab/notebook-extension:tracker", timeout=10) as reply:
        settings = json.load(reply)
    assert settings["settings"]["windowingMode"] == "none"


def test_the_animation_draws_in_jupyterlab_before_any_cell_runs(lab, page):
    page.goto(f"{lab}/lab/tree/{LESSON.name}")
    animation = page.locator(".js-plotly-plot:has(.slider-container)")
    sync_api.expect(animation).to_have_count(1)
    sync_api.expect(animation.locator(".annotation-text").first).to_contain_text("step 23 of 23")


def test_lesson_01_runs_and_the_stepper_plays_in_jupyterlab(lab, page):
    page.goto(f"{lab}/lab/tree/{LESSON.name}")
    page.wait_for_function("window.jupyterapp && window.jupyterapp.shell.currentWidget?.content?.widgets?.length")
    num_cells = len(json.loads(LESSON.read_text())["cells"])
    cells = page.locator(".jp-Notebook .jp-Cell")
    sync_api.expect(cells).to_have_count(num_cells)  # windowing off: every cell rendered
    page.wait_for_function("window.jupyterapp.shell.currentWidget.sessionContext.session?.kernel")
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    wait_for_counters(page, FINAL_COUNTERS)
    stepper = page.locator(".labkit-play").locator("xpath=../..")
    stepper.scroll_into_view_if_needed()
    screenshot(stepper, "jupyterlab-stepper-final")
    whole = static_bars(page)

    page.click(".labkit-play button >> nth=0")
    page.wait_for_function(
        "text => !document.querySelector('.labkit-counter-static').textContent.includes(text)", arg="step 23 of 23"
    )
    assert static_bars(page) != whole, "playing must redraw the slot diagram"
    screenshot(stepper, "jupyterlab-stepper-playing")
    wait_for_counters(page, FINAL_COUNTERS)
    assert static_bars(page) == whole
    screenshot(page, "jupyterlab-lesson-01")


def test_a_step_of_the_stepper_redraws_its_figures_in_place(lab, page, capsys):
    """Each press redraws the counter and the bars (time_steps waits for both) without building a
    figure again: the figures' elements are the ones marked before the first press. The time a step
    takes is printed, not asserted."""
    page.goto(f"{lab}/lab/tree/{LESSON.name}")
    page.wait_for_function("window.jupyterapp?.shell.currentWidget?.sessionContext?.session?.kernel")
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    wait_for_counters(page, FINAL_COUNTERS)
    figures = ".labkit-figure-static, .labkit-figure-continuous"
    assert page.evaluate(MARK_JS, figures) == 2
    milliseconds = time_steps(page, "step-back", 9) + time_steps(page, "step-forward", 9)
    with capsys.disabled():
        print(f"\nstepper: one step in the browser takes {statistics.median(milliseconds):.0f} ms "
              f"(median of {len(milliseconds)}; goal {STEP_GOAL_MS} ms)")
    assert counter_text(page, "static") == FINAL_COUNTERS["static"]
    assert page.evaluate(COUNT_MARKED_JS, figures) == 2  # neither figure was built again


# Voilà ----------------------------------------------------------------------------------------------


def test_voila_serves_the_lesson_with_a_live_stepper(voila, page):
    page.goto(voila)
    wait_for_counters(page, FINAL_COUNTERS)
    page.locator(".labkit-play").scroll_into_view_if_needed()
    screenshot(page, "voila-lesson-01")


def test_voila_keeps_each_run_that_answers_a_prediction_behind_a_reveal(voila, page):
    page.goto(voila)
    wait_for_counters(page, FINAL_COUNTERS)  # every cell has run
    reveals = page.locator("details.labkit-answer")
    sync_api.expect(reveals).to_have_count(2)  # lesson 01's two predictions answered by a run
    first_run = reveals.first.locator(".jp-OutputArea")
    sync_api.expect(first_run).to_be_hidden()
    sync_api.expect(page.get_by_text("23 iterations, 32 tokens")).to_be_hidden()  # the answer, not on screen
    reveals.first.locator("summary").click()
    sync_api.expect(first_run).to_contain_text("Static(num_slots=2)      23 iterations")


# The HTML export, with no kernel and no network ------------------------------------------------------


def answer_offline(route) -> None:
    """plotly.js from the copy plotly.py ships, which the page's integrity hash accepts only if it is the
    version asked for; nothing else (the export also asks for require.js and MathJax, which it doesn't need)."""
    if route.request.url.startswith("https://cdn.plot.ly/plotly-"):
        route.fulfill(path=str(LOCAL_PLOTLY_JS))
    else:
        route.abort()


def test_the_exported_animation_plays_with_no_kernel(page, tmp_path):
    exported = tmp_path / "lesson01.html"
    exported.write_text(export_html(), encoding="utf-8")
    page.route(re.compile(r"^https?://"), answer_offline)
    page.goto(exported.as_uri())
    animation = page.locator(".js-plotly-plot:has(.slider-container)")
    titles = animation.locator(".annotation-text")
    sync_api.expect(titles.first).to_have_text(
        "Static(num_slots=2) · step 23 of 23 · 32 tokens · utilization 69.6% · 0 waiting"
    )
    whole = animation.locator(".cartesianlayer").inner_html()
    animation.locator(".updatemenu-button").first.click()  # ▶
    sync_api.expect(titles.first).to_contain_text("step 3 of 23")
    assert animation.locator(".cartesianlayer").inner_html() != whole
    screenshot(animation, "html-export-animation-playing")
    sync_api.expect(titles.last).to_have_text(
        "Continuous(num_slots=2) · step 17 of 17 · 32 tokens · utilization 94.1% · 0 waiting"
    )
    sync_api.expect(titles.first).to_contain_text("step 23 of 23")
    screenshot(animation, "html-export-animation-final")
