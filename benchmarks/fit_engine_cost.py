"""This engine's one price: a CostModel fitted to measured calibration runs, for every lesson.

Runs a calibration trace (mixed prompts, exponential outputs, requests arriving over time)
on the engine under continuous batching with chunked prefill and under static batching
(whose finished rows are computed as padding), and fits one `CostModel` to all their steps:
device terms to the measured device time, host terms to the host time (`CostModel.fit_split`),
judged on held-out steps. The traces of `bench_twin.py`, which checks the model against
fresh runs, are not among them.

With `--save` it writes benchmarks/results/engine-cost.json; lessons load it with
`lk.CostModel.load("../benchmarks/results/engine-cost.json")`. The price is this engine's
on the machine that ran this script (the JSON says which), with the engine's default
threads. Saving a new price changes the lessons' checked outputs: run `make notebooks`
after it. Run: `python benchmarks/fit_engine_cost.py [--save]` (about 15 s on a 2-core CPU).
"""

import argparse
import datetime
import json
import os
import platform
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

import labkit as lk
from labkit.analysis import CostFit
from labkit.engine import Engine

RESULTS = Path(__file__).resolve().parent / "results"
WORK = ("num_prefill_tokens", "num_decode_tokens", "num_kv_tokens", "num_rows", "host_seconds", "device_seconds",
        "step_seconds")


def calibration_trace(seed: int) -> lk.Trace:
    return lk.Trace.sample(96, output="exponential", mean_output=48, prompt="uniform", mean_prompt=96, rate=60.0,
                           seed=seed)


def calibration_policies() -> list:
    return [lk.Continuous(num_slots=16, max_tokens_per_step=256, chunked_prefill=True), lk.Static(num_slots=8)]


def fit_runs(logs: list[lk.StepLog]) -> CostFit:
    """One model for the steps of every log, taken together."""
    arrays = [np.concatenate([getattr(log, name) for log in logs]) for name in WORK]
    return lk.CostModel.fit_split(*arrays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--save", action="store_true", help="write the price to --out, for the lessons")
    parser.add_argument("--out", type=Path, default=RESULTS / "engine-cost.json")
    args = parser.parse_args()
    engine = Engine(device=args.device, seed=0)
    trace = calibration_trace(args.seed)
    engine.run(lk.Trace.sample(8, mean_output=8, mean_prompt=32, seed=args.seed), lk.Continuous(4), progress=False)  # warm-up
    logs = [engine.run(trace, policy, progress=False) for policy in calibration_policies()]
    fit = fit_runs(logs)
    print(fit)
    print(fit.model)
    if not args.save:
        print(f"not saved: --save writes it to {args.out}")
        return
    args.out.write_text(json.dumps({
        "model": asdict(fit.model),
        "fit": {"steps_train": fit.num_train, "steps_test": fit.num_test, "relative_error": fit.relative_error,
                "r2": fit.r2},
        "calibration": {"trace": f"Trace.sample(96, exponential mean 48, uniform prompts mean 96, 60/s, seed={args.seed})",
                        "policies": [repr(p) for p in calibration_policies()], "steps": sum(log.num_steps for log in logs)},
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "device": str(engine.device), "threads": engine.threads, "torch": torch.__version__},
        "date": datetime.date.today().isoformat(),
    }, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
