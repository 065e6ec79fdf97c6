"""schedule_animation: slot diagrams that fill in step by step with no kernel.

A plotly figure with one frame per step, a slider and a play button. It plays wherever
plotly.js runs (an HTML export, nbviewer, a Jupyter front end before any cell has run),
so the A–H lesson still moves where an ipywidget such as `ScheduleStepper` cannot.
`show_anywhere` displays it in a form each of those front ends draws. Its HTML loads
plotly.js from plotly's CDN, since 4.8 MB of it in every notebook is too much;
`export_offline_html` writes an HTML export that carries plotly.js once, draws every plotly
figure the notebook stores (nbconvert alone draws only those `show_anywhere` displayed) and
so plays with no network.

Invariants:

- frame k shows every log clipped to steps [0, k), exactly as `show_steps` draws it,
  and titles each diagram with the counters `progress_text` gives after k steps;
  k runs from 0 to the longest log's step count, and frame k is named str(k);
- the figure itself shows the last frame: every schedule whole;
- a frame holds only what changes: bar lengths, bar texts and the diagram titles;
- an offline export asks no server for plotly.js: it holds plotly.js once, inline, in place
  of the first CDN script tag, and no other CDN tag for it; it draws each stored plotly
  figure once.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio
from IPython.display import display
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from labkit.sched import StepLog
from labkit.viz.figures import clipped_bars, slot_diagram
from labkit.viz.stepper import PLAY_INTERVAL_MS, progress_text

PLOTLY_CDN_SCRIPT = re.compile(r'<script\b[^>]*\bsrc="https://cdn\.plot\.ly/[^"]+"[^>]*>\s*</script>')
SLIDER_HEIGHT = 90  # room under the diagrams for the slider and the play buttons
_JUMP = dict(mode="immediate", frame=dict(duration=0, redraw=True), transition=dict(duration=0))
_PLAY = dict(fromcurrent=True, frame=dict(duration=PLAY_INTERVAL_MS, redraw=True), transition=dict(duration=0))


def schedule_animation(*logs: StepLog) -> go.Figure:
    """Slot diagrams of `logs` stacked on one step axis, with one frame and one slider step
    per step and the counters in each diagram's title; ▶ plays them in the browser."""
    num_steps = max(log.num_steps for log in logs)
    fig = _stacked_diagrams(logs, num_steps)
    fig.frames = [_frame(logs, step) for step in range(num_steps + 1)]
    fig.update_layout(sliders=[_slider(num_steps)], updatemenus=[_play_buttons()])
    return fig


def kernel_free_bundle(fig: go.Figure) -> dict:
    """`fig` as plotly's mime type, which JupyterLab draws, and as HTML that loads plotly.js from
    its CDN, which nbviewer and HTML exports draw (GitHub's notebook preview runs no script);
    `export_offline_html` makes an export that needs no CDN."""
    html = pio.to_html(fig, include_plotlyjs="cdn", include_mathjax=False, full_html=False, auto_play=False)
    return {"application/vnd.plotly.v1+json": json.loads(pio.to_json(fig)), "text/html": html}


def show_anywhere(fig: go.Figure) -> None:
    """Display `kernel_free_bundle(fig)` as a cell output."""
    display(kernel_free_bundle(fig), raw=True)


def export_offline_html(notebook: str | Path, target: str | Path) -> Path:
    """Write `notebook` to `target` as one HTML page, as `jupyter nbconvert --to html` does, but
    with every stored plotly figure drawn and plotly.js inlined once in place of its CDN script
    tags: the figures play with no network. The page is about 4.8 MB larger."""
    from nbconvert import HTMLExporter  # comes with JupyterLab; labkit itself does not need it

    html = HTMLExporter().from_notebook_node(_with_figures_drawn(notebook))[0]
    tags = list(PLOTLY_CDN_SCRIPT.finditer(html))
    if not tags:
        raise ValueError(f"notebook = {str(notebook)!r}: no output holds a plotly figure, so nothing to draw")
    inline = f"<script>{get_plotlyjs()}</script>"
    offline = html[: tags[0].start()] + inline + PLOTLY_CDN_SCRIPT.sub("", html[tags[0].end() :])
    target = Path(target)
    target.write_text(offline, encoding="utf-8")
    return target


def _with_figures_drawn(path: str | Path):
    """The notebook at `path`, each plotly output without HTML given `kernel_free_bundle`'s HTML;
    a notebook that stores no outputs (a student copy) is refused, naming the copy that does."""
    import nbformat

    notebook = nbformat.read(str(path), as_version=4)
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    if not outputs:
        raise ValueError(f"notebook = {str(path)!r} stores no outputs (the lessons in notebooks/ are saved unrun): "
                         f"export the instructor copy, solutions/{Path(path).name}, or run it and save it first")
    for output in outputs:
        data = output.get("data", {})
        if "application/vnd.plotly.v1+json" in data and "text/html" not in data:
            figure = go.Figure(data["application/vnd.plotly.v1+json"])
            data["text/html"] = kernel_free_bundle(figure)["text/html"]
    return notebook


def _counters(logs, step: int) -> list[str]:
    return [f"{log.policy} · {progress_text(log, step)}" for log in logs]


def _stacked_diagrams(logs, num_steps: int) -> go.Figure:
    """One `slot_diagram` per log, one row each, every row showing steps [0, num_steps)."""
    diagrams = [slot_diagram(log, num_steps=num_steps) for log in logs]
    fig = make_subplots(
        rows=len(logs), cols=1, shared_xaxes=True, vertical_spacing=0.12, subplot_titles=_counters(logs, num_steps)
    )
    for row, diagram in enumerate(diagrams, start=1):
        fig.add_trace(diagram.data[0], row=row, col=1)
        fig.update_xaxes(diagram.layout.xaxis, row=row, col=1)
        fig.update_yaxes(diagram.layout.yaxis, row=row, col=1)
    fig.update_xaxes(title=None)
    fig.update_xaxes(title="step", row=len(logs), col=1)
    layout = diagrams[0].layout
    fig.update_layout(
        height=sum(diagram.layout.height for diagram in diagrams) + SLIDER_HEIGHT,
        margin=layout.margin,
        plot_bgcolor=layout.plot_bgcolor,
        uniformtext=layout.uniformtext,
    )
    return fig


def _frame(logs, step: int) -> go.Frame:
    """Every log clipped to steps [0, step), and the diagram titles (subplot annotations,
    which keep their places) rewritten with the counters after `step` steps."""
    return go.Frame(
        name=str(step),
        data=[go.Bar(clipped_bars(log, step)) for log in logs],
        traces=list(range(len(logs))),
        layout=dict(annotations=[dict(text=text) for text in _counters(logs, step)]),
    )


def _slider(num_steps: int) -> dict:
    steps = [dict(label=str(step), method="animate", args=[[str(step)], _JUMP]) for step in range(num_steps + 1)]
    return dict(active=num_steps, steps=steps, currentvalue=dict(prefix="step "), x=0.1, len=0.9, pad=dict(t=30))


def _play_buttons() -> dict:
    """▶ plays from the step shown (from step 0 when the last is shown); ❚❚ stops."""
    return dict(
        type="buttons",
        direction="left",
        x=0,
        y=0,
        xanchor="left",
        yanchor="top",
        pad=dict(t=65),
        buttons=[
            dict(label="▶", method="animate", args=[None, _PLAY]),
            dict(label="❚❚", method="animate", args=[[None], _JUMP]),
        ],
    )
