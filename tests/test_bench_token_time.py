"""bench_token_time.py's phase-by-phase steps: each runs its path's operations, so its phases add up to that path."""


import pytest
import torch

from labkit.engine import FusedTinyGPT, ModelConfig, TinyGPT
from tests.scripts import load_script

def load_bench():
    return load_script("benchmarks/bench_token_time.py")


@pytest.mark.parametrize("rows", [3, 8])
def test_each_phased_step_gives_its_paths_logits_and_names_every_phase(rows):
    bench = load_bench()
    model = TinyGPT(ModelConfig(vocab_size=64, d_model=64, n_layers=2, d_ff=96), seed=0).eval()
    for step, phased in ((model, bench.plain_phases), (FusedTinyGPT(model), bench.fused_phases)):
        cache, batch = bench.decode_step(model.config, rows, 40, num_blocks=64)
        clock = bench.PhaseClock()
        with torch.inference_mode():
            assert torch.equal(phased(step, batch, cache, clock.tick), step(batch, cache))
        assert list(clock.seconds) == ["plan", "embedding", "rotary", "norms", "qkv", "KV write", "attention",
                                       "o-proj", "MLP", "LM head", "sampling"]


def test_a_phased_step_that_skips_an_operation_fails_the_check(monkeypatch):
    """Negative control: the plain phases without the rotation of queries and keys."""
    bench = load_bench()
    monkeypatch.setattr(bench, "rotate", lambda x, cos, signed_sin: x * 1)
    model = TinyGPT(ModelConfig(vocab_size=64, d_model=64, n_layers=2, d_ff=96), seed=0).eval()
    cache, batch = bench.decode_step(model.config, 4, 40, num_blocks=64)
    with torch.inference_mode():
        assert not torch.equal(bench.plain_phases(model, batch, cache, bench.PhaseClock().tick), model(batch, cache))
