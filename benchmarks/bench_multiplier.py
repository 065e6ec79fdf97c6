"""Multiplier benchmark: a headline speed-up on labkit's engine taken apart into its factors.

One backlogged trace per configuration (every request waiting at t = 0; 8 * B0 requests;
exponential outputs, mean 24, capped at 112; 16-token prompts), served within one KV
memory (`labkit.analysis.multiplier.Memory`): a pool of B0 * 144 tokens, in which a system
without paging reserves 144 tokens a request (BOS + 16 prompt tokens + up to 112 outputs,
rounded up to whole 16-token blocks), so it holds B0 requests; the paged system holds up
to 8 * B0. Five runs on one random Llama (`transformers_llama(ModelConfig(), seed=0)`,
fp32), its weights shared by every system, all fed the engine's prompt ids:

1. HF generate: transformers' `generate` in static batches of B0 (`generate_static`);
2. per-request: labkit's engine with Orca's per-request attention loop, Static(B0);
3. static, continuous, paged: labkit's engine with batched attention, Static(B0),
   Continuous(B0) and Continuous on the paged pool (`Memory.policies`).

`take_apart` turns them into implementation (HF generate -> per-request -> batched),
refill, memory and step-cost factors whose product is HF generate's duration over
paged's (no baseline-batch factor: every baseline runs the B0 its memory allows). The five
alternate, `--repeats` times, each keeping its shortest run; torch is warmed up first.
Printed per configuration: the factor and run tables; the simulator's step-count factors
(`take_apart(trace, memory, lk.simulate)`), which must equal the measured ones; and the
simulator's prediction of static -> paged
with a CostModel fitted to the measured paged run (`lk.multiplier.predict`), and with this
engine's one price (benchmarks/results/engine-cost.json, fitted to other runs by
fit_engine_cost.py), beside the measured. Everything goes to benchmarks/results/multiplier-<device>.json.

Run: `python benchmarks/bench_multiplier.py` (B0 = 8 and 16, 3 repeats; a few minutes on
two CPU cores), or a smoke run: `python benchmarks/bench_multiplier.py --slots 2 --repeats 1
--out /tmp/multiplier.json`.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch

import labkit as lk
from labkit.sched.blocks import num_blocks_for
from labkit.engine import Engine, ModelConfig, TinyGPT
from labkit.engine.device import default_threads
from labkit.engine.peers import generate_static, transformers_llama
from labkit.analysis.multiplier import KINDS, Memory, Multiplier, take_apart

RESULTS = Path(__file__).resolve().parent / "results"
ENGINE_COST = RESULTS / "engine-cost.json"  # this engine's one price, from fit_engine_cost.py
PROMPT_LEN, MEAN_OUTPUT, MAX_OUTPUT, BLOCK = 16, 24, 112, 16
RESERVE = num_blocks_for(1 + PROMPT_LEN + MAX_OUTPUT, BLOCK) * BLOCK  # 144: BOS + prompt + longest output, whole blocks
NAME = "batched"  # the implementation under test: labkit's engine with batched attention
COUNTED = ("baseline batch", "refill", "memory")  # the factors that count steps, equal on every back end


def configuration(slots: int, requests_per_slot: int) -> tuple[lk.Trace, Memory]:
    trace = lk.Trace.sample(requests_per_slot * slots, mean_output=MEAN_OUTPUT, max_output=MAX_OUTPUT, prompt="equal",
                            mean_prompt=PROMPT_LEN, seed=0)
    memory = Memory(pool_tokens=slots * RESERVE, reserve_tokens=RESERVE, max_slots=requests_per_slot * slots,
                    block_size=BLOCK)
    return trace, memory


def measure(trace: lk.Trace, memory: Memory, hf, engines: dict[str, Engine], repeats: int) -> Multiplier:
    """`take_apart` `repeats` times, the five runs alternating; then once more on each run's shortest."""
    prompts = [engines[NAME].prompt_ids(int(rid), int(n)) for rid, n in zip(trace.ids, trace.prompt_lengths)]
    baselines = {
        "HF generate": lambda trace, policy: generate_static(hf, prompts, trace, policy.num_slots),
        "per-request": lambda trace, policy: engines["per-request"].run(trace, policy, progress=False),
    }

    def run(trace, policy):
        return engines[NAME].run(trace, policy, progress=False)

    best: dict = {}
    for repeat in range(repeats):
        with torch.inference_mode():
            measured = take_apart(trace, memory, run, baselines, NAME)
        for name, log in measured.runs.items():
            if name not in best or log.duration < best[name].duration:
                best[name] = log
        print(f"B0 = {memory.num_reserved_slots}, repeat {repeat + 1}/{repeats}: seconds, best so far "
              + ", ".join(f"{name} {log.duration:.2f}" for name, log in best.items()))
    schedules = {repr(policy): name for name, policy in memory.policies().items()}
    return take_apart(trace, memory, lambda trace, policy: best[schedules[repr(policy)]],
                      {name: (lambda trace, policy, name=name: best[name]) for name in baselines}, NAME)


def bench(trace: lk.Trace, memory: Memory, hf, engines: dict[str, Engine], repeats: int) -> dict:
    start = time.perf_counter()
    measured = measure(trace, memory, hf, engines, repeats)
    simulated = take_apart(trace, memory, lk.simulate)
    fit = lk.CostModel.fit(measured.runs["paged"])
    predicted = lk.multiplier.predict(trace, memory, fit.model)
    priced = lk.multiplier.predict(trace, memory, lk.CostModel.load(ENGINE_COST))
    seconds = time.perf_counter() - start

    b0 = memory.num_reserved_slots
    print(f"\nB0 = {b0}: {len(trace)} requests, {int(trace.output_lengths.sum()):,} output tokens; KV pool "
          f"{memory.pool_tokens:,} tokens ({memory.num_blocks} blocks), {memory.reserve_tokens} reserved a request, "
          f"paged up to {memory.max_slots} at once")
    print(measured.factor_table() + "\n\n" + measured.run_table())
    steps_equal = all(measured.factor(kind) == simulated.factor(kind) for kind in COUNTED)
    print("simulate: " + ", ".join(f"{kind} {simulated.factor(kind):.2f}×" for kind in COUNTED)
          + f" (steps {', '.join(f'{n} {log.num_steps}' for n, log in simulated.runs.items())}); "
          f"equal to the measured: {steps_equal}")
    static_over_paged = measured.runs["static"].duration / measured.runs["paged"].duration
    print(f"{fit}\n  {fit.model}")
    for source, prediction in (("with it", predicted), ("with this engine's price", priced)):
        factors = " × ".join(f"{kind} {prediction.factor(kind):.2f}×" for kind in KINDS[1:]
                             if kind != "baseline batch" or prediction.factor(kind) != 1)
        print(f"predicted {source}, static → paged: {factors} = {prediction.total:.2f}×; measured "
              f"{static_over_paged:.2f}× (step cost {measured.factor('step cost'):.2f}×)")
    reference = measured.runs["paged"].outputs
    agree = {name: sum(log.outputs[r] == reference[r] for r in reference) for name, log in measured.runs.items()}
    print("greedy outputs equal to paged's: " + ", ".join(f"{name} {n}/{len(trace)}" for name, n in agree.items()))
    print(f"({seconds:.0f} s)")
    return {
        "requests": len(trace), "output_tokens": int(trace.output_lengths.sum()),
        "memory": {"pool_tokens": memory.pool_tokens, "reserve_tokens": memory.reserve_tokens,
                   "max_slots": memory.max_slots, "block_size": memory.block_size, "B0": b0},
        "factors": {f.name: f.value for f in measured.factors}, "total": measured.total,
        "runs": {name: {"steps": log.num_steps, "duration_s": log.duration, "tokens_per_s": log.tokens_per_second}
                 for name, log in measured.runs.items()},
        "simulated_steps": {name: log.num_steps for name, log in simulated.runs.items()},
        "steps_equal_simulated": steps_equal,
        "predicted": {"refill": predicted.factor("refill"), "memory": predicted.factor("memory"),
                      "step cost": predicted.factor("step cost"), "total": predicted.total,
                      "cost_model": repr(fit.model), "fit_held_out_error": fit.relative_error},
        "predicted_with_engine_price": {"step cost": priced.factor("step cost"), "total": priced.total},
        "measured_static_over_paged": static_over_paged,
        "outputs_equal_to_paged": agree,
        "seconds": seconds,
    }


def warm_up(hf, engines: dict[str, Engine]) -> None:
    """torch's first runs are slow (allocations, kernel choice): one small trace through every system."""
    trace = lk.Trace.sample(8, mean_output=8, prompt="equal", mean_prompt=PROMPT_LEN, seed=1)
    prompts = [engines[NAME].prompt_ids(int(rid), int(n)) for rid, n in zip(trace.ids, trace.prompt_lengths)]
    generate_static(hf, prompts, trace, 4)
    for engine in engines.values():
        for policy in (lk.Static(num_slots=4), lk.Continuous(num_slots=8, num_blocks=64)):
            engine.run(trace, policy, progress=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--slots", type=int, nargs="+", default=[8, 16], help="B0 of each configuration")
    parser.add_argument("--requests-per-slot", type=int, default=8,
                        help="requests per B0, and the paged system's most requests at once per B0")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=default_threads(),
                        help="torch threads for every run, transformers' and labkit's alike (default: labkit's "
                        f"choice on this machine, {default_threads()})")
    parser.add_argument("--out", type=Path, help="the JSON file (default benchmarks/results/multiplier-<device>.json)")
    args = parser.parse_args()
    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    hf = transformers_llama(ModelConfig(), seed=0)
    engines = {name: Engine(model=TinyGPT.from_hf_llama(hf, attention=attention), device=args.device,
                            threads=args.threads)
               for name, attention in (("per-request", "per_request"), (NAME, "batched"))}
    hf.to(engines[NAME].device)
    versions = {name: importlib.metadata.version(name) for name in ("torch", "transformers", "labkit")}
    machine = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
               "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
               "torch_threads": torch.get_num_threads(), "device": str(engines[NAME].device), **versions}
    print(", ".join(f"{k} {v}" for k, v in machine.items()) + f"; default model "
          f"({engines[NAME].model.num_parameters() / 1e6:.2f} M parameters), transformers attention sdpa")
    with torch.inference_mode():
        warm_up(hf, engines)
    results = {}
    for slots in args.slots:
        trace, memory = configuration(slots, args.requests_per_slot)
        results[slots] = bench(trace, memory, hf, engines, args.repeats)
    seconds = time.perf_counter() - start
    print(f"\n{seconds:.0f} s in all")
    out = args.out or RESULTS / f"multiplier-{engines[NAME].device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**machine, "model_config": asdict(ModelConfig()),
                               "args": {**vars(args), "out": str(out)}, "seconds": seconds,
                               "configurations": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
