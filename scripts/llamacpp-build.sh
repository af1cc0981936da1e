#!/usr/bin/env bash
# Builds the pinned llama.cpp (the one llama-cpp-python 0.3.36 vendors, which has DFlash) for the llama.cpp peer
# and the GGUF export check:
#   .llamacpp/src/            the llama.cpp source (convert_hf_to_gguf.py, gguf-py)
#   .llamacpp/bin/            llama-speculative-simple, llama-completion, llama-server, llama-bench
#   .venv: llama-cpp-python   (the `llamacpp` bench peer), sentencepiece (the converter imports it)
# ~10 min (tools) + ~6 min (binding) at -j2.  Usage: scripts/llamacpp-build.sh [--tools-only|--binding-only]
# GGML_LLAMAFILE=OFF (environment) builds without llamafile's sgemm: llama.cpp's f32 batches then take the same
# dot products as one token (bench/results/llamacpp-check-nollamafile); llama.cpp's default is ON.
#
# Why the explicit feature list: the default native build dies with SIGILL on AMX hosts (tile instructions on
# multi-token batches), so AMX is always off and every other x86 feature is named from /proc/cpuinfo.
# --no-cache-dir: pip would otherwise reuse a crashing wheel built earlier.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
WHAT=${1:-all}
JOBS=${JOBS:-$(nproc)}

has() { grep -qw "$1" /proc/cpuinfo; }
flag() { if has "$2"; then echo "-D$1=ON"; else echo "-D$1=OFF"; fi; }
CMAKE_FLAGS="-DGGML_NATIVE=OFF $(flag GGML_AVX avx) $(flag GGML_AVX2 avx2) $(flag GGML_FMA fma) $(flag GGML_F16C f16c)
$(flag GGML_BMI2 bmi2) $(flag GGML_AVX512 avx512f) $(flag GGML_AVX512_VBMI avx512vbmi)
$(flag GGML_AVX512_VNNI avx512_vnni) $(flag GGML_AVX512_BF16 avx512_bf16) $(flag GGML_AVX_VNNI avx_vnni)
-DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF"
CMAKE_FLAGS=$(echo $CMAKE_FLAGS)  # one line
echo "llama.cpp build flags: $CMAKE_FLAGS"

mkdir -p .llamacpp
if [ ! -f .llamacpp/src/convert_hf_to_gguf.py ]; then
  .venv/bin/python -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d .llamacpp
  tar xzf ".llamacpp/llama_cpp_python-$VERSION.tar.gz" -C .llamacpp
  rm -rf .llamacpp/src && mv ".llamacpp/llama_cpp_python-$VERSION/vendor/llama.cpp" .llamacpp/src
  rm -rf ".llamacpp/llama_cpp_python-$VERSION"
fi
.venv/bin/python -m pip install -q sentencepiece

if [ "$WHAT" != "--binding-only" ]; then
  # shellcheck disable=SC2086
  cmake -S .llamacpp/src -B .llamacpp/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF -DGGML_LLAMAFILE="${GGML_LLAMAFILE:-ON}" $CMAKE_FLAGS \
    > .llamacpp/cmake.log
  cmake --build .llamacpp/build -j "$JOBS" --target llama-speculative-simple llama-completion llama-server llama-bench
  mkdir -p .llamacpp/bin
  for t in llama-speculative-simple llama-completion llama-server llama-bench; do
    cp ".llamacpp/build/bin/$t" .llamacpp/bin/
  done
  echo "tools in .llamacpp/bin: $(ls .llamacpp/bin | tr '\n' ' ')"
fi

if [ "$WHAT" != "--tools-only" ]; then
  CMAKE_ARGS="$CMAKE_FLAGS" .venv/bin/python -m pip install -q --no-cache-dir --force-reinstall --no-deps \
    "llama-cpp-python==$VERSION"
  .venv/bin/python -m pip install -q diskcache jinja2
  .venv/bin/python -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
fi
