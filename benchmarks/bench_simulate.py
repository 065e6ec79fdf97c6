"""Time `simulate` on the Azure conversation trace (19,366 requests) at 64 slots.

1. Decode-only and backlogged, with Continuous and Static.
2. The full model: real prompt lengths and arrival times, a KV pool, a token budget of
   2,048, chunked prefill and the cost model. Reported with its step count, for a pool
   of 8,192 blocks (slots bind, nobody is preempted) and one of 4,096 (blocks bind and
   requests are preempted thousands of times).
3. The same, step by step (`fast_forward=False`): the plain loop a student reads, which
   asks the policy before every step.

With `--baseline DIR` each case also runs on the labkit found in DIR (a checkout of an
older commit), in fresh processes that take turns with this one's, and the table gives
the ratio of the two best times. That is how a change to the scheduler core is held to a
speed budget. Results go to benchmarks/results/simulate-cpu.json with `--save`.

On a 2-core machine. Run: `make bench` (or `python benchmarks/bench_simulate.py --repeat 5`).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import labkit as lk

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "simulate-cpu.json"
SLOTS = 64


def full_model(num_blocks: int):
    return lk.Continuous(SLOTS, num_blocks=num_blocks, block_size=16, max_tokens_per_step=2048, chunked_prefill=True)


CASES = {  # name -> (trace, policy, simulate options), built when run
    "continuous, decode-only": lambda: (lk.Trace.azure_conv().backlogged(), lk.Continuous(SLOTS), {}),
    "static, decode-only": lambda: (lk.Trace.azure_conv().backlogged(), lk.Static(SLOTS), {}),
    "full model, 8,192 blocks": lambda: (lk.Trace.azure_conv(), full_model(8192), {"cost": lk.CostModel()}),
    "full model, 4,096 blocks": lambda: (lk.Trace.azure_conv(), full_model(4096), {"cost": lk.CostModel()}),
}
PLAIN_CASES = ("continuous, decode-only", "full model, 4,096 blocks")  # also timed step by step


def run_case(name: str, fast_forward: bool = True) -> tuple[float, lk.StepLog]:
    trace, policy, options = CASES[name]()
    if not fast_forward:
        options = {**options, "fast_forward": False}
    start = time.perf_counter()
    log = lk.simulate(trace, policy, **options)
    return time.perf_counter() - start, log


def seconds_in_fresh_process(name: str, labkit_dir: Path) -> float:
    """One timed run of case `name` in a new interpreter that imports labkit from `labkit_dir`."""
    env = {**os.environ, "PYTHONPATH": str(labkit_dir)}
    result = subprocess.run([sys.executable, __file__, "--one-case", name], env=env, check=True,
                            capture_output=True, text=True)
    return float(result.stdout.split()[-1])


def report(name: str, seconds: float, log: lk.StepLog) -> str:
    return (f"{name:26} {seconds:6.3f} s  {len(log.trace) / seconds:8,.0f} requests/s  "
            f"{log.num_output_tokens / seconds / 1e6:5.1f} M tokens/s  ({log.num_steps:,} steps in {log.num_runs:,} runs, "
            f"{log.num_preemptions:,} preemptions, utilization {log.utilization:.1%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="a checkout of an older labkit to compare with")
    parser.add_argument("--save", action="store_true", help=f"write the results to {RESULTS.relative_to(ROOT)}")
    parser.add_argument("--one-case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_case:
        print(run_case(args.one_case)[0])
        return
    print(f"best of {args.repeat} runs, {SLOTS} slots, Azure conversation trace")
    results = {}
    for name in CASES:
        best, log = min((run_case(name) for _ in range(args.repeat)), key=lambda run: run[0])
        results[name] = {"seconds": best, "steps": log.num_steps, "runs": log.num_runs}
        print(report(name, best, log))
        if name in PLAIN_CASES:
            plain, _ = run_case(name, fast_forward=False)
            results[name]["plain_seconds"] = plain
            print(f"{'':26} {plain:6.3f} s step by step (fast_forward=False): {plain / best:.0f}x slower")
    if args.baseline:
        compare(results, args.baseline.resolve(), args.repeat)
    if args.save:
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")


def compare(results: dict, baseline: Path, repeat: int) -> None:
    """Time every case here and in `baseline`, taking turns in fresh processes; print the ratios."""
    print(f"\nagainst the labkit in {baseline.name}, fresh processes taking turns, best of {repeat}:")
    for name, result in results.items():
        times = {"this": [], "baseline": []}
        for _ in range(repeat):
            times["this"].append(seconds_in_fresh_process(name, ROOT))
            times["baseline"].append(seconds_in_fresh_process(name, baseline))
        this, before = min(times["this"]), min(times["baseline"])
        result.update(this_fresh_seconds=this, baseline_seconds=before, ratio=this / before)
        print(f"{name:26} {this:6.3f} s here, {before:6.3f} s before: {this / before:4.2f}x the time")


if __name__ == "__main__":
    main()
