"""CUDA graphs for decode steps: a GPU speed-up, kept apart from the plain forward pass.

On a GPU a tiny model's decode step is a few hundred small kernels, and launching them
one by one from Python takes longer than running them. A CUDA graph records one step's
kernels once and replays them all with a single launch, as vLLM and nano-vllm do for
decode steps. A graph fixes every shape and every address, so:

- a graph serves a bucket: exactly `batch_size` rows with contexts up to `context_len`
  tokens (the next power of two). The step arrives at a batch size the engine runs: the
  scheduler pads it to the policy's `ExecutionShape.decode_sizes` (`labkit.sched.shape`),
  so the padded rows are logged and priced, and a graph is captured per size met. Rows
  past a context feed nothing more: their table's tail is the cache's padding block;
- each graph owns static input buffers; a step's inputs are copied into them before the
  replay, and nothing the graph reads is ever reallocated;
- graphs are captured on a bucket's first use and kept for the run; all share one memory
  pool, which is safe because they replay one at a time.

Only pure decode steps replay. Prefill and mixed steps run eagerly: their shapes vary
with every prompt, and there are few of them.

`capture` is the one CUDA-only part. `eager_capture` stands in for it on the CPU, so
the tests can prove that bucketing, padding and the static buffers give exactly the
plain path's logits; the `gpu` tests prove the same for real graphs.

Invariant: for every pure decode step, `DecodeGraphs(inputs)` equals `model(inputs, cache)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from labkit.engine.attention import BatchedAttention, decode_group
from labkit.engine.kv import PagedKVCache
from labkit.engine.model import ModelInputs, TinyGPT
from labkit.sched.blocks import num_blocks_for

Step = Callable[[], torch.Tensor]


def cuda_capture(step: Step, pool) -> Step:
    """Record `step` in a CUDA graph after one warm-up call; returns a replay that gives its output tensor."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture stream, as torch advises
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        logits = step()

    def replay() -> torch.Tensor:
        graph.replay()
        return logits

    return replay


def eager_capture(step: Step, pool) -> Step:
    """The CPU's stand-in for `cuda_capture`: "replaying" calls the step on the same static buffers."""
    return step


def next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass
class _Bucket:
    """The static buffers of one graph: batch_size rows, context_len tokens of context each."""

    input_ids: torch.Tensor  # (B,)
    positions: torch.Tensor  # (B,)
    write_entries: torch.Tensor  # (B,)
    block_tables: torch.Tensor  # (B, context_len / block_size)
    context_lens: torch.Tensor  # (B,)
    rows: torch.Tensor  # (B,) 0..B-1: each row is one request's last (only) token
    replay: Step | None = None


class DecodeGraphs:
    """Decode steps of `model` over `cache`, replayed from CUDA graphs captured per bucket."""

    def __init__(self, model: TinyGPT, cache: PagedKVCache, capture=None):
        self.model, self.cache = model, cache
        self.capture = capture or cuda_capture
        self.pool = torch.cuda.graph_pool_handle() if self.capture is cuda_capture else None
        self.buckets: dict[tuple[int, int], _Bucket] = {}

    @staticmethod
    def can_run(inputs: ModelInputs) -> bool:
        """Whether the step is a pure decode step: one new token per request."""
        return inputs.input_ids.shape[0] == inputs.num_requests

    def __call__(self, inputs: ModelInputs) -> torch.Tensor:
        """(R, vocab) logits of a pure decode step, as `model(inputs, cache)` gives them."""
        assert self.can_run(inputs), "only pure decode steps replay; run prefills eagerly"
        bucket = self._bucket(inputs)
        self._load(bucket, inputs)
        if bucket.replay is None:
            bucket.replay = self.capture(lambda: self._step(bucket), self.pool)
        return bucket.replay()[: inputs.num_requests]

    def _bucket(self, inputs: ModelInputs) -> _Bucket:
        block_size = self.cache.block_size
        batch_size = inputs.num_requests
        num_blocks = next_power_of_two(num_blocks_for(max(inputs.context_lens), block_size))
        key = (batch_size, num_blocks * block_size)
        if key not in self.buckets:
            device = inputs.input_ids.device

            def zeros(*shape):
                return torch.zeros(shape, dtype=torch.long, device=device)

            self.buckets[key] = _Bucket(zeros(batch_size), zeros(batch_size), zeros(batch_size),
                                        zeros(batch_size, num_blocks), zeros(batch_size),
                                        torch.arange(batch_size, device=device))
        return self.buckets[key]

    def _load(self, bucket: _Bucket, inputs: ModelInputs) -> None:
        """Copy the step into the bucket's buffers (one row each: the bucket is the step's size);
        table entries past a request's blocks point at the padding block."""
        num_blocks = min(inputs.block_tables.shape[1], bucket.block_tables.shape[1])  # a table may reserve more
        bucket.input_ids.copy_(inputs.input_ids)
        bucket.positions.copy_(inputs.positions)
        bucket.write_entries.copy_(inputs.write_entries)
        bucket.block_tables.fill_(self.cache.padding_block)[:, :num_blocks].copy_(inputs.block_tables[:, :num_blocks])
        bucket.context_lens.copy_(torch.tensor(inputs.context_lens))

    def _step(self, bucket: _Bucket) -> torch.Tensor:
        """The decode step on the bucket's buffers: tensors only, so a graph can record it."""
        context_len = bucket.block_tables.shape[1] * self.cache.block_size
        decodes = decode_group(bucket.rows, bucket.block_tables, bucket.context_lens, self.cache.block_size,
                               context_len)
        attention = BatchedAttention([decodes], prefills=[])
        return self.model.logits(bucket.input_ids, bucket.positions, bucket.write_entries, bucket.rows, self.cache,
                                 attention)
