"""Choosing where tensors live: "auto", "cpu", "cuda" or "mps".

Invariant: `resolve_device` returns only a device that is present on this machine;
otherwise it raises ValueError that lists the devices that are.
"""

from __future__ import annotations

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
