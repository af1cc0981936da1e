#!/usr/bin/env bash
# Installs llama-cpp-python into .venv (the optional `llamacpp` peer of `dflashkit bench`), ~6 min of compiling.
# Its default native build dies with SIGILL on this CPU (AMX tile instructions on multi-token prompts), so the
# AMX options are off and the x86 feature set is named explicitly. --no-cache-dir: pip would reuse a crashing wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
-DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF" \
  .venv/bin/python -m pip install -q --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36
.venv/bin/python -m pip install -q diskcache jinja2
.venv/bin/python -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
