"""Core engine benchmark on this machine: the verification-cost curve and AR vs DFlash decoding speed.

    .venv/bin/python bench/core.py [--out bench/results] [--prompts 10] [--max-new-tokens 128]

1. Target forward time for q = 1, 2, 4, 8, 16, 32 new tokens after a 256-token context (the price of
   verifying a block of q tokens), float32 and bfloat16, median of repeated runs.
2. Batch-1 greedy decoding, same engine: block size 1 (autoregressive) vs DFlash at block sizes 8 and 16 with
   the bundled drafter, on HumanEval and MT-Bench first-turn prompts: tau, tokens/s (median over prompts),
   speedup, and how many outputs differ from AR (bfloat16 rounds a 16-token block differently from a
   one-token step, so near-ties can flip).
Writes core.json and core.md under --out. Run it with nothing else busy on the CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from dflashkit import DecodeConfig, DFlashEngine
from dflashkit.bench import HUMANEVAL_WRAPPER
from dflashkit.data import humaneval_prompts, mtbench_questions
from dflashkit.loader import encode_chat, load_default_drafter, load_target


def forward_curve(dtype: str, reps: int = 15) -> dict:
    target, _ = load_target(dtype=dtype)
    target.set_taps([1, 7, 14, 20, 27])
    cache = target.new_cache(1, 512)
    ctx = 256
    target.forward(torch.randint(100, 20000, (1, ctx)), torch.arange(ctx)[None], cache)
    out = {}
    with torch.inference_mode():
        for q in (1, 2, 4, 8, 16, 32):
            times = []
            for _ in range(reps):
                ids = torch.randint(100, 20000, (1, q))
                pos = ctx + torch.arange(q)[None]
                t0 = time.perf_counter()
                h, _ = target.forward(ids, pos, cache, kv_len=ctx + q, taps=q > 1)
                target.logits(h).argmax(-1)
                times.append(time.perf_counter() - t0)
            out[q] = round(statistics.median(times[2:]) * 1000, 2)
    return out


def decode(dtype: str, n_prompts: int, max_new: int) -> dict:
    target, tok = load_target(dtype=dtype)
    drafter, trained = load_default_drafter(target, tok)
    eng = DFlashEngine(target, drafter, tokenizer=tok, config=DecodeConfig())
    sets = {
        "humaneval": [HUMANEVAL_WRAPPER.format(p["prompt"]) for p in humaneval_prompts()[:n_prompts]],
        "mt-bench": [q["turns"][0] for q in mtbench_questions()[:n_prompts]],
    }
    eng.generate([encode_chat(tok, "Hello")], max_new_tokens=8, block_size=16)  # warm-up
    res = {"drafter_trained": trained}
    for name, prompts in sets.items():
        ids = [encode_chat(tok, p) for p in prompts]
        runs = {}
        for b in (1, 8, 16):
            gens = [eng.generate([x], max_new_tokens=max_new, block_size=b)[0] for x in ids]
            runs[b] = gens
        ar_tps = statistics.median(g.stats.tokens_per_s for g in runs[1])
        row = {"ar": {"tokens_per_s": round(ar_tps, 2)}}
        for b in (8, 16):
            tps = statistics.median(g.stats.tokens_per_s for g in runs[b])
            row[f"dflash-b{b}"] = {
                "tau": round(statistics.mean(g.stats.tau for g in runs[b]), 3),
                "tokens_per_s": round(tps, 2),
                "speedup_vs_ar": round(tps / ar_tps, 3),
                "outputs_differing_from_ar": sum(g.tokens != a.tokens for g, a in zip(runs[b], runs[1])),
            }
        res[name] = row
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    result = {
        "command": " ".join([sys.executable.split("/")[-1]] + sys.argv),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "forward_ms": {d: forward_curve(d) for d in ("float32", "bfloat16")},
        "decode": {"bfloat16": decode("bfloat16", args.prompts, args.max_new_tokens)},
        "settings": {"prompts_per_set": args.prompts, "max_new_tokens": args.max_new_tokens, "batch": 1,
                     "temperature": 0},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "core.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Core engine benchmark", "", f"`{result['command']}` — {result['machine']['threads']} threads, "
             f"torch {result['machine']['torch']}", "", "## Target forward time vs new tokens (256-token context, ms, median)", "",
             "| q | " + " | ".join(result["forward_ms"]) + " |", "|---|" + "---|" * len(result["forward_ms"])]
    for q in (1, 2, 4, 8, 16, 32):
        lines.append(f"| {q} | " + " | ".join(str(result["forward_ms"][d][q]) for d in result["forward_ms"]) + " |")
    lines += ["", f"## Greedy decoding, batch 1, {args.max_new_tokens} new tokens, bfloat16, {args.prompts} prompts per set "
              "(tokens/s = median over prompts)", "",
              "| set | method | tau | tokens/s | speedup vs AR | outputs != AR |", "|---|---|---|---|---|---|"]
    for name, row in result["decode"]["bfloat16"].items():
        if name == "drafter_trained":
            continue
        lines.append(f"| {name} | ar | 1.0 | {row['ar']['tokens_per_s']} | 1.0 | - |")
        for m in ("dflash-b8", "dflash-b16"):
            r = row[m]
            lines.append(f"| {name} | {m} | {r['tau']} | {r['tokens_per_s']} | {r['speedup_vs_ar']} | "
                         f"{r['outputs_differing_from_ar']}/{args.prompts} |")
    (out / "core.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
