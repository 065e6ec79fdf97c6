"""labkit.viz: pixels. Figures and widgets that read a `StepLog` (or theory numbers) and nothing else.

Imports plotly, ipywidgets, numpy and the labkit layers above it; it never runs an engine,
and it keeps no module-level mutable state. A module named `<topic>_figures` draws what the
analysis module `<topic>` computes (`multiplier_figures`: `labkit.analysis.multiplier`).
The text tables the lessons print beside the figures (`policy_table`, `group_table`,
`gain_table`) are `labkit.analysis.ordering`'s, exported here too.
"""

from labkit.analysis.ordering import gain_table, group_table, policy_table
from labkit.viz.animation import kernel_free_bundle, schedule_animation, show_anywhere
from labkit.viz.figures import (
    clipped_bars,
    harmonic_curves,
    length_histogram,
    monte_carlo_convergence,
    phase_split,
    redraw,
    request_color,
    show_steps,
    slot_diagram,
    utilization_bars,
)
from labkit.viz.costs import step_breakdown, step_time_curve
from labkit.viz.lanes_figures import LaneExplorer, lane_timeline, overlap_speedup_curve
from labkit.viz.latency import goodput_bars, latency_tradeoff, predicted_against_measured, step_times
from labkit.viz.live import LiveSlotDiagram
from labkit.viz.multiplier_figures import multiplier_bars, multiplier_waterfall
from labkit.viz.ordering_figures import noise_sweep, ttft_by_length, ttft_waiting
from labkit.viz.memory import pool_sweep, pool_usage, preemption_steps, running_requests, server_occupancy
from labkit.viz.stepper import ScheduleStepper, progress_text

__all__ = [
    "LaneExplorer",
    "LiveSlotDiagram",
    "ScheduleStepper",
    "gain_table",
    "goodput_bars",
    "group_table",
    "latency_tradeoff",
    "predicted_against_measured",
    "pool_sweep",
    "pool_usage",
    "preemption_steps",
    "running_requests",
    "server_occupancy",
    "step_times",
    "clipped_bars",
    "harmonic_curves",
    "kernel_free_bundle",
    "lane_timeline",
    "length_histogram",
    "monte_carlo_convergence",
    "multiplier_bars",
    "multiplier_waterfall",
    "noise_sweep",
    "overlap_speedup_curve",
    "phase_split",
    "policy_table",
    "progress_text",
    "redraw",
    "request_color",
    "schedule_animation",
    "show_anywhere",
    "show_steps",
    "slot_diagram",
    "step_breakdown",
    "step_time_curve",
    "ttft_by_length",
    "ttft_waiting",
    "utilization_bars",
]
