"""Worker for the `zlab` benchmark peer: runs Z Lab's reference package `dflash` on OUR drafter.

It runs inside its own virtualenv (`scripts/zlab-env.sh` builds `.venv-zlab`: dflash 0.1.0, transformers
5.15, torch 2.13.0 CPU) and must not import dflashkit. Protocol: one JSON object per line on stdin
({"ids": [...], "max_new_tokens": N, "block_size": B}), one JSON result per line on stdout
({"tokens": [...], "acceptance_lengths": [...], "ttft_s": ..., "decode_s": ...}); a first line reports
readiness or the load error.

    .venv-zlab/bin/python -m dflashkit.zlab_worker TARGET_DIR DRAFTER_DIR DTYPE EOS_ID
(run with PYTHONPATH=src so that only this file is taken from the repo).
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    target_dir, drafter_dir, dtype_name, eos = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    import torch
    from transformers import AutoModelForCausalLM

    import dflash.model as zmodel
    from dflash.model import DFlashDraftModel, dflash_generate

    # Its stats path calls torch.cuda.synchronize(); on a CPU a plain clock is the same measurement.
    zmodel._cuda_time = time.perf_counter
    dtype = getattr(torch, dtype_name)
    torch.set_grad_enabled(False)
    target = AutoModelForCausalLM.from_pretrained(target_dir, attn_implementation="sdpa", dtype=dtype).eval()
    draft, info = DFlashDraftModel.from_pretrained(drafter_dir, attn_implementation="sdpa", dtype=dtype,
                                                   output_loading_info=True)
    # A missing tensor is only reported by transformers and then randomly initialised: refuse instead.
    if info.get("missing_keys") or info.get("mismatched_keys"):
        print(json.dumps({"error": f"Z Lab loader: missing {info.get('missing_keys')}, "
                                   f"mismatched {info.get('mismatched_keys')}"}), flush=True)
        return 1
    draft = draft.eval()
    print(json.dumps({"ready": True, "unexpected_keys": list(info.get("unexpected_keys") or [])}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        ids = torch.tensor([req["ids"]])
        out = dflash_generate(draft, target, ids, req["max_new_tokens"], stop_token_ids=[eos], temperature=0.0,
                              block_size=req["block_size"], return_stats=True)
        toks = out.output_ids[0, ids.shape[1]:].tolist()
        print(json.dumps({"tokens": toks, "acceptance_lengths": [int(a) for a in out.acceptance_lengths],
                          "ttft_s": out.time_to_first_token,
                          "decode_s": out.time_per_output_token * out.num_output_tokens}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
