"""The `labkit` command. `labkit demo` (or `python -m labkit demo`) runs the headline
experiment: one trace served by TinyGPT under static and under continuous batching,
with measured throughput and latency printed beside the simulator's prediction.

Invariants:

- both policies serve the same trace on the same engine, after a short warm-up run,
  so neither pays one-time start-up costs;
- the predicted gain comes from the simulator alone (slot-steps, static / continuous),
  the measured gain from the engine's clock alone (tokens/s, continuous / static);
- a bad option value ends in one `labkit demo: error: ...` line on stderr and exit
  code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import labkit as lk
from labkit.analysis import metrics
from labkit.args import (MEAN_OUTPUT, MEAN_PROMPT, positive_number, recorded_trace, sampled_trace, trace_error,
                         whole_number)
from labkit.engine import Engine, ModelConfig
from labkit.engine.attention import ATTENTION_LAYOUTS
from labkit.engine.device import default_threads
from labkit.engine.engine import DTYPES
from labkit.serve.replay_cli import add_replay_parser, replay_command
from labkit.serve.server import add_serve_parser

WARM_UP = lk.Trace.from_lengths([2])
COLUMNS = [
    "policy", "steps", "util (%)", "device idle (%)", "tokens/s", "TTFT p50 (ms)", "TTFT p99 (ms)",
    "ITL p50 (ms)", "ITL p99 (ms)", "predicted gain", "measured gain",
]


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "export-html":
        return export_html(args, parser)
    if args.command == "serve":
        from labkit.serve.server import serve_command

        return serve_command(args, commands["serve"])
    if args.command == "replay":
        return replay_command(args, commands["replay"])
    return demo(args, commands["demo"])


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `labkit` parser, and its subcommands' parsers by name (each reports its option errors)."""
    parser = argparse.ArgumentParser(prog="labkit", description="labkit: predict, run and see continuous batching.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo_parser = commands.add_parser(
        "demo",
        help="serve one trace with static and continuous batching on TinyGPT and compare",
        description="Serve one trace on TinyGPT twice, with lk.Static(SLOTS) and lk.Continuous(SLOTS), and "
        "print steps, slot utilization, measured tokens/s, TTFT and ITL percentiles, and the gain the "
        "simulator predicts beside the gain the engine measures.",
    )
    demo_parser.add_argument("--slots", type=whole_number(1), default=8, help="batch slots per policy (default 8)")
    demo_parser.add_argument(
        "--requests", type=whole_number(1), default=32,
        help="requests to serve (default 32); the toy trace always has its 8",
    )
    demo_parser.add_argument(
        "--trace", default="exponential", metavar="{toy,exponential,azure-conv,PATH.csv}",
        help="toy: requests A-H of lesson 1; exponential (default): sampled with exponential outputs "
        f"(mean {MEAN_OUTPUT}) and uniform prompts (mean {MEAN_PROMPT}); azure-conv: the shipped Azure "
        "conversation trace; PATH.csv[.gz]: TIMESTAMP,ContextTokens,GeneratedTokens rows. For azure-conv "
        "and CSV files the first REQUESTS requests that fit the model's max_seq_len are served, at their "
        "own arrival times",
    )
    demo_parser.add_argument(
        "--rate", type=positive_number, default=None,
        help="Poisson arrivals at this many requests/s, for --trace exponential only "
        "(default: every request waits at t=0)",
    )
    demo_parser.add_argument(
        "--device", default="auto", metavar="{auto,cpu,cuda,mps}",
        help="where the model runs (default auto: cuda, then mps, then cpu)",
    )
    demo_parser.add_argument(
        "--attention", choices=ATTENTION_LAYOUTS, default="batched",
        help="batched (default): one attention pass per layer over every request; per_request: Orca's loop",
    )
    demo_parser.add_argument(
        "--threads", type=whole_number(1), default=None,
        help=f"torch CPU threads while the engine works (default: every CPU but one, here {default_threads()})",
    )
    demo_parser.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="the model's and KV cache's dtype (default float32)"
    )
    demo_parser.add_argument(
        "--no-cuda-graphs", action="store_true", help="on a CUDA device, run decode steps eagerly, not from graphs"
    )
    demo_parser.add_argument(
        "--overlap", action="store_true", help="schedule and prepare each step while the previous one runs"
    )
    demo_parser.add_argument(
        "--seed", type=whole_number(0), default=0, help="seed for the sampled trace and the model (default 0)"
    )
    demo_parser.add_argument("--no-progress", action="store_true", help="hide the engine's progress bars")
    export_parser = commands.add_parser(
        "export-html", help="write a lesson as one HTML page whose figures play with no network",
        description="Export NOTEBOOK to OUTPUT as `jupyter nbconvert --to html` does, with every stored plotly "
                    "figure drawn and plotly.js inlined once.",
    )
    export_parser.add_argument(
        "notebook", help="a lesson that stores its outputs, e.g. solutions/01_static_vs_continuous.ipynb"
    )
    export_parser.add_argument("output", help="the HTML file to write")
    serve_parser = add_serve_parser(commands)
    replay_parser = add_replay_parser(commands)
    return parser, {"demo": demo_parser, "serve": serve_parser, "replay": replay_parser}


def export_html(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Write the offline HTML export `args` ask for; a missing or figure-less notebook ends in an error."""
    from labkit.viz.animation import export_offline_html

    if not Path(args.notebook).is_file():
        parser.error(f"argument notebook: {args.notebook!r} is not a file")
    try:
        target = export_offline_html(args.notebook, args.output)
    except (OSError, ValueError) as error:
        parser.error(f"argument notebook: {error}")
    print(f"wrote {target} ({target.stat().st_size / 1e6:.1f} MB)")
    return 0


def demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the experiment that `args` describe and print its report."""
    engine, trace, description = prepare(args, parser)
    print_header(engine, trace, description)
    logs = serve(engine, trace, args.slots, progress=not args.no_progress)
    print(metrics.format_table(COLUMNS, report_rows(logs, predicted_gain(trace, args.slots))))
    print()
    print("predicted gain: the simulator's steps, static / continuous; measured gain: tokens/s, continuous / static")
    return 0


def prepare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Engine, lk.Trace, str]:
    """The engine and the trace `args` ask for; a bad value ends in `parser.error`."""
    if args.rate is not None and args.trace != "exponential":
        parser.error("argument --rate: only --trace exponential samples arrivals; "
                     "toy, azure-conv and CSV traces keep their own")
    try:
        engine = Engine(ModelConfig(attention=args.attention), device=args.device, seed=args.seed,
                        threads=args.threads, dtype=args.dtype, cuda_graphs=not args.no_cuda_graphs,
                        overlap=args.overlap)
    except ValueError as error:
        parser.error(f"argument --device: {error}")
    try:
        trace, description = load_trace(args, engine)
    except (OSError, ValueError, csv.Error) as error:
        parser.error(f"argument --trace: {trace_error(args.trace, error)}")
    return engine, trace, description


def print_header(engine: Engine, trace: lk.Trace, description: str) -> None:
    config = engine.config
    print(f"device: {engine.device} ({engine.threads} CPU thread(s), {engine.dtype_name}, "
          f"CUDA graphs {'on' if engine.cuda_graphs else 'off'}, overlap {'on' if engine.overlap else 'off'})")
    print(f"model:  TinyGPT, {engine.model.num_parameters() / 1e6:.2f}M parameters "
          f"({config.n_layers} layers, d_model {config.d_model}, vocab {config.vocab_size}), "
          f"{config.attention} attention")
    print(f"trace:  {description}")
    print(f"        {trace!r}, mean prompt {trace.prompt_lengths.mean():.1f} tokens")
    print(flush=True)  # before the progress bars on stderr


def load_trace(args: argparse.Namespace, engine: Engine) -> tuple[lk.Trace, str]:
    """The trace `--trace` names, and one line saying where it came from."""
    if args.trace in ("toy", "exponential"):
        return sampled_trace(args.trace, args.requests, args.rate, args.seed)
    source = recorded_trace(args.trace)
    trace, num_skipped = first_that_fit(source, args.requests, engine)
    max_seq_len = engine.config.max_seq_len
    return trace, (
        f"{args.trace}: the first {len(trace)} requests with prompt + output <= max_seq_len {max_seq_len} "
        f"({num_skipped} longer ones skipped), at their own arrival times"
    )


def first_that_fit(trace: lk.Trace, num_requests: int, engine: Engine) -> tuple[lk.Trace, int]:
    """The first `num_requests` requests of `trace` that the model can hold, and how many were skipped."""
    return trace.first_that_fit(num_requests, engine.config.max_seq_len)


def serve(engine: Engine, trace: lk.Trace, num_slots: int, progress: bool) -> dict[str, lk.StepLog]:
    """Engine runs of `trace` under static and continuous batching, after a warm-up run."""
    engine.run(WARM_UP, lk.Continuous(1), progress=False)
    return {
        "static": engine.run(trace, lk.Static(num_slots), progress=progress),
        "continuous": engine.run(trace, lk.Continuous(num_slots), progress=progress),
    }


def predicted_gain(trace: lk.Trace, num_slots: int) -> float:
    """The simulator's slot-step ratio: steps under static over steps under continuous batching."""
    return lk.simulate(trace, lk.Static(num_slots)).num_steps / lk.simulate(trace, lk.Continuous(num_slots)).num_steps


def report_rows(logs: dict[str, lk.StepLog], predicted: float) -> list[list[str]]:
    """One row of cells per run; static batching is the baseline (1.00x) of both gains."""
    baseline = logs["static"].tokens_per_second
    rows = []
    for name, log in logs.items():
        gaps = metrics.itl(log)
        ttft = [1000 * metrics.percentile(log.ttft, q) for q in (50, 99)]
        itl = [1000 * metrics.percentile(gaps, q) for q in (50, 99)]
        gains = (1.0, 1.0) if name == "static" else (predicted, log.tokens_per_second / baseline)
        rows.append([
            name, f"{log.num_steps:,}", f"{100 * log.utilization:.1f}", f"{100 * log.device_idle_fraction:.1f}",
            f"{log.tokens_per_second:,.0f}",
            *(f"{ms:,.1f}" for ms in (*ttft, *itl)), *(f"{gain:.2f}x" for gain in gains),
        ])
    return rows
