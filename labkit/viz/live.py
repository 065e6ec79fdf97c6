"""LiveSlotDiagram: a slot diagram that redraws while a back end runs.

Pass `diagram.update` as `on_step` to `lk.simulate` or `Engine.run`; the back end never
knows a widget exists. Invariant: after `update(log)` the figure shows exactly `log`'s
steps so far, and each update is one message to the front end.
"""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go

from labkit.sched import StepLog
from labkit.traffic import Trace
from labkit.viz.figures import redraw, slot_diagram


class LiveSlotDiagram(widgets.VBox):
    """An empty slot diagram for `num_slots` slots that fills in as `update(log)` is called."""

    def __init__(self, trace: Trace, num_slots: int, title: str = "live run"):
        super().__init__()
        self.title = title
        self.caption = widgets.Label(f"{title}: waiting for the first step").add_class("labkit-live-caption")
        self.figure = go.FigureWidget(slot_diagram(StepLog(trace, num_slots, title), title=title))
        self.children = [self.caption, self.figure]

    def __repr__(self) -> str:
        return f"LiveSlotDiagram(title={self.title!r})"

    def update(self, log: StepLog) -> None:
        redraw(self.figure, log)
        self.caption.value = f"{self.title}: step {log.num_steps}, {log.num_output_tokens} tokens"
