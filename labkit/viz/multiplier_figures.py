"""Headline multipliers taken apart: a waterfall of one `labkit.analysis.multiplier.Multiplier`,
and stacked bars that set several side by side, each beside its published figure.

Both draw on a log scale, where factors multiply by stacking: a factor of 2 is as tall as
any other factor of 2, and a factor below 1 points down.

Invariants: every factor is drawn with its value as its label, inside its segment or, for a
segment too thin to hold it, beside the bar with its kind; the bars of a multiplier stack
to its total, which is marked and written at its marker, left of the bar; the published
figure, if any, is marked and written right of the bar, with its note (how it was measured)
under it; nothing else is drawn.

The multipliers themselves are `labkit.analysis.multiplier`'s; lesson 10's question about
them is `labkit.exercises.multiplier_question`.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping

import numpy as np
import plotly.graph_objects as go

from labkit.analysis.multiplier import KINDS, Multiplier
from labkit.viz.figures import GRID

KIND_COLORS = dict(zip(KINDS, ("#4C78A8", "#72B7B2", "#54A24B", "#B279A2", "#E45756")))
TOTAL_COLOR, PUBLISHED_COLOR = "#555555", "#F58518"
BAR_WIDTH, MARKER_OFFSET = 0.5, 0.38  # in category widths: the markers flank the bar, total left, published right
THIN = 0.1  # decades: a segment thinner than this (a factor within about 1.26x of 1) is labelled beside its bar


def multiplier_waterfall(multiplier: Multiplier, title: str | None = None) -> go.Figure:
    """From the baseline's 1× each factor lifts (or lowers) the running product; the last bar is the total."""
    fig = go.Figure()
    product = 1.0
    for factor in multiplier.factors:
        after = product * factor.value
        fig.add_trace(go.Bar(
            x=[factor.name.replace(" → ", " →<br>")], base=[min(product, after)], y=[abs(after - product)], name=factor.kind,
            marker_color=KIND_COLORS[factor.kind], text=[f"{factor.value:.2f}×"], textposition="outside",
            legendgroup=factor.kind, showlegend=factor.kind not in {t.name for t in fig.data},
            hovertemplate=f"{factor.name}: {factor.value:.3g}× ({factor.ratio}), running product {after:.3g}×"
                          "<extra></extra>"))
        product = after
    fig.add_trace(go.Bar(x=["total"], base=[1.0], y=[multiplier.total - 1.0], name="total", marker_color=TOTAL_COLOR,
                         text=[f"{multiplier.total:.2f}×"], textposition="outside",
                         hovertemplate=f"total: {multiplier.total:.3g}×<extra></extra>"))
    fig.update_layout(title=title or f"{multiplier.total:.2f}× over {multiplier.baseline}, factor by factor",
                      barmode="overlay", plot_bgcolor="white", height=440,
                      legend=dict(orientation="h", y=1.0, yanchor="bottom"))
    fig.update_xaxes(tickangle=0)
    products = [1.0, *np.cumprod([f.value for f in multiplier.factors])]
    fig.update_yaxes(type="log", title="× the baseline's throughput", gridcolor=GRID,
                     **_times_ticks(min(products), max(products)))
    return fig


def multiplier_bars(multipliers: dict[str, Multiplier | Mapping[str, float]],
                    published: dict[str, float] | None = None,
                    title: str = "Where each multiplier comes from",
                    published_notes: dict[str, str] | None = None) -> go.Figure:
    """One stacked bar of log factors per named multiplier, its total as a diamond left of
    the bar, and the published figure (same names) as a star right of it where one is given,
    with its note from `published_notes` under it ("at matched latency", say) where one is.
    A multiplier is a `Multiplier` or its factors by kind ({kind: value}, a recorded run's,
    say; a kind left out is 1), whose product is then its total."""
    published, published_notes = published or {}, published_notes or {}
    unknown = sorted(set(published_notes) - set(published))
    if unknown:
        raise ValueError(f"published_notes = {published_notes!r}: {unknown} has no published figure")
    names = list(multipliers)
    factors = {name: _factors_by_kind(name, multipliers[name]) for name in names}
    at = np.arange(len(names), dtype=float)
    fig = go.Figure()
    for kind in KINDS:
        values = [factors[name][kind] for name in names]
        fig.add_trace(go.Bar(x=at, y=np.log10(values), width=BAR_WIDTH, name=kind, marker_color=KIND_COLORS[kind],
                             text=["" if _is_thin(v) else f"{v:.2f}×" for v in values], textposition="inside",
                             insidetextanchor="middle", customdata=values,
                             hovertemplate=f"{kind}: %{{customdata:.3g}}×<extra></extra>"))
    for x, name in zip(at, names):
        _label_thin_segments(fig, x, factors[name])
    _mark(fig, at - MARKER_OFFSET, [math.prod(factors[name].values()) for name in names], "total")
    shown = [i for i, name in enumerate(names) if name in published]
    if shown:
        _mark(fig, at[shown] + MARKER_OFFSET, [published[names[i]] for i in shown], "published",
              [published_notes.get(names[i], "") for i in shown])
    ends = {name: _stack_ends(factors[name]) for name in names}
    low = min(down for down, _ in ends.values())
    high = max([*(up for _, up in ends.values()), *published.values()])
    fig.update_layout(title=title, barmode="relative", plot_bgcolor="white", height=500,
                      uniformtext=dict(minsize=11, mode="show"), legend=dict(orientation="h", y=-0.15))
    fig.update_xaxes(tickvals=at, ticktext=names, range=[-0.7, len(names) - 0.3])
    fig.update_yaxes(title="factor (log scale)", gridcolor=GRID, zerolinecolor="#888",
                     **_times_ticks(low, high * 3, log=True))
    return fig


MARKERS = {"total": dict(symbol="diamond", size=14, color=TOTAL_COLOR, line=dict(color="white", width=1)),
           "published": dict(symbol="star", size=16, color=PUBLISHED_COLOR)}


def _mark(fig: go.Figure, x, values: list[float], name: str, notes: list[str] | None = None) -> None:
    """Markers at `values` (log axis), each written above its marker as "name / N×", its note under it."""
    color = MARKERS[name]["color"]
    fig.add_trace(go.Scatter(x=x, y=np.log10(values), mode="markers", name=name, marker=MARKERS[name],
                             customdata=values, hovertemplate=f"{name}: %{{customdata:.3g}}×<extra></extra>"))
    for at, value, note in zip(x, values, notes or [""] * len(values)):
        fig.add_annotation(x=at, y=math.log10(value), text=f"{name}<br>{value:.3g}×", showarrow=False,
                           yanchor="bottom", yshift=9, font=dict(color=color))
        if note:
            fig.add_annotation(x=at, y=math.log10(value), text="<br>".join(textwrap.wrap(note, 14)),
                               showarrow=False, yanchor="top", yshift=-10, font=dict(color=color, size=11))


def _label_thin_segments(fig: go.Figure, x: float, factors: dict[str, float]) -> None:
    """Each segment too thin to hold its label gets it beside the bar, with its kind."""
    for kind, middle in _segment_middles(factors).items():
        if _is_thin(factors[kind]) and not _is_one(factors[kind]):
            fig.add_annotation(x=x + BAR_WIDTH / 2, y=middle, text=f"{kind} {factors[kind]:.2f}×", showarrow=False,
                               xanchor="left", xshift=4, font=dict(size=11), bgcolor="white")


def _factors_by_kind(name: str, multiplier: Multiplier | Mapping[str, float]) -> dict[str, float]:
    """{kind: value} for every kind of KINDS: a `Multiplier`'s, or a mapping's with 1 for a kind it leaves out."""
    if isinstance(multiplier, Multiplier):
        return {kind: multiplier.factor(kind) for kind in KINDS}
    unknown = sorted(set(multiplier) - set(KINDS))
    if unknown:
        raise ValueError(f"multipliers[{name!r}] = {dict(multiplier)!r}: {unknown} is no kind of factor; "
                         f"choose from {KINDS}")
    bad = {kind: value for kind, value in multiplier.items() if not value > 0}
    if bad:
        raise ValueError(f"multipliers[{name!r}] = {dict(multiplier)!r}: {bad} is not a factor above 0")
    return {kind: float(multiplier.get(kind, 1.0)) for kind in KINDS}


def _is_one(factor: float) -> bool:
    """Whether a factor is 1 (up to rounding): a kind left out, with no segment to label."""
    return math.isclose(factor, 1.0, rel_tol=1e-9)


def _is_thin(factor: float) -> bool:
    """Whether a factor's segment is too thin on the log axis to hold its label."""
    return abs(math.log10(factor)) < THIN


def _segment_middles(factors: dict[str, float]) -> dict[str, float]:
    """The log10 height of the middle of each kind's segment as plotly stacks them in a
    relative bar: factors above 1 upward from 1× in KINDS' order, those below 1 downward."""
    middles, ends = {}, {True: 0.0, False: 0.0}
    for kind in KINDS:
        height, up = math.log10(factors[kind]), factors[kind] >= 1
        middles[kind] = ends[up] + height / 2
        ends[up] += height
    return middles


def _stack_ends(factors: dict[str, float]) -> tuple[float, float]:
    """(bottom, top) of a multiplier's stacked bar: the product of its factors below 1, and of those above."""
    return math.prod(f for f in factors.values() if f < 1), math.prod(f for f in factors.values() if f > 1)


def _times_ticks(low: float, high: float, log: bool = False) -> dict:
    """Ticks at 1, 2 and 5 times powers of ten from about `low` to `high` (and 1), labelled "2×";
    given as their log10 when the axis is already in log units."""
    low, high = min(low, 1.0), max(high, 1.0)
    ticks = [m * 10.0**e for e in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
             for m in (1, 2, 5)]
    ticks = [t for t in ticks if low / 2 <= t <= high * 2]
    return dict(tickvals=np.log10(ticks) if log else ticks, ticktext=[f"{t:g}×" for t in ticks])
