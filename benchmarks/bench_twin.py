"""The twin: does the simulator, priced with this engine's one CostModel, predict the engine?

For two traces the fit never saw, it runs static and continuous batching on the engine and
in the simulator (`lk.simulate(cost=engine-cost.json's model)`), and prints, side by side,
each policy's duration, simulated over measured, and the time gain of continuous over static
batching, simulated and measured. A third column prices static batching the way the simulator
did before it priced padded rows: its live rows only (`Static(drop_finished=True)` in the
simulator), to show the gap that pricing closes.

Targets (issue: "the twin tells the truth about cost"): simulated static duration within 15%
of the engine's, and the simulated gain within 15% of the measured one, on both traces.

The engine runs each policy `--repeats` times, alternating, and keeps the median duration.
Results go to benchmarks/results/twin-<device>.json.
Run: `python benchmarks/bench_twin.py` (about a minute on a 2-core CPU).
"""

import argparse
import datetime
import json
import os
import platform
from pathlib import Path

import numpy as np
import torch

import labkit as lk
from labkit.engine import Engine

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 0.15  # relative error allowed on the static duration and on the gain


def traces() -> dict[str, tuple[lk.Trace, int]]:
    """(trace, slots) by name: the issue's case, and one with longer, varied prompts."""
    return {
        "40 requests, exponential(40) outputs, 16-token prompts, 8 slots":
            (lk.Trace.sample(40, output="exponential", mean_output=40, prompt="equal", mean_prompt=16, seed=0), 8),
        "64 requests, uniform outputs (mean 48), uniform prompts (mean 96), 16 slots":
            (lk.Trace.sample(64, output="uniform", mean_output=48, prompt="uniform", mean_prompt=96, seed=3), 16),
    }


def compare(engine: Engine, cost: lk.CostModel, trace: lk.Trace, num_slots: int, repeats: int) -> dict:
    static, continuous = lk.Static(num_slots=num_slots), lk.Continuous(num_slots=num_slots)
    measured = {"static": [], "continuous": []}
    for _ in range(repeats):
        measured["static"].append(engine.run(trace, static, progress=False).duration)
        measured["continuous"].append(engine.run(trace, continuous, progress=False).duration)
    engine_s = {name: float(np.median(seconds)) for name, seconds in measured.items()}
    simulated_s = {"static": lk.simulate(trace, static, cost=cost).duration,
                   "continuous": lk.simulate(trace, continuous, cost=cost).duration}
    live_rows_only = lk.simulate(trace, lk.Static(num_slots=num_slots, drop_finished=True), cost=cost).duration
    gains = {"engine": engine_s["static"] / engine_s["continuous"],
             "simulated": simulated_s["static"] / simulated_s["continuous"],
             "simulated, live rows only": live_rows_only / simulated_s["continuous"]}
    return {"engine_seconds": engine_s, "simulated_seconds": simulated_s,
            "simulated_static_live_rows_only": live_rows_only, "gain": gains,
            "static_error": simulated_s["static"] / engine_s["static"] - 1,
            "continuous_error": simulated_s["continuous"] / engine_s["continuous"] - 1,
            "gain_error": gains["simulated"] / gains["engine"] - 1, "all_durations": measured}


def report(name: str, result: dict) -> None:
    engine_s, simulated_s, gain = result["engine_seconds"], result["simulated_seconds"], result["gain"]
    print(f"\n{name}")
    rows = [["static", f"{simulated_s['static']:.3f}", f"{engine_s['static']:.3f}", f"{result['static_error']:+.1%}",
             f"{result['simulated_static_live_rows_only']:.3f}"],
            ["continuous", f"{simulated_s['continuous']:.3f}", f"{engine_s['continuous']:.3f}",
             f"{result['continuous_error']:+.1%}", "-"],
            ["gain", f"{gain['simulated']:.2f}x", f"{gain['engine']:.2f}x", f"{result['gain_error']:+.1%}",
             f"{gain['simulated, live rows only']:.2f}x"]]
    print(lk.metrics.format_table(["", "simulated s", "engine s", "sim/engine - 1", "live rows only"], rows))
    met = abs(result["static_error"]) <= TARGET and abs(result["gain_error"]) <= TARGET
    print(f"static duration and gain within {TARGET:.0%}: {met}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cost", type=Path, default=RESULTS / "engine-cost.json")
    args = parser.parse_args()
    cost = lk.CostModel.load(args.cost)
    print(cost)
    engine = Engine(device=args.device, seed=0)
    engine.run(lk.Trace.sample(8, mean_output=8, mean_prompt=32, seed=1), lk.Continuous(4), progress=False)  # warm-up
    results = {}
    for name, (trace, num_slots) in traces().items():
        results[name] = compare(engine, cost, trace, num_slots, args.repeats)
        report(name, results[name])
    out = RESULTS / f"twin-{engine.device.type}.json"
    out.write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "cost": str(args.cost.name), "repeats": args.repeats,
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "threads": engine.threads, "torch": torch.__version__},
        "traces": results}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
