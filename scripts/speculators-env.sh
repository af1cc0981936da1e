#!/usr/bin/env bash
# Builds .venv-speculators/: vLLM's `speculators` 0.9.0 beside torch 2.13.0 (CPU) and its pinned transformers,
# to validate `dflashkit export --format speculators`. Idempotent. --no-deps: a plain install pulls a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venv-speculators
[ -x $V/bin/python ] || python3 -m venv $V
$V/bin/python -m pip install -q torch==2.13.0
$V/bin/python -m pip install -q --no-deps speculators==0.9.0
$V/bin/python -m pip install -q transformers==5.19.0 datasets==5.1.0 loguru==0.7.3 pydantic-settings openai \
    hs-connectors==0.9.0 protobuf aiohttp httpx typer safetensors psutil rich
$V/bin/python -c "import importlib.metadata as md, transformers, torch; print('speculators', md.version('speculators'), 'transformers', transformers.__version__, 'torch', torch.__version__)"
