"""What one client that floods `labkit serve` does to another client's time to first token,
under first come, first served and under `--policy fair`, with room in the queue and with
the queue full.

`labkit serve` (TinyGPT, 8 slots, one CPU thread, its engine's loop in a process of its own)
is started once per policy. A polite client (`user: "polite"`) first measures its TTFT alone:
the median of five requests of 8 tokens, one after another. Then a flooding client (`user:
"flood"`) keeps `--flood` streams of `--flood-tokens` tokens open, each sending its next
request as soon as one ends (a notebook cell with `asyncio.gather` over many prompts does the
same); once the server's queue holds the flood (8 running, the rest waiting), the polite
client sends its five requests again, one after another, and their TTFTs are kept. Under
first come, first served each waits behind the queue the flood keeps full; under `fair` it
is admitted at the next free slot, its client having been served the fewest tokens.
With `--max-waiting 16` the queue is full: the flood's refused requests (503) are sent again
at once, as a careless client does, and a polite request takes the place of the flood's
newest waiting one (`labkit serve` sheds the client holding the most of the queue). A
polite request refused is counted, not sent again.

Results go to benchmarks/results/flood-cpu.json.
Run: `python benchmarks/bench_flood.py` (about a minute on a 2-core CPU).
"""

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import httpx

from labkit.serve.processes import start_labkit_serve

RESULTS = Path(__file__).resolve().parent / "results"
POLITE_PROMPT, POLITE_TOKENS, POLITE_REQUESTS = list(range(1, 17)), 8, 5  # 16 prompt tokens (BOS first), 8 out
SLOTS = 8
POLICIES = ("continuous", "fair")
QUEUES = {"room in the queue": [], "the queue full": ["--max-waiting", "16"]}


async def ttft(client: httpx.AsyncClient, url: str, user: str, max_tokens: int, prompt: list[int]) -> float | None:
    """Seconds from sending a streamed request to its first token, the stream then read to its
    end; None if the server refused it (503)."""
    payload = {"model": "tinygpt", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "user": user}
    sent, first = time.perf_counter(), None
    async with client.stream("POST", f"{url}/v1/completions", json=payload) as answer:
        if answer.status_code == 503:
            return None
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - sent
    return first


async def num_waiting(client: httpx.AsyncClient, url: str) -> float:
    """The server's queue, as its /metrics gauge says."""
    lines = (await client.get(f"{url}/metrics")).text.splitlines()
    return next(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:num_requests_waiting"))


async def polite_ttfts(client: httpx.AsyncClient, url: str) -> list[float]:
    return [await ttft(client, url, "polite", POLITE_TOKENS, POLITE_PROMPT) for _ in range(POLITE_REQUESTS)]


async def flood_stream(client: httpx.AsyncClient, url: str, tokens: int, stop: asyncio.Event) -> int:
    """One of the flood's streams: request after request, a refused one sent again at once, until
    `stop`; how many it sent."""
    sent = 0
    while not stop.is_set():
        await ttft(client, url, "flood", tokens, [0, 7])
        sent += 1
    return sent


async def measure(url: str, flood: int, flood_tokens: int, queue_size: int) -> dict:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=flood + 8)) as client:
        await ttft(client, url, "polite", POLITE_TOKENS, POLITE_PROMPT)  # warm-up
        alone = await polite_ttfts(client, url)
        stop = asyncio.Event()
        flooding = [asyncio.create_task(flood_stream(client, url, flood_tokens, stop)) for _ in range(flood)]
        while await num_waiting(client, url) < min(flood - SLOTS, queue_size):  # the flood is in
            await asyncio.sleep(0.05)
        behind = await polite_ttfts(client, url)
        stop.set()
        flood_requests = sum(await asyncio.gather(*flooding))
    served = [seconds for seconds in behind if seconds is not None]
    return {"polite_ttft_alone_s": alone, "polite_ttft_alone_median_s": statistics.median(alone),
            "polite_ttft_behind_flood_s": behind, "polite_refused": len(behind) - len(served),
            "polite_ttft_behind_flood_median_s": statistics.median(served) if served else None,
            "flood_requests_sent": flood_requests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood", type=int, default=64, help="the flooding client's concurrent streams (default 64)")
    parser.add_argument("--flood-tokens", type=int, default=128, help="tokens each of them asks for (default 128)")
    args = parser.parse_args()
    result = {"date": datetime.date.today().isoformat(), "machine": platform.machine(), "cpus": os.cpu_count(),
              "load_average": round(os.getloadavg()[0], 2), "slots": SLOTS, "flood_streams": args.flood,
              "flood_tokens_each": args.flood_tokens, "polite_tokens": POLITE_TOKENS, "by_policy": {}}
    for queue, flags in QUEUES.items():
        for policy in POLICIES:
            with start_labkit_serve("--policy", policy, "--slots", str(SLOTS), *flags, "--device", "cpu",
                                    "--threads", "1") as server:
                server.wait_until_healthy()
                queue_size = int(flags[1]) if flags else args.flood
                run = asyncio.run(measure(server.url, args.flood, args.flood_tokens, queue_size))
            result["by_policy"].setdefault(queue, {})[policy] = run
            behind = run["polite_ttft_behind_flood_median_s"]
            print(f"{queue}, --policy {policy}: polite TTFT alone {run['polite_ttft_alone_median_s'] * 1000:.0f} ms; "
                  f"behind {args.flood} streams of {args.flood_tokens} tokens "
                  f"{'-' if behind is None else f'{behind:.2f} s'} (median of those served), "
                  f"{run['polite_refused']} of {POLITE_REQUESTS} refused", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "flood-cpu.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
