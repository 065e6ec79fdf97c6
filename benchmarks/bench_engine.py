"""Engine benchmarks: step time by batch size, and measured vs predicted gain.

1. Decode step time and tokens/s at batch sizes 1..64, at a fixed context of 128 tokens.
2. Backlogged exponential traces at 8 and 32 slots, served by Static and Continuous on
   the engine: the measured wall-clock gain (static seconds / continuous seconds) over
   the simulator's predicted slot-step gain (static steps / continuous steps), both
   from the same run. Goal: 0.95 or more.

Results go to benchmarks/results/engine-<device>.json and are summarised on stdout.
Run: `make bench` or `python benchmarks/bench_engine.py --device auto --requests-per-slot 8`.
"""

import argparse
import json
import platform
from pathlib import Path

import torch

import labkit as lk
from labkit.engine import Engine

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
RESULTS = Path(__file__).resolve().parent / "results"


def step_times(engine: Engine, context_len: int) -> dict[int, float]:
    return {b: engine.time_decode_step(b, context_len=context_len, repeats=10) for b in BATCH_SIZES}


def gain_ratio(engine: Engine, num_slots: int, num_requests: int, seed: int) -> dict[str, float]:
    trace = lk.Trace.sample(num_requests, output="exponential", mean_output=32, mean_prompt=16, seed=seed)
    static, continuous = lk.Static(num_slots=num_slots), lk.Continuous(num_slots=num_slots)
    predicted = lk.simulate(trace, static).num_steps / lk.simulate(trace, continuous).num_steps
    runs = {policy: engine.run(trace, policy, progress=False) for policy in (static, continuous)}
    measured = runs[static].duration / runs[continuous].duration
    phases = {repr(p): {k: float(v.sum()) for k, v in log.phase_seconds.items()} for p, log in runs.items()}
    return {"requests": num_requests, "predicted_gain": predicted, "measured_gain": measured,
            "ratio": measured / predicted, "seconds_by_phase": phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--requests-per-slot", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    engine = Engine(device=args.device, seed=args.seed)
    print(f"{engine.device} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), "
          f"TinyGPT {engine.model.num_parameters() / 1e6:.1f} M parameters, torch {torch.__version__}")
    times = step_times(engine, args.context)
    for b, seconds in times.items():
        print(f"B = {b:2}: {1000 * seconds:7.2f} ms per decode step, {b / seconds:8.0f} tokens/s")
    gains = {b: gain_ratio(engine, b, b * args.requests_per_slot, args.seed) for b in (8, 32)}
    for b, g in gains.items():
        print(f"{b:2} slots, {g['requests']} requests: measured gain {g['measured_gain']:.2f}x, "
              f"predicted {g['predicted_gain']:.2f}x, ratio {g['ratio']:.3f} (goal >= 0.95)")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"engine-{engine.device.type}.json"
    out.write_text(json.dumps({"device": str(engine.device), "torch": torch.__version__, "threads": torch.get_num_threads(),
                               "context": args.context, "step_seconds": times, "gains": gains}, indent=2))
    print(f"wrote {out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out}")


if __name__ == "__main__":
    main()
