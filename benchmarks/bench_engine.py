"""Engine benchmarks: what a step costs, by attention layout, batch, context and threads.

1. Decode step time at batch sizes 1..64, context 128, for both attention layouts
   ("batched", the default, and Orca's "per_request" loop), at every thread count from 1 to
   this machine's CPUs: alternating, best of `--repeats`. Goal: batched <= 0.5x per-request
   at B = 32.
2. What a step is made of (GEMMs, attention, everything else) at B = 1, 8 and 32.
3. The context sweep: step time against context at B = 8, and against B at context 1,024.
4. A busy neighbour: the B = 8 step with one core kept busy by another process, as a ratio
   to the idle step, at each thread count. Goal: <= 1.5x at the engine's default.
5. Backlogged exponential traces at 8 and 32 slots under Static and Continuous: the measured
   wall-clock gain over the simulator's predicted slot-step gain. Goal: 0.9 or more.
6. A long-context neighbour: a decode step of seven requests 16..100 tokens deep, without
   and with an eighth 1,500 tokens deep, with decodes grouped by context (the engine) and
   in one padded group (as before grouping). Goal: with / without <= 2.5x, grouped.

Results go to benchmarks/results/engine-<device>.json and are summarised on stdout.
Run: `make bench`, or `python benchmarks/bench_engine.py --device cuda` on a GPU;
`--only long-neighbour` runs section 6 alone and updates its entry in the results file.
"""

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import torch

import labkit as lk
from labkit.engine import Engine, ModelConfig, attention
from labkit.engine.attention import ATTENTION_LAYOUTS
from labkit.engine.device import default_threads
from labkit.engine.timing import ragged_decode_step_seconds

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (64, 128, 256, 512, 1024, 2048)
SHORT_CONTEXTS, LONG_CONTEXT = (16, 30, 44, 58, 72, 86, 100), 1500
RESULTS = Path(__file__).resolve().parent / "results"


def best_of(repeats: int, measure) -> dict:
    """Call `measure()` -> {key: seconds} `repeats` times, alternating inside it; keep each key's minimum."""
    best = {}
    for _ in range(repeats):
        for key, seconds in measure().items():
            best[key] = min(seconds, best.get(key, seconds))
    return best


def layouts(device: str, threads: int, seed: int) -> dict[str, Engine]:
    return {layout: Engine(ModelConfig(attention=layout), device=device, seed=seed, threads=threads)
            for layout in ATTENTION_LAYOUTS}


def step_times(engines: dict[str, Engine], repeats: int) -> dict[str, dict[int, float]]:
    """Decode step seconds by layout and batch size, context 128."""
    best = best_of(repeats, lambda: {(layout, b): engine.time_decode_step(b, 128, repeats=10)
                                     for b in BATCH_SIZES for layout, engine in engines.items()})
    return {layout: {b: best[layout, b] for b in BATCH_SIZES} for layout in engines}


def fastest_parts(engine: Engine, batch_size: int, repeats: int) -> dict[str, float]:
    """The parts of the fastest of `repeats` measured steps (their split is taken from one measurement)."""
    return min((engine.decode_step_parts(batch_size, 128, repeats=10) for _ in range(repeats)), key=lambda p: p["step"])


def context_sweep(engine: Engine, repeats: int) -> dict[str, dict[int, float]]:
    by_context = best_of(repeats, lambda: {c: engine.time_decode_step(8, c, repeats=5) for c in CONTEXTS})
    by_batch = best_of(repeats, lambda: {b: engine.time_decode_step(b, 1024, repeats=5) for b in BATCH_SIZES})
    return {"B = 8, by context": by_context, "context 1024, by B": by_batch}


def busy_neighbour(device: str, seed: int, max_threads: int, repeats: int) -> dict[int, dict[str, float]]:
    """B = 8 decode step, idle and with one core kept busy by another process, per thread count."""
    engines = {n: Engine(device=device, seed=seed, threads=n) for n in range(1, max_threads + 1)}

    def measure():
        return best_of(repeats, lambda: {n: e.time_decode_step(8, 128, repeats=10) for n, e in engines.items()})

    idle = measure()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        busy = measure()
    finally:
        spinner.kill()
    return {n: {"idle": idle[n], "busy": busy[n], "busy / idle": busy[n] / idle[n]} for n in engines}


def gain_ratio(engine: Engine, num_slots: int, num_requests: int, seed: int) -> dict:
    trace = lk.Trace.sample(num_requests, output="exponential", mean_output=32, mean_prompt=16, seed=seed)
    static, continuous = lk.Static(num_slots=num_slots), lk.Continuous(num_slots=num_slots)
    predicted = lk.simulate(trace, static).num_steps / lk.simulate(trace, continuous).num_steps
    runs = {policy: engine.run(trace, policy, progress=False) for policy in (static, continuous)}
    measured = runs[static].duration / runs[continuous].duration
    phases = {repr(p): {k: float(v.sum()) for k, v in log.phase_seconds.items()} for p, log in runs.items()}
    return {"requests": num_requests, "predicted_gain": predicted, "measured_gain": measured,
            "ratio": measured / predicted, "seconds_by_phase": phases}


def long_neighbour(engine: Engine, repeats: int) -> dict[str, dict[str, float]]:
    """Decode step seconds of the short requests without and with the long one, by decode grouping."""
    steps = {"without": list(SHORT_CONTEXTS), "with": [*SHORT_CONTEXTS, LONG_CONTEXT]}
    groupings = {"grouped by context": attention.MAX_WASTE, "one group": math.inf}  # no waste bound: one group

    def measure():
        times = {}
        for grouping, max_waste in groupings.items():
            with mock.patch.object(attention, "MAX_WASTE", max_waste):
                times.update({(grouping, step): ragged_decode_step_seconds(engine, contexts, repeats=10)
                              for step, contexts in steps.items()})
        return times

    best = best_of(repeats, measure)
    return {grouping: {step: best[grouping, step] for step in steps} | {
        "with / without": best[grouping, "with"] / best[grouping, "without"]} for grouping in groupings}


def print_long_neighbour(result: dict) -> None:
    print(f"\ndecode step of {len(SHORT_CONTEXTS)} requests {SHORT_CONTEXTS[0]}..{SHORT_CONTEXTS[-1]} tokens deep, "
          f"without and with one {LONG_CONTEXT} deep:")
    for grouping, r in result.items():
        print(f"  {grouping:18}: without {ms(r['without'])} ms, with {ms(r['with'])} ms, {r['with / without']:.2f}x")
    print("  goal: grouped by context <= 2.5x")


def ms(seconds: float) -> str:
    return f"{1000 * seconds:7.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--requests-per-slot", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=["long-neighbour"], help="run this section alone")
    args = parser.parse_args()
    engine = Engine(device=args.device, seed=args.seed)
    out = RESULTS / f"engine-{engine.device.type}.json"
    if args.only:
        long = long_neighbour(engine, args.repeats)
        print_long_neighbour(long)
        results = json.loads(out.read_text()) if out.exists() else {}
        date = datetime.datetime.now().isoformat(timespec="seconds")
        out.write_text(json.dumps(results | {"long_neighbour": long | {"date": date}}, indent=2))
        print(f"\nwrote {out}")
        return
    cpus = len(os.sched_getaffinity(0))
    machine = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": str(engine.device),
               "processor": platform.processor() or platform.machine(), "cpus": cpus,
               "default_threads": default_threads(), "torch": torch.__version__, "cuda_graphs": engine.cuda_graphs}
    print(", ".join(f"{k} {v}" for k, v in machine.items())
          + f"; TinyGPT {engine.model.num_parameters() / 1e6:.1f} M parameters")
    thread_counts = range(1, cpus + 1) if engine.device.type == "cpu" else [engine.threads]

    times = {n: step_times(layouts(args.device, n, args.seed), args.repeats) for n in thread_counts}
    for n, by_layout in times.items():
        print(f"\n{n} thread(s), decode step ms at context 128:  B " + " ".join(f"{b:7}" for b in BATCH_SIZES))
        for layout, by_batch in by_layout.items():
            print(f"  {layout:12}" + " " * 23 + " ".join(ms(by_batch[b]) for b in BATCH_SIZES))
        ratio = by_layout["batched"][32] / by_layout["per_request"][32]
        print(f"  batched / per_request at B = 32: {ratio:.2f} (goal <= 0.5)")

    parts = {layout: {b: fastest_parts(e, b, args.repeats) for b in (1, 8, 32)}
             for layout, e in layouts(args.device, engine.threads, args.seed).items()}
    print(f"\nWhat a decode step is made of, ms at context 128, {engine.threads} thread(s):")
    for layout, by_batch in parts.items():
        for b, p in by_batch.items():
            print(f"  {layout:12} B = {b:2}: " + ", ".join(f"{k} {1000 * v:.2f}" for k, v in p.items()))

    sweep = context_sweep(engine, args.repeats)
    for name, values in sweep.items():
        print(f"\nstep ms, {name}: " + ", ".join(f"{k}: {1000 * v:.2f}" for k, v in values.items()))

    neighbour = {}
    if engine.device.type == "cpu":
        neighbour = busy_neighbour(args.device, args.seed, cpus, args.repeats)
        print("\nB = 8 step with one core kept busy by another process:")
        for n, r in neighbour.items():
            print(f"  {n} thread(s): idle {ms(r['idle'])} ms, busy {ms(r['busy'])} ms, {r['busy / idle']:.2f}x")
        default = neighbour[engine.threads]["busy"] / min(r["idle"] for r in neighbour.values())
        print(f"  the default ({engine.threads} thread(s)) busy, against the fastest idle step: {default:.2f}x")

    gains = {b: gain_ratio(engine, b, b * args.requests_per_slot, args.seed) for b in (8, 32)}
    for b, g in gains.items():
        print(f"\n{b:2} slots, {g['requests']} requests: measured gain {g['measured_gain']:.2f}x, "
              f"predicted {g['predicted_gain']:.2f}x, ratio {g['ratio']:.3f} (goal >= 0.9)")

    long = long_neighbour(engine, args.repeats)
    print_long_neighbour(long)

    RESULTS.mkdir(exist_ok=True)
    out.write_text(json.dumps({**machine, "step_seconds": times, "step_parts": parts, "context_sweep": sweep,
                               "busy_neighbour": neighbour, "gains": gains, "long_neighbour": long}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
