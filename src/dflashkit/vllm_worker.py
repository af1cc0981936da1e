"""Worker for the vLLM peers (`vllm`, `vllm-dflash` in `dflashkit bench`) and for scripts/vllm_check.py.

It runs inside its own virtualenv (`scripts/vllm-env.sh` builds `.venv-vllm`: vLLM 0.32.0 CPU build beside
torch 2.13.0) and must not import dflashkit. vLLM's offline API (`vllm.LLM`) runs in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, executor "uni"), so the drafts vLLM proposes can be recorded by wrapping its
DFlash proposer. Protocol: one JSON object per line on stdin ({"ids": [...], "max_new_tokens": N,
"trace": bool, "time_first": bool}), one JSON result per line on stdout ({"tokens": [...], "ttft_s", "decode_s",
"num_drafts", "accepted_per_pos": [...], "trace": [[anchor, [drafts...]], ...]}); a first line reports
readiness or the load error.

    .venv-vllm/bin/python -m dflashkit.vllm_worker TARGET_DIR DRAFTER_DIR|- DTYPE NUM_SPEC_TOKENS
(run with PYTHONPATH=src so that only this file is taken from the repo; the caller sets the vLLM env vars).
"""

from __future__ import annotations

import json
import os
import sys
import time


def protocol_stream():
    """The real stdout for protocol lines; everything else that writes to fd 1 (vLLM logs to stdout, C code
    prints) goes to stderr instead, so a log line can never be read as a reply."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def counters(llm) -> tuple[int, list[int]]:
    """(number of drafts, accepted tokens per draft position) summed over vLLM's metric snapshot."""
    drafts, per_pos = 0, []
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [a + b for a, b in zip(per_pos, m.values)] if per_pos else list(m.values)
    return drafts, per_pos


def main() -> int:
    target_dir, drafter_dir, dtype, num_spec = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    proto = protocol_stream()

    def reply(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    trace: list = []
    try:
        from vllm import LLM, SamplingParams

        spec = None
        if drafter_dir != "-":
            from vllm.v1.spec_decode.dflash import DFlashProposer

            original = DFlashProposer.propose

            def propose(self, *args, **kwargs):  # record (anchor, drafts) of every proposal, then pass through
                drafts = original(self, *args, **kwargs)
                anchors = kwargs["next_token_ids"].tolist()
                for a, d in zip(anchors, drafts.tolist()):
                    trace.append([int(a), [int(x) for x in d]])
                return drafts

            DFlashProposer.propose = propose
            spec = {"method": "dflash", "model": drafter_dir, "num_speculative_tokens": num_spec}
        llm = LLM(model=target_dir, dtype=dtype, enforce_eager=True, max_model_len=2048, seed=0,
                  distributed_executor_backend="uni", enable_prefix_caching=False, speculative_config=spec,
                  disable_log_stats=False)  # the acceptance counters live in the stat loggers
    except Exception as e:  # noqa: BLE001 - the caller needs the reason, whatever it is
        reply({"error": f"{type(e).__name__}: {e}"})
        return 1
    reply({"ready": True})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        prompt = {"prompt_token_ids": req["ids"]}
        greedy = dict(temperature=0.0, detokenize=False)
        ttft = 0.0
        if req.get("time_first"):  # prefill + first token, timed alone (prefix caching is off)
            t0 = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
            ttft = time.perf_counter() - t0
        d0, p0 = counters(llm)
        trace.clear()
        t0 = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(max_tokens=req["max_new_tokens"], **greedy), use_tqdm=False)
        total = time.perf_counter() - t0
        d1, p1 = counters(llm)
        reply({"tokens": list(out[0].outputs[0].token_ids), "ttft_s": ttft, "decode_s": max(total - ttft, 1e-9),
               "num_drafts": d1 - d0, "accepted_per_pos": [b - a for a, b in zip(p0 or [0] * len(p1), p1)],
               "trace": list(trace) if req.get("trace") else None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
