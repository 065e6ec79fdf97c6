"""ScheduleStepper: one trace under static and continuous batching, step by step.

Invariants:

- the figures and counters always show `self.logs` clipped to the first `self.step`
  steps; a policy that has finished shows its whole schedule;
- `self.logs`, `self.lengths`, `self.num_slots` and `self.equal_lengths` describe the
  last valid input; invalid input changes nothing but the error label, and never raises;
- input is bounded (`MAX_REQUESTS` requests of at most `MAX_OUTPUT_LENGTH` tokens on at most
  `MAX_SLOTS` slots), so no entry can stall the kernel or fill its memory;
- stepping sends one batched update per figure and rebuilds nothing.

DOM classes for browser tests: labkit-lengths, labkit-num-slots, labkit-equal,
labkit-error, labkit-play, labkit-step, labkit-step-back, labkit-step-forward,
labkit-counter-<policy>, labkit-figure-<policy>.
"""

from __future__ import annotations

import re
import string

import ipywidgets as widgets
import numpy as np
import plotly.graph_objects as go

from labkit.sched import Continuous, Static, StepLog, simulate
from labkit.traffic import TOY_OUTPUT_LENGTHS, Trace
from labkit.viz.figures import show_steps, slot_diagram

POLICIES = (("static", Static), ("continuous", Continuous))
PLAY_INTERVAL_MS = 500
MAX_REQUESTS = 200  # the stepper is for traces you can read bar by bar
MAX_OUTPUT_LENGTH = 1_000  # tokens a request: longer ones would cost seconds of simulation and memory, not insight
MAX_SLOTS = 200  # more slots than the stepper has requests add only empty rows


def parse_lengths(text: str) -> list[float]:
    """'2, 6 3' -> [2.0, 6.0, 3.0]; a ValueError names the first entry that is not a number."""
    numbers = []
    for token in (t for t in re.split(r"[\s,]+", text) if t):
        try:
            numbers.append(float(token))
        except ValueError:
            raise ValueError(f"output lengths: {token!r} is not a number") from None
    return numbers


def check_size(lengths, num_slots) -> None:
    """Raise ValueError, naming the field and the value, for a trace too big to simulate and draw at once."""
    if len(lengths) > MAX_REQUESTS:
        raise ValueError(
            f"output lengths: {len(lengths)} requests is more than the stepper draws (at most {MAX_REQUESTS}); "
            "use lk.simulate and lk.viz.slot_diagram for bigger traces"
        )
    for position, length in enumerate(lengths):
        if isinstance(length, (int, float, np.number)) and length > MAX_OUTPUT_LENGTH:  # the Trace rejects the rest
            shown = f"{length:,.0f}" if np.isfinite(length) else repr(length)
            raise ValueError(
                f"output_lengths[{position}] = {shown}: more tokens than the stepper draws for one request (at most "
                f"{MAX_OUTPUT_LENGTH:,}); use lk.simulate and lk.viz.slot_diagram for longer requests"
            )
    if isinstance(num_slots, (int, float, np.number)) and num_slots > MAX_SLOTS:
        raise ValueError(f"num_slots = {num_slots:,}: more slots than the stepper draws (at most {MAX_SLOTS})")


def lettered_trace(lengths) -> Trace:
    """Requests all waiting at t=0, labelled A, B, C ... when there are at most 26 of them."""
    trace = Trace.from_lengths(lengths)
    letters = tuple(string.ascii_uppercase[: len(trace)]) if len(trace) <= 26 else ()
    return Trace(trace.output_lengths, trace.prompt_lengths, trace.arrivals, trace.ids, letters)


def equalized(trace: Trace) -> Trace:
    """The same requests, every output length replaced by the rounded mean."""
    mean_length = round(float(trace.output_lengths.mean()))
    return lettered_trace(np.full(len(trace), mean_length))


def progress_text(log: StepLog, step: int) -> str:
    """Counters after the first `step` steps: step, tokens and utilization so far, and the
    requests waiting during the last step shown (before the first step, at step 0)."""
    step = min(step, log.num_steps)
    num_output_tokens = int(np.count_nonzero(log.slots[:step] >= 0))
    utilization = f"{num_output_tokens / (log.num_slots * step):.1%}" if step else "–"
    if step:
        num_waiting = int(log.num_queued[step - 1])
    else:
        num_waiting = int(np.count_nonzero(log.trace.arrivals <= log.step_start[0]))
    return (
        f"step {step} of {log.num_steps} · {num_output_tokens} tokens · "
        f"utilization {utilization} · {num_waiting} waiting"
    )


class ScheduleStepper(widgets.VBox):
    """Static and continuous batching of the same requests, stacked on one step axis."""

    def __init__(self, lengths=TOY_OUTPUT_LENGTHS, num_slots: int = 2, equal_lengths: bool = False):
        super().__init__()
        self._simulate(lengths, num_slots, equal_lengths)
        self.counters = {name: widgets.Label().add_class(f"labkit-counter-{name}") for name, _ in POLICIES}
        self.panels = {name: widgets.VBox() for name, _ in POLICIES}
        self.figures: dict[str, go.FigureWidget] = {}
        self.error = widgets.Label(style=dict(text_color="#b00020")).add_class("labkit-error")
        self.children = [self._inputs(), self.error, self._controls(), *self.panels.values()]
        self._show_logs()

    def _inputs(self) -> widgets.HBox:
        """Output lengths, slot count and the equal-lengths toggle; any change re-simulates."""
        self.lengths_box = widgets.Text(
            ", ".join(map(str, self.lengths)), description="output lengths", continuous_update=False, style={"description_width": "initial"}
        ).add_class("labkit-lengths")
        self.num_slots_box = widgets.IntText(
            self.num_slots, description="slots", continuous_update=False
        ).add_class("labkit-num-slots")
        self.equal_toggle = widgets.ToggleButton(self.equal_lengths, description="equal lengths").add_class(
            "labkit-equal"
        )
        boxes = [self.lengths_box, self.num_slots_box, self.equal_toggle]
        for box in boxes:
            box.observe(lambda _: self._on_input(), names="value")
        return widgets.HBox(boxes)

    def _controls(self) -> widgets.HBox:
        """Play, step back, the step slider and step forward."""
        self.play = widgets.Play(interval=PLAY_INTERVAL_MS).add_class("labkit-play")
        self.slider = widgets.IntSlider(description="step").add_class("labkit-step")
        widgets.jslink((self.play, "value"), (self.slider, "value"))
        self.slider.observe(lambda change: self._draw(change["new"]), names="value")
        back = widgets.Button(icon="step-backward", tooltip="step back").add_class("labkit-step-back")
        forward = widgets.Button(icon="step-forward", tooltip="step forward").add_class("labkit-step-forward")
        back.on_click(lambda _: self.go_to(self.step - 1))
        forward.on_click(lambda _: self.go_to(self.step + 1))
        return widgets.HBox([self.play, back, self.slider, forward])

    def __repr__(self) -> str:
        equal = ", equal_lengths=True" if self.equal_lengths else ""
        return f"ScheduleStepper(lengths={self.lengths}, num_slots={self.num_slots}{equal})"

    # Public controls

    @property
    def step(self) -> int:
        """Steps shown: 0 shows nothing run yet, the longest schedule's length shows everything."""
        return self.slider.value

    def go_to(self, step: int) -> None:
        """Show the first `step` steps, clamped to the slider's range."""
        self.slider.value = int(np.clip(step, self.slider.min, self.slider.max))

    # Input -> logs -> view

    def _simulate(self, lengths, num_slots, equal_lengths) -> None:
        """Set logs and inputs together, or raise ValueError and change nothing."""
        check_size(lengths, num_slots)
        trace = lettered_trace(lengths)
        shown = equalized(trace) if equal_lengths else trace
        logs = {name: simulate(shown, policy(num_slots=num_slots)) for name, policy in POLICIES}
        self.logs, self.lengths, self.num_slots = logs, trace.output_lengths.tolist(), num_slots
        self.equal_lengths = bool(equal_lengths)

    def _on_input(self) -> None:
        try:
            lengths = parse_lengths(self.lengths_box.value)
            self._simulate(lengths, self.num_slots_box.value, self.equal_toggle.value)
        except ValueError as error:
            self.error.value = str(error)
            return
        self.error.value = ""
        self._show_logs()

    def _show_logs(self) -> None:
        """Build one figure per policy on a shared step axis, then show the whole schedule."""
        longest = max(log.num_steps for log in self.logs.values())
        for name, log in self.logs.items():
            figure = go.FigureWidget(slot_diagram(log, title=log.policy, num_steps=longest))
            self.panels[name].children = [self.counters[name], figure.add_class(f"labkit-figure-{name}")]
            if name in self.figures:
                self.figures[name].close()
            self.figures[name] = figure
        self.play.max = self.slider.max = longest
        # the front end's link copies Play's value onto the slider when it starts (as in Voilà), so set both
        self.play.value = self.slider.value = longest
        self._draw(longest)  # the slider may already stand at `longest`, so draw in any case

    def _draw(self, step: int) -> None:
        for name, log in self.logs.items():
            show_steps(self.figures[name], log, step)
            self.counters[name].value = f"{name.capitalize()}: {progress_text(log, step)}"
