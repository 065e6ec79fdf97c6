"""guidellm, the benchmark vLLM's project ships, against `labkit serve` with guidellm's default
request format (`/v1/chat/completions`, streamed): every request of a synchronous run succeeds.
It runs where `make guidellm` has built `.venv-guidellm` (or LABKIT_GUIDELLM names a `guidellm`
command), and is skipped with the reason elsewhere, so `make test` and CI do not need it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from labkit.engine.config import ModelConfig
from labkit.serve.processes import start_labkit_serve

GUIDELLM = Path(os.environ.get("LABKIT_GUIDELLM") or Path(__file__).resolve().parents[1] / ".venv-guidellm/bin/guidellm")
NUM_REQUESTS = 6

pytestmark = pytest.mark.skipif(not GUIDELLM.exists(), reason="guidellm is not installed: run make guidellm")


def test_guidellm_runs_against_labkit_serve_with_its_default_request_format(tmp_path):
    from labkit.engine.peers import save_llama_dir

    directory = tmp_path / "model"
    save_llama_dir(directory, ModelConfig(vocab_size=128), seed=0)  # guidellm reads its tokenizer
    with start_labkit_serve(str(directory), "--device", "cpu", "--threads", "1", model=str(directory)) as server:
        server.wait_until_healthy()
        run = subprocess.run([str(GUIDELLM), "run", "--backend", f"kind=openai_http,target={server.url}",
                              "--profile", "kind=synchronous", "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
                              "--tokenizer", f"kind=huggingface_auto,model={directory}",
                              "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
                              "--output", f"kind=json,path={tmp_path / 'report.json'}", "--disable-console-interactive"],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    totals = json.loads((tmp_path / "report.json").read_text())["benchmarks"][0]["metrics"]["request_totals"]
    assert (totals["successful"], totals["errored"]) == (NUM_REQUESTS, 0)
