"""Traffic: the requests a schedule serves.

A `Trace` is an immutable table of requests. Invariants, checked on construction:

- it holds at least one request;
- output lengths are whole numbers >= 1, prompt lengths whole numbers >= 0;
- arrivals are finite, >= 0, in seconds from the first request;
- every column has one entry per request, and request ids are unique;
- if the trace carries prompt token ids, request i has exactly `prompt_lengths[i]` of
  them, each a whole number >= 0 (whether they fit a vocabulary is the model's check).

Request ids survive `select`, so a sub-trace still names the same requests.
This module imports numpy and nothing heavier.
"""

from __future__ import annotations

import csv
import gzip
import io
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

import numpy as np

from labkit.checks import number, whole_number

OUTPUT_DISTRIBUTIONS = ("exponential", "uniform", "equal", "lognormal")
PROMPT_DISTRIBUTIONS = ("uniform", "equal", "none")
CSV_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
AZURE_CONV_2023 = "azure_llm_conv_2023.csv.gz"
TOY_OUTPUT_LENGTHS = (2, 6, 3, 8, 2, 4, 5, 2)


def _whole_numbers(name: str, values, minimum: int | None) -> np.ndarray:
    """`values` as an int64 array, or a ValueError naming the first bad entry (None: no minimum)."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a flat list of numbers, got shape {array.shape}")
    if array.dtype.kind not in "iuf":
        raise ValueError(f"{name} must hold numbers, got {array.dtype} values such as {array[:1].tolist()}")
    array = array.astype(np.float64)
    bad = ~np.isfinite(array) | (array != np.round(array)) | (minimum is not None and array < minimum)
    if bad.any():
        index = int(np.argmax(bad))
        at_least = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"{name}[{index}] = {array[index]:g}: each entry must be a whole number{at_least}")
    return array.astype(np.int64)


def _prompt_tokens(prompts, prompt_lengths: np.ndarray) -> tuple[np.ndarray, ...]:
    """Each prompt's token ids as a read-only int64 array, checked against its length."""
    if not len(prompts):
        return ()
    if len(prompts) != len(prompt_lengths):
        raise ValueError(f"prompt_tokens has {len(prompts)} entries but prompt_lengths has {len(prompt_lengths)}")
    arrays = []
    for i, (tokens, length) in enumerate(zip(prompts, prompt_lengths)):
        array = _whole_numbers(f"prompt_tokens[{i}]", np.asarray(tokens).reshape(-1), minimum=0)
        if len(array) != length:
            raise ValueError(f"prompt_tokens[{i}] has {len(array)} ids but prompt_lengths[{i}] = {length}")
        array.setflags(write=False)
        arrays.append(array)
    return tuple(arrays)


def _seconds(name: str, values) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    bad = ~np.isfinite(array) | (array < 0)
    if bad.any():
        index = int(np.argmax(bad))
        raise ValueError(f"{name}[{index}] = {array[index]:g}: arrivals must be finite and >= 0 seconds")
    return array


@dataclass(frozen=True, eq=False)
class Trace:
    """Requests with arrival time (s), prompt length and output length (tokens).

    priorities: one whole number per request, lower served first by a policy that reads
    them (`labkit.Priority`, as vLLM's `priority`); all 0 unless given.
    clients: one whole number per request, the client that sent it, which a policy that shares
    the engine between clients reads (`labkit.Fair`); all 0 (one client) unless given.
    """

    output_lengths: np.ndarray
    prompt_lengths: np.ndarray
    arrivals: np.ndarray
    ids: np.ndarray
    labels: tuple[str, ...] = field(default=())
    prompt_tokens: tuple[np.ndarray, ...] = field(default=())
    priorities: np.ndarray | None = field(default=None)
    clients: np.ndarray | None = field(default=None)

    def __post_init__(self):
        outputs = _whole_numbers("output_lengths", self.output_lengths, minimum=1)
        if len(outputs) == 0:
            raise ValueError("output_lengths is empty: a trace needs at least one request")
        columns = {
            "prompt_lengths": _whole_numbers("prompt_lengths", self.prompt_lengths, minimum=0),
            "arrivals": _seconds("arrivals", self.arrivals),
            "ids": _whole_numbers("ids", self.ids, minimum=0),
            "priorities": (np.zeros(len(outputs), np.int64) if self.priorities is None
                           else _whole_numbers("priorities", self.priorities, minimum=None)),
            "clients": (np.zeros(len(outputs), np.int64) if self.clients is None
                        else _whole_numbers("clients", self.clients, minimum=0)),
        }
        for name, column in columns.items():
            if len(column) != len(outputs):
                raise ValueError(f"{name} has {len(column)} entries but output_lengths has {len(outputs)}")
        if len(np.unique(columns["ids"])) != len(outputs):
            raise ValueError("ids must be unique")
        if self.labels and len(self.labels) != len(outputs):
            raise ValueError(f"labels has {len(self.labels)} entries but output_lengths has {len(outputs)}")
        for name, column in {"output_lengths": outputs, **columns}.items():
            column.setflags(write=False)
            object.__setattr__(self, name, column)
        object.__setattr__(self, "labels", tuple(self.labels) or tuple(str(i) for i in columns["ids"]))
        object.__setattr__(self, "prompt_tokens", _prompt_tokens(self.prompt_tokens, columns["prompt_lengths"]))

    # Construction

    @classmethod
    def from_lengths(cls, output_lengths, prompt_lengths=None, arrivals=None, prompt_tokens=None) -> Trace:
        """Requests 0..n-1 with the given lengths; no prompt and all arriving at t=0 unless given.

        prompt_tokens: optional token ids of each prompt (a list of lists); without
        `prompt_lengths`, the lengths are taken from them.
        """
        count = len(np.atleast_1d(output_lengths))
        if prompt_tokens is not None and len(prompt_tokens) != count:
            raise ValueError(f"prompt_tokens has {len(prompt_tokens)} entries but output_lengths has {count}")
        if prompt_lengths is None:
            prompt_lengths = np.zeros(count, np.int64) if prompt_tokens is None else [len(p) for p in prompt_tokens]
        return cls(
            output_lengths=np.atleast_1d(output_lengths),
            prompt_lengths=prompt_lengths,
            arrivals=np.zeros(count) if arrivals is None else arrivals,
            ids=np.arange(count),
            prompt_tokens=() if prompt_tokens is None else tuple(prompt_tokens),
        )

    @classmethod
    def toy(cls) -> Trace:
        """The lab's running example: requests A–H, all waiting at t=0, no prompt."""
        trace = cls.from_lengths(TOY_OUTPUT_LENGTHS)
        letters = tuple("ABCDEFGH")
        return cls(trace.output_lengths, trace.prompt_lengths, trace.arrivals, trace.ids, letters)

    @classmethod
    def sample(
        cls,
        num_requests: int,
        output: str | Trace = "exponential",
        mean_output: float = 64,
        prompt: str | Trace = "uniform",
        mean_prompt: float = 128,
        rate: float | None = None,
        burstiness: float = 1.0,
        sigma: float = 1.0,
        seed: int = 0,
        max_output: int | None = None,
    ) -> Trace:
        """Draw a trace with numpy's seeded Generator.

        output: "exponential" (geometric, the memoryless discrete kind, mean `mean_output`),
            "uniform" (1 .. 2*mean-1), "equal" (every length `mean_output`),
            "lognormal" (shape `sigma`, mean `mean_output`), or a Trace to resample from (empirical).
        max_output: outputs longer than this are drawn again, so the distribution is capped
            by rejection (as Anyscale's continuous-batching benchmark draws); None: no cap.
        prompt: "uniform" (0 .. 2*mean_prompt), "equal", "none", or a Trace to resample from.
        rate: requests per second, with gamma inter-arrival times of shape `burstiness`
            (1 is Poisson, below 1 is burstier); None puts every arrival at t=0.
        """
        whole_number("num_requests", num_requests)
        rng = np.random.default_rng(seed)
        return cls.from_lengths(
            _draw_capped_outputs(rng, num_requests, output, mean_output, sigma, max_output),
            prompt_lengths=_draw_prompts(rng, num_requests, prompt, mean_prompt),
            arrivals=_draw_arrivals(rng, num_requests, rate, burstiness),
        )

    @classmethod
    def from_csv(cls, path) -> Trace:
        """Read TIMESTAMP,ContextTokens,GeneratedTokens rows (the Azure LLM inference trace format).

        Arrivals become seconds from the first row's timestamp; `.csv.gz` files are read as gzip.
        """
        path = Path(path)
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", newline="") as handle:
            return cls._from_csv_rows(handle, str(path))

    @classmethod
    def azure_conv(cls) -> Trace:
        """The Azure LLM inference trace 2023, conversation service (19,366 requests; CC-BY-4.0).

        Source: Azure/AzurePublicDataset, released with Patel et al., "Splitwise: Efficient
        generative LLM inference using phase splitting", ISCA 2024. See labkit/data/README.md.
        """
        with resources.as_file(resources.files("labkit.data") / AZURE_CONV_2023) as path:
            return cls.from_csv(path)

    @classmethod
    def _from_csv_rows(cls, handle: io.TextIOBase, source: str) -> Trace:
        reader = csv.DictReader(handle)
        missing = [c for c in CSV_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{source}: missing column(s) {missing}; expected {list(CSV_COLUMNS)}")
        times, prompts, outputs = [], [], []
        for row in reader:
            try:
                times.append(_timestamp(row["TIMESTAMP"]))
                prompts.append(int(row["ContextTokens"]))
                outputs.append(int(row["GeneratedTokens"]))
            except (TypeError, ValueError) as error:
                raise ValueError(f"{source}: bad row at line {reader.line_num}: {dict(row)} ({error})") from None
        if not times:
            raise ValueError(f"{source}: no rows; a trace needs at least one request")
        arrivals = (np.asarray(times) - times[0]) / np.timedelta64(1, "s")
        if (arrivals < 0).any():
            raise ValueError(f"{source}: row {int(np.argmax(arrivals < 0)) + 2} arrives before the first row")
        return cls.from_lengths(outputs, prompt_lengths=prompts, arrivals=arrivals)

    # Views

    def __len__(self) -> int:
        return len(self.output_lengths)

    def __repr__(self) -> str:
        return (
            f"Trace({len(self)} requests, {int(self.output_lengths.sum())} output tokens, "
            f"mean output {self.output_lengths.mean():.1f}, last arrival {self.arrivals.max():.2f} s)"
        )

    def backlogged(self) -> Trace:
        """The same requests, all waiting at t=0."""
        return replace(self, arrivals=np.zeros(len(self)))

    def at_rate(self, rate: float) -> Trace:
        """The same requests in the same order and bursts, the clock stretched so that they
        arrive at `rate` requests per second: (n − 1) / (last arrival − first) = rate."""
        number("rate", rate, unit="requests per second")
        span = self.arrivals.max() - self.arrivals.min()
        if len(self) < 2 or span == 0:
            raise ValueError(f"at_rate({rate:g}): the {len(self)} requests all arrive at {self.arrivals.min():g} s, "
                             "so there is no rate to stretch; sample the trace with rate= first")
        first = self.arrivals.min()
        return replace(self, arrivals=first + (self.arrivals - first) * ((len(self) - 1) / span / rate))

    def with_priorities(self, priorities) -> Trace:
        """The same requests with these priorities, one whole number each (lower is served first)."""
        return replace(self, priorities=priorities)

    def with_clients(self, clients) -> Trace:
        """The same requests, each sent by the client these whole numbers name."""
        return replace(self, clients=clients)

    def capped(self, max_output: int) -> Trace:
        """The same requests, each output cut to at most `max_output` tokens."""
        whole_number("max_output", max_output)
        return replace(self, output_lengths=np.minimum(self.output_lengths, max_output))

    def first_that_fit(self, num_requests: int, max_len: int | None) -> tuple[Trace, int]:
        """The first `num_requests` requests whose prompt + output fit in `max_len` tokens (a model's
        context, as vLLM's max_model_len and labkit's max_seq_len count it; None: no limit), and
        how many longer ones came before the last of them and were left out."""
        whole_number("num_requests", num_requests)
        whole_number("max_len", max_len, or_none=True)
        fits = np.arange(len(self)) if max_len is None else np.flatnonzero(
            self.prompt_lengths + self.output_lengths <= max_len)
        fits = fits[:num_requests]
        if fits.size == 0:
            raise ValueError(f"max_len = {max_len}: no request has prompt + output <= {max_len} tokens "
                             f"(the shortest has {int((self.prompt_lengths + self.output_lengths).min())})")
        return self.select(fits), int(fits[-1]) + 1 - fits.size

    def select(self, positions) -> Trace:
        """The requests at these positions, keeping their ids and labels."""
        positions = np.atleast_1d(np.asarray(positions))
        if positions.dtype.kind not in "iu" or ((positions < 0) | (positions >= len(self))).any():
            raise ValueError(f"select({positions.tolist()}): positions must be whole numbers in 0..{len(self) - 1}")
        return Trace(
            self.output_lengths[positions],
            self.prompt_lengths[positions],
            self.arrivals[positions],
            self.ids[positions],
            tuple(self.labels[p] for p in positions),
            tuple(self.prompt_tokens[p] for p in positions) if self.prompt_tokens else (),
            self.priorities[positions],
            self.clients[positions],
        )


def _timestamp(text) -> np.datetime64:
    if not isinstance(text, str) or np.isnat(stamp := np.datetime64(text.strip() or "NaT", "ns")):
        raise ValueError(f"TIMESTAMP {text!r} is not a date and time")
    return stamp


def _check_mean(name: str, mean: float, minimum: float) -> None:
    number(name, mean, minimum, or_equal=True)


MAX_REDRAWS = 1000  # rounds of redrawing too-long outputs before giving up on a cap


def _draw_capped_outputs(rng: np.random.Generator, count: int, output, mean: float, sigma: float,
                         max_output: int | None) -> np.ndarray:
    """`_draw_outputs`, with every output above `max_output` drawn again until none is."""
    lengths = _draw_outputs(rng, count, output, mean, sigma)
    if max_output is None:
        return lengths
    whole_number("max_output", max_output, or_none=True)
    for _ in range(MAX_REDRAWS):
        too_long = lengths > max_output
        if not too_long.any():
            return lengths
        lengths[too_long] = _draw_outputs(rng, int(too_long.sum()), output, mean, sigma)
    raise ValueError(f"max_output = {max_output}: after {MAX_REDRAWS} rounds of redrawing, {int(too_long.sum())} "
                     f"outputs of {count} are still longer; the distribution (mean_output = {mean}) rarely "
                     "draws that short")


def _draw_outputs(rng: np.random.Generator, count: int, output, mean: float, sigma: float) -> np.ndarray:
    if isinstance(output, Trace):
        return rng.choice(output.output_lengths, size=count)
    _check_mean("mean_output", mean, 1)
    if output == "exponential":
        return rng.geometric(1 / mean, size=count)
    if output == "uniform":
        return rng.integers(1, 2 * round(mean) - 1, size=count, endpoint=True)
    if output == "equal":
        return np.full(count, round(mean))
    if output == "lognormal":
        number("sigma", sigma)
        draws = rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, size=count)
        return np.maximum(1, np.round(draws)).astype(np.int64)
    raise ValueError(f"output = {output!r}: choose one of {OUTPUT_DISTRIBUTIONS} or pass a Trace")


def _draw_prompts(rng: np.random.Generator, count: int, prompt, mean: float) -> np.ndarray:
    if isinstance(prompt, Trace):
        return rng.choice(prompt.prompt_lengths, size=count)
    _check_mean("mean_prompt", mean, 0)
    if prompt == "uniform":
        return rng.integers(0, 2 * round(mean), size=count, endpoint=True)
    if prompt == "equal":
        return np.full(count, round(mean))
    if prompt == "none":
        return np.zeros(count, np.int64)
    raise ValueError(f"prompt = {prompt!r}: choose one of {PROMPT_DISTRIBUTIONS} or pass a Trace")


def _draw_arrivals(rng: np.random.Generator, count: int, rate: float | None, burstiness: float) -> np.ndarray:
    if rate is None:
        return np.zeros(count)
    number("rate", rate, unit="requests per second", or_none=True)
    if not np.isfinite(burstiness) or burstiness <= 0:
        raise ValueError(f"burstiness = {burstiness!r}: must be a gamma shape > 0 (1 is Poisson)")
    gaps = rng.gamma(shape=burstiness, scale=1 / (rate * burstiness), size=count - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])
