#!/usr/bin/env bash
# Regenerates the committed benchmark results (quiet 2-core CPU, ~6 h in all; nothing else may run meanwhile).
#   bench/results/main           : every method on all 164 HumanEval + 80 MT-Bench (2 turns), 128 new tokens, B=16
#   bench/results/acceptance-256 : the training acceptance setting: 164 HumanEval + 80 MT-Bench first turns,
#                                  256 new tokens, B=16, ar and dflash (+ the mismatch audit, float64 re-decodes)
#   bench/results/lookup-256     : the same setting with draft trees: DFlash B=16 and B=3 + an 8-token n-gram lookup
#                                  branch, and the lookup branch alone
#   bench/results/tree-256       : the same setting with the CLI's default draft tree: a pruned tree of the drafter's
#                                  20 likeliest paths + an adaptive n-gram lookup branch (up to 16 tokens)
#   bench/results/sweeps         : block size 4/8/16, T=0 and T=1, batch size 1/4/8/16, 16 HumanEval prompts
#   bench/results/vllm-peers     : ar, dflash, vllm, vllm-dflash on 20 HumanEval + 20 MT-Bench questions
#   bench/results/serve-load     : dflashkit serve vs vllm serve, AR and DFlash, concurrency 1-16
# Needs: make .venv/.stamp; optional peers: scripts/llamacpp-build.sh (llamacpp), scripts/zlab-env.sh (zlab),
# scripts/vllm-env.sh (vllm; also `scripts/vllm_check.py`, the float32 equivalence checks, ~6 min).
set -euo pipefail
cd "$(dirname "$0")/.."
export TQDM_DISABLE=${TQDM_DISABLE:-0}
B=.venv/bin/dflashkit
$B bench --dataset humaneval --dataset mt-bench --max-new-tokens 128 --block-size 16 \
    --methods ar,dflash,zlab,hf,hf-lookup,llamacpp --out bench/results/main
$B bench --dataset humaneval --dataset mt-bench-t1 --max-new-tokens 256 --block-size 16 \
    --methods ar,dflash --out bench/results/acceptance-256
.venv/bin/python bench/mismatch_audit.py bench/results/acceptance-256 --noise-prompts 24
$B bench --dataset humaneval --dataset mt-bench-t1 --max-new-tokens 256 --block-size 16 \
    --methods ar,dflash-lookup,lookup --lookup 8 --lookup-skip 2 --lookup-block-size 16 --lookup-block-size 3 \
    --tree 0 --lookup-per-n 0 --draft-vocab 0 --out bench/results/lookup-256
$B bench --dataset humaneval --dataset mt-bench-t1 --max-new-tokens 256 --block-size 16 \
    --methods ar,dflash-lookup --tree 20 --tree-min-prob 0.03 --lookup 16 --lookup-per-n 4 --lookup-skip 3 \
    --out bench/results/tree-256
$B bench --dataset humaneval --limit 16 --max-new-tokens 128 \
    --block-size 4 --block-size 8 --block-size 16 --temperature 0 --temperature 1 \
    --batch-size 1 --batch-size 4 --batch-size 8 --batch-size 16 --methods ar,dflash --out bench/results/sweeps
$B bench --dataset humaneval --dataset mt-bench --limit 20 --max-new-tokens 128 --block-size 16 \
    --methods ar,dflash,vllm,vllm-dflash --out bench/results/vllm-peers
.venv/bin/python bench/serve_load.py --out bench/results/serve-load
