"""benchmarks/bench_peers.py at a toy size: four runs per batch size, identical greedy outputs, a JSON report."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "ContinuousBatchingConfig"):
    pytest.skip("transformers without continuous batching", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_peers.py"
RUNS = ["HF generate", "HF continuous", "labkit Static", "labkit Continuous"]


def test_toy_run_compares_four_systems(tmp_path):
    out = tmp_path / "peers.json"
    args = ["--model-config", "tiny", "--batch-sizes", "2", "--requests-per-slot", "2", "--mean-output", "4",
            "--repeats", "1", "--threads", "1", "--out", str(out)]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "labkit Continuous / HF continuous" in done.stdout
    result = json.loads(out.read_text())["batch_sizes"]["2"]
    assert list(result["runs"]) == RUNS
    assert all(run["tokens/s"] > 0 for run in result["runs"].values())
    assert result["outputs equal to labkit Continuous"] == dict.fromkeys(RUNS, 4)
    assert result["predicted slot-step gain"] >= 1
