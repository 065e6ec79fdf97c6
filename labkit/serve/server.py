"""`labkit serve`: TinyGPT behind the OpenAI-compatible API, with the lab's own policies.

The knobs carry the policies' names; each maps to a `vllm serve` flag (README):
--slots (--max-num-seqs), --blocks (--num-gpu-blocks-override), --block-size
(--block-size), --budget (--max-num-batched-tokens), --chunked-prefill
(--enable-chunked-prefill), --policy priority (--scheduling-policy priority: each
request's `priority` field orders the queue). --policy spf admits the shortest predicted
output first, its predictor off by a factor e^(--noise * z); vLLM has no such policy.
uvicorn serves the app; on SIGINT or SIGTERM it stops taking requests, lets open streams
finish for a few seconds, and the engine aborts what is left.

The parser needs only the standard library, so `labkit demo` works without the `serve`
extra; the serving stack (torch, FastAPI, uvicorn, prometheus-client) is imported when
a server is built.
"""

from __future__ import annotations

import argparse

import labkit as lk

ITERATION_LEVEL = {"continuous": lk.Continuous, "priority": lk.Priority, "spf": lk.ShortestPredictedFirst}
POLICIES = (*ITERATION_LEVEL, "static", "dynamic")
POLICIES_HELP = ("the scheduling policy (default continuous): continuous (first come, first served), priority "
                 "(the lowest value of a request's priority field first, preempting higher values), spf "
                 "(shortest predicted output first), static (whole batches), dynamic (batches that wait up to "
                 "--timeout to fill)")
DEFAULT_MODEL_NAME = "tinygpt"
GRACEFUL_SHUTDOWN_SECONDS = 5


def policy_from(args: argparse.Namespace):
    """The policy the command line asks for; a ValueError names a bad knob. --noise and
    --predictor-seed, when not given, take ShortestPredictedFirst's own defaults."""
    pool = dict(num_blocks=args.blocks, block_size=args.block_size)
    predictor = {name: value for name, value in (("noise", args.noise), ("seed", args.predictor_seed))
                 if value is not None}
    if predictor and args.policy != "spf":
        raise ValueError(f"--noise and --predictor-seed apply to --policy spf, not {args.policy}")
    if args.policy in ITERATION_LEVEL:
        return ITERATION_LEVEL[args.policy](num_slots=args.slots, max_tokens_per_step=args.budget,
                                            chunked_prefill=args.chunked_prefill, **pool, **predictor)
    if args.budget is not None or args.chunked_prefill:
        raise ValueError(f"--budget and --chunked-prefill apply to --policy {', '.join(ITERATION_LEVEL)}, "
                         f"not {args.policy}")
    if args.policy == "static":
        return lk.Static(num_slots=args.slots, **pool)
    return lk.Dynamic(num_slots=args.slots, timeout=args.timeout, **pool)


def build_server(engine, policy, model_name: str = DEFAULT_MODEL_NAME):
    """(app, online engine): the API for `engine` (a labkit Engine) scheduled by `policy`."""
    from labkit.serve.api import make_app
    from labkit.serve.metrics import ServerMetrics
    from labkit.serve.online import OnlineEngine

    online = OnlineEngine(engine, policy, ServerMetrics(model_name))
    return make_app(online, model_name), online


def add_policy_knobs(parser, whole_number, number, slots: int | None) -> None:
    """The policy's knobs, under the names `labkit serve` gives them; `slots` is --slots' default.
    `whole_number(minimum)` and `number(minimum, or_equal=False)` make argparse types."""
    parser.add_argument("--policy", choices=POLICIES, default="continuous", help=POLICIES_HELP)
    slots_help = f"default {slots}" if slots else "no default: without it, nothing is predicted"
    parser.add_argument("--slots", type=whole_number(1), default=slots, help=f"requests that may run at once ({slots_help})")
    parser.add_argument("--blocks", type=whole_number(1), default=None, help="KV blocks in the pool (default: enough "
                        "for every slot to hold the longest sequence)")
    parser.add_argument("--block-size", type=whole_number(1), default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--budget", type=whole_number(1), default=None, help="tokens one step may process (default "
                        "unlimited)")
    parser.add_argument("--chunked-prefill", action="store_true", help="let a prompt be split over steps")
    parser.add_argument("--timeout", type=number(0), default=0.05, help="--policy dynamic: seconds a batch may "
                        "wait to fill (default 0.05)")
    parser.add_argument("--noise", type=number(0, or_equal=True), default=None, help="--policy spf: the predictor is off "
                        "by a factor e^(noise * z), z standard normal (default 0: it knows every output length)")
    parser.add_argument("--predictor-seed", type=whole_number(0), default=None, help="--policy spf: seed of the "
                        "predictor's errors (default 0)")


def add_serve_parser(commands, whole_number, number) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "serve", help="serve TinyGPT behind an OpenAI-compatible API, with continuous batching",
        description="Serve TinyGPT over HTTP (POST /v1/completions, GET /v1/models, /health, /metrics), "
        "scheduling every step with a labkit policy.",
    )
    add_policy_knobs(parser, whole_number, number, slots=8)
    parser.add_argument("--device", default="auto", metavar="{auto,cpu,cuda,mps}", help="where the model runs")
    parser.add_argument("--threads", type=whole_number(1), default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=whole_number(0), default=0, help="seed of the model's weights (default 0)")
    parser.add_argument("--model-name", default=DEFAULT_MODEL_NAME, help=f"the served model's name (default "
                        f"{DEFAULT_MODEL_NAME})")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=whole_number(1), default=8000, help="port to listen on (default 8000)")
    return parser


def serve_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Build the engine and the policy `args` describe, and serve until interrupted."""
    import uvicorn

    from labkit.engine import Engine, ModelConfig

    try:
        policy = policy_from(args)
        engine = Engine(ModelConfig(), device=args.device, seed=args.seed, threads=args.threads)
    except ValueError as problem:
        parser.error(str(problem))
    app, _ = build_server(engine, policy, args.model_name)
    print(f"serving {args.model_name} ({engine}) with {policy!r} on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)
    return 0
