#!/usr/bin/env bash
# The GPU checks in one run, on a machine with a CUDA device: the tests marked `gpu` (CUDA graph
# replay equals eager steps, batched equals solo in fp32, the simulator twin, overlap gives the
# plain tokens), then the engine and host benchmarks on CUDA, which write
# benchmarks/results/engine-cuda.json and host-cuda.json.
# Needs python3 with a CUDA build of torch, numpy, tqdm, pytest and hypothesis.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
python3 -m pytest -o addopts= -p no:cacheprovider -m gpu -rs tests/test_cuda_graphs.py tests/test_overlap.py
python3 benchmarks/bench_engine.py --device cuda --repeats 3
python3 benchmarks/bench_host.py --device cuda --repeats 3
