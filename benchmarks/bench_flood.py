"""What one client that floods `labkit serve` does to another client's time to first token.

`labkit serve` has no per-client fairness: its queue is first come, first served (or by the
`priority` field), whoever sent the requests. This measures the cost of that on the default
server (TinyGPT, 8 slots, one CPU thread): a quiet client's TTFT alone (the median of five
requests), then the TTFT of one request it sends once a flooding client holds `--flood`
streams of `--flood-tokens` tokens each (8 of them running, the rest waiting).

Results go to benchmarks/results/flood-<device>.json.
Run: `python benchmarks/bench_flood.py` (about half a minute on a 2-core CPU).
"""

import argparse
import asyncio
import datetime
import json
import platform
import statistics
import threading
import time
from pathlib import Path

import httpx

import labkit as lk
from labkit.engine import Engine, ModelConfig
from labkit.serve.guards import make_server
from labkit.serve.limits import Limits
from labkit.serve.processes import free_port
from labkit.serve.server import build_server

RESULTS = Path(__file__).resolve().parent / "results"
QUIET_PROMPT, QUIET_TOKENS = list(range(1, 17)), 16  # the quiet client's request: 16 prompt tokens, 16 out


def serve() -> tuple[str, object, threading.Thread]:
    """(url, uvicorn server, its thread) of `labkit serve`'s default TinyGPT with 8 slots."""
    port = free_port()
    limits = Limits(shutdown_grace=0.1)
    app, online = build_server(Engine(ModelConfig(), device="cpu", seed=0, threads=1), lk.Continuous(num_slots=8),
                               limits=limits)
    server = make_server(app, online, limits, port=port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, thread


async def ttft(client: httpx.AsyncClient, url: str, max_tokens: int = QUIET_TOKENS, prompt=QUIET_PROMPT) -> float:
    """Seconds from sending a streamed request to its first token; the stream is then read to its end."""
    payload = {"model": "tinygpt", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    sent, first = time.perf_counter(), None
    async with client.stream("POST", f"{url}/v1/completions", json=payload) as answer:
        async for line in answer.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - sent
    return first


async def waiting(client: httpx.AsyncClient, url: str) -> float:
    lines = (await client.get(f"{url}/metrics")).text.splitlines()
    return next(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:num_requests_waiting"))


async def measure(url: str, flood: int, flood_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=flood + 8)) as client:
        await ttft(client, url)  # warm-up
        alone = [await ttft(client, url) for _ in range(5)]
        flooding = [asyncio.create_task(ttft(client, url, flood_tokens, [7])) for _ in range(flood)]
        while await waiting(client, url) < flood - 8:  # the flood is in: 8 running, the rest queued
            await asyncio.sleep(0.05)
        behind_flood = await ttft(client, url)
        await asyncio.gather(*flooding)
    return {"quiet_ttft_alone_median_s": statistics.median(alone), "quiet_ttft_behind_flood_s": behind_flood,
            "flood_streams": flood, "flood_tokens_each": flood_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood", type=int, default=64, help="the flooding client's concurrent streams (default 64)")
    parser.add_argument("--flood-tokens", type=int, default=128, help="tokens each of them asks for (default 128)")
    args = parser.parse_args()
    url, server, thread = serve()
    try:
        result = asyncio.run(measure(url, args.flood, args.flood_tokens))
    finally:
        server.should_exit = True
        thread.join()
    result.update(date=datetime.date.today().isoformat(), machine=platform.machine(), slots=8)
    print(f"quiet client's TTFT alone: {result['quiet_ttft_alone_median_s'] * 1000:.0f} ms (median of 5); behind "
          f"{args.flood} streams of {args.flood_tokens} tokens from one flooding client: "
          f"{result['quiet_ttft_behind_flood_s']:.2f} s")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "flood-cpu.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
