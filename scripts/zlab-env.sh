#!/usr/bin/env bash
# Builds .venv-zlab/: Z Lab's reference package `dflash` 0.1.0 beside torch 2.13.0 (CPU), for the `zlab` peer of
# `dflashkit bench`. Idempotent. --no-deps for dflash: its own pins would pull a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venv-zlab
[ -x $V/bin/python ] || python3 -m venv $V
$V/bin/python -m pip install -q torch==2.13.0
$V/bin/python -m pip install -q --no-deps dflash==0.1.0
$V/bin/python -m pip install -q transformers==5.15.0 tqdm requests safetensors
$V/bin/python -c "import dflash, transformers, torch; print('dflash', dflash.__file__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
