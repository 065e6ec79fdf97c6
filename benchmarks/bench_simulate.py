"""Time `simulate` on the Azure conversation trace (19,366 requests, decode-only, backlogged).

Target: 0.5 s or less per policy at 64 slots on a 2-core machine. Run: `make bench`
(or `python benchmarks/bench_simulate.py --repeat 5 --slots 64`).
"""

import argparse
import time

import labkit as lk


def best_time(trace: lk.Trace, policy, repeat: int) -> tuple[float, lk.StepLog]:
    timings = []
    for _ in range(repeat):
        start = time.perf_counter()
        log = lk.simulate(trace, policy)
        timings.append(time.perf_counter() - start)
    return min(timings), log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--slots", type=int, default=64)
    args = parser.parse_args()
    trace = lk.Trace.azure_conv().backlogged()
    print(f"{trace}; best of {args.repeat} runs")
    for policy in (lk.Continuous(num_slots=args.slots), lk.Static(num_slots=args.slots)):
        seconds, log = best_time(trace, policy, args.repeat)
        slot_steps = log.num_slots * log.num_steps
        print(
            f"{policy!r:26} {seconds:6.3f} s  {len(trace) / seconds:8,.0f} requests/s  "
            f"{log.num_tokens / seconds / 1e6:5.1f} M tokens/s  {slot_steps / seconds / 1e6:5.1f} M slot-steps/s  "
            f"({log.num_steps:,} steps, utilization {log.utilization:.1%})"
        )


if __name__ == "__main__":
    main()
