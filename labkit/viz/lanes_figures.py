"""Two-lane timelines, host above device, and what overlap buys.

`lane_timeline` draws `labkit.analysis.lanes.Lanes`, laid out by `two_lanes` or measured by
an engine (`Lanes.from_log`); the device's idle stretches (`idle_stretches`) are shaded, each
bar's hover gives its start, end and length, and each device row is labelled with the share
of the drawn span in which the device idles.
`LaneExplorer` puts host and device sliders on the two-lane picture with and without
overlap, under their arithmetic (`layout_summary`). `overlap_speedup_curve` plots
(host + device) / max(host, device) against host time.

Invariants: a timeline draws every stretch it is given and nothing else, and the explorer
always shows the layout of its sliders' current values.

DOM classes for browser tests: labkit-lane-host, labkit-lane-device, labkit-lane-summary.

Lesson 08's question about the lanes (q7) is `labkit.exercises.lanes_question`.
"""

from __future__ import annotations

import ipywidgets as widgets
import numpy as np
import plotly.graph_objects as go

from labkit.analysis.lanes import Lanes, idle_stretches, layout_summary, two_lanes
from labkit.viz.figures import GRID

HOST_COLOR, DEVICE_COLOR, IDLE_COLOR = "#4C78A8", "#F58518", "rgba(228, 87, 86, 0.25)"


def _bars(stretches: np.ndarray, row: str, name: str, color: str, scale: float, legend: bool) -> go.Bar:
    return go.Bar(y=[row] * len(stretches), base=scale * stretches[:, 0], x=scale * (stretches[:, 1] - stretches[:, 0]),
                  customdata=scale * stretches[:, 1], orientation="h", name=name, marker_color=color,
                  legendgroup=name, showlegend=legend,
                  hovertemplate=f"{name}: %{{base:.2f}} to %{{customdata:.2f}} ms (%{{x:.2f}} ms)<extra></extra>")


def _idle_label(lanes: Lanes) -> str:
    return f"device idle {lanes.device_idle_fraction:.0%}"


def lane_timeline(panels: dict[str, Lanes], scale: float = 1.0, title: str = "Host and device, step by step") -> go.Figure:
    """One pair of rows (host, device) per named layout; `scale` turns its times into ms
    (1 for `two_lanes` in ms, 1000 for a log's seconds)."""
    fig = go.Figure()
    for i, (name, lanes) in enumerate(panels.items()):
        first = i == 0
        fig.add_trace(_bars(lanes.host, f"{name}: host", "host work", HOST_COLOR, scale, first))
        fig.add_trace(_bars(idle_stretches(lanes), f"{name}: device", "device idle", IDLE_COLOR, scale, first))
        fig.add_trace(_bars(lanes.device, f"{name}: device", "device work", DEVICE_COLOR, scale, first))
        fig.add_annotation(x=1.0, xref="paper", xanchor="left", y=f"{name}: device", text=_idle_label(lanes),
                           showarrow=False)
    rows = [f"{name}: {lane}" for name in panels for lane in ("host", "device")]
    fig.update_layout(title=title, barmode="overlay", height=140 + 55 * len(rows), plot_bgcolor="white",
                      legend=dict(orientation="h", y=-0.25), margin=dict(r=130))
    fig.update_yaxes(categoryorder="array", categoryarray=rows[::-1])
    fig.update_xaxes(title="milliseconds", gridcolor=GRID, rangemode="tozero")
    return fig


class LaneExplorer(widgets.VBox):
    """Sliders for host and device ms per step over the two-lane picture, without and with overlap."""

    def __init__(self, host: float = 2.0, device: float = 5.0, num_steps: int = 5):
        super().__init__()
        self.num_steps = num_steps
        self.host = widgets.FloatSlider(value=host, min=0.5, max=10.0, step=0.5, description="host ms")
        self.device = widgets.FloatSlider(value=device, min=0.5, max=10.0, step=0.5, description="device ms")
        self.summary = widgets.HTML()
        for slider, name in ((self.host, "host"), (self.device, "device")):
            slider.add_class(f"labkit-lane-{name}")
            slider.observe(self._update, names="value")
        self.summary.add_class("labkit-lane-summary")
        self.figure = go.FigureWidget(lane_timeline(self._panels()))
        self.figure.update_xaxes(range=[0, 20 * num_steps])  # room for the slowest layout
        self._update()
        self.children = [widgets.HBox([self.host, self.device]), self.summary, self.figure]

    def __repr__(self) -> str:
        return f"LaneExplorer(host={self.host.value}, device={self.device.value}, num_steps={self.num_steps})"

    def _panels(self) -> dict[str, Lanes]:
        host, device = self.host.value, self.device.value
        return {name: two_lanes(host, device, self.num_steps, overlap)
                for name, overlap in (("without overlap", False), ("with overlap", True))}

    def _update(self, change=None) -> None:
        fresh = lane_timeline(self._panels())
        with self.figure.batch_update():
            for trace, new in zip(self.figure.data, fresh.data):
                trace.base, trace.x, trace.y, trace.customdata = new.base, new.x, new.y, new.customdata
            for label, new in zip(self.figure.layout.annotations, fresh.layout.annotations):
                label.text = new.text
        self.summary.value = layout_summary(self.host.value, self.device.value)


def overlap_speedup_curve(device: float = 5.0, max_host: float = 20.0) -> go.Figure:
    """(host + device) / max(host, device) against host ms, for `device` ms of device work per step."""
    host = np.linspace(0, max_host, 401)  # (401,)
    speedup = (host + device) / np.maximum(host, device)
    fig = go.Figure(go.Scatter(x=host, y=speedup, mode="lines", name="overlap speed-up",
                               hovertemplate="host %{x:.1f} ms: %{y:.2f}x<extra></extra>"))
    fig.add_vline(x=device, line_dash="dot", annotation_text=f"host = device = {device:g} ms: 2x",
                  annotation_position="bottom right")
    fig.update_layout(title=f"What overlap buys, with {device:g} ms of device work per step", height=360,
                      plot_bgcolor="white", showlegend=False)
    fig.update_xaxes(title="host ms per step", gridcolor=GRID)
    fig.update_yaxes(title="throughput with overlap / without", gridcolor=GRID, range=[0.95, 2.05])
    return fig
