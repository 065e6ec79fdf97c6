"""Peers benchmark: labkit's engine against transformers, same trace, same weights, one process.

Four ways to serve one backlogged trace (exponential outputs, mean 24 tokens; 16-token
prompts; every request waiting at t = 0) with one random Llama (`torch.manual_seed(0)`, fp32):

1. HF generate: transformers `generate` in static batches of B in trace order, greedy, each
   batch running to its longest output (finished rows are computed anyway, as HF does);
2. HF continuous: transformers' own continuous batching (the manager of
   `continuous_batching_context_manager`), at most B requests per step, each request with its
   own `max_new_tokens` (which `generate_batch` cannot give: it takes one for all);
3. labkit Static(B) and 4. labkit Continuous(B), on labkit's engine with the same weights.

Every system is fed the same ids (BOS, then the engine's prompt) and emits exactly each
request's output length (no EOS). The four alternate, each keeping its best of `--repeats`
runs by useful tokens/s: the sum of output lengths over the wall seconds of the whole trace.
TTFT counts from t = 0; ITL pools the gaps between consecutive tokens of a request. HF
generate's per-step times come from a streamer, HF continuous's from `record_timestamps`,
labkit's from its StepLog. Printed per B, with the simulator's predicted Continuous/Static
gain (static slot-steps / continuous slot-steps); everything goes to
benchmarks/results/peers-<device>.json.

Run: `python benchmarks/bench_peers.py` (48 requests at B = 8, 192 at B = 32, 3 repeats), or a
smoke run: `python benchmarks/bench_peers.py --model-config tiny --batch-sizes 2 --requests-per-slot 2
--mean-output 4 --repeats 1 --out /tmp/peers.json`.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

import labkit as lk
from labkit.sched.blocks import num_blocks_for
from labkit.engine import Engine, ModelConfig, TinyGPT
from labkit.engine.attention import ATTENTION_LAYOUTS
from labkit.engine.device import default_threads
from labkit.engine.peers import PAD, generate_static, transformers_llama

RESULTS = Path(__file__).resolve().parent / "results"
MODEL_CONFIGS = {
    "default": ModelConfig(),
    "tiny": ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64),
}
PAGE_SIZE = 16  # HF continuous batching's page size, labkit's default block_size


@dataclass
class Run:
    """One served trace: its wall time, every TTFT and ITL gap (s), and each request's tokens."""

    tokens_per_second: float
    ttft: np.ndarray
    itl: np.ndarray
    outputs: dict[int, list[int]] = field(repr=False)

    def summary(self) -> dict[str, float]:
        p = lk.metrics.percentile
        return {"tokens/s": self.tokens_per_second, "TTFT p50 (s)": p(self.ttft, 50), "TTFT p99 (s)": p(self.ttft, 99),
                "ITL p50 (ms)": 1000 * p(self.itl, 50), "ITL p99 (ms)": 1000 * p(self.itl, 99)}


def hf_generate(model, prompts: list[list[int]], trace: lk.Trace, batch_size: int) -> Run:
    """Static batches in trace order, left-padded, each run for its longest output (`generate_static`)."""
    log = generate_static(model, prompts, trace, batch_size)
    return Run(log.tokens_per_second, log.ttft, lk.metrics.itl(log), log.outputs)


def hf_continuous(model, prompts: list[list[int]], trace: lk.Trace, batch_size: int) -> Run:
    """transformers' continuous batching with at most `batch_size` requests per step, a KV pool as
    large as labkit's, a token budget that admits B whole prompts at once, and no prefix sharing."""
    longest = max(len(p) + int(n) for p, n in zip(prompts, trace.output_lengths))
    config = ContinuousBatchingConfig(
        max_requests_per_batch=batch_size, page_size=PAGE_SIZE, num_blocks=batch_size * num_blocks_for(longest, PAGE_SIZE),
        max_batch_tokens=batch_size * max(map(len, prompts)), allow_block_sharing=False, safety_margin=0.0,
        auto_switch_to_flash=False,
    )
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=PAD)
    results = {}
    with model.continuous_batching_context_manager(generation, continuous_batching_config=config, warmup=False) as cb:
        with cb.pause():  # the loop parks once its cache exists; every request then joins its first step
            start = time.perf_counter()
            for rid, ids, n in zip(trace.ids, prompts, trace.output_lengths):
                cb.add_request(ids, request_id=str(rid), max_new_tokens=int(n), record_timestamps=True, eos_token_id=-1)
        while len(results) < len(trace):
            result = cb.get_result(timeout=600)
            if result is None or result.error:
                raise RuntimeError(f"HF continuous batching failed: {result.error if result else 'no result'}")
            if result.is_finished():
                results[int(result.request_id)] = result
        seconds = time.perf_counter() - start
    stamps = [np.array(results[int(rid)].timestamps) - start for rid in trace.ids]
    return Run(int(trace.output_lengths.sum()) / seconds, np.array([s[0] for s in stamps]),
               np.concatenate([np.diff(s) for s in stamps]), {r: out.generated_tokens for r, out in results.items()})


def labkit_run(engine: Engine, trace: lk.Trace, policy) -> Run:
    """The StepLog's clock: wall time from the first step's start to the last step's end (the
    KV pool's allocation excluded, as for HF continuous, whose clock starts once its cache exists)."""
    log = engine.run(trace, policy, progress=False)
    return Run(log.tokens_per_second, log.ttft, lk.metrics.itl(log), log.outputs)


def bench(model, engine: Engine, trace: lk.Trace, batch_size: int, repeats: int) -> dict:
    """Best of `repeats` for each of the four, alternating; their summaries, ratios and agreement."""
    prompts = [engine.prompt_ids(int(rid), int(n)) for rid, n in zip(trace.ids, trace.prompt_lengths)]
    systems = {
        "HF generate": lambda: hf_generate(model, prompts, trace, batch_size),
        "HF continuous": lambda: hf_continuous(model, prompts, trace, batch_size),
        "labkit Static": lambda: labkit_run(engine, trace, lk.Static(num_slots=batch_size)),
        "labkit Continuous": lambda: labkit_run(engine, trace, lk.Continuous(num_slots=batch_size)),
    }
    best: dict[str, Run] = {}
    for repeat in range(repeats):
        with torch.inference_mode():
            for name, serve in systems.items():
                run = serve()
                if name not in best or run.tokens_per_second > best[name].tokens_per_second:
                    best[name] = run
        print(f"B = {batch_size}, repeat {repeat + 1}/{repeats}: tokens/s best so far "
              + ", ".join(f"{name} {run.tokens_per_second:,.0f}" for name, run in best.items()))
    speed = {name: run.tokens_per_second for name, run in best.items()}
    predicted = (lk.simulate(trace, lk.Static(num_slots=batch_size)).num_steps
                 / lk.simulate(trace, lk.Continuous(num_slots=batch_size)).num_steps)
    measured = speed["labkit Continuous"] / speed["labkit Static"]
    reference = best["labkit Continuous"].outputs
    return {
        "requests": len(trace), "runs": {name: run.summary() for name, run in best.items()},
        "labkit Static / HF generate": speed["labkit Static"] / speed["HF generate"],
        "labkit Continuous / HF continuous": speed["labkit Continuous"] / speed["HF continuous"],
        "labkit Continuous / Static": measured, "predicted slot-step gain": predicted,
        "measured / predicted gain": measured / predicted,
        "outputs equal to labkit Continuous": {
            name: sum(run.outputs[r] == reference[r] for r in reference) for name, run in best.items()},
    }


def report(batch_size: int, result: dict) -> None:
    hf = result["runs"]["HF generate"]["tokens/s"]
    header = ["run", "useful tok/s", "x HF generate", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms", "ITL p99 ms"]
    rows = [[name, f"{s['tokens/s']:,.0f}", f"{s['tokens/s'] / hf:.2f}", f"{s['TTFT p50 (s)']:.3f}",
             f"{s['TTFT p99 (s)']:.3f}", f"{s['ITL p50 (ms)']:.2f}", f"{s['ITL p99 (ms)']:.2f}"]
            for name, s in result["runs"].items()]
    print(f"\nB = {batch_size}, {result['requests']} requests\n" + lk.metrics.format_table(header, rows))
    for key in ("labkit Static / HF generate", "labkit Continuous / HF continuous"):
        print(f"{key + ':':36} {result[key]:.2f}")
    print(f"{'labkit Continuous / Static:':36} {result['labkit Continuous / Static']:.2f} measured, "
          f"{result['predicted slot-step gain']:.2f} predicted (slot steps), "
          f"ratio {result['measured / predicted gain']:.3f}")
    agree = result["outputs equal to labkit Continuous"]
    print("greedy outputs equal to labkit Continuous's: "
          + ", ".join(f"{name} {n}/{result['requests']}" for name, n in agree.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model-config", choices=MODEL_CONFIGS, default="default")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--requests-per-slot", type=int, default=6)
    parser.add_argument("--mean-output", type=float, default=24)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=default_threads(),
                        help="torch threads for every run, transformers' and labkit's alike (default: labkit's "
                        f"choice on this machine, {default_threads()})")
    parser.add_argument("--hf-attention", choices=["sdpa", "eager"], default="sdpa",
                        help="transformers' attention (default sdpa, its own default on the CPU)")
    parser.add_argument("--attention", choices=ATTENTION_LAYOUTS, default="batched", help="labkit's attention")
    parser.add_argument("--out", type=Path, help="the JSON file (default benchmarks/results/peers-<device>.json)")
    args = parser.parse_args()
    config = MODEL_CONFIGS[args.model_config]
    torch.set_num_threads(args.threads)
    model = transformers_llama(config, seed=0)
    # SDPA by default (transformers_llama's): it is transformers' default on the CPU and the same fused
    # kernel labkit's TinyGPT calls. Continuous batching takes it as is; eager is swapped for "paged|eager"
    # there, and the flash kernels it prefers need CUDA.
    if args.hf_attention != "sdpa":
        model.set_attn_implementation(args.hf_attention)
    engine = Engine(model=TinyGPT.from_hf_llama(model, attention=args.attention), device=args.device, seed=args.seed,
                    threads=args.threads)
    model.to(engine.device)
    versions = {name: importlib.metadata.version(name) for name in ("torch", "transformers", "labkit")}
    machine = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
               "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
               "torch_threads": torch.get_num_threads(), "device": str(engine.device), **versions}
    print(", ".join(f"{k} {v}" for k, v in machine.items()) + f"; {args.model_config} model "
          f"({engine.model.num_parameters() / 1e6:.2f} M parameters), transformers attention {args.hf_attention}, "
          f"labkit attention {args.attention}")
    results = {}
    for b in args.batch_sizes:
        trace = lk.Trace.sample(b * args.requests_per_slot, output="exponential", mean_output=args.mean_output,
                                prompt="equal", mean_prompt=args.prompt_len, seed=args.seed)
        results[b] = bench(model, engine, trace, b, args.repeats)
        report(b, results[b])
    out = args.out or RESULTS / f"peers-{engine.device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**machine, "model_config": asdict(config), "args": {**vars(args), "out": str(out)},
                               "batch_sizes": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
