"""labkit.viz: pixels. Figures and widgets that read a `StepLog` (or theory numbers) and nothing else.

Imports plotly, ipywidgets, numpy and the labkit layers above it; it never runs an engine,
and it keeps no module-level mutable state.
"""

from labkit.viz.figures import (
    harmonic_curves,
    length_histogram,
    monte_carlo_convergence,
    phase_split,
    redraw,
    request_color,
    show_steps,
    slot_diagram,
    step_time_curve,
    utilization_bars,
)
from labkit.viz.live import LiveSlotDiagram
from labkit.viz.stepper import ScheduleStepper, progress_text

__all__ = [
    "LiveSlotDiagram",
    "ScheduleStepper",
    "harmonic_curves",
    "length_histogram",
    "monte_carlo_convergence",
    "phase_split",
    "progress_text",
    "redraw",
    "request_color",
    "show_steps",
    "slot_diagram",
    "step_time_curve",
    "utilization_bars",
]
