"""Lesson 04's check yourself: past what context a wider TinyGPT's step reads more bytes of
keys and values than of weights (q1), and what 64 rows at a long context cost on a weight-bound GPU (q2).

Invariants: q1 counts the weights of a TinyGPT built with the question's sizes (so it
imports torch when it grades), as the lesson counts its own; q2 prices steps with
`labkit.analysis.hardware.weight_bound_price()`, and tells the answer of this CPU's saved
price (`benchmarks/results/engine-cost.json`, where the repository has it) from the right
one. Nothing is written down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from labkit.analysis.cost_fit import CostModel
from labkit.analysis.hardware import weight_bound_price
from labkit.exercises.feedback import Question, correct, incorrect, real_number

BYTES_PER_VALUE = 4  # fp32, as TinyGPT runs on this CPU
SAVED_CPU_PRICE = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "engine-cost.json"


@dataclass(frozen=True)
class KVCrossover(Question):
    """A TinyGPT of width `d_model` and MLP width `d_ff` decodes `batch_size` requests: past
    how many tokens of context does a step read more bytes of keys and values than of weights?"""

    d_model: int
    d_ff: int
    batch_size: int
    answer_format = "a number of tokens, e.g. 300"

    def sizes(self, config=None) -> dict[str, int]:
        """Bytes of the linear layers' weights ("weights"), of the LM head among them ("lm_head"),
        of the embedding table, which no GEMM reads ("embedding"), and of the keys and values
        of one token of context ("kv"): of the question's TinyGPT, or of `config`'s."""
        import torch

        from labkit.engine import ModelConfig, TinyGPT

        model = TinyGPT(config or ModelConfig(d_model=self.d_model, d_ff=self.d_ff), seed=0)
        weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        return {"weights": BYTES_PER_VALUE * weights, "lm_head": BYTES_PER_VALUE * model.lm_head.weight.numel(),
                "embedding": BYTES_PER_VALUE * model.model.embed_tokens.weight.numel(),
                "kv": 2 * model.config.n_layers * model.config.d_model * BYTES_PER_VALUE}

    def crossover(self, weight_bytes: float, size: dict[str, int]) -> float:
        """Tokens of context at which `batch_size` requests' keys and values weigh `weight_bytes`."""
        return weight_bytes / (self.batch_size * size["kv"])

    def expected(self) -> float:
        size = self.sizes()
        return self.crossover(size["weights"], size)

    def grade(self, answer):
        tokens = real_number(answer, "tokens")
        size = self.sizes()
        expected = self.crossover(size["weights"], size)
        if math.isclose(tokens, expected, rel_tol=0.005):
            return correct(f"{size['weights'] / 1e6:.1f} MB of weights / ({self.batch_size} × {size['kv']:,} bytes) = "
                           f"{expected:,.0f} tokens: the weights grew with the square of the width, keys and values "
                           "only with the width, so the crossover in bytes moved out.")
        for candidate, message in self.slips(size, expected):
            if math.isclose(tokens, candidate, rel_tol=0.005):
                return incorrect(f"{tokens:,.0f}: {message}")
        return incorrect(f"{tokens:,.0f} is not it. {self.hint_text()}")

    def scaled(self) -> tuple[float, float, int]:
        """The lesson's TinyGPT's crossover; that crossover scaled as if every weight grew with the
        square of the width and keys and values with the width; and how many times the width grew."""
        from labkit.engine import ModelConfig

        lesson = ModelConfig()
        size = self.sizes(lesson)
        base, widening = self.crossover(size["weights"], size), self.d_model / lesson.d_model
        return base, base * widening, widening

    def slips(self, size: dict[str, int], expected: float) -> list[tuple[float, str]]:
        """(the answer a likely slip gives, what the slip was), nearest answers first; where two
        slips give one answer, the first message names both."""
        base, scaled, widening = self.scaled()
        embedding = self.crossover(size["weights"] + size["embedding"], size)
        also = (" (Counting the embedding table, which no GEMM reads, gives the same number.)"
                if math.isclose(scaled, embedding, rel_tol=0.005) else "")
        return [
            (scaled,
             f"that scales the lesson's {base:,.0f} tokens by the width, as if every weight grew {widening ** 2:g} "
             f"times and keys and values {widening:g} times. The LM head is vocab × d_model, and the vocabulary "
             f"does not change, so it grows only {widening:g} times: count the weights again at the new "
             f"width.{also}"),
            (self.crossover(size["weights"] - size["lm_head"], size),
             f"that leaves out the LM head ({size['lm_head'] // BYTES_PER_VALUE:,} weights, vocab × d_model): it is a "
             "linear layer too, and every step reads it."),
            (embedding,
             f"that counts the embedding table ({size['embedding'] // BYTES_PER_VALUE:,} weights) as well: a step "
             "looks up one row of it per token and never reads the rest, so it is not a GEMM's weight read."),
            (self.batch_size * expected,
             f"that is the crossover for one request; {self.batch_size} requests read {self.batch_size} contexts, so "
             f"divide by {self.batch_size} too."),
            (2 * expected, "every layer caches a key *and* a value per token: twice d_model values."),
            (expected / 2, "keys and values are counted twice: 2 × layers × d_model × 4 bytes a token, no more."),
        ]

    def hint_text(self) -> str:
        return ("Count the linear weights at the new width (4 projections of d_model × d_model and 3 MLP matrices "
                "of d_model × d_ff per layer, plus the LM head of vocab × d_model), 4 bytes each; a token of context "
                "holds a key and a value of d_model per layer. The crossover is weight bytes / (B × KV bytes a token).")

    def solution_text(self) -> str:
        size = self.sizes()
        tokens = self.crossover(size["weights"], size)
        return (f"weights: {size['weights']:,} bytes; keys and values: {size['kv']:,} bytes a token; "
                f"{size['weights']:,} / ({self.batch_size} × {size['kv']:,}) = {tokens:,.0f}. answer = {tokens:.0f}")


@dataclass(frozen=True)
class WeightBoundStep(Question):
    """On an H200 serving Llama 3.1 8B (`weight_bound_price()`), how many times a decode step of
    one request does a step of `rows` requests cost, each `context` tokens deep?"""

    rows: int
    context: int
    answer_format = "a ratio, e.g. 1.5"

    def seconds(self, rows: int, kv_terms: bool = True, price: CostModel | None = None) -> float:
        price = price or weight_bound_price()
        return price.step_seconds(0, rows, rows * self.context if kv_terms else 0, num_requests=rows)

    def expected(self) -> float:
        return self.seconds(self.rows) / self.seconds(1)

    def ratio_of(self, **how) -> float:
        return self.seconds(self.rows, **how) / self.seconds(1, **how)

    def grade(self, answer):
        ratio = real_number(answer, "ratio")
        expected, without_kv = self.expected(), self.ratio_of(kv_terms=False)
        added = self.ratio_of(price=replace(weight_bound_price(), roofline=False))
        this_cpu = self.ratio_of(price=CostModel.load(SAVED_CPU_PRICE)) if SAVED_CPU_PRICE.exists() else None
        if math.isclose(ratio, expected, rel_tol=0.02):
            return correct(f"{expected:.2f}×: {1000 * self.seconds(self.rows):.2f} ms against "
                           f"{1000 * self.seconds(1):.2f} ms. Without the keys and values it would be "
                           f"{without_kv:.2f}×: the {self.rows} rows' arithmetic hides behind the weights' read, so "
                           f"what grows is the {self.context:,} tokens of keys and values each row reads.")
        if math.isclose(ratio, without_kv, rel_tol=0.02):
            return incorrect(f"{ratio:g}: that leaves out the keys and values each row reads: {self.context:,} "
                             "tokens of context per request, at the price's per_kv_token.")
        if math.isclose(ratio, added, rel_tol=0.01):
            return incorrect(f"{ratio:g} adds the arithmetic to the memory traffic. The GPU computes while it "
                             "streams, so a step takes the larger of the two (price.roofline is True).")
        if this_cpu is not None and math.isclose(ratio, this_cpu, rel_tol=0.02):
            return incorrect(f"{ratio:g} is what this CPU's saved price gives (TinyGPT's fitted cost), where every row "
                             "costs real time. The question is about the H200 serving Llama 3.1 8B: price = "
                             "lk.hardware.weight_bound_price().")
        if math.isclose(ratio, self.rows, rel_tol=0.05):
            return incorrect(f"{ratio:g} would be {self.rows} separate steps. One step reads the weights once for "
                             "every row in it.")
        return incorrect(f"{ratio:g} is not it. {self.hint_text()}")

    def hint_text(self) -> str:
        return ("price = lk.hardware.weight_bound_price(); a decode step of B requests, each C tokens deep, costs "
                "price.step_seconds(0, B, B * C). Divide the step of "
                f"{self.rows} by the step of 1.")

    def solution_text(self) -> str:
        return (f"price.step_seconds(0, {self.rows}, {self.rows} * {self.context}) / "
                f"price.step_seconds(0, 1, {self.context}) = {self.expected():.3f}. answer = {self.expected():.2f}")


q1 = KVCrossover(d_model=512, d_ff=1536, batch_size=8)
q2 = WeightBoundStep(rows=64, context=1024)
