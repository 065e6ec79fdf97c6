"""The engine: the "run" back end. A real TinyGPT forward pass for every step.

`Engine.run(trace, policy)` takes the same policy objects as `labkit.simulate` and
returns the same `StepLog`: the shared loop in `labkit.sched.driver` asks the policy,
applies its decision and records the step; the engine only executes steps. A
`ModelRunner` (`labkit.engine.model_runner`) runs each step on the model, timed by the
`StepTimer` it calls at each phase (`labkit.engine.steps`). With `overlap=True` the loop is
`labkit.sched.overlap`'s, one step ahead, and the runner `labkit.engine.overlap`'s
`LaneRunner`, the same step with its device work on a lane of its own.

Invariants:

- every sequence is a begin-of-sequence token, the request's prompt, then its outputs;
  prompt ids come from the trace when it carries them, and are otherwise drawn from the
  engine's seed and the request id, so a request is the same request alone or batched,
  in any run;
- a request's KV lives in the paged cache blocks that `labkit.sched.BlockPool` lent
  it, `policy.block_size` tokens each; the pool has the policy's `num_blocks`, or, when
  that is unlimited, enough for every slot to hold the longest request; every block is
  back in the pool when a run ends;
- each step processes exactly the tokens the policy scheduled: a whole prompt, a chunk
  of one, a recompute of prompt and outputs after preemption, or one decode token; a
  request samples its next token only when the step leaves none of its tokens uncomputed;
- decoding is greedy and each request emits exactly its output length (EOS is ignored);
- the clock advances by each step's measured wall time, from the previous step's end to
  its own, split into host and device time; when nothing runs it jumps to the next
  arrival rather than sleeping;
- under `Static(drop_finished=False)`, a finished request that still holds its slot
  is computed anyway, as a padded row whose output is thrown away (as Hugging Face's
  `generate` does); with `drop_finished=True` only live rows are computed. The padded
  rows are the batch's (`labkit.sched.state.Batch.padding`), so the simulator prices
  exactly the rows the engine computes;
- the batches it runs are the policy's `shape` (`labkit.sched.shape.ExecutionShape`): a
  pure decode step is padded to the smallest of its decode sizes that holds it (on CUDA a
  graph is captured per size; on the CPU the same padded step runs eagerly), and the
  padded rows are the batch's too (`Batch.num_shape_padding`); `execution_shape` gives a
  shape whose `max_seq_len` is the model's, and a longer one is refused.
"""

from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from labkit.checks import flag, whole_number
from labkit.engine.config import ModelConfig
from labkit.engine.cuda_graphs import DecodeGraphs
from labkit.engine.device import default_threads, resolve_device, torch_threads
from labkit.engine.fused import FusedTinyGPT
from labkit.engine.kv import PagedKVCache
from labkit.engine.model import TinyGPT
from labkit.engine.model_runner import HostWork, ModelRunner, busy_python
from labkit.engine.overlap import LaneRunner, OverlappedSteps
from labkit.engine.steps import StepTimer, TimedSteps
from labkit.engine.timing import (count_step_operations, decode_step_parts, decode_step_seconds,
                                  linear_layers_seconds)
from labkit.sched import BlockPool, StepLog
from labkit.sched.driver import drive
from labkit.sched.overlap import drive_overlapped
from labkit.sched.policy import check_policy, shape_of
from labkit.sched.scheduler import kv_pool
from labkit.sched.shape import ExecutionShape
from labkit.traffic import Trace

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sequence_lengths(trace: Trace) -> np.ndarray:
    """The most tokens each request's cache holds: BOS, the prompt, and every output but the last."""
    return trace.prompt_lengths + trace.output_lengths


def _check_knobs(threads, dtype, overlap, extra_host_seconds, extra_host_work, fused) -> None:
    """A ValueError naming the first of an Engine's knobs that has a value it cannot take."""
    whole_number("threads", threads, or_none=True)
    if dtype not in DTYPES:
        raise ValueError(f"dtype = {dtype!r}: must be one of {', '.join(DTYPES)}")
    flag("overlap", overlap)
    flag("fused", fused)
    if isinstance(extra_host_seconds, bool) or not isinstance(extra_host_seconds, (int, float)) or not (
            0 <= extra_host_seconds < 1):
        raise ValueError(f"extra_host_seconds = {extra_host_seconds!r}: must be a number of seconds in [0, 1)")
    if not callable(extra_host_work):
        raise ValueError(f"extra_host_work = {extra_host_work!r}: must be a function of seconds, such as "
                         "busy_python, busy_native or time.sleep")


class Engine:
    """A tiny transformer with a paged KV cache, driven by a scheduling policy."""

    def __init__(self, config: ModelConfig | None = None, device: str = "auto", seed: int = 0,
                 model: TinyGPT | None = None, threads: int | None = None, dtype: str = "float32",
                 cuda_graphs: bool = True, overlap: bool = False, extra_host_seconds: float = 0.0,
                 extra_host_work: HostWork = busy_python, fused: bool = False):
        """threads: torch's intra-op CPU threads while the engine works; by default every
        CPU but one (`labkit.engine.device.default_threads` says why).
        dtype: "float32" (the default, for exact comparisons), "bfloat16" or "float16".
        cuda_graphs: on a CUDA device, replay decode steps from CUDA graphs
        (`labkit.engine.cuda_graphs`); ignored elsewhere.
        overlap: schedule and prepare step t+1 while step t runs (`labkit.engine.overlap`).
        extra_host_seconds: host work added to every step's host side, a knob to make the
        host's share large on purpose.
        extra_host_work: what that work is (`labkit.engine.model_runner`): `busy_python` (the
        default) holds a core and the interpreter lock, `busy_native` a core only,
        `sleep_holding_lock` the lock only, `time.sleep` neither.
        fused: run steps on `labkit.engine.fused.FusedTinyGPT`, the same arithmetic in fewer torch
        calls (`labkit serve`'s default); by default they run on `TinyGPT.forward`, the plain path a
        student reads, which the lessons and the saved price of a step measure.
        """
        _check_knobs(threads, dtype, overlap, extra_host_seconds, extra_host_work, fused)
        self.device = resolve_device(device)
        self.dtype_name, self.dtype = dtype, DTYPES[dtype]
        self.model = (model or TinyGPT(config or ModelConfig(), seed=seed)).to(self.device, self.dtype).eval()
        self.config = self.model.config
        self.seed = seed
        self.threads = threads or default_threads()
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.overlap = overlap
        self.extra_host_seconds = float(extra_host_seconds)
        self.extra_host_work = extra_host_work
        self.fused = fused

    def __repr__(self) -> str:
        extra = f", extra_host_seconds={self.extra_host_seconds}" if self.extra_host_seconds else ""
        if self.extra_host_work is not busy_python:
            extra += f", extra_host_work={getattr(self.extra_host_work, '__name__', self.extra_host_work)}"
        return (f"Engine({self.config}, device={str(self.device)!r}, seed={self.seed}, threads={self.threads}, "
                f"dtype={self.dtype_name!r}, cuda_graphs={self.cuda_graphs}, overlap={self.overlap}, fused={self.fused}{extra})")

    def prompt_ids(self, request_id: int, prompt_len: int) -> list[int]:
        """The begin-of-sequence token and `prompt_len` prompt ids drawn from (seed, request id)."""
        rng = np.random.default_rng([self.seed, request_id])
        return [self.config.bos_token_id, *rng.integers(1, self.config.vocab_size, prompt_len).tolist()]

    def run(self, trace: Trace, policy, on_step=None, progress: bool = True) -> StepLog:
        """Serve `trace` with `policy`; returns the StepLog, with `outputs` and measured times.

        progress: show a progress bar for runs longer than about a second.
        """
        check_policy(policy)
        self._check_shape(shape_of(policy))
        self._check_fits(trace)
        self._check_vocabulary(trace)
        blocks = kv_pool(policy, int(sequence_lengths(trace).max()))
        prompts = [self.prompt(trace, index) for index in range(len(trace))]
        with torch.inference_mode(), torch_threads(self.threads), tqdm(
            total=int(trace.output_lengths.sum()), unit="tok", delay=1.0, disable=not progress, leave=False
        ) as bar:
            if self.overlap:
                with OverlappedSteps(self.model_runner(blocks, LaneRunner, num_requests=len(trace)), bar) as steps:
                    log = drive_overlapped(trace, policy, steps, on_step, blocks, prompts)
            else:
                timer = StepTimer(self.device.type == "cuda")
                steps = TimedSteps(self.model_runner(blocks, timer=timer), timer, bar)
                log = drive(trace, policy, steps, on_step, blocks, prompts)
        assert blocks.num_free_blocks == blocks.num_blocks, "a run must return every KV block"
        return log

    def model_runner(self, blocks: BlockPool, kind: type[ModelRunner] = ModelRunner, **options) -> ModelRunner:
        """A runner of this engine's model over a new KV cache of `blocks`' size, with CUDA graphs
        if the engine uses them; `kind`: `ModelRunner`, or the overlapped engine's `LaneRunner`,
        given its `options`."""
        cache = PagedKVCache(self.config, blocks.num_blocks, blocks.block_size, self.device, self.dtype)
        model = FusedTinyGPT(self.model) if self.fused else self.model
        graphs = DecodeGraphs(model, cache) if self.cuda_graphs else None
        return kind(model, cache, graphs, self.extra_host_seconds, self.extra_host_work, **options)

    def prompt(self, trace: Trace, index: int) -> list[int]:
        """BOS and the prompt of the request at `index` in `trace`: the trace's ids if it has them,
        else drawn from the engine's seed and the request's id."""
        if trace.prompt_tokens:
            return [self.config.bos_token_id, *trace.prompt_tokens[index].tolist()]
        return self.prompt_ids(int(trace.ids[index]), int(trace.prompt_lengths[index]))

    def time_decode_step(self, batch_size: int, context_len: int = 128, repeats: int = 5, block_size: int = 16,
                         cpu_time: bool = False, prompt_len: int = 0) -> float:
        """Median seconds of one decode step of `batch_size` requests, each `context_len` tokens deep;
        with `cpu_time`, CPU seconds (`labkit.engine.timing` says why); with `prompt_len`, a step
        that also admits one request and prefills its prompt of that many tokens."""
        return decode_step_seconds(self, batch_size, context_len, repeats, block_size, cpu_time, prompt_len)

    def decode_step_parts(self, batch_size: int, context_len: int = 128, repeats: int = 5,
                          cpu_time: bool = False) -> dict[str, float]:
        """Median seconds of a decode step and of its GEMMs, its attention and everything else
        (`labkit.engine.timing` says how each is measured); with `cpu_time`, CPU seconds."""
        return decode_step_parts(self, batch_size, context_len, repeats, cpu_time=cpu_time)

    def time_linear_layers(self, rows: int, passes: int = 1, repeats: int = 5, cpu_time: bool = False) -> float:
        """Median seconds of the step's linear layers over `rows` rows in `passes` passes (each
        pass reads every weight); with `cpu_time`, CPU seconds."""
        return linear_layers_seconds(self, rows, passes, repeats, cpu_time)

    def count_step_operations(self, batch_size: int, context_len: int = 128) -> int:
        """Operations one eager decode step asks the framework for."""
        return count_step_operations(self, batch_size, context_len)

    def execution_shape(self, decode_sizes=None, max_num_tokens: int | None = None) -> ExecutionShape:
        """The batches this engine runs: `decode_sizes` (its graph sizes; None: any), at most
        `max_num_tokens` tokens a step, and sequences up to its model's `max_seq_len`."""
        return ExecutionShape(decode_sizes, max_num_tokens, self.config.max_seq_len)

    def _check_shape(self, shape: ExecutionShape) -> None:
        """A ValueError if a policy's shape promises sequences longer than the model takes."""
        if shape.max_seq_len is not None and shape.max_seq_len > self.config.max_seq_len:
            raise ValueError(f"policy.shape.max_seq_len = {shape.max_seq_len} is more than this model's max_seq_len "
                             f"{self.config.max_seq_len}; use engine.execution_shape(...)")

    def fits(self, trace: Trace) -> np.ndarray:
        """bool per request: whether its whole sequence fits the model's `max_seq_len`."""
        return sequence_lengths(trace) <= self.config.max_seq_len

    def _check_fits(self, trace: Trace) -> None:
        """A ValueError if a request can never fit the model."""
        too_long = np.flatnonzero(~self.fits(trace))
        if too_long.size:
            i = int(too_long[0])
            raise ValueError(
                f"request {int(trace.ids[i])}: prompt {int(trace.prompt_lengths[i])} + output "
                f"{int(trace.output_lengths[i])} tokens exceed max_seq_len {self.config.max_seq_len}"
            )

    def _check_vocabulary(self, trace: Trace) -> None:
        for i, tokens in enumerate(trace.prompt_tokens):
            outside = np.flatnonzero(tokens >= self.config.vocab_size)
            if outside.size:
                raise ValueError(
                    f"request {int(trace.ids[i])}: prompt token id {int(tokens[outside[0]])} at position "
                    f"{int(outside[0])} is outside the vocabulary (0..{self.config.vocab_size - 1})"
                )
