"""Real servers on the same weights: `labkit serve DIR` against `transformers serve DIR
--continuous-batching` and, where it is installed (`make vllm`), `vllm serve DIR`, measured by
the same replay client on the same traffic.

Both load one Hugging Face directory: TinyGPT's default shape saved as a Llama
(`labkit.engine.peers.save_llama_dir`) with a 128-token vocabulary of ASCII bytes, so that
every token is one character and a text stream's chunks are tokens. Both get the same knobs
where they have one (16-token KV blocks, 512 of them, 256 tokens a step; labkit's 8 slots
have no transformers flag: it caps a batch at 1,024 requests by default) and one torch thread.
A third server, labkit's with 24 slots (as many as the traffic has requests), takes the slot
cap away. vLLM gets labkit's limits under its own flags (`--max-num-seqs 8`,
`--max-num-batched-tokens 256`, `--max-model-len 2048`), a 1 GiB KV cache, float32 and eager
mode (no CUDA graphs or torch.compile on a CPU), its own block size (its CPU attention
takes only multiples of 32 tokens), prefix caching off (on by default in vLLM 0.32; labkit
has none, and the rounds replay the same prompts) and one thread, pinned to core 0.
After a warm-up replay on each, it measures each, taking turns in the same order every
round (vLLM last), `--repeats` times (default 5); every replay asks for greedy decoding:

- lesson 09's traffic: the first 24 Azure conversation requests that fit, outputs capped at
  32 tokens, at twice the capacity `labkit serve --slots 8` shows in that round (every request
  sent at once, as the lesson measures it), the same arrivals for every server
  (tokens/s, TTFT, ITL);
- a lone request (a 16-token prompt, 64 tokens out): its median ITL, over HTTP, with nothing
  else to schedule: one request's decode step plus each server's streaming path;
- eight such requests sent at once: their median ITL, the same with eight in a step.

Before the rounds, each server is asked for the greedy tokens of four prompts (ASCII ids, 16
tokens out): labkit's and vLLM's as token ids, the model's begin-of-sequence id first;
`transformers serve`, which takes only text, as the prompt's text (its tokenizer adds the
begin-of-sequence token); the result records whether all agree.

A second section, `streams`, measures decode at 8 and 32 concurrent streams (each a
16-token prompt and 256 new tokens, all sent at once), three ways on the same weights and
requests, taking turns in every round: the engine `labkit serve` runs, in this process
(`Engine.run`, the engine and policy built from the same command line by the server's own
functions), `labkit serve --slots N` over HTTP (its engine's loop in a process of its own, as
`labkit serve` runs it on a CPU), and `vllm serve --max-num-seqs N`. labkit
gets 1,024 blocks of 16 here, so that 32 streams fit and none is preempted (vLLM's 1 GiB
holds them all too); the other knobs are the lesson's. It
records each round's tokens/s, the ratios serve / in-process and labkit serve / vLLM (per
round, then their medians), and the share of requests each server answered with the
in-process engine's tokens.

Results go to benchmarks/results/servers-cpu.json, or servers-cpu-vllm.json when vLLM took
part; lesson 09 quotes their ranges. `--sections` measures some sections and keeps the
others' results from the file.
Run: `python benchmarks/bench_servers.py` (about three minutes on a 2-core CPU for the lesson's
section, two more for the streams, and three for vLLM to start).
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch
import transformers

import labkit as lk
from labkit.cli import build_parser
from labkit.engine import ModelConfig
from labkit.engine.peers import save_llama_dir
from labkit.serve.server import engine_from, policy_from
from labkit.serve.processes import (VLLM_START_TIMEOUT_S, start_labkit_serve, start_transformers_serve,
                                    start_vllm_serve, vllm_command)

RESULTS = Path(__file__).resolve().parent / "results"
CONFIG = ModelConfig(vocab_size=128)  # TinyGPT's shape, ASCII bytes only
KNOBS = ["--blocks", "512", "--block-size", "16", "--budget", "256", "--chunked-prefill"]
SLOTS, NO_CAP = 8, 24  # labkit's slot cap in lesson 09, and one that never binds on its 24 requests
LOAD = 2  # lesson 09's load: twice the capacity labkit serve --slots 8 shows
STREAMS = (8, 32)  # concurrent streams in the `streams` section
STREAM_PROMPT, STREAM_TOKENS = 16, 256  # each stream's prompt and new tokens
STREAM_KNOBS = ["--blocks", "1024", *KNOBS[2:]]  # 32 streams of 16 + 256 tokens fit: none is preempted, as in vLLM
SECTIONS = ("lesson", "streams")
THREADS = ("--device", "cpu", "--threads", "1")


def lesson_trace() -> lk.Trace:
    """Lesson 09's traffic, before its load is set: 24 Azure conversation requests, outputs capped at 32."""
    trace, _ = lk.Trace.azure_conv().capped(32).first_that_fit(24, CONFIG.max_seq_len)
    return trace


def replay_options(server, directory: str) -> dict:
    return dict(url=server.url, model=server.model, tokenizer=directory, vocab_size=CONFIG.vocab_size, progress=False)


def lesson_traffic(server, directory: str) -> tuple[lk.Trace, float]:
    """The lesson's traffic at LOAD times the capacity `server` shows now, and that capacity (requests/s)."""
    trace = lesson_trace()
    probe = lk.replay(trace.backlogged(), **replay_options(server, directory))
    assert not probe.failures, probe.failures
    served = len(trace) / probe.duration
    return trace.at_rate(LOAD * served), served


GREEDY_PROMPTS = [[73, 102, 33], [100, 101, 102, 103, 104], [66], [105, 106, 107, 108, 109, 110, 111, 112]]


def greedy_tokens(server, prompt: list[int], max_tokens: int = 16) -> list[int]:
    """`server`'s greedy tokens for `prompt` (ASCII ids): as token ids after the BOS, or, for a
    server that takes only text, as the prompt's text, its answer read back as ids."""
    body = {"model": server.model, "max_tokens": max_tokens, "temperature": 0}
    if server.name == "transformers serve":
        text = bytes(i - 1 for i in prompt).decode()
        answer = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": text}, timeout=120).json()
        return [byte + 1 for byte in answer["choices"][0]["text"].encode()]
    body.update(prompt=[CONFIG.bos_token_id, *prompt], ignore_eos=True, min_tokens=max_tokens, return_token_ids=True)
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]


def measure(server, directory: str, traffic: lk.Trace) -> dict:
    """One replay of `traffic`, a lone request and eight at once against `server`."""
    replay = replay_options(server, directory)
    log = lk.replay(traffic, **replay)
    lone = lk.replay(lk.Trace.from_lengths([64], prompt_lengths=[16]), **replay)
    eight = lk.replay(lk.Trace.from_lengths([64] * 8, prompt_lengths=[16] * 8), **replay)
    assert not (log.failures or lone.failures or eight.failures), (log.failures, lone.failures, eight.failures)
    row = lk.metrics.summary(log)
    chunks = np.concatenate(log.chunk_sizes)
    return {"tokens_per_s": row["tokens/s"], "ttft_p50_s": row["TTFT p50 (s)"], "ttft_p99_s": row["TTFT p99 (s)"],
            "itl_p50_ms": row["ITL p50 (ms)"], "tpot_mean_ms": float(np.mean(lk.metrics.tpot(log))) * 1e3,
            "chunks_with_several_tokens": float(np.mean(chunks > 1)), "lone_itl_p50_ms": lk.metrics.summary(lone)["ITL p50 (ms)"],
            "eight_itl_p50_ms": lk.metrics.summary(eight)["ITL p50 (ms)"]}


def streams_trace(num_streams: int) -> lk.Trace:
    """`num_streams` requests at once, each a 16-token prompt and 256 new tokens."""
    return lk.Trace.from_lengths([STREAM_TOKENS] * num_streams, prompt_lengths=[STREAM_PROMPT] * num_streams)


def in_process(directory: str, serve_args: list[str]):
    """(engine, policy) that `labkit serve DIRECTORY SERVE_ARGS` builds, built here by its own functions."""
    _, commands = build_parser()
    args = commands["serve"].parse_args([directory, *serve_args])
    engine, _ = engine_from(args)
    return engine, policy_from(args)


def measure_streams(num_streams: int, engine, policy, servers: dict, directory: str) -> dict:
    """One round at `num_streams` streams: tokens/s in this process, then from each server, and the share
    of requests each server answered with the in-process tokens."""
    trace = streams_trace(num_streams)
    start = time.perf_counter()
    expected = engine.run(trace, policy, progress=False).outputs
    row = {"in-process": {"tokens_per_s": int(trace.output_lengths.sum()) / (time.perf_counter() - start)}}
    for name, server in servers.items():
        log = lk.replay(trace, **replay_options(server, directory))
        assert not log.failures, log.failures
        same = np.mean([log.outputs.get(int(i)) == expected[int(i)] for i in trace.ids])
        row[name] = {"tokens_per_s": log.tokens_per_second, "same_tokens_share": float(same)}
    return row


def stream_ratios(rounds: list[dict]) -> dict:
    """Per round and as medians: labkit serve over the in-process engine, and over vLLM where it ran."""
    pairs = {"serve / in-process": ("labkit serve", "in-process"), "labkit serve / vLLM": ("labkit serve", "vllm serve")}
    ratios = {name: [r[a]["tokens_per_s"] / r[b]["tokens_per_s"] for r in rounds]
              for name, (a, b) in pairs.items() if b in rounds[0]}
    return {name: {"median": float(np.median(values)), "rounds": values} for name, values in ratios.items()}


def streams_summary(runs: dict[int, list[dict]]) -> dict:
    """For each stream count: each server's tokens/s per round, their median, and the ratios."""
    return {str(n): {"tokens_per_s": {name: {"median": float(np.median([r[name]["tokens_per_s"] for r in rounds])),
                                             "rounds": [r[name]["tokens_per_s"] for r in rounds]}
                                      for name in rounds[0]},
                     "same_tokens_share": {name: [r[name]["same_tokens_share"] for r in rounds]
                                           for name in rounds[0] if name != "in-process"},
                     "ratios": stream_ratios(rounds)}
            for n, rounds in runs.items()}


def vllm_version() -> str:
    """The version of the vLLM that `vllm_command` runs, as its own interpreter reports it."""
    python = vllm_command().parent / "python"
    return subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
                          capture_output=True, text=True, check=True).stdout.strip()


class Servers:
    """The servers the sections ask for, each started once on first use, all stopped together."""

    def __init__(self, running: contextlib.ExitStack, directory: str):
        self.running, self.directory, self.started = running, directory, {}

    def labkit(self, slots: int, knobs: list[str] = KNOBS):
        name = f"labkit serve --slots {slots}" + ("" if knobs == KNOBS else f" {' '.join(knobs)}")
        return self._start(name, lambda: start_labkit_serve(
            self.directory, *THREADS, *knobs, "--slots", str(slots), model=self.directory))

    def vllm(self, max_num_seqs: int):
        return self._start(f"vllm serve --max-num-seqs {max_num_seqs}", lambda: start_vllm_serve(
            self.directory, max_num_seqs=max_num_seqs, max_model_len=CONFIG.max_seq_len, max_num_batched_tokens=256,
            threads=1))

    def transformers(self):
        return self._start("transformers serve", lambda: start_transformers_serve(
            self.directory, num_blocks=512, max_batch_tokens=256, threads=1))

    def for_lesson(self, with_vllm: bool) -> dict:
        """The lesson's servers by name; the first one's capacity sets the load."""
        servers = {f"labkit serve --slots {SLOTS}": self.labkit(SLOTS), f"labkit serve --slots {NO_CAP}": self.labkit(NO_CAP),
                   "transformers serve": self.transformers()}
        return {**servers, f"vllm serve --max-num-seqs {SLOTS}": self.vllm(SLOTS)} if with_vllm else servers

    def for_streams(self, with_vllm: bool) -> dict[int, dict]:
        """For each stream count, labkit serve with that many slots, and vLLM with as many sequences."""
        return {n: {"labkit serve": self.labkit(n, STREAM_KNOBS), **({"vllm serve": self.vllm(n)} if with_vllm else {})}
                for n in STREAMS}

    def _start(self, name: str, start):
        if name not in self.started:
            self.started[name] = self.running.enter_context(start())
        return self.started[name]

    def wait_until_healthy(self) -> None:
        """Wait for every server started, and warm each up with a replay that is not kept."""
        for server in self.started.values():
            server.wait_until_healthy(timeout=VLLM_START_TIMEOUT_S)
            lk.replay(lesson_trace().backlogged(), **replay_options(server, self.directory))


def lesson_section(servers: dict, directory: str, repeats: int) -> dict:
    """The greedy tokens of every server, then `repeats` rounds of lesson 09's traffic, a lone request and
    eight at once, at LOAD times the capacity the first server shows in that round."""
    tokens = {name: [greedy_tokens(server, prompt) for prompt in GREEDY_PROMPTS] for name, server in servers.items()}
    tokens_equal = all(t == next(iter(tokens.values())) for t in tokens.values())
    print("greedy tokens equal on every server:", tokens_equal, flush=True)
    runs, loads = {name: [] for name in servers}, []
    for _ in range(repeats):
        traffic, served = lesson_traffic(next(iter(servers.values())), directory)
        loads.append({"capacity_rps": served, "rate_rps": LOAD * served})
        print("load", loads[-1], flush=True)
        for name, server in servers.items():
            runs[name].append(measure(server, directory, traffic))
            print(name, runs[name][-1], flush=True)
    return {"knobs": " ".join(KNOBS), "load": f"{LOAD} x the capacity of labkit serve --slots {SLOTS}",
            "greedy_tokens": {"prompts": GREEDY_PROMPTS, "by_server": tokens, "equal": tokens_equal},
            "loads": loads, "runs": runs,
            "range": {name: {key: [min(r[key] for r in rows), max(r[key] for r in rows)] for key in rows[0]}
                      for name, rows in runs.items()}}


def streams_section(servers: dict[int, dict], directory: str, repeats: int) -> dict:
    """`repeats` rounds, each at every stream count: in this process, then each server; the summary."""
    engines = {n: in_process(directory, [*THREADS, *STREAM_KNOBS, "--slots", str(n)]) for n in servers}
    runs = {n: [] for n in servers}
    for _ in range(repeats):
        for n, by_name in servers.items():
            runs[n].append(measure_streams(n, *engines[n], by_name, directory))
            print(f"{n} streams", {name: round(r["tokens_per_s"]) for name, r in runs[n][-1].items()}, flush=True)
    return {"streams": {**when(), "prompt_tokens": STREAM_PROMPT, "new_tokens": STREAM_TOKENS,
                        "knobs": " ".join(STREAM_KNOBS), "by_streams": streams_summary(runs)}}


def when() -> dict:
    """The day a section ran, what ran it, and the machine's load then."""
    return {"date": datetime.date.today().isoformat(), "processor": platform.machine(), "cpus": os.cpu_count(),
            "load_average": round(os.getloadavg()[0], 2), "torch": torch.__version__,
            "transformers": transformers.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM out even where it is installed")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="the sections to measure; the others' results are kept from the file")
    args = parser.parse_args()
    with_vllm = vllm_command() is not None and not args.no_vllm
    path = RESULTS / ("servers-cpu-vllm.json" if with_vllm else "servers-cpu.json")
    result = json.loads(path.read_text()) if path.exists() else {}
    with tempfile.TemporaryDirectory(prefix="tinygpt-llama-") as directory, contextlib.ExitStack() as running:
        save_llama_dir(directory, CONFIG, seed=0)
        started = Servers(running, directory)
        lesson = started.for_lesson(with_vllm) if "lesson" in args.sections else {}
        streams = started.for_streams(with_vllm) if "streams" in args.sections else {}
        started.wait_until_healthy()
        if lesson:  # the lesson's section keeps its fields at the top, where lesson 09 reads them
            result.update({**when(), **lesson_section(lesson, directory, args.repeats)})
        if streams:
            result.update(streams_section(streams, directory, args.repeats))
    result["vllm"] = vllm_version() if with_vllm else None
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({key: result[key] for key in ("range", "streams") if key in result}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
