"""`labkit serve MODEL_DIR`: a saved Llama directory (grouped-query attention, tied embeddings)
served by labkit and by `transformers serve`, and requests that end at the model's EOS.

`labkit serve DIR` runs as the command line runs it: in a subprocess for the comparison with
`transformers serve`, and in-process (the same parser, `engine_from` and `build_server`) where
a test reads the engine's block pool."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import threading
import time

import httpx
import pytest
import torch
import uvicorn

from labkit.cli import build_parser
from labkit.engine.config import ModelConfig
from labkit.engine.peers import save_llama_dir
from labkit.serve.server import build_server, engine_from, model_name_from, policy_from
from labkit.serve.processes import answers_health, free_port, start_labkit_serve
from labkit.serve.tokenizer import ModelTokenizer, TextStream

from hf_servers import transformers_serve

transformers = pytest.importorskip("transformers")

# Ids 1..127 are the ASCII bytes 0..126, so every token decodes to one character (0, BOS, to none).
CONFIG = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, tie_embeddings=True,
                     d_ff=128, max_seq_len=256, rope_theta=5000.0)
PROMPTS = ["Hello", "The quick brown fox", "a", "labkit serves Llama"]
MAX_TOKENS = 8
START_TIMEOUT_S = 60
EOS_PROMPT, EOS_MAX_TOKENS = "Hello", 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gqa-tied")
    save_llama_dir(directory, CONFIG, seed=2, initializer_range=0.2)
    return directory


@contextlib.contextmanager
def labkit_serve(directory):
    """`labkit serve DIR` in a subprocess on a free loopback port; yields its URL; stopped at the end."""
    with start_labkit_serve(str(directory), "--device", "cpu", "--threads", "1", "--slots", "4",
                            model=str(directory)) as server:
        yield server.wait_until_healthy().url


async def complete_all(url: str, bodies: list[dict]) -> list[dict]:
    """The answers to `bodies`, sent at once."""
    async with httpx.AsyncClient(timeout=60) as client:
        answers = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body) for body in bodies))
    assert [answer.status_code for answer in answers] == [200] * len(bodies), [a.text for a in answers]
    return [answer.json()["choices"][0] for answer in answers]


def test_labkit_and_transformers_serve_give_the_same_greedy_text(model_dir):
    bodies = [{"model": str(model_dir), "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0} for p in PROMPTS]
    with labkit_serve(model_dir) as url:
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == str(model_dir)  # the name: DIR as given
        ours = asyncio.run(complete_all(url, bodies))
    with transformers_serve(model_dir) as server:
        theirs = asyncio.run(complete_all(server.url, bodies))
    assert [choice["text"] for choice in ours] == [choice["text"] for choice in theirs]
    assert [choice["finish_reason"] for choice in ours + theirs] == ["length"] * 2 * len(PROMPTS)
    assert all(len(choice["token_ids"]) == MAX_TOKENS for choice in ours)
    assert len({choice["text"] for choice in ours}) == len(PROMPTS)  # the texts depend on the prompts


# EOS ------------------------------------------------------------------------------------


def hf_generate(directory, prompt: str, **generate) -> list[int]:
    """transformers' greedy `generate` on the directory's model, the prompt tokenized as `transformers serve` does."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).float().eval()
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])  # (1, 1 + len): BOS first
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=EOS_MAX_TOKENS,
                         pad_token_id=0, **generate)
    return out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def eos_dir(model_dir, tmp_path_factory):
    """(a copy of model_dir whose config.json names as EOS a token the model emits for EOS_PROMPT, first
    at the third output or later, and that position)."""
    tokens = hf_generate(model_dir, EOS_PROMPT, eos_token_id=None, min_new_tokens=EOS_MAX_TOKENS)
    position = next(i for i in range(2, EOS_MAX_TOKENS - 2) if tokens[i] not in tokens[:i])
    directory = tmp_path_factory.mktemp("with-eos")
    shutil.copytree(model_dir, directory, dirs_exist_ok=True)
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "eos_token_id": tokens[position]}))
    return directory, position


@pytest.fixture(scope="module")
def eos_server(eos_dir):
    """`labkit serve EOS_DIR --slots 2` in-process (a thread): (its URL, its online engine)."""
    parser, commands = build_parser()
    args = parser.parse_args(["serve", str(eos_dir[0]), "--slots", "2", "--device", "cpu", "--threads", "1"])
    engine, checkpoint = engine_from(args)
    app, online = build_server(engine, policy_from(args), model_name_from(args), checkpoint)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not answers_health(url):
        assert time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.05)
    yield url, online
    server.should_exit = True
    thread.join(timeout=30)


def test_a_request_stops_at_the_eos_unless_it_ignores_it(eos_dir, eos_server):
    directory, position = eos_dir
    url, online = eos_server
    eos = json.loads((directory / "config.json").read_text())["eos_token_id"]
    body = {"model": str(directory), "prompt": EOS_PROMPT, "max_tokens": EOS_MAX_TOKENS}
    min_tokens = position + 2
    stopped, ignoring, held_back = asyncio.run(complete_all(url, [
        body, {**body, "ignore_eos": True}, {**body, "min_tokens": min_tokens}]))

    assert stopped["token_ids"] == hf_generate(directory, EOS_PROMPT, eos_token_id=eos)
    assert stopped["token_ids"][-1] == eos and len(stopped["token_ids"]) == position + 1
    assert stopped["finish_reason"] == "stop"
    assert ignoring["token_ids"] == hf_generate(directory, EOS_PROMPT, eos_token_id=None,
                                                min_new_tokens=EOS_MAX_TOKENS)
    assert ignoring["token_ids"][position] == eos and ignoring["finish_reason"] == "length"
    assert held_back["token_ids"] == hf_generate(directory, EOS_PROMPT, eos_token_id=eos, min_new_tokens=min_tokens)
    assert eos not in held_back["token_ids"][:min_tokens]
    assert stopped["text"] == transformers.AutoTokenizer.from_pretrained(directory).decode(stopped["token_ids"])

    deadline = time.monotonic() + 10
    while online.core.blocks.num_free_blocks < online.core.blocks.num_blocks or online.core.state.by_id:
        assert time.monotonic() < deadline, "the stopped request's slot and blocks did not return"
        time.sleep(0.02)


def test_a_streamed_request_ends_with_stop_at_the_eos(eos_dir, eos_server):
    directory, position = eos_dir
    url, _ = eos_server
    payload = {"model": str(directory), "prompt": EOS_PROMPT, "max_tokens": EOS_MAX_TOKENS, "stream": True}
    tokens, reasons = [], []
    with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=60) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    tokens += choice["token_ids"]
                    reasons.append(choice["finish_reason"])
    assert len(tokens) == position + 1
    assert reasons == [None] * (position + 1) + ["stop"]


def test_streamed_text_pieces_add_up_to_the_text_and_never_split_a_character(model_dir):
    tokenizer = ModelTokenizer(transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True))
    token_ids = tokenizer.encode("ab 日本 🙂!") + [0] + tokenizer.encode("é")  # multi-byte characters, and BOS
    stream = TextStream(tokenizer)
    pieces = [stream.add(token_id) for token_id in token_ids] + [stream.rest()]
    assert "".join(pieces) == tokenizer.decode(token_ids) == "ab 日本 🙂!é"
    assert pieces[:4] == ["a", "b", " ", ""]  # 日's first byte waits for the rest of it
    assert all("\ufffd" not in piece for piece in pieces)
    assert "\ufffd" in tokenizer.decode(token_ids[3:4])  # negative control: a byte alone decodes to U+FFFD
