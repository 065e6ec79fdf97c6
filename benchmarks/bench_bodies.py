"""Whether large request bodies stall the other streams of `labkit serve`.

One stream runs (TinyGPT, one CPU thread, 400 tokens); once it has 100, another process sends
20 bodies at once, and the largest gap between two of the running stream's tokens while they
are handled (from the first sent until 50 ms after the last answer) is kept. Three kinds of
burst, in rounds that take turns:

- `small`: 20 bodies of 300 bytes, each refused at once (temperature 1): the cost of 20
  requests, whatever their size (the control);
- `near the limit`: 20 bodies just under the default body limit, which follows the model
  (57,344 bytes for TinyGPT): a text prompt the server reads, parses and tokenizes before it
  refuses it for its length;
- `near 4 MiB`: the same against a server started with `--max-body-bytes 4194304`, the
  limit every model had before.

The gap between tokens with no burst (the stream's median gap) is kept beside them. This
machine's client, server and engine share two cores: a burst also takes CPU from the engine.

Results go to benchmarks/results/bodies-cpu.json.
Run: `python benchmarks/bench_bodies.py` (about a minute on a 2-core CPU).
"""

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import platform
import statistics
import time
from pathlib import Path

import httpx

from labkit.engine import ModelConfig
from labkit.serve.limits import Limits
from labkit.serve.processes import start_labkit_serve

RESULTS = Path(__file__).resolve().parent / "results"
NUM_BODIES, STREAM_TOKENS, BURST_AFTER = 20, 400, 100
FOUR_MIB = 4 * 2**20


def bodies(kind: str, limit: int) -> list[bytes]:
    """The burst's bodies: each a completion request of about the size its kind says."""
    if kind == "small":
        body = {"model": "tinygpt", "prompt": "x" * 200, "max_tokens": 1, "temperature": 1}
    else:
        body = {"model": "tinygpt", "prompt": "x" * (limit - 100), "max_tokens": 1}
    return [json.dumps(body).encode()] * NUM_BODIES


def send_burst(url: str, contents: list[bytes], go, sent) -> None:
    """In a process of its own: wait for `go`, send every body at once, put (first sent, last answered)."""
    async def burst():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=NUM_BODIES)) as client:
            go.wait()
            start = time.time()
            await asyncio.gather(*[client.post(f"{url}/v1/completions", content=content,
                                               headers={"content-type": "application/json"}) for content in contents])
            sent.put((start, time.time()))
    asyncio.run(burst())


async def token_times(url: str, go) -> list[float]:
    """The running stream's token arrival times; `go` is set once it has BURST_AFTER tokens."""
    times = []
    payload = {"model": "tinygpt", "prompt": [0, 5], "max_tokens": STREAM_TOKENS, "stream": True}
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", f"{url}/v1/completions", json=payload) as answer:
            async for line in answer.aiter_lines():
                if line.startswith("data: {"):
                    times.append(time.time())
                    if len(times) == BURST_AFTER:
                        go.set()
    return times


def one_burst(url: str, contents: list[bytes]) -> dict:
    """The running stream's largest gap while the burst is handled, and its median gap, in ms."""
    go, sent = multiprocessing.Event(), multiprocessing.Queue()
    sender = multiprocessing.Process(target=send_burst, args=(url, contents, go, sent))
    sender.start()
    times = asyncio.run(token_times(url, go))
    start, end = sent.get()
    sender.join()
    gaps = [(earlier, later - earlier) for earlier, later in zip(times, times[1:])]
    during = [gap for earlier, gap in gaps if earlier + gap >= start and earlier <= end + 0.05]
    return {"largest_gap_ms": 1000 * max(during, default=0.0),
            "median_gap_ms": 1000 * statistics.median(gap for _, gap in gaps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    config = ModelConfig()
    limit = Limits().for_model(config.max_seq_len, config.vocab_size).max_body_bytes
    runs = {"small": [], "near the limit": [], "near 4 MiB": []}
    with start_labkit_serve("--device", "cpu", "--threads", "1") as default, \
            start_labkit_serve("--device", "cpu", "--threads", "1", "--max-body-bytes", str(FOUR_MIB)) as old:
        default.wait_until_healthy()
        old.wait_until_healthy()
        for _ in range(args.repeats):
            for kind, server, size in (("small", default, limit), ("near the limit", default, limit),
                                       ("near 4 MiB", old, FOUR_MIB)):
                runs[kind].append(one_burst(server.url, bodies(kind, size)))
                print(kind, {key: round(value, 1) for key, value in runs[kind][-1].items()}, flush=True)
    result = {"date": datetime.date.today().isoformat(), "machine": platform.machine(), "cpus": os.cpu_count(),
              "load_average": round(os.getloadavg()[0], 2), "default_body_limit": limit, "bodies": NUM_BODIES,
              "runs": runs,
              "largest_gap_ms": {kind: {"median": statistics.median(r["largest_gap_ms"] for r in rows),
                                        "range": [min(r["largest_gap_ms"] for r in rows),
                                                  max(r["largest_gap_ms"] for r in rows)]}
                                 for kind, rows in runs.items()}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bodies-cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["largest_gap_ms"], indent=2))


if __name__ == "__main__":
    main()
