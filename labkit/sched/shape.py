"""Execution shapes: the batches an engine can run, an admission limit beside slots, blocks and budget.

A real engine does not run any batch it is handed. It captures CUDA graphs for a fixed list
of decode batch sizes (vLLM's `cudagraph_capture_sizes`: 1, 2, 4, then multiples of 8), so a
decode step of 9 requests replays the graph for 16, and 7 padded rows are computed and
thrown away. It is built for a most tokens per step (vLLM's `max_num_batched_tokens`,
TensorRT-LLM's `max_num_tokens`) and a longest sequence (`max_model_len`, `max_seq_len`).

`ExecutionShape` holds those three limits. A policy carries one (`policy.shape`), so both back
ends read the same shape: the scheduler pads each pure decode step's batch to
`decode_size(rows)` (`labkit.sched.state.Batch`), the engine computes the padded rows and the
simulator prices them.

Invariants:

- `decode_sizes` is sorted, without repeats; `decode_size(n)` is the smallest size that holds
  n rows, or n itself past the largest (run eagerly, unpadded, as vLLM does past its
  largest graph); with no sizes, every batch runs at its own size;
- a padded row feeds one token at position 0 against one cache entry of its own, and emits
  nothing: it is work, never a slot's use;
- a request whose sequence (begin-of-sequence token, prompt, outputs but the last) is longer
  than `max_seq_len` can never run, and is refused before any work.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from labkit.checks import whole_number


def vllm_capture_sizes(largest: int) -> tuple[int, ...]:
    """vLLM's default pattern of CUDA-graph batch sizes, up to `largest`: 1, 2, 4, multiples of 8
    below 256, then multiples of 16 (`cudagraph_capture_sizes` in vllm/config/vllm.py, 0.32)."""
    whole_number("largest", largest)
    pattern = (1, 2, 4, *range(8, 256, 8), *range(256, largest + 1, 16))
    return tuple(size for size in pattern if size <= largest)


@dataclass(frozen=True)
class ExecutionShape:
    """The batches an engine runs.

    decode_sizes: batch sizes a pure decode step runs at (graph sizes); None: any size.
    max_num_tokens: tokens one step may process; None: no limit.
    max_seq_len: the longest sequence a request may hold; None: no limit.
    """

    decode_sizes: tuple[int, ...] | None = None
    max_num_tokens: int | None = None
    max_seq_len: int | None = None

    def __post_init__(self):
        if self.decode_sizes is not None:
            if isinstance(self.decode_sizes, (str, bytes)) or not hasattr(self.decode_sizes, "__iter__"):
                raise ValueError(f"decode_sizes = {self.decode_sizes!r}: must be a list of batch sizes, such as [8, 16]")
            sizes = tuple(self.decode_sizes)
            if not sizes:
                raise ValueError("decode_sizes = []: give at least one batch size, or None for any size")
            for size in sizes:
                whole_number("decode_sizes", size)
            object.__setattr__(self, "decode_sizes", tuple(sorted(set(sizes))))
        whole_number("max_num_tokens", self.max_num_tokens, or_none=True)
        whole_number("max_seq_len", self.max_seq_len, or_none=True)

    def __repr__(self) -> str:
        shown = [f"{name}={value!r}" for name, value in vars(self).items() if value is not None]
        return f"ExecutionShape({', '.join(shown)})"

    def decode_size(self, num_rows: int) -> int:
        """Rows a pure decode step of `num_rows` rows computes: the smallest size that holds them."""
        sizes = self.decode_sizes
        if sizes is None or num_rows > sizes[-1]:
            return num_rows
        return sizes[bisect.bisect_left(sizes, num_rows)]

    def rows_to_run(self, num_running: int, num_wanted: int, min_fill: float) -> int:
        """How many of `num_wanted` rows (`num_running` of them running already) to run so that
        no decode step runs mostly padded: all of them if they stay in the size the running ones
        use, or fill at least `min_fill` of their size; else only up to the largest size they
        fill, and never fewer than run now. With nothing running, at least one row runs."""
        size = self.decode_size(num_wanted)
        if size == self.decode_size(max(num_running, 1)) or num_wanted >= min_fill * size:
            return num_wanted
        full = [s for s in self.decode_sizes if s <= num_wanted]  # past the largest size, `size` was num_wanted
        return max(num_running, full[-1])

    def check_fits(self, request) -> None:
        """A ValueError, before any work, if `request` is longer than the engine's `max_seq_len`."""
        if self.max_seq_len is not None and request.max_context_len > self.max_seq_len:
            raise ValueError(
                f"request {request.id}: its sequence holds up to {request.max_context_len} tokens (a begin-of-sequence "
                f"token, prompt {request.prompt_len}, outputs {request.output_len} but the last), more than the "
                f"engine's max_seq_len = {self.max_seq_len}; it can never run"
            )

    def check_slots(self, num_slots: int) -> None:
        """A ValueError if a step of `num_slots` decodes would already break `max_num_tokens`
        (vLLM refuses `max_num_batched_tokens` below `max_num_seqs` for the same reason)."""
        if self.max_num_tokens is not None and self.max_num_tokens < num_slots:
            raise ValueError(
                f"shape.max_num_tokens = {self.max_num_tokens} is smaller than num_slots = {num_slots}: a step in "
                "which every slot decodes would not fit; raise max_num_tokens or lower num_slots"
            )
