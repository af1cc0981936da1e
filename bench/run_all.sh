#!/usr/bin/env bash
# Regenerates the committed benchmark results (quiet 2-core CPU, ~2 h in all; nothing else may run meanwhile).
#   bench/results/main   : every method on all 164 HumanEval + 80 MT-Bench (2 turns) prompts, 128 new tokens, B=16
#   bench/results/sweeps : block size 4/8/16, T=0 and T=1, batch size 1/4/8/16 for ar and dflash, 16 HumanEval prompts
# Needs: make .venv/.stamp; optional peers: scripts/llamacpp-build.sh (llamacpp), scripts/zlab-env.sh (zlab).
set -euo pipefail
cd "$(dirname "$0")/.."
export TQDM_DISABLE=${TQDM_DISABLE:-0}
B=.venv/bin/dflashkit
$B bench --dataset humaneval --dataset mt-bench --max-new-tokens 128 --block-size 16 \
    --methods ar,dflash,zlab,hf,hf-lookup,llamacpp --out bench/results/main
$B bench --dataset humaneval --limit 16 --max-new-tokens 128 \
    --block-size 4 --block-size 8 --block-size 16 --temperature 0 --temperature 1 \
    --batch-size 1 --batch-size 4 --batch-size 8 --batch-size 16 --methods ar,dflash --out bench/results/sweeps
