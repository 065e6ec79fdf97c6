"""A second real server for tests: `transformers serve` on a tiny Llama directory, in a subprocess
(`labkit.serve.processes`, which says what such a server is).

    with transformers_serve() as server:          # saves TINY_LLAMA's weights to a temporary directory
        lk.replay(trace, url=server.url, model=server.model, tokenizer=server.directory)

    with transformers_serve(directory) as server:  # serves a directory you saved, e.g. with
        ...                                        # labkit.engine.peers.save_llama_dir, for labkit serve too
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from labkit.engine.config import ModelConfig
from labkit.engine.peers import save_llama_dir
from labkit.serve.processes import start_transformers_serve

# Ids 1..127 are the ASCII bytes 0..126, so each token the model emits decodes to one character
# (id 0, the begin-of-sequence token, decodes to nothing).
TINY_LLAMA = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=256)
NUM_BLOCKS = 256  # KV cache blocks of 16 tokens, far more than the tests' requests need
MAX_BATCH_TOKENS = 256  # tokens per step


@dataclass(frozen=True)
class HFServer:
    """A running `transformers serve`: its base URL, the model name requests must send (the
    directory as given on its command line), and the model directory (its tokenizer included)."""

    url: str
    model: str
    directory: Path


@contextlib.contextmanager
def transformers_serve(directory: str | os.PathLike | None = None, *, config: ModelConfig = TINY_LLAMA,
                       seed: int = 0, threads: int = 1):
    """Serve a Llama directory with `transformers serve` and yield its `HFServer`; stop it at the end.

    directory: the model directory to serve; None saves `save_llama_dir(tmp, config, seed)` into a
    temporary directory, removed at the end. threads: torch's CPU threads in the server.
    """
    with contextlib.ExitStack() as stack:
        if directory is None:
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tiny-llama-")))
            save_llama_dir(directory, config, seed)
        directory = Path(directory)
        server = stack.enter_context(start_transformers_serve(directory, num_blocks=NUM_BLOCKS,
                                                              max_batch_tokens=MAX_BATCH_TOKENS, threads=threads))
        server.wait_until_healthy()
        yield HFServer(url=server.url, model=server.model, directory=directory)
