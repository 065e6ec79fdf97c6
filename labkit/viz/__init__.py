"""labkit.viz: pixels. Figures and widgets that read a `StepLog` (or theory numbers) and nothing else.

Imports plotly, ipywidgets, numpy and the labkit layers above it; it never runs an engine,
and it keeps no module-level mutable state.
"""

from labkit.viz.figures import (
    harmonic_curves,
    length_histogram,
    monte_carlo_convergence,
    request_color,
    show_steps,
    slot_diagram,
    utilization_bars,
)
from labkit.viz.stepper import ScheduleStepper, progress_text

__all__ = [
    "ScheduleStepper",
    "harmonic_curves",
    "length_histogram",
    "monte_carlo_convergence",
    "progress_text",
    "request_color",
    "show_steps",
    "slot_diagram",
    "utilization_bars",
]
