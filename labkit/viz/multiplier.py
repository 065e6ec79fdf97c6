"""Headline multipliers taken apart: a waterfall of one `labkit.analysis.multiplier.Multiplier`,
and stacked bars that set several side by side, each beside its published figure.

Both draw on a log scale, where factors multiply by stacking: a factor of 2 is as tall as
any other factor of 2, and a factor below 1 (what a gain costs) points down.

Invariants: every factor is drawn with its value as its label; the bars of a multiplier
stack to its total, which is marked and written above the bar with the published figure
given for it, if any; the total's marker sits left of its bar and the published figure's
right of it, so the two never cover each other; nothing else is drawn.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import plotly.graph_objects as go

from labkit.analysis.multiplier import KINDS, Multiplier
from labkit.viz.figures import GRID

KIND_COLORS = dict(zip(KINDS, ("#4C78A8", "#72B7B2", "#54A24B", "#B279A2", "#E45756")))
TOTAL_COLOR, PUBLISHED_COLOR = "#555555", "#F58518"
BAR_WIDTH, MARKER_OFFSET = 0.5, 0.38  # in category widths: the markers flank the bar, total left, published right


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
                    title: str = "Where each multiplier comes from") -> go.Figure:
    """One stacked bar of log factors per named multiplier, its total as a diamond left of
    the bar, and the published figure (same names) as a star right of it where one is given.
    A multiplier is a `Multiplier` or its factors by kind ({kind: value}, a recorded run's,
    say; a kind left out is 1), whose product is then its total."""
    published = published or {}
    names = list(multipliers)
    factors = {name: _factors_by_kind(name, multipliers[name]) for name in names}
    at = np.arange(len(names), dtype=float)
    fig = go.Figure()
    for kind in KINDS:
        values = [factors[name][kind] for name in names]
        fig.add_trace(go.Bar(x=at, y=np.log10(values), width=BAR_WIDTH, name=kind, marker_color=KIND_COLORS[kind],
                             text=[f"{v:.2f}×" for v in values], textposition="inside", insidetextanchor="middle",
                             customdata=values, hovertemplate=f"{kind}: %{{customdata:.3g}}×<extra></extra>"))
    totals = [math.prod(factors[name].values()) for name in names]
    fig.add_trace(go.Scatter(x=at - MARKER_OFFSET, y=np.log10(totals), mode="markers", name="total",
                             marker=dict(symbol="diamond", size=14, color=TOTAL_COLOR, line=dict(color="white", width=1)),
                             customdata=totals, hovertemplate="total: %{customdata:.3g}×<extra></extra>"))
    shown = [i for i, name in enumerate(names) if name in published]
    if shown:
        claims = [published[names[i]] for i in shown]
        fig.add_trace(go.Scatter(x=at[shown] + MARKER_OFFSET, y=np.log10(claims), mode="markers", name="published",
                                 marker=dict(symbol="star", size=16, color=PUBLISHED_COLOR), customdata=claims,
                                 hovertemplate="published: %{customdata:g}×<extra></extra>"))
    ends = {name: _stack_ends(factors[name]) for name in names}
    for x, name, total in zip(at, names, totals):
        claim = f"<br>{published[name]:g}× published" if name in published else ""
        fig.add_annotation(x=x, y=math.log10(ends[name][1]), text=f"total {total:.1f}×{claim}",
                           showarrow=False, yanchor="bottom", yshift=4)
    low = min(down for down, _ in ends.values())
    high = max([*(up for _, up in ends.values()), *published.values()])
    fig.update_layout(title=title, barmode="relative", plot_bgcolor="white", height=500,
                      legend=dict(orientation="h", y=-0.15))
    fig.update_xaxes(tickvals=at, ticktext=names, range=[-0.7, len(names) - 0.3])
    fig.update_yaxes(title="factor (log scale)", gridcolor=GRID, zerolinecolor="#888",
                     **_times_ticks(low, high * 3, log=True))
    return fig


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
