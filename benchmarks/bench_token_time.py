"""Where a served token's time goes: the front end, the scheduler, and each phase of the forward
pass, on the plain path (`TinyGPT.forward`) and the fast path (`labkit.engine.fused`), at 8 and
32 streams.

The traffic is `bench_servers.py`'s streams: R requests at once, each a 16-token prompt and
--new-tokens new tokens (default 256), served by the engine and policy `labkit serve --slots
R` builds (TinyGPT's default shape, one torch thread, 1,024 blocks of 16, 256 tokens a step,
chunked prefill), built here by the server's own functions. Two sections, each in rounds
that take turns (medians, and the lowest and highest round):

1. `serving`: the same requests three ways on each path: `Engine.run` in this process (its
   log splits each step into schedule, prepare, forward and sample), the server's own loop
   (`OnlineEngine`) in this process with clients that keep their tokens in a list (no HTTP),
   and `labkit serve --slots R` over HTTP, replayed by `lk.replay` (the fast path only: the
   server has no knob for the plain one). A token's milliseconds split into: forward,
   prepare, sample and scheduler (schedule, which holds the policy, its bookkeeping and the
   log), summed over the run's steps and divided by its tokens; the online loop's own cost
   (1/tokens/s online minus in-process; its loop runs in a thread beside the clients' event
   loop); and the front end (1/tokens/s over HTTP minus online: FastAPI, the event loop and
   the stream's chunks in the server's process, the pipe to the engine's process, and a
   client that parses every chunk; below zero when the server's two processes beat one).
2. `forward`: one decode step of R rows at the streams' mean context, phase by phase with a
   clock between phases: the path's own operations in its own order, on a cache of the
   server's size laid out as a run lays it out (each request's blocks taken in turn), each
   run checked to give the path's logits bit for bit. Phases: attention's plan, embedding,
   rotary (tables and rotation), norms, qkv, KV write, attention, o-proj (and its residual
   add), MLP (and its residual add), LM head (with the final norm's row selection) and
   sampling (argmax, read back). The whole step is also timed as the path runs it.
3. `chunks`: the fast path's decode step at 32 rows and two contexts, its decode groups cut
   into chunks of at most 1 to 16 MiB of keys and values, or not cut, in rounds that take
   turns: where `labkit.engine.fused.CHUNK_BYTES` comes from.

Results go to benchmarks/results/token-time-cpu.json; `--sections` measures some sections and
keeps the others' results from the file.
Run: `python benchmarks/bench_token_time.py` (about four minutes on a 2-core CPU).
"""

import argparse
import asyncio
import collections
import contextlib
import datetime
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import labkit as lk
from labkit.cli import build_parser
from labkit.engine import PagedKVCache, ModelInputs
from labkit.engine.attention import plan_attention
from labkit.engine.device import torch_threads
from labkit.engine.fused import FusedTinyGPT
from labkit.engine.model import rotate
from labkit.serve.online import OnlineEngine
from labkit.serve.processes import start_labkit_serve
from labkit.serve.server import engine_from, policy_from

RESULTS = Path(__file__).resolve().parent / "results"
ROWS = (8, 32)
PROMPT = 16
NUM_BLOCKS, BLOCK_SIZE = 1024, 16  # enough for 32 streams of 16 + 256 tokens: no request is preempted
SERVE_ARGS = ("--device", "cpu", "--threads", "1", "--blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
              "--budget", "256", "--chunked-prefill")
SECTIONS = ("serving", "forward", "chunks")
CHUNK_MIB = (1, 2, 4, 8, 16, None)  # the chunk sizes `chunks` compares (None: groups not cut)
PATHS = ("plain", "fused")


def served_engine(rows: int, fused: bool):
    """(engine, policy) that `labkit serve --slots ROWS SERVE_ARGS` builds, on the plain or the fast path."""
    _, commands = build_parser()
    args = commands["serve"].parse_args([*SERVE_ARGS, "--slots", str(rows)])
    engine, _ = engine_from(args)
    engine.fused = fused
    return engine, policy_from(args)


def streams(rows: int, new_tokens: int) -> lk.Trace:
    return lk.Trace.from_lengths([new_tokens] * rows, prompt_lengths=[PROMPT] * rows)


# Serving: in-process, the online loop, over HTTP

def in_process(engine, policy, trace: lk.Trace) -> dict:
    """tokens/s of `Engine.run`, and a token's milliseconds in each phase of its steps."""
    start = time.perf_counter()
    log = engine.run(trace, policy, progress=False)
    seconds = time.perf_counter() - start
    per_token = {phase: 1e3 * float(np.sum(values)) / log.num_output_tokens for phase, values in log.phase_seconds.items()}
    return {"tokens_per_s": log.num_output_tokens / seconds, "ms_per_token": per_token, "outputs": log.outputs}


def online(engine, policy, trace: lk.Trace) -> dict:
    """tokens/s of the server's loop in this process, every request submitted at once, no HTTP."""
    loop = OnlineEngine(engine, policy)
    loop.start_thread()

    async def every_stream() -> dict[int, list[int]]:
        streams = {int(i): loop.submit(engine.prompt_ids(int(i), int(prompt_len)), int(new_tokens))[1]
                   for i, prompt_len, new_tokens in zip(trace.ids, trace.prompt_lengths, trace.output_lengths)}
        return {i: [item async for item in tokens_of(stream)] for i, stream in streams.items()}

    start = time.perf_counter()
    tokens = asyncio.run(every_stream())
    seconds = time.perf_counter() - start
    loop.stop()
    return {"tokens_per_s": int(trace.output_lengths.sum()) / seconds, "outputs": tokens}


async def tokens_of(stream):
    """A stream's tokens, until its finish reason."""
    while isinstance(item := await stream.get(), int):
        yield item


def over_http(server, trace: lk.Trace) -> dict:
    log = lk.replay(trace, url=server.url, model=server.model, progress=False)
    assert not log.failures, log.failures
    return {"tokens_per_s": log.tokens_per_second, "outputs": log.outputs}


def serving_round(rows: int, new_tokens: int, server) -> dict:
    """One round at `rows` streams: each path in process and online, the fast path over HTTP; every
    way's tokens checked equal to the plain path's in-process tokens."""
    trace = streams(rows, new_tokens)
    runs = {}
    for path in PATHS:
        engine, policy = served_engine(rows, fused=path == "fused")
        runs[f"{path}, in-process"] = in_process(engine, policy, trace)
        runs[f"{path}, online"] = online(engine, policy, trace)
    runs["fused, labkit serve"] = over_http(server, trace)
    expected = runs["plain, in-process"]["outputs"]
    assert all(run.pop("outputs") == expected for run in runs.values()), "a way of serving changed the tokens"
    return runs


def token_split(runs: dict, path: str) -> dict:
    """A token's milliseconds on `path`: the engine's phases, the online loop, the front end (fast path)."""
    ms = {way: 1e3 / runs[f"{path}, {way}"]["tokens_per_s"] for way in ("in-process", "online")}
    split = dict(runs[f"{path}, in-process"]["ms_per_token"])
    split["online loop"] = ms["online"] - ms["in-process"]
    if f"{path}, labkit serve" in runs:
        split["front end (HTTP, stream)"] = 1e3 / runs[f"{path}, labkit serve"]["tokens_per_s"] - ms["online"]
    return split


def serving(new_tokens: int, repeats: int) -> dict:
    with started_servers() as servers:
        rounds = {rows: [] for rows in ROWS}
        for _ in range(repeats):
            for rows in ROWS:
                rounds[rows].append(serving_round(rows, new_tokens, servers[rows]))
                print(f"{rows} streams", {way: round(r["tokens_per_s"]) for way, r in rounds[rows][-1].items()},
                      flush=True)
    return {"new_tokens": new_tokens, "by_rows": {str(rows): serving_summary(runs) for rows, runs in rounds.items()}}


@contextlib.contextmanager
def started_servers():
    """`labkit serve --slots R` for each R, started together, healthy and warmed up; stopped on leaving."""
    with contextlib.ExitStack() as running:
        servers = {rows: running.enter_context(start_labkit_serve(*SERVE_ARGS, "--slots", str(rows))) for rows in ROWS}
        for rows, server in servers.items():
            over_http(server.wait_until_healthy(), streams(rows, 8))
        yield servers


def median_range(values) -> dict:
    return {"median": float(np.median(values)), "range": [float(np.min(values)), float(np.max(values))]}


def serving_summary(rounds: list[dict]) -> dict:
    tokens_per_s = {way: median_range([r[way]["tokens_per_s"] for r in rounds]) for way in rounds[0]}
    splits = [{path: token_split(r, path) for path in PATHS} for r in rounds]
    ms_per_token = {path: {part: median_range([s[path][part] for s in splits]) for part in splits[0][path]}
                    for path in PATHS}
    return {"tokens_per_s": tokens_per_s, "ms_per_token": ms_per_token}


# The forward pass, phase by phase

def decode_step(config, rows: int, context_len: int, num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE):
    """A cache of the server's size, filled, and a decode step of `rows` requests `context_len` tokens deep,
    whose blocks were taken in turn (block j of request i is j * rows + i), as a run takes them."""
    cache = PagedKVCache(config, num_blocks, block_size, "cpu")
    cache.k.normal_(generator=torch.Generator().manual_seed(0))
    cache.v.normal_(generator=torch.Generator().manual_seed(1))
    num_lent = -(-context_len // block_size)
    tables = [[j * rows + i for j in range(num_lent)] for i in range(rows)]
    batch = ModelInputs.build([[1]] * rows, [context_len - 1] * rows, tables, block_size)
    return cache, batch


def plain_phases(model, batch, cache, tick) -> torch.Tensor:
    """`TinyGPT.forward`'s operations, in its order, with `tick(phase)` after each phase."""
    attention = plan_attention(model.config.attention, batch.num_new, batch.context_lens, batch.block_tables,
                               cache.block_size, model.gather_scratch)
    tick("plan")
    x = model.model.embed_tokens(batch.input_ids)
    tick("embedding")
    cos, signed_sin = model.rotary(batch.positions)
    tick("rotary")
    for i, layer in enumerate(model.model.layers):
        k_cache, v_cache = cache.layer(i)
        a, T = layer.self_attn, x.shape[0]
        nh, nkv, hs = a.n_heads, a.n_kv_heads, a.head_dim
        h = layer.input_layernorm(x)
        tick("norms")
        qkv = a.qkv_proj(h).view(T, nh + 2 * nkv, hs)
        tick("qkv")
        qk = rotate(qkv[:, : nh + nkv], cos[:, None], signed_sin[:, None])
        q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :]
        tick("rotary")
        k_cache.index_copy_(0, batch.write_entries, k)
        v_cache.index_copy_(0, batch.write_entries, v)
        tick("KV write")
        y = attention(q, k_cache, v_cache)
        tick("attention")
        x = x + a.o_proj(y.reshape(T, nh * hs))
        tick("o-proj")
        h = layer.post_attention_layernorm(x)
        tick("norms")
        x = x + layer.mlp(h)
        tick("MLP")
    logits = model.lm_head(model.model.norm(x.index_select(0, batch.last_rows)))
    tick("LM head")
    logits.argmax(-1).tolist()
    tick("sampling")
    return logits


def fused_phases(fused: FusedTinyGPT, batch, cache, tick) -> torch.Tensor:
    """`FusedTinyGPT`'s operations, in its order, with `tick(phase)` after each phase."""
    attention = fused.plan(batch, cache.block_size)
    tick("plan")
    x = F.embedding(batch.input_ids, fused.model.model.embed_tokens.weight)
    tick("embedding")
    cos, signed_sin = (table[:, None] for table in fused.model.rotary(batch.positions))
    tick("rotary")
    for i, layer in enumerate(fused.layers):
        k_cache, v_cache = cache.layer(i)
        (T, C), nh, nkv = x.shape, layer.n_heads, layer.n_kv_heads
        h = F.rms_norm(x, (C,), layer.input_norm, layer.eps)
        tick("norms")
        qkv = (h @ layer.qkv).view(T, nh + 2 * nkv, -1)
        tick("qkv")
        qk = rotate(qkv[:, : nh + nkv], cos, signed_sin)
        tick("rotary")
        k_cache.index_copy_(0, batch.write_entries, qk[:, nh:])
        v_cache.index_copy_(0, batch.write_entries, qkv[:, nh + nkv :])
        tick("KV write")
        y = attention(qk[:, :nh], k_cache, v_cache)
        tick("attention")
        x += y.reshape(T, -1) @ layer.o
        tick("o-proj")
        h = F.rms_norm(x, (C,), layer.post_norm, layer.eps)
        tick("norms")
        gate, up = (h @ layer.gate_up).chunk(2, dim=-1)
        x += (F.silu(gate) * up) @ layer.down
        tick("MLP")
    last = x.index_select(0, batch.last_rows)
    logits = F.rms_norm(last, last.shape[1:], fused.norm.weight, fused.norm.eps) @ fused.lm_head
    tick("LM head")
    logits.argmax(-1).tolist()
    tick("sampling")
    return logits


class PhaseClock:
    """Seconds of each phase, summed over a step: `tick(phase)` charges the time since the last tick."""

    def __init__(self):
        self.seconds = collections.defaultdict(float)
        self.last = time.perf_counter()

    def tick(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self.last
        self.last = now


def forward(new_tokens: int, repeats: int) -> dict:
    """For each row count, each path's decode step phase by phase and whole, in rounds that take turns."""
    context_len = 1 + PROMPT + new_tokens // 2  # the streams' mean context
    results = {}
    with torch.inference_mode(), torch.no_grad():
        for rows in ROWS:
            engine, _ = served_engine(rows, fused=True)
            model = engine.model
            paths = {"plain": (model, plain_phases), "fused": (FusedTinyGPT(model), fused_phases)}
            cache, batch = decode_step(model.config, rows, context_len)
            phases, whole = {path: [] for path in PATHS}, {path: [] for path in PATHS}
            with torch_threads(engine.threads):
                for path, (step, phased) in paths.items():
                    assert torch.equal(phased(step, batch, cache, PhaseClock().tick), step(batch, cache)), path
                for _ in range(repeats):
                    for path, (step, phased) in paths.items():
                        clock = PhaseClock()
                        phased(step, batch, cache, clock.tick)
                        phases[path].append(dict(clock.seconds))
                        start = time.perf_counter()
                        step(batch, cache).argmax(-1).tolist()
                        whole[path].append(time.perf_counter() - start)
            results[str(rows)] = {path: {
                "step_ms": median_range(1e3 * np.array(whole[path])),
                "phases_ms": {phase: median_range([1e3 * p[phase] for p in phases[path]]) for phase in phases[path][0]}}
                for path in PATHS}
            print(f"{rows} rows:", {path: round(results[str(rows)][path]["step_ms"]["median"], 2) for path in PATHS},
                  flush=True)
    return {"context_len": context_len, "by_rows": results}


def chunks(repeats: int) -> dict:
    """The fast path's decode step at 32 rows, for each chunk size, at two contexts: median ms and range."""
    engine, _ = served_engine(32, fused=True)
    paths = {str(mib): FusedTinyGPT(engine.model, mib and mib << 20) for mib in CHUNK_MIB}
    results = {}
    with torch.inference_mode(), torch_threads(engine.threads):
        for context_len in (145, 273):
            cache, batch = decode_step(engine.model.config, 32, context_len)
            seconds = {mib: [] for mib in paths}
            for _ in range(repeats):
                for mib, step in paths.items():
                    start = time.perf_counter()
                    step(batch, cache)
                    seconds[mib].append(time.perf_counter() - start)
            results[str(context_len)] = {mib: median_range(1e3 * np.array(s)) for mib, s in seconds.items()}
            print(f"context {context_len}:", {mib: round(r["median"], 2) for mib, r in results[str(context_len)].items()},
                  flush=True)
    return {"rows": 32, "step_ms_by_context_and_chunk_mib": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=256, help="new tokens per stream")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of serving")
    parser.add_argument("--steps", type=int, default=40, help="rounds of the phase-by-phase step")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="the sections to measure; the others' results are kept from the file")
    args = parser.parse_args()
    path = RESULTS / "token-time-cpu.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    if "forward" in args.sections:
        result["forward"] = forward(args.new_tokens, args.steps)
    if "chunks" in args.sections:
        result["chunks"] = chunks(args.steps)
    if "serving" in args.sections:
        result["serving"] = serving(args.new_tokens, args.repeats)
    result.update({"date": datetime.date.today().isoformat(), "processor": platform.machine(),
                   "cpus": os.cpu_count(), "torch": torch.__version__, "serve_args": " ".join(SERVE_ARGS),
                   "load_average": round(os.getloadavg()[0], 2)})
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
