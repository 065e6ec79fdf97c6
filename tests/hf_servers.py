"""A second real server for tests: `transformers serve` on a tiny Llama directory, in a subprocess.

    with transformers_serve() as server:          # saves TINY_LLAMA's weights to a temporary directory
        lk.replay(trace, url=server.url, model=server.model, tokenizer=server.directory)

    with transformers_serve(directory) as server:  # serves a directory you saved, e.g. with
        ...                                        # labkit.engine.peers.save_llama_dir, for labkit serve too

It runs `transformers serve DIR --continuous-batching --device cpu --dtype float32` offline
(HF_HUB_OFFLINE=1) on a free loopback port, with a small KV cache and batch (`--cb-num-blocks`,
`--cb-max-batch-tokens`: sized from free memory by default, the cache takes 10-14 s to set up
on the first request on a CPU), waits until /health answers (or fails with the server's
stderr), yields a `HFServer` and kills the server at the end. The executable is the
`transformers` beside this interpreter; it needs the `test` extra's accelerate and openai.

What such a server is, checked on transformers 5.24: it serves /v1/completions, /v1/models
and /health, and no /metrics; the model name a request sends is DIR exactly as given on its
command line (GET /v1/models lists it; any other name is refused with HTTP 400); it refuses
unknown fields (ignore_eos, min_tokens, priority: HTTP 422) and token-id prompts (HTTP 400);
it streams text, one chunk per token that decodes to something, then a chunk with the
finish_reason and the usage, and no [DONE]; greedy unless a request asks for sampling; an
empty prompt kills its continuous-batching worker.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from labkit.engine.model import ModelConfig
from labkit.engine.peers import save_llama_dir

# Ids 1..127 are the ASCII bytes 0..126, so each token the model emits decodes to one character
# (id 0, the begin-of-sequence token, decodes to nothing).
TINY_LLAMA = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=256)
START_TIMEOUT_S = 120  # seconds for the server to load the model and answer /health
NUM_BLOCKS = 256  # KV cache blocks, of transformers' default 256 tokens each
MAX_BATCH_TOKENS = 256  # tokens per step; both far more than the tests' requests need
STDERR_SHOWN = 3000  # characters of the server's stderr a failure to start shows


@dataclass(frozen=True)
class HFServer:
    """A running `transformers serve`: its base URL, the model name requests must send (the
    directory as given on its command line), and the model directory (its tokenizer included)."""

    url: str
    model: str
    directory: Path


@contextlib.contextmanager
def transformers_serve(directory: str | os.PathLike | None = None, *, config: ModelConfig = TINY_LLAMA,
                       seed: int = 0, threads: int = 1, num_blocks: int = NUM_BLOCKS,
                       max_batch_tokens: int = MAX_BATCH_TOKENS, timeout: float = START_TIMEOUT_S):
    """Serve a Llama directory with `transformers serve` and yield its `HFServer`; kill it at the end.

    directory: the model directory to serve; None saves `save_llama_dir(tmp, config, seed)` into a
    temporary directory, removed at the end. threads: torch's CPU threads in the server.
    num_blocks, max_batch_tokens: its KV cache blocks and tokens per step (`--cb-num-blocks`,
    `--cb-max-batch-tokens`). timeout: seconds to wait for /health before failing with the
    server's stderr.
    """
    with contextlib.ExitStack() as stack:
        if directory is None:
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tiny-llama-")))
            save_llama_dir(directory, config, seed)
        directory = Path(directory)
        stderr = stack.enter_context(tempfile.TemporaryFile("w+"))
        port = free_port()
        server = subprocess.Popen(
            [str(_executable()), "serve", str(directory), "--continuous-batching", "--device", "cpu",
             "--dtype", "float32", "--cb-num-blocks", str(num_blocks), "--cb-max-batch-tokens",
             str(max_batch_tokens), "--host", "127.0.0.1", "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=stderr,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)},
        )
        stack.callback(_stop, server)
        url = f"http://127.0.0.1:{port}"
        _wait_for_health(server, url, stderr, timeout)
        yield HFServer(url=url, model=str(directory), directory=directory)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _executable() -> Path:
    executable = Path(sys.executable).parent / "transformers"
    if not executable.exists():
        raise RuntimeError(f"{executable}: no `transformers` command beside this Python; install transformers")
    return executable


def _wait_for_health(server: subprocess.Popen, url: str, stderr, timeout: float) -> None:
    """Return once GET /health answers 200; a server that exits or stays silent fails with its stderr."""
    deadline = time.monotonic() + timeout
    while server.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    why = f"exited with code {server.returncode}" if server.poll() is not None else f"no answer after {timeout:g} s"
    stderr.seek(0)
    raise RuntimeError(f"transformers serve at {url}: {why} from /health; its stderr ends:\n"
                       f"{stderr.read()[-STDERR_SHOWN:]}")


def _stop(server: subprocess.Popen) -> None:
    server.kill()
    server.wait(timeout=30)
