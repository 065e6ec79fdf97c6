"""`labkit replay TRACE --url URL --model NAME`: send a trace to an OpenAI-compatible server at
its arrival times and print what was measured, as `lk.metrics.table` does, and what failed.

Invariants:

- TRACE and its options (`--requests`, `--rate`, `--seed`) mean what they mean for `labkit demo`,
  through the same `labkit.args`. It sends the first REQUESTS requests whose sequence, a
  begin-of-sequence token (`--bos-token-id`, unless none), prompt and output (outputs cut to
  `--max-tokens` first, when given), fits the served model's context: `--max-model-len`,
  else the `max_model_len` the server reports for the model in GET /v1/models (vLLM and labkit
  serve report one), else no limit; it says how many longer ones it left out, since a server
  refuses a request longer than its context and the replay would fail it;
- a bad option ends in one `labkit replay: error: ...` line and exit code 2, never a
  traceback; a replay that ran prints its summary, the fallbacks it took (what the server
  refused, see `labkit.serve.replay`) and every failed request, then exits 0 when every request
  finished and 1 when any failed (an unreachable server fails them all);
- importing this module loads no more than `labkit` itself does, so `labkit demo` runs without
  the `serve` extra: the client (httpx) is imported when the command runs. It never imports
  `labkit.cli`, which imports it to add the command.
"""

from __future__ import annotations

import argparse
import csv
import os

import labkit as lk
from labkit.analysis import metrics
from labkit.args import (BUILTIN_TRACES, positive_number, recorded_trace, sampled_trace, trace_error,
                         whole_number)
from labkit.serve.server import add_policy_knobs, policy_from

DEFAULT_URL = "http://127.0.0.1:8000"  # where `labkit serve` listens by default
MAX_FAILURES_SHOWN = 10


def add_replay_parser(commands) -> argparse.ArgumentParser:
    """Add the `replay` subcommand to an argparse subparsers object; returns its parser."""
    parser = commands.add_parser(
        "replay",
        help="send a trace to an OpenAI-compatible server (labkit serve, vLLM, transformers serve) and measure it",
        description="Send TRACE's requests to the server at URL at their arrival times, each asking for its "
        "output length (ignore_eos, min_tokens), stream the answers, and print tokens/s, TTFT, ITL, TPOT and "
        "latency as lk.metrics.table does, and every failed request. A server that refuses ignore_eos and "
        "min_tokens, or token-id prompts, gets requests without them, or text prompts, and the metrics count "
        "what came back. Exits 1 when any request failed.",
    )
    parser.add_argument(
        "trace", metavar="TRACE",
        help=f"{', '.join(BUILTIN_TRACES)} or PATH.csv[.gz], as for `labkit demo`; azure-conv and CSV "
        "traces send their first REQUESTS requests that fit the model's context (see --max-model-len)",
    )
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the server's base URL (default {DEFAULT_URL})")
    parser.add_argument("--model", required=True, help="the served model's name, as GET /v1/models lists it")
    parser.add_argument(
        "--rate-scale", type=positive_number, default=1.0,
        help="send this many times faster than the trace's arrivals (default 1)",
    )
    parser.add_argument(
        "--load", type=positive_number, default=None,
        help="first send every request at once to measure the server's capacity, then replay the trace's arrivals "
        "stretched to LOAD times that rate (0.5: below capacity, 2: over it), whatever the machine; not with "
        "--rate-scale",
    )
    parser.add_argument(
        "--max-concurrency", type=whole_number(1), default=None,
        help="at most this many requests in flight (default: no limit)",
    )
    parser.add_argument(
        "--requests", type=whole_number(1), default=32,
        help="requests to send (default 32); the toy trace always has its 8",
    )
    parser.add_argument(
        "--max-tokens", metavar="N", type=whole_number(1), default=None,
        help="cut every output to at most N tokens (default: the trace's own lengths)",
    )
    parser.add_argument(
        "--max-model-len", metavar="N", type=whole_number(1), default=None,
        help="send only requests whose prompt + output fit in N tokens (default: the max_model_len the server "
        "reports in GET /v1/models, as vLLM and labkit serve do; no limit if it reports none)",
    )
    parser.add_argument(
        "--rate", type=positive_number, default=None,
        help="Poisson arrivals at this many requests/s, for TRACE exponential only (default: all at t=0)",
    )
    parser.add_argument(
        "--seed", type=whole_number(0), default=0,
        help="seed for the sampled trace and for prompt ids, as the engine draws them (default 0)",
    )
    parser.add_argument(
        "--vocab-size", metavar="N", type=whole_number(2), default=512,
        help="draw prompt ids below N, as labkit's engine draws them for a model of this vocabulary (default 512, "
        "TinyGPT's); a server refuses an id past its model's vocabulary",
    )
    parser.add_argument(
        "--bos-token-id", metavar="ID", type=bos_token_id, default=0,
        help="the served model's begin-of-sequence id, sent before every token-id prompt so every server "
        "gets the ids labkit's engine feeds its model (default 0, TinyGPT's; a --tokenizer brings its own; "
        "none: send the prompt alone)",
    )
    parser.add_argument(
        "--tokenizer", metavar="DIR", default=None,
        help="a local Hugging Face tokenizer directory, the server's: for a server that takes only text prompts "
        "(transformers serve), each prompt is sent as text of exactly its length in these tokens (default: "
        "labkit's byte-level text, approximate lengths)",
    )
    parser.add_argument(
        "--api-key", metavar="KEY", default=os.environ.get("LABKIT_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="sent as a Bearer token, for a server started with an API key (default: $LABKIT_API_KEY, else "
        "$OPENAI_API_KEY, else none)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    prediction = parser.add_argument_group(
        "prediction beside measurement", "with --slots, also simulate the replayed trace under the policy these "
        "knobs describe (the server's, if you know them), timed by a CostModel fitted to TinyGPT on this machine")
    add_policy_knobs(prediction, slots=None)
    return parser


def replay_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Replay the trace `args` name against the server and print the report; 1 when a request failed."""
    from labkit.serve.replay import replay, served_max_model_len

    max_model_len = args.max_model_len or served_max_model_len(args.url, args.model, args.api_key)
    trace, description = load_replay_trace(args, parser, max_model_len)
    options = dict(url=args.url, model=args.model, max_concurrency=args.max_concurrency, seed=args.seed,
                   vocab_size=args.vocab_size,
                   tokenizer=args.tokenizer, bos_token_id=args.bos_token_id, api_key=args.api_key)
    try:
        trace, pace = at_load(trace, args, parser, options)
        log = replay(trace, rate_scale=args.rate_scale, progress=not args.no_progress, **options)
    except ValueError as error:
        parser.error(str(error))
    print(f"server: {log.url}, model {args.model}")
    print(f"trace:  {description}, {pace}")
    print(f"        {log.trace!r}")
    print(f"fallbacks: {', '.join(log.fallbacks) or 'none'}")
    print()
    print(metrics.table({**predicted_beside(log.trace, args, parser), "measured": log}))
    print()
    print_failures(log.failures, len(log.trace))
    return 1 if log.failures else 0


def at_load(trace: lk.Trace, args: argparse.Namespace, parser: argparse.ArgumentParser,
            options: dict) -> tuple[lk.Trace, str]:
    """`trace` stretched to --load times the server's capacity, measured by sending every request at
    once, and a line saying so; with no --load, `trace` and its rate scale."""
    if args.load is None:
        return trace, f"rate scale {args.rate_scale:g}"
    if args.rate_scale != 1:
        parser.error("argument --load: sets the rate from the server's capacity; leave out --rate-scale")
    if trace.arrivals.max() == trace.arrivals.min():
        parser.error(f"argument --load: {args.trace}'s requests all arrive at once, so there is no rate to set; "
                     "use azure-conv, a CSV trace or exponential with --rate")
    from labkit.serve.replay import replay

    probe = replay(trace.backlogged(), progress=False, **options)
    if probe.failures:
        print_failures(probe.failures, len(trace))
        parser.error(f"argument --load: the capacity probe failed {len(probe.failures)} of {len(trace)} requests")
    served = len(trace) / probe.duration
    return trace.at_rate(args.load * served), (f"{args.load:g} × the server's capacity: {served:.2f} requests/s with "
                                               f"all {len(trace)} sent at once, so {args.load * served:.2f} requests/s")


def predicted_beside(trace: lk.Trace, args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """{"predicted": a simulation of `trace`} when --slots asks for one, else {}. The cost model is
    fitted to TinyGPT serving the same trace on this machine (lesson 06)."""
    if args.slots is None:
        return {}
    from labkit.engine import Engine

    try:
        policy = policy_from(args)
    except ValueError as error:
        parser.error(str(error))
    fit = lk.CostModel.fit(Engine(seed=args.seed).run(trace, policy, progress=False))
    print(f"predicted with {policy!r}, {fit}")
    return {"predicted": lk.simulate(trace, policy, cost=fit.model)}


def bos_token_id(text: str) -> int | None:
    """--bos-token-id: a whole number >= 0, or "none"."""
    if text.lower() == "none":
        return None
    try:
        return whole_number(0)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a whole number >= 0, or none") from None


def load_replay_trace(args: argparse.Namespace, parser: argparse.ArgumentParser,
                      max_model_len: int | None) -> tuple[lk.Trace, str]:
    """The requests the replay sends: the first REQUESTS of the trace TRACE names whose sequence
    (BOS, unless --bos-token-id none, prompt and output) fits in `max_model_len` tokens (None:
    all), outputs cut to --max-tokens first; and one line saying where they came from. A bad
    trace, or one of which nothing fits, ends in `parser.error`."""
    if args.rate is not None and args.trace != "exponential":
        parser.error("argument --rate: only TRACE exponential samples arrivals; "
                     "toy, azure-conv and CSV traces keep their own")
    sampled = args.trace in ("toy", "exponential")
    try:
        source, description = (sampled_trace(args.trace, args.requests, args.rate, args.seed) if sampled
                               else (recorded_trace(args.trace), f"{args.trace}: the first"))
    except (OSError, ValueError, csv.Error) as error:
        parser.error(f"argument TRACE: {trace_error(args.trace, error)}")
    if args.max_tokens is not None:
        source = source.capped(args.max_tokens)
    with_bos = args.bos_token_id is not None
    sequence = f"{'BOS + ' if with_bos else ''}prompt + output"
    room = None if max_model_len is None else max_model_len - with_bos  # for prompt + output
    lengths = source.prompt_lengths + source.output_lengths + with_bos
    if room is not None and lengths.min() > max_model_len:
        parser.error(f"argument --max-model-len: {max_model_len}: no request has {sequence} <= {max_model_len} "
                     f"tokens (the shortest has {int(lengths.min())})")
    trace, num_left_out = source.first_that_fit(min(args.requests, len(source)), room)
    if sampled:
        num_left_out = len(source) - len(trace)  # the sample is all there is: every one that does not fit
    else:
        description += f" {len(trace)} requests"
    if args.max_tokens is not None:
        description += f", outputs cut to {args.max_tokens} tokens"
    if max_model_len is not None:
        whose = "the server's max_model_len" if args.max_model_len is None else "--max-model-len"
        description += (f", with {sequence} <= {max_model_len} tokens ({whose}; {num_left_out} longer "
                        f"{'one' if num_left_out == 1 else 'ones'} left out)")
    return trace, description + ("" if sampled else ", at their own arrival times")


def print_failures(failures: list[tuple[int, str]], num_requests: int) -> None:
    """How many requests failed, and the first MAX_FAILURES_SHOWN messages."""
    print(f"failed: {len(failures)} of {num_requests} requests")
    for _, message in failures[:MAX_FAILURES_SHOWN]:
        print(f"  {message}")
    if len(failures) > MAX_FAILURES_SHOWN:
        print(f"  ... and {len(failures) - MAX_FAILURES_SHOWN} more")
