"""Time `simulate` on the Azure conversation trace (19,366 requests) at 64 slots.

1. Decode-only and backlogged, with Continuous and Static: target 0.5 s or less each.
2. The full model: real prompt lengths and arrival times, a KV pool, a token budget of
   2,048, chunked prefill and the cost model: target 1 s or less. Reported with its step
   count, for a pool of 8,192 blocks (slots bind, nobody is preempted) and one of 4,096
   (blocks bind and requests are preempted thousands of times).

On a 2-core machine. Run: `make bench` (or `python benchmarks/bench_simulate.py --repeat 5`).
"""

import argparse
import time

import labkit as lk


def best_time(trace: lk.Trace, policy, repeat: int, **options) -> tuple[float, lk.StepLog]:
    timings = []
    for _ in range(repeat):
        start = time.perf_counter()
        log = lk.simulate(trace, policy, **options)
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
        report(policy, seconds, log)
    for num_blocks in (8192, 4096):
        full = lk.Continuous(
            args.slots, num_blocks=num_blocks, block_size=16, max_tokens_per_step=2048, chunked_prefill=True
        )
        seconds, log = best_time(lk.Trace.azure_conv(), full, args.repeat, cost=lk.CostModel())
        print(f"full model, real prompts and arrivals, cost=CostModel(): {log.num_preemptions:,} preemptions")
        report(full, seconds, log)


def report(policy, seconds: float, log: lk.StepLog) -> None:
    slot_steps = log.num_slots * log.num_steps
    print(
        f"{policy!r:26} {seconds:6.3f} s  {len(log.trace) / seconds:8,.0f} requests/s  "
        f"{log.num_tokens / seconds / 1e6:5.1f} M tokens/s  {slot_steps / seconds / 1e6:5.1f} M slot-steps/s  "
        f"({log.num_steps:,} steps in {log.num_runs:,} runs, utilization {log.utilization:.1%})"
    )


if __name__ == "__main__":
    main()
