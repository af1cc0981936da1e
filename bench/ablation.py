"""What limits tau for the bundled SmolLM2 drafter: training compute, block size, draft vocabulary.

    .venv/bin/python bench/ablation.py [--phase1 DIR] [--prompts 8] [--max-new-tokens 128]

Variants (greedy, batch 1, bfloat16, same prompts; tau and median tokens/s, AR in the same engine):
- training compute: the drafter after phase 1 of its GPU run (879 steps; pass its directory with --phase1,
  it is not bundled) vs the bundled one (1,829 steps);
- block size 8 vs 16;
- reduced draft vocabulary (the 8,192 / 16,384 most frequent response tokens of the training data), applied
  at load time to the full-vocabulary drafter: drafting is cheaper, proposals outside the set are impossible.
Writes ablation.json and ablation.md next to the other results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from dflashkit import DecodeConfig, DFlashEngine
from dflashkit.bench import HUMANEVAL_WRAPPER
from dflashkit.checkpoint import load_drafter
from dflashkit.data import humaneval_prompts, load_shards, mtbench_questions
from dflashkit.loader import BUNDLED_DRAFTER, encode_chat, load_target
from dflashkit.draft_vocab import frequent_tokens, with_draft_vocab


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase1", default=None)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    target, tok = load_target(dtype="bfloat16")
    prompts = ([encode_chat(tok, HUMANEVAL_WRAPPER.format(p["prompt"].strip())) for p in humaneval_prompts()[:args.prompts]]
               + [encode_chat(tok, q["turns"][0]) for q in mtbench_questions()[:args.prompts]])
    shards = load_shards(Path("data/smollm2-135m-instruct"), "train")
    bundled = load_drafter(BUNDLED_DRAFTER)
    variants = [("bundled (1829 steps), B=16", bundled, 16), ("bundled, B=8", bundled, 8)]
    if args.phase1:
        variants.append(("phase 1 (879 steps), B=16", load_drafter(args.phase1), 16))
    for k in (16384, 8192):
        variants.append((f"bundled + draft vocab {k}, B=16", with_draft_vocab(bundled, frequent_tokens(shards, k, target.vocab_size)), 16))
    ar_engine = DFlashEngine(target, None, tokenizer=tok, config=DecodeConfig())
    ar_engine.generate(prompts[:1], max_new_tokens=8)
    ar = [ar_engine.generate([p], max_new_tokens=args.max_new_tokens)[0] for p in prompts]
    ar_tps = statistics.median(g.stats.tokens_per_s for g in ar)
    rows = [{"variant": "autoregressive (block size 1)", "tau": 1.0, "tokens_per_s": round(ar_tps, 2), "speedup_vs_ar": 1.0}]
    for name, drafter, b in variants:
        eng = DFlashEngine(target, drafter.to(target.dtype), tokenizer=tok, config=DecodeConfig())
        eng.generate(prompts[:1], max_new_tokens=8, block_size=b)
        gens = [eng.generate([p], max_new_tokens=args.max_new_tokens, block_size=b)[0] for p in prompts]
        tps = statistics.median(g.stats.tokens_per_s for g in gens)
        rows.append({"variant": name, "tau": round(statistics.mean(g.stats.tau for g in gens), 3),
                     "tokens_per_s": round(tps, 2), "speedup_vs_ar": round(tps / ar_tps, 3)})
        print(rows[-1], flush=True)
    out = Path(args.out)
    (out / "ablation.json").write_text(json.dumps({"command": " ".join(sys.argv), "prompts": len(prompts),
                                                   "max_new_tokens": args.max_new_tokens, "rows": rows}, indent=2) + "\n")
    md = [f"# Ablation (`{' '.join(sys.argv)}`)", "",
          f"{args.prompts} HumanEval + {args.prompts} MT-Bench first turns, {args.max_new_tokens} new tokens, greedy, "
          "batch 1, bfloat16, 2 CPU threads; tokens/s = median over prompts.", "",
          "| variant | tau | tokens/s | speedup vs AR |", "|---|---|---|---|"]
    md += [f"| {r['variant']} | {r['tau']} | {r['tokens_per_s']} | {r['speedup_vs_ar']} |" for r in rows]
    (out / "ablation.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
