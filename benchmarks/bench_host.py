"""Host benchmarks: when the CPU shows, and what overlap scheduling hides.

1. The two-lane simulation: 2 ms of host and 5 ms of device work give a 7 ms step with
   the device idle 2/7 of the time, and a 5 ms step with overlap, 1.4x the throughput.
   Goal: exactly these numbers.
2. The engine's host share of decode-step time at B = 8, 32 and 64, with overlap off and
   on, alternating (`decode_steps`): the host and device ms per decode step (the device's
   measured in the overlapped run too), the device's idle share, and the speed-up against
   the arithmetic (host + device) / max(host, device).
   Goal on CUDA (when measured): an overlapped step within 5% of the device's at B = 32.
3. What the host's work holds, and what overlap then buys (`host_work`): TinyGPT at B = 8
   with 2 ms of extra host work a step (`Engine(extra_host_seconds=0.002)`) of four kinds,
   plain and overlapped: busy Python (a core and the interpreter lock held), busy native
   code (a core held, the lock released), a sleep that keeps the lock (the lock held, no
   core) and a plain sleep (neither). Each kind keeps its speed-up in every round
   (`speedups`; rounds alternate the kinds, and which of a kind's two runs goes first) and,
   from its median round, five decode steps' lanes taking turns and overlapped (`lanes`: the
   window whose device idle share is the median of the run's windows), for lesson 08 to draw.
4. The host's time per decode step at scale (`decode_host`): TinyGPT taking turns at B = 8
   to 1,024, the median host and device ms of its decode steps, the run with the lowest
   host time of the repeats. Lesson 08 fits host = a + b B over this range.
5. CostModel.fit with host terms on an engine run: its error on held-out steps, and on
   every step of another run it never saw. Goal: within 15%.
6. labkit's own scheduler: CPU time of `policy.schedule` against running and waiting requests.

Results go to benchmarks/results/host-<device>.json and are summarised on stdout; "runs"
records when each section ran, the machine's load average then and the run's niceness (run
it with `nice -n -19` on a machine other programs share, so that they wait for it, not it
for them). `--sections` measures only some sections and keeps the others from the saved file.
Run: `make bench`, or `python benchmarks/bench_host.py --device cuda` on a GPU.
"""

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

import labkit as lk
from labkit.analysis.host import schedule_seconds
from labkit.analysis.lanes import Lanes, overlap_speedup, two_lanes
from labkit.engine import Engine
from labkit.engine.model_runner import busy_native, busy_python, sleep_holding_lock

RESULTS = Path(__file__).resolve().parent / "results"
BATCH_SIZES = (8, 32, 64)
HOST_WORK = {"busy Python": busy_python, "busy native": busy_native,  # holds a core and the lock; a core
             "sleep, lock held": sleep_holding_lock, "sleep": time.sleep}  # the lock; neither
EXTRA_HOST_SECONDS = 0.002
SCALE_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
SECTIONS = ("two_lanes", "decode_steps", "host_work", "decode_host", "fit", "schedule_seconds")


def two_lane_check() -> dict:
    plain, overlapped = (two_lanes(2.0, 5.0, 100, overlap) for overlap in (False, True))
    result = {"step_ms": plain.step_period, "device_idle": plain.device_idle_fraction,
              "overlapped_step_ms": overlapped.step_period, "speedup": plain.step_period / overlapped.step_period,
              "speedup_formula": overlap_speedup(2.0, 5.0)}
    print(f"two lanes, 2 ms host + 5 ms device: step {result['step_ms']} ms, device idle "
          f"{result['device_idle']:.4f} (2/7 = {2 / 7:.4f}); overlapped step {result['overlapped_step_ms']} ms, "
          f"{result['speedup']}x")
    return result


def decode_trace(batch_size: int, output_len: int) -> lk.Trace:
    return lk.Trace.from_lengths([output_len] * batch_size, [16] * batch_size)


def decode_steps(log) -> dict:
    """Per decode step (no prompt tokens): median step, host and device ms, and the idle share."""
    decode = log.num_prefill_tokens == 0
    step, host, device = (np.asarray(a)[decode] for a in (log.step_seconds, log.host_seconds, log.device_seconds))
    return {"step_ms": 1e3 * float(np.median(step)), "host_ms": 1e3 * float(np.median(host)),
            "device_ms": 1e3 * float(np.median(device)), "host_share": float(host.sum() / step.sum()),
            "device_idle": float(1 - device.sum() / step.sum())}


def best_runs(engines: dict, traces: dict, repeats: int) -> dict:
    """{(trace key, engine key): decode_steps of the run with the shortest median step}, over
    `repeats` rounds in which every engine runs every trace, alternating."""
    best: dict = {}
    for _ in range(repeats):
        for trace_key, trace in traces.items():
            for engine_key, engine in engines.items():
                measured = decode_steps(engine.run(trace, lk.Continuous(num_slots=len(trace)), progress=False))
                key = (trace_key, engine_key)
                if key not in best or measured["step_ms"] < best[key]["step_ms"]:
                    best[key] = measured
    return best


def overlap_result(plain: dict, overlapped: dict) -> dict:
    return {"plain": plain, "overlap": overlapped, "speedup": plain["step_ms"] / overlapped["step_ms"],
            "arithmetic": overlap_speedup(plain["host_ms"], plain["device_ms"])}


def print_overlap(label: str, result: dict) -> None:
    plain, overlapped = result["plain"], result["overlap"]
    print(f"{label}: plain step {plain['step_ms']:.2f} ms (host {plain['host_ms']:.2f}, device "
          f"{plain['device_ms']:.2f}, device idle {plain['device_idle']:.1%}); overlapped step "
          f"{overlapped['step_ms']:.2f} ms (device {overlapped['device_ms']:.2f}, "
          f"idle {overlapped['device_idle']:.1%}); {result['speedup']:.2f}x, "
          f"the arithmetic {result['arithmetic']:.2f}x")


def host_shares(device: str, threads: int | None, output_len: int, repeats: int) -> dict:
    """TinyGPT's decode steps at each batch size, plain and overlapped."""
    engines = {overlap: Engine(device=device, threads=threads, overlap=overlap) for overlap in (False, True)}
    best = best_runs(engines, {b: decode_trace(b, output_len) for b in BATCH_SIZES}, repeats)
    results = {}
    for b in BATCH_SIZES:
        results[b] = overlap_result(best[b, False], best[b, True])
        print_overlap(f"TinyGPT, B = {b:2}", results[b])
    return {"TinyGPT": results}


def host_work(device: str, threads: int | None, output_len: int, repeats: int) -> dict:
    """TinyGPT at B = 8 with EXTRA_HOST_SECONDS of each kind of host work, plain and overlapped,
    in `repeats` rounds that alternate the kinds: each number the median over the rounds, the
    speed-up of every round, and the lanes of the median round."""
    trace = decode_trace(8, output_len)
    engines = {(kind, overlap): Engine(device=device, threads=threads, overlap=overlap,
                                       extra_host_seconds=EXTRA_HOST_SECONDS, extra_host_work=work)
               for kind, work in HOST_WORK.items() for overlap in (False, True)}
    rounds = {kind: [] for kind in HOST_WORK}  # kind -> [(overlap_result, plain log, overlapped log)]
    for round_index in range(repeats):
        order = (False, True) if round_index % 2 == 0 else (True, False)  # plain first in every other round
        for kind in HOST_WORK:
            by_overlap = {overlap: engines[kind, overlap].run(trace, lk.Continuous(num_slots=8), progress=False)
                          for overlap in order}
            logs = [by_overlap[False], by_overlap[True]]
            rounds[kind].append((overlap_result(*(decode_steps(log) for log in logs)), *logs))
    results = {}
    for kind, runs in rounds.items():
        measured = [run for run, *_ in runs]
        median = {lane: {name: float(np.median([run[lane][name] for run in measured])) for name in measured[0][lane]}
                  for lane in ("plain", "overlap")}
        speedups = [run["speedup"] for run in measured]
        _, *median_logs = runs[int(np.argsort(speedups)[len(speedups) // 2])]
        results[kind] = {**median, "speedup": float(np.median(speedups)), "speedups": speedups,
                         "speedup_range": [min(speedups), max(speedups)],
                         "arithmetic": overlap_speedup(median["plain"]["host_ms"], median["plain"]["device_ms"]),
                         "lanes": {mode: median_window(log) for mode, log in zip(("plain", "overlap"), median_logs)}}
        print_overlap(f"B = 8, +{EXTRA_HOST_SECONDS * 1e3:g} ms {kind}, medians of {repeats}", results[kind])
    return results


def median_window(log, num_steps: int = 5) -> dict:
    """The lanes of `num_steps` consecutive decode steps of `log`, in seconds: of every such
    window, the one whose device idle share is the median."""
    decode = np.flatnonzero(log.num_prefill_tokens == 0)
    windows = [Lanes.from_log(log, num_steps, first) for first in range(decode[0], decode[-1] - num_steps + 2)]
    lanes = windows[int(np.argsort([w.device_idle_fraction for w in windows])[len(windows) // 2])]
    return {"host": lanes.host.tolist(), "device": lanes.device.tolist()}


def decode_host(device: str, threads: int | None, repeats: int) -> dict:
    """TinyGPT's host and device ms per decode step, taking turns, from B = 8 to 1,024: of
    `repeats` runs, the one with the lowest median host time."""
    engine = Engine(device=device, threads=threads)
    results = {}
    for b in SCALE_SIZES:
        runs = [decode_steps(engine.run(decode_trace(b, 16), lk.Continuous(num_slots=b), progress=False))
                for _ in range(repeats)]
        results[b] = min(runs, key=lambda run: run["host_ms"])
        print(f"decode host, B = {b:4}: host {results[b]['host_ms']:.3f} ms, device {results[b]['device_ms']:.2f} ms")
    return results


def fit_check(device: str, threads: int | None) -> dict:
    engine = Engine(device=device, threads=threads)
    policy = lk.Continuous(num_slots=16, max_tokens_per_step=256, chunked_prefill=True)

    def traffic(seed: int) -> lk.Trace:
        return lk.Trace.sample(48, output="exponential", mean_output=24, prompt="uniform", mean_prompt=96,
                               rate=40.0, seed=seed)

    engine.run(traffic(0), policy, progress=False)  # warm up: the first run's allocations are outliers
    fit = lk.CostModel.fit(engine.run(traffic(1), policy, progress=False))
    other = engine.run(traffic(2), policy, progress=False)
    predicted = fit.model.step_seconds(other.num_prefill_tokens, other.num_decode_tokens, other.num_kv_tokens,
                                       other.num_rows)
    other_error = float(np.abs(predicted - other.step_seconds).mean() / other.step_seconds.mean())
    print(f"{fit}; on another run's {other.num_steps} steps: {other_error:.1%}")
    print(f"  {fit.model}")
    return {"held_out_error": fit.relative_error, "other_run_error": other_error, "num_train": fit.num_train,
            "model": repr(fit.model)}


def scheduler_cost() -> dict:
    policies = {"Continuous": lk.Continuous(num_slots=1),
                "Continuous, KV pool and budget": lk.Continuous(num_slots=1, num_blocks=64, max_tokens_per_step=2048,
                                                                chunked_prefill=True),
                "Static": lk.Static(num_slots=1)}
    results = {}
    for name, policy in policies.items():
        results[name] = {f"{running} running, {waiting} waiting": schedule_seconds(policy, running, waiting)
                         for running in (8, 64, 256, 1024) for waiting in (0, 1024)}
        print(f"policy.schedule, {name}: " + ", ".join(f"{k} {1e6 * v:.1f} us" for k, v in results[name].items()))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's)")
    parser.add_argument("--output-len", type=int, default=48, help="decode steps per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="measure only these; keep the others from the saved results")
    args = parser.parse_args()
    engine = Engine(device=args.device, threads=args.threads)
    machine = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": str(engine.device),
               "processor": platform.processor() or platform.machine(), "threads": engine.threads,
               "torch": torch.__version__, "cuda_graphs": engine.cuda_graphs}
    print(", ".join(f"{k} {v}" for k, v in machine.items()))
    measure = {"two_lanes": two_lane_check,
               "decode_steps": lambda: host_shares(args.device, args.threads, args.output_len, args.repeats),
               "host_work": lambda: host_work(args.device, args.threads, args.output_len, args.repeats),
               "decode_host": lambda: decode_host(args.device, args.threads, args.repeats),
               "fit": lambda: fit_check(args.device, args.threads),
               "schedule_seconds": scheduler_cost}
    out = RESULTS / f"host-{engine.device.type}.json"
    saved = json.loads(out.read_text()) if out.exists() and set(args.sections) != set(SECTIONS) else {}
    kept = [name for name in SECTIONS if name in saved and name not in args.sections]
    runs = {name: saved.get("runs", {}).get(name, {"date": saved["date"]}) for name in kept}
    sections = {name: saved[name] for name in kept}
    for name in args.sections:
        runs[name] = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                      "load_average": round(os.getloadavg()[0], 2), "niceness": os.nice(0)}
        sections[name] = measure[name]()
    RESULTS.mkdir(exist_ok=True)
    results = {**machine, "runs": {name: runs[name] for name in SECTIONS if name in runs},
               **{name: sections[name] for name in SECTIONS if name in sections}}
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
