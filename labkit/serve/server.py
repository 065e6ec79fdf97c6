"""`labkit serve [MODEL_DIR]`: TinyGPT, or a local Llama checkpoint, behind the OpenAI-compatible
API, with the lab's own policies.

MODEL_DIR, as `vllm serve DIR` takes it, is a Hugging Face model directory that
`labkit.engine.checkpoint` loads (what it supports, and refuses, is said there); the
served name is then MODEL_DIR as given, and prompts and answers go through the model's own
tokenizer. Without it, the seeded TinyGPT is served under the name tinygpt, with the
byte-level tokenizer. --model-name overrides either name.

The knobs carry the policies' names; each maps to a `vllm serve` flag (README):
--slots (--max-num-seqs), --blocks (--num-gpu-blocks-override), --block-size
(--block-size), --budget (--max-num-batched-tokens), --chunked-prefill
(--enable-chunked-prefill), --policy priority (--scheduling-policy priority: each
request's `priority` field orders the queue). --policy spf admits the shortest predicted
output first, its predictor off by a factor e^(--noise * z); vLLM has no such policy.
--policy fair, the default, shares the engine between clients (a request's `user` field,
else its address) by their virtual token counters (`labkit.Fair`), so that one client's
flood does not hold back the rest; with one client it decides exactly as --policy
continuous, first come, first served (vLLM's default, --scheduling-policy fcfs).
uvicorn serves the app behind `labkit.serve.guards`, so that a class can share one server:
--api-key (as vLLM's), --max-waiting, --max-waiting-per-client, --max-body-bytes,
--max-connections, --max-connections-per-client and --read-timeout (`labkit.serve.limits`). On SIGINT or SIGTERM it stops taking requests, lets the open ones
finish for 5 s, then the engine aborts the rest, each ending with an error, and the log
says how many; a second SIGINT skips what is left of the 5 s.

The parser needs only the standard library, so `labkit demo` works without the `serve`
extra; the serving stack (torch, FastAPI, uvicorn, prometheus-client) is imported when
a server is built.
"""

from __future__ import annotations

import argparse
import os
import shutil

import labkit as lk
from labkit.args import number, whole_number
from labkit.serve.limits import Limits

ITERATION_LEVEL = {"continuous": lk.Continuous, "priority": lk.Priority, "spf": lk.ShortestPredictedFirst,
                   "fair": lk.Fair}
POLICIES = (*ITERATION_LEVEL, "static", "dynamic")
POLICIES_HELP = ("the scheduling policy (default fair): fair (the client served the fewest weighted tokens first, "
                 "first come, first served within a client; a client is a request's user field, else its address; "
                 "with one client the same as continuous), continuous (first come, first served), priority "
                 "(the lowest value of a request's priority field first, preempting higher values), spf "
                 "(shortest predicted output first), static (whole batches), dynamic (batches "
                 "that wait up to --timeout to fill)")
DEFAULT_MODEL_NAME = "tinygpt"


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


def build_server(engine, policy, model_name: str = DEFAULT_MODEL_NAME, checkpoint=None, limits: Limits = Limits(),
                 own_process: bool = False):
    """(app, online engine): the API for `engine` (a labkit Engine) scheduled by `policy`, under
    `limits`. With a `checkpoint` (`labkit.engine.checkpoint.Checkpoint`, the engine's model) text
    goes through its tokenizer and requests stop at its EOS ids; without, through the byte-level
    tokenizer, never early. The engine's loop runs in a thread of this process, or with
    `own_process` in a process of its own. `labkit.serve.guards.make_server` serves the app."""
    from labkit.serve import tokenizer
    from labkit.serve.api import make_app
    from labkit.serve.prometheus import ServerMetrics
    from labkit.serve.online import OnlineEngine

    limits = limits.for_model(engine.config.max_seq_len, engine.config.vocab_size)
    eos_token_ids = checkpoint.eos_token_ids if checkpoint else ()
    online = OnlineEngine(engine, policy, ServerMetrics(model_name), eos_token_ids, limits.max_waiting, own_process,
                          limits.max_waiting_per_client)
    text_tokenizer = tokenizer.ModelTokenizer(checkpoint.tokenizer) if checkpoint else tokenizer
    return make_app(online, model_name, text_tokenizer, limits), online


def engine_from(args: argparse.Namespace):
    """(engine, checkpoint): MODEL_DIR's model and its checkpoint, or the seeded TinyGPT and None."""
    from labkit.engine import Engine, ModelConfig
    from labkit.engine.checkpoint import load_checkpoint

    fused = not args.plain_forward
    if args.model_dir is None:
        config = ModelConfig() if args.max_model_len is None else ModelConfig(max_seq_len=args.max_model_len)
        return Engine(config, device=args.device, seed=args.seed, threads=args.threads, fused=fused), None
    checkpoint = load_checkpoint(args.model_dir, max_seq_len=args.max_model_len)
    return Engine(model=checkpoint.model, device=args.device, threads=args.threads, fused=fused), checkpoint


def check_shared_memory(engine, shared_memory: str = "/dev/shm") -> None:
    """A ValueError if the model's weights do not fit in `shared_memory`, through which the
    engine's process gets them (torch.multiprocessing); nothing where there is no such folder."""
    if not os.path.isdir(shared_memory):
        return
    model = engine.model
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
                for tensor in [*model.parameters(), *model.buffers()]}  # tied weights share one
    needed, free = sum(storages.values()), shutil.disk_usage(shared_memory).free
    if needed > free:
        raise ValueError(f"the model's weights ({needed / 2**20:.0f} MiB) do not fit in {shared_memory} ({free / 2**20:.0f} "
                         "MiB free), through which the engine's process gets them: give it more room (docker run "
                         "--shm-size 4g) or pass --engine-in-thread")


def model_name_from(args: argparse.Namespace) -> str:
    """The served model's name: --model-name, else MODEL_DIR as given (as vLLM names it), else tinygpt."""
    return args.model_name or args.model_dir or DEFAULT_MODEL_NAME


def add_policy_knobs(parser, slots: int | None) -> None:
    """The policy's knobs, under the names `labkit serve` gives them; `slots` is --slots' default."""
    parser.add_argument("--policy", choices=POLICIES, default="fair", help=POLICIES_HELP)
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


def add_serve_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "serve", help="serve TinyGPT or a local Llama model behind an OpenAI-compatible API, with continuous "
        "batching",
        description="Serve TinyGPT, or the Llama model in MODEL_DIR, over HTTP (POST /v1/completions, "
        "GET /v1/models, /health, /metrics), scheduling every step with a labkit policy.",
    )
    parser.add_argument("model_dir", nargs="?", default=None, metavar="MODEL_DIR", help="a local Hugging Face "
                        "directory of a Llama-architecture model (config.json, *.safetensors, tokenizer files); "
                        "default: the seeded TinyGPT")
    add_policy_knobs(parser, slots=8)
    parser.add_argument("--device", default="auto", metavar="{auto,cpu,cuda,mps}", help="where the model runs")
    parser.add_argument("--threads", type=whole_number(1), default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=whole_number(0), default=0, help="seed of TinyGPT's weights (default 0)")
    parser.add_argument("--engine-in-thread", action="store_true", help="run the engine's loop in a thread of the "
                        "HTTP server's process; by default, on a CPU, it runs in a process of its own, as vLLM's "
                        "engine core does, so that the two do not take turns at one interpreter lock")
    parser.add_argument("--plain-forward", action="store_true", help="run every step on TinyGPT.forward as "
                        "written, not on its fast path (labkit.engine.fused), which gives the same tokens sooner")
    parser.add_argument("--model-name", default=None, help=f"the served model's name (default: MODEL_DIR as "
                        f"given, else {DEFAULT_MODEL_NAME})")
    parser.add_argument("--max-model-len", type=whole_number(1), default=None, help="the longest sequence "
                        "(prompt + output) served, as vLLM's --max-model-len (default: the model's)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=whole_number(1), default=8000, help="port to listen on (default 8000)")
    add_limit_flags(parser)
    return parser


def add_limit_flags(parser) -> None:
    """The flags of `Limits`: an API key, and limits on the queue, the body, connections and slowness."""
    default = Limits()
    parser.add_argument("--api-key", default=os.environ.get("LABKIT_API_KEY"), metavar="KEY", help="require the "
                        "header 'Authorization: Bearer KEY' on every path but /health and /metrics, as vllm serve "
                        "--api-key does (default: $LABKIT_API_KEY, else no key)")
    parser.add_argument("--max-waiting", type=whole_number(1), default=default.max_waiting, help="requests that "
                        "may wait for a slot; one more sheds the newest waiting request of the client holding the "
                        "most of them if it holds more than the sender would, else gets HTTP 503 (default "
                        f"{default.max_waiting})")
    parser.add_argument("--max-waiting-per-client", type=whole_number(1), default=default.max_waiting_per_client,
                        help="requests one client (its user field, else its address) may have waiting; one more "
                        "gets HTTP 503 (default: no cap of its own; a full queue sheds the biggest holder's)")
    parser.add_argument("--max-body-bytes", type=whole_number(1), default=default.max_body_bytes, help="the "
                        "largest request body; a larger one gets HTTP 413 before it is parsed (default: what the "
                        "model can use: 16 KiB, and 16 bytes for each token of its context and each id of its "
                        "vocabulary)")
    parser.add_argument("--max-connections", type=whole_number(1), default=default.max_connections, help="open "
                        "connections; one more is closed as soon as it is accepted (default "
                        f"{default.max_connections}, fewer if the open-file limit is lower)")
    parser.add_argument("--max-connections-per-client", type=whole_number(1),
                        default=default.max_connections_per_client, help="open connections from one address; one "
                        f"more is closed as soon as it is accepted (default {default.max_connections_per_client})")
    parser.add_argument("--read-timeout", type=number(0), default=default.read_timeout, help="seconds a "
                        "connection may take to send a request's head, then as many for its body (else HTTP 408) "
                        f"(default {default.read_timeout:g})")


def limits_from(args: argparse.Namespace) -> Limits:
    """The limits the command line asks for; a ValueError names a bad one."""
    return Limits(api_key=args.api_key, max_waiting=args.max_waiting, max_waiting_per_client=args.max_waiting_per_client,
                  max_body_bytes=args.max_body_bytes, max_connections=args.max_connections,
                  max_connections_per_client=args.max_connections_per_client, read_timeout=args.read_timeout)


def serve_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Build the engine, the policy and the limits `args` describe, and serve until interrupted."""
    from labkit.serve.guards import make_server, max_open_connections, raise_open_file_limit

    try:
        policy = policy_from(args)
        limits = limits_from(args)
        raise_open_file_limit()
        max_open_connections(limits.max_connections)  # a ValueError if the open-file limit leaves no room
        engine, checkpoint = engine_from(args)
        own_process = engine.device.type == "cpu" and not args.engine_in_thread
        if own_process:
            check_shared_memory(engine)
    except ValueError as problem:
        parser.error(str(problem))
    model_name = model_name_from(args)
    app, online = build_server(engine, policy, model_name, checkpoint, limits, own_process)
    where = "in a process of its own" if own_process else "in a thread"
    print(f"serving {model_name} ({engine}, {where}) with {policy!r} on http://{args.host}:{args.port}", flush=True)
    try:
        make_server(app, online, limits, args.host, args.port).run()
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it caught again once it has shut down
        pass
    return 0
