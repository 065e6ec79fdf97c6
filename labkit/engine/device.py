"""Choosing where tensors live ("auto", "cpu", "cuda" or "mps"), and how many CPU threads work on them.

Invariants:

- `resolve_device` returns only a device that is present on this machine; otherwise it
  raises ValueError that lists the devices that are;
- `torch_threads` sets torch's intra-op threads only inside its block, and restores the
  process's setting after it, so an engine never changes what the rest of a notebook sees.
"""

from __future__ import annotations

import contextlib
import os

import torch

DEVICE_NAMES = ("auto", "cpu", "cuda", "mps")


def available_devices() -> list[str]:
    """Device types present on this machine, fastest first."""
    names = []
    if torch.cuda.is_available():
        names.append("cuda")
    if torch.backends.mps.is_available():
        names.append("mps")
    return names + ["cpu"]


def resolve_device(name: str) -> torch.device:
    """"auto" picks cuda, then mps, then cpu; a named device must be present."""
    available = available_devices()
    if name not in DEVICE_NAMES:
        raise ValueError(
            f"device = {name!r}: must be one of {', '.join(DEVICE_NAMES)}; "
            f"available on this machine: {', '.join(available)}"
        )
    if name == "auto":
        return torch.device(available[0])
    if name not in available:
        raise ValueError(f"device = {name!r} is not present; available on this machine: {', '.join(available)}")
    return torch.device(name)


def default_threads() -> int:
    """Torch intra-op threads for the engine: every CPU this process may use but one, at least one.

    The tiny default model's steps are short and made of small operations. A thread pool
    waits for its slowest thread at every operation, so when another process (the notebook
    server, the browser drawing a live figure) takes a core that a pool thread needs, every
    step stalls. Measured on a 2-core machine (benchmarks/bench_engine.py, DESIGN.md): with
    one core kept busy, a B = 8 decode step slowed 2.6x at 2 threads and not at all (0.99x)
    at 1 thread. Leaving one core free keeps steps steady, at some cost in speed on an idle
    machine (two threads were 1.5x faster there); `Engine(threads=...)` overrides it.
    """
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, available - 1)


@contextlib.contextmanager
def torch_threads(num_threads: int):
    """Run the block with `num_threads` intra-op threads, then restore the previous count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
