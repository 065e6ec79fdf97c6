"""Two lanes, host and device: when each step's host work and device work run.

Each step needs host work (scheduling, preparing inputs) before its device work (the
forward pass). `two_lanes` lays out `num_steps` steps on the two lanes:

- without overlap the host waits for a step's outputs before it prepares the next, so
  the lanes take turns and a step takes host + device;
- with overlap (one step ahead, as in SGLang's overlap scheduler) the host prepares step
  t+1 while the device runs step t, so in steady state a step takes max(host, device).

With 2 ms of host and 5 ms of device work a step takes 7 ms and the device idles 2/7 of
the time; overlapped, a step takes 5 ms: (2 + 5) / 5 = 1.4 times the throughput
(`layout_summary` says so in words). `idle_stretches` lists the device lane's gaps.

Invariants:

- device work of step t starts when its host work is done and the device has finished
  step t-1; host work never overlaps host work, device work never overlaps device work;
- without overlap, host work of step t+1 starts when device work of step t ends;
- with overlap, host work of step t+1 starts when host work of step t is done and device
  work of step t has started: the host is never more than one step ahead.

The topic's other parts: `labkit.viz.lanes_figures` draws the lanes, and
`labkit.exercises.lanes_question` asks lesson 08's question (q7) about them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Lanes:
    """Stretches of work, (start, end) in seconds, on the host lane and the device lane."""

    host: np.ndarray  # (H, 2)
    device: np.ndarray  # (D, 2)

    @property
    def span(self) -> float:
        """Seconds from the first stretch's start to the last one's end."""
        stretches = np.concatenate([self.host, self.device])
        return float(stretches[:, 1].max() - stretches[:, 0].min())

    @property
    def device_idle_fraction(self) -> float:
        """The share of the span in which the device does no work."""
        return 1.0 - float((self.device[:, 1] - self.device[:, 0]).sum()) / self.span

    @property
    def step_period(self) -> float:
        """Seconds between the ends of the last two device stretches: a step in steady state."""
        return float(self.device[-1, 1] - self.device[-2, 1])

    @classmethod
    def from_log(cls, log, num_steps: int, first_step: int = 0) -> Lanes:
        """The measured stretches of an engine run's steps first_step .. first_step + num_steps - 1,
        on the wall clock, from the end of the step before them (or the run's start)."""
        device = np.array(log.lanes["device"]).reshape(-1, 2)[first_step : first_step + num_steps]
        host = np.array(log.lanes["host"]).reshape(-1, 2)
        origin = log.lanes["device"][first_step - 1][1] if first_step else 0.0
        host = host[(host[:, 1] > origin) & (host[:, 0] < device[-1, 1])]
        return cls(np.clip(host, origin, None) - origin, device - origin)


def two_lanes(host: float, device: float, num_steps: int, overlap: bool) -> Lanes:
    """`num_steps` steps of `host` seconds of host work and `device` seconds of device work each."""
    host_stretches, device_stretches = np.zeros((num_steps, 2)), np.zeros((num_steps, 2))
    host_free = device_free = 0.0  # when each lane may take its next stretch
    for t in range(num_steps):
        host_stretches[t] = host_free, host_free + host
        device_start = max(host_free + host, device_free)
        device_stretches[t] = device_start, device_start + device
        device_free = device_start + device
        host_free = max(host_free + host, device_start) if overlap else device_free
    return Lanes(host_stretches, device_stretches)


def overlap_speedup(host: float, device: float) -> float:
    """Steady-state throughput with overlap over without: (host + device) / max(host, device)."""
    return (host + device) / max(host, device)


def idle_stretches(lanes: Lanes) -> np.ndarray:
    """(start, end) of every gap in the device lane, from the first stretch of either lane to the last."""
    device = lanes.device[np.argsort(lanes.device[:, 0])]
    starts = np.concatenate([[min(lanes.host[:, 0].min(), device[0, 0])], device[:, 1]])
    ends = np.concatenate([device[:, 0], [max(lanes.host[:, 1].max(), device[-1, 1])]])
    keep = ends > starts
    return np.column_stack([starts[keep], ends[keep]])


def layout_summary(host: float, device: float) -> str:
    """The arithmetic of `host` and `device` ms per step, without and with overlap."""
    plain = two_lanes(host, device, 2, overlap=False)
    return (f"without overlap a step takes {host + device:.1f} ms and the device idles "
            f"{plain.device_idle_fraction:.1%} of the time; with overlap a step takes {max(host, device):.1f} ms: "
            f"{overlap_speedup(host, device):.2f}x the throughput")
