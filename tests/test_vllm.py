"""vLLM itself, beside `labkit serve` and `transformers serve`, on the same weights (a tiny Llama
directory), marked `vllm`: they run where `tools/install_vllm.sh` has built `.venv-vllm` (or
LABKIT_VLLM names a `vllm` command), and are skipped with the reason elsewhere, so `make test`
and CI do not need vLLM. vLLM takes a few minutes to start, once for the module.

- `labkit replay toy` and `labkit replay azure-conv` complete against it with no failed request;
- its stream may pack several tokens into one chunk, and ITL is still counted per token;
- the same token-id prompts give the same greedy tokens on all three servers (with a negative
  control: without the begin-of-sequence token, labkit's tokens differ).
"""

from __future__ import annotations


import httpx
import numpy as np
import pytest

import labkit as lk
from labkit.cli import main
from labkit.engine.config import ModelConfig
from labkit.serve.processes import VLLM_START_TIMEOUT_S, start_labkit_serve, start_vllm_serve, vllm_command
from tests.hf_servers import transformers_serve

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(vllm_command() is None, reason="vLLM is not installed: run tools/install_vllm.sh")]

# vLLM's CPU attention takes a head size of 32 or more (TinyGPT's default, 16, it refuses);
# ids 1..127 are ASCII bytes, so a prompt of printable ids is also text every tokenizer here reads back
LLAMA = ModelConfig(vocab_size=128, d_model=128, n_layers=2, n_heads=2, d_ff=256, max_seq_len=1024)
PROMPTS = [[73, 102, 33], [100, 101, 102, 103, 104], [66], [105, 106, 107, 108, 109, 110, 111, 112]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    from labkit.engine.peers import save_llama_dir

    path = tmp_path_factory.mktemp("vllm-llama")
    save_llama_dir(path, LLAMA, seed=0)
    return path


@pytest.fixture(scope="module")
def vllm(directory):
    with start_vllm_serve(directory, max_num_seqs=16, max_model_len=1024, threads=1) as server:
        yield server.wait_until_healthy(timeout=VLLM_START_TIMEOUT_S)


def token_ids(url: str, model: str, prompt: list[int]) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "min_tokens": MAX_TOKENS,
            "return_token_ids": True, "temperature": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["token_ids"]


def test_the_same_token_ids_give_the_same_greedy_tokens_on_three_servers(vllm, directory):
    with start_labkit_serve(str(directory), "--threads", "1", model=str(directory)) as labkit, \
            transformers_serve(directory) as hf:
        labkit.wait_until_healthy()
        for prompt in PROMPTS:
            sent = [0, *prompt]  # the model's begin-of-sequence token first, as replay sends it
            expected = token_ids(vllm.url, vllm.model, sent)
            assert token_ids(labkit.url, labkit.model, sent) == expected
            text = bytes(i - 1 for i in prompt).decode()  # transformers serve takes text; its tokenizer adds the BOS
            body = {"model": hf.model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0}
            answer = httpx.post(f"{hf.url}/v1/completions", json=body, timeout=120).json()
            assert answer["choices"][0]["text"] == bytes(i - 1 for i in expected).decode()
        # negative control: without the begin-of-sequence token, the same model gives other tokens
        assert token_ids(labkit.url, labkit.model, PROMPTS[0]) != token_ids(vllm.url, vllm.model, [0, *PROMPTS[0]])


def test_an_empty_token_id_prompt_is_refused_and_replay_sends_the_bos(vllm):
    answer = httpx.post(f"{vllm.url}/v1/completions", json={"model": vllm.model, "prompt": [], "max_tokens": 2})
    assert answer.status_code == 400 and "at least one prompt" in answer.text
    log = lk.replay(lk.Trace.toy(), url=vllm.url, model=vllm.model, vocab_size=LLAMA.vocab_size, progress=False)
    assert log.failures == [] and log.fallbacks == ()
    unknown = lk.replay(lk.Trace.toy(), url=vllm.url, model=vllm.model, bos_token_id=None,
                        vocab_size=LLAMA.vocab_size, progress=False)
    assert unknown.failures == [] and unknown.fallbacks == ("one-token prompts",)  # said once, then sent so


@pytest.mark.parametrize("argv", [
    ["toy"],
    ["azure-conv", "--requests", "16", "--max-tokens", "32", "--max-concurrency", "8"],
])
def test_labkit_replay_completes_against_vllm(vllm, argv, capsys):
    command = ["replay", *argv, "--url", vllm.url, "--model", vllm.model, "--vocab-size", str(LLAMA.vocab_size),
               "--no-progress"]
    assert main(command) == 0
    out = capsys.readouterr().out
    assert "failed: 0 of" in out and "fallbacks: none" in out


def test_itl_is_per_token_when_chunks_carry_several(vllm):
    """Sixteen streams at once: vLLM may pack tokens into chunks, and each request's median ITL
    stays within 2x of its TPOT, which a gap per chunk would not."""
    trace = lk.Trace.from_lengths([64] * 16, prompt_lengths=[8] * 16)
    log = lk.replay(trace, url=vllm.url, model=vllm.model, vocab_size=LLAMA.vocab_size, progress=False)
    assert log.failures == []
    ids, times = log.token_times()
    for request_id in trace.ids:
        gaps = np.diff(times[ids == request_id])
        tpot = (times[ids == request_id][-1] - times[ids == request_id][0]) / 63
        assert tpot / 2 <= np.median(gaps) <= 2 * tpot
    packed = sum(int((sizes > 1).sum()) for sizes in log.chunk_sizes)
    print(f"chunks with several tokens: {packed} of {sum(len(s) for s in log.chunk_sizes)}")
