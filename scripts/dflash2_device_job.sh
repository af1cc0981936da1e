#!/bin/bash
# One lent-GPU call: fine-tune the bundled drafter into DFlash2 (docs/training.md, "Continuing on a lent GPU").
# Needs .gpu/p0 .gpu/p1 (the GGUF in two parts), .gpu2/prompts.jsonl.gz and .whl/gguf-*.whl already there.
set -o pipefail
OUT=$1; shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TQDM_DISABLE=1 DFLASHKIT_CACHE=/tmp/dfk-cache
cat .gpu/p0 .gpu/p1 > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 4
nvidia-smi -L 2>/dev/null
${PY:-python3} scripts/train_default_drafter.py --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
  --prompts .gpu2/prompts.jsonl.gz --out "$OUT" --work /tmp/dfk-work --data-in data/smollm2-135m-instruct \
  --gen-seconds 120 --train-seconds 250 --max-prompt-tokens 320 --max-new-tokens 192 \
  --arch dflash2 --selector-rank 64 --selector-lr-scale 10 \
  --init-from src/dflashkit/drafters/smollm2-135m-instruct --lr 2e-4 --run-name dflash2-phase6 "$@" 2>&1 | tee "$OUT/log.txt"
