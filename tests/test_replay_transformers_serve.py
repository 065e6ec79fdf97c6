"""lk.replay and `labkit replay` against a real server that is not labkit's: `transformers serve`
(continuous batching, on the CPU) on a tiny Llama directory, started once for the module
(tests/hf_servers.py). It refuses ignore_eos, min_tokens, return_token_ids and token-id prompts,
streams text without token ids or [DONE], and has no /metrics: the replay takes each fallback
once, says so, and every request finishes with its tokens counted and timed. Last, the helper that starts the
server fails with its stderr when it does not come up.
"""

from __future__ import annotations

import json
import sys

import httpx
import numpy as np
import pytest

import labkit as lk
from labkit.cli import main
from labkit.serve.replay import PromptTexts, prompt_ids, replay
from labkit.serve.processes import ServerProcess, free_port
from tests.hf_servers import transformers_serve

TRACE = lk.Trace.from_lengths([4, 6, 3, 5, 2, 6, 4, 3], prompt_lengths=[5, 3, 8, 4, 6, 2, 7, 5],
                              arrivals=[0, 0, 0.05, 0.1, 0.1, 0.15, 0.2, 0.2])
FALLBACKS = ("no ignore_eos", "no min_tokens", "no return_token_ids", "text prompts")


@pytest.fixture(scope="module")
def server():
    with transformers_serve() as running:
        yield running


@pytest.fixture(scope="module")
def replayed(server):
    """TRACE replayed with the server's own tokenizer directory, so prompts are exact."""
    return replay(TRACE, url=server.url, model=server.model, tokenizer=server.directory, progress=False)


def test_every_request_finishes_with_each_fallback_taken_once_and_said(replayed, server):
    assert replayed.failures == [] and replayed.is_finished.all()
    assert replayed.fallbacks == FALLBACKS
    fields, token_ids = [note for note in replayed.notes if " refused a request " in note]
    assert fields.startswith(f"{server.url} refused a request (HTTP 422: Unexpected fields in the request: {{'")
    assert fields.endswith("}); from now on requests go without ignore_eos, min_tokens and return_token_ids; an "
                           "answer may stop before its output length, and counts as it came back, not as a failure; a "
                           "chunk that carries text and no token ids counts as one token")
    assert token_ids == (f"{server.url} refused a request (HTTP 400: prompt must be a string.); from now on prompts "
                         f"go as text of exactly each prompt's length in the tokens of '{server.directory}'")
    assert f"{server.url}/metrics: HTTP 404, so no gauge series (log.server is empty)" in replayed.notes
    assert len(replayed.notes) == 3 and len(replayed.server) == 0


def test_the_metrics_count_the_tokens_that_came_back(replayed):
    completion_tokens = [replayed.usage[i]["completion_tokens"] for i in TRACE.ids.tolist()]
    assert replayed.trace.output_lengths.tolist() == completion_tokens
    assert completion_tokens == TRACE.output_lengths.tolist()  # the model has no EOS: it stops at max_tokens
    assert replayed.asked_lengths.tolist() == TRACE.output_lengths.tolist()
    row = lk.metrics.summary(replayed)
    assert row["tokens"] == replayed.num_output_tokens == sum(completion_tokens) and row["failed requests"] == 0
    assert row["tokens/s"] > 0 and row["TTFT p50 (s)"] > 0 and not np.isnan(row["ITL p50 (ms)"])


def test_each_prompt_is_exactly_its_length_in_the_server_s_tokens(replayed, server):
    from transformers import AutoTokenizer

    added = AutoTokenizer.from_pretrained(server.directory, local_files_only=True).num_special_tokens_to_add()
    served = [replayed.usage[i]["prompt_tokens"] - added for i in TRACE.ids.tolist()]
    assert served == TRACE.prompt_lengths.tolist()  # as the server counted them, less its begin-of-sequence token


def test_every_chunk_of_text_has_its_time(replayed, server):
    texts = PromptTexts(server.directory)
    for i, (prompt_len, length) in enumerate(zip(TRACE.prompt_lengths, TRACE.output_lengths)):
        chunks = stream_alone(server, texts(prompt_ids(i, int(prompt_len))), int(length))
        times = replayed.tokens_at[i]
        assert len(times) == len(chunks) and replayed.texts.get(i, "") == "".join(chunks)
        assert (np.diff(times) >= 0).all() and times[0] >= replayed.sent_at[i]


def test_the_command_exits_0_and_says_which_fallbacks_it_took(server, capsys):
    # toy's prompts are empty: each goes as one token, as an empty one kills the server's worker
    assert main(["replay", "toy", "--url", server.url, "--model", server.model, "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "\nfallbacks: no ignore_eos, no min_tokens, no return_token_ids, text prompts\n" in out and "failed: 0 of 8 requests" in out
    rows = {line.split("  ")[0]: line.split()[-1] for line in out.splitlines() if "  " in line}
    assert rows["tokens"] == str(lk.Trace.toy().output_lengths.sum())
    assert "prompt lengths are approximate" in err.replace("\n  ", " ")  # a note wraps at its width


def test_a_request_refused_in_the_fallback_mode_fails_with_the_server_s_message(server, capsys):
    assert main(["replay", "toy", "--url", server.url, "--model", "another-model", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "failed: 8 of 8 requests\n" in out
    assert (f"  {server.url}: request 0: HTTP 400: Server is pinned to '{server.model}'; requested "
            "'another-model'.\n") in out


def stream_alone(server, prompt: str, max_tokens: int) -> list[str]:
    """The non-empty texts of the chunks the server streams for this prompt on its own."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines]
    return [text for chunk in chunks for choice in chunk["choices"] if (text := choice["text"])]


@pytest.mark.parametrize(
    "code, timeout, why",
    [
        ("import sys; sys.stderr.write('no model here'); sys.exit(3)", 30, "exited with code 3"),
        ("import sys, time; sys.stderr.write('no model here'); sys.stderr.flush(); time.sleep(30)", 0.5,
         "no answer after 0.5 s"),
    ],
)
def test_a_server_that_does_not_come_up_fails_with_its_stderr(code, timeout, why):
    port = free_port()
    with ServerProcess("a stand-in", [sys.executable, "-c", code], port, model="none") as process:
        with pytest.raises(RuntimeError) as failure:
            process.wait_until_healthy(timeout)
    assert str(failure.value) == (f"a stand-in at http://127.0.0.1:{port}: {why} from /health; its stderr ends:\n"
                                  "no model here")


# Text prompts are tokenized as the model's tokenizer does


TEXTS = ["hello there", "continuous batching", "a", "slots and blocks"]


@pytest.fixture(scope="module")
def no_bos_servers(tmp_path_factory):
    """labkit serve and transformers serve on one Llama directory whose tokenizer adds no
    begin-of-sequence token."""
    from labkit.engine.peers import save_llama_dir
    from labkit.serve.processes import start_labkit_serve
    from tests.hf_servers import TINY_LLAMA

    directory = tmp_path_factory.mktemp("no-bos-llama")
    save_llama_dir(directory, TINY_LLAMA, seed=0, add_bos=False)
    with start_labkit_serve(str(directory), "--threads", "1", model=str(directory)) as labkit, \
            transformers_serve(directory) as hf:
        labkit.wait_until_healthy()
        yield labkit, hf


def greedy_text(url: str, model: str, prompt, max_tokens: int = 8) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


def test_a_text_prompt_is_tokenized_as_the_model_s_tokenizer_does(no_bos_servers):
    labkit, hf = no_bos_servers
    for text in TEXTS:
        assert greedy_text(labkit.url, labkit.model, text) == greedy_text(hf.url, hf.model, text)
    # negative control: with a begin-of-sequence token put first by hand, labkit's text differs
    ids = [0, *[byte + 1 for byte in TEXTS[0].encode()]]
    assert greedy_text(labkit.url, labkit.model, ids) != greedy_text(hf.url, hf.model, TEXTS[0])
