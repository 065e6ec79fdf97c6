"""Two prices of a step, side by side: where a conclusion about cost holds.

A conclusion that depends on what a step costs (continuous batching's inter-token latency,
a gain in seconds, when host time wins, what chunked prefill trades) may hold on this CPU
and not on a GPU, or the other way round. On this CPU every row a step computes costs real
time; on a GPU serving a real model a small batch is weight-bound and an extra row is
almost free. So a lesson prints such a conclusion under both prices:

    prices = two_prices(lk.CostModel.load(".../engine-cost.json"))
    table = by_price(lambda price: {"ITL p50": ..., "tokens/s": ...}, prices)
    print(table)

Invariants: `two_prices` always names this machine's price first and the GPU's second; a
`ByPrice` holds one value per (row, price), every row under every price, in the order the
conclusion gave them; nothing here runs a clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from labkit.analysis.cost_fit import CostModel
from labkit.analysis.hardware import weight_bound_price
from labkit.analysis.metrics import format_table
from labkit.sched.cost import HOST_TERMS

THIS_CPU = "CPU (saved fit)"  # this lab's engine, fitted once on the lab's 2-core CPU and saved
GPU = "H200 (spec sheet)"  # Llama 3.1 8B on an H200, priced from published figures


def two_prices(this_cpu: CostModel) -> dict[str, CostModel]:
    """This lab's engine's saved price on its CPU, and a weight-bound GPU's (an H200 serving
    Llama 3.1 8B) from public figures, by name: a roofline, the larger of the step's memory
    traffic and its arithmetic."""
    return {THIS_CPU: this_cpu, GPU: weight_bound_price()}


def with_host_of(device: CostModel, host: CostModel) -> CostModel:
    """`device`'s device terms with `host`'s host terms: the same scheduler and Python loop
    (priced on this CPU) in front of another device."""
    return replace(device, **{name: getattr(host, name) for name in HOST_TERMS}, overlap=host.overlap,
                   overlap_exposed=host.overlap_exposed)


@dataclass(frozen=True)
class ByPrice:
    """A conclusion's numbers under each price: `values[price][row]`, printed with `fmt`, one
    format for every row or a format per row ("{:.2f}x" for a row it does not name)."""

    values: dict[str, dict[str, float]]
    fmt: str | dict[str, str] = "{:.2f}x"

    def __post_init__(self):
        rows = [list(by_row) for by_row in self.values.values()]
        if not rows or any(names != rows[0] for names in rows):
            raise ValueError(f"values = {self.values!r}: every price needs the same rows, in the same order")

    def __getitem__(self, price: str) -> dict[str, float]:
        return self.values[price]

    def row(self, name: str) -> dict[str, float]:
        """One row's value under each price."""
        return {price: by_row[name] for price, by_row in self.values.items()}

    def __str__(self) -> str:
        prices = list(self.values)
        rows = [[name, *(self._format(name).format(self.values[price][name]) for price in prices)]
                for name in self.values[prices[0]]]
        return format_table(["", *prices], rows)

    def _format(self, row: str) -> str:
        return self.fmt if isinstance(self.fmt, str) else self.fmt.get(row, "{:.2f}x")


def by_price(conclude: Callable[[CostModel], dict[str, float]], prices: dict[str, CostModel],
             fmt: str | dict[str, str] = "{:.2f}x") -> ByPrice:
    """`conclude(price)`, a dict of named numbers, under every price."""
    return ByPrice({name: dict(conclude(price)) for name, price in prices.items()}, fmt)
