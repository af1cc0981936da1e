"""Where a decoding step's time goes outside the target's forward and head: wall-clock timers around each part of
the engine's step (the propose, the policy, the lookup, the tree's build / inputs / accept, the commit, the drafter),
on the real default target, held-out prompts, batch 1 (or `--batch-size N`), plain decoding and the default system.

Each part is timed inclusive (a part's time contains the parts it calls), per step and per call. Why: right after a
target step a small torch or numpy call costs ~10x its warm time (the step streams ~100 MB of weights through the
caches), so the host's share is measured inside real decoding, not in a microbenchmark.

    python bench/host_work.py --prompts 8 --out bench/results/NAME
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

from dflashkit import DecodeConfig, DFlashEngine
from dflashkit import batch as batch_mod
from dflashkit import corpus as corpus_mod
from dflashkit import lookup as lookup_mod
from dflashkit import proposers as prop_mod
from dflashkit import sampling as sampling_mod
from dflashkit.bench.datasets import load_dataset
from dflashkit.loader import encode_chat, load_models
from dflashkit.policy import adaptive as adaptive_mod

PARTS = [  # (owner, attribute, label): what is timed
    (batch_mod.DecodeBatch, "step", "step"), (batch_mod.DecodeBatch, "_propose", "propose"),
    (batch_mod.DecodeBatch, "_commit", "commit"), (adaptive_mod.AdaptivePolicy, "plan", "policy.plan"),
    (adaptive_mod.AdaptivePolicy, "observe", "policy.observe"), (adaptive_mod.AdaptivePolicy, "cut", "policy.cut"),
    (adaptive_mod, "best_cut", "best_cut"), (prop_mod.LookupProposer, "propose", "lookup"),
    (lookup_mod.SuffixIndex, "propose", "lookup.own"), (corpus_mod.Corpus, "match", "lookup.corpus"),
    (prop_mod.DrafterProposer, "propose", "drafter"), (prop_mod.DraftState, "append_path", "drafter.features"),
    (batch_mod, "build", "tree.build"), (batch_mod, "verify_inputs", "tree.inputs"),
    (batch_mod, "accepted", "tree.accepted"), (sampling_mod.Sampler, "__call__", "sampler"),
]


def timed(totals: collections.Counter, calls: collections.Counter, owner, name: str, label: str) -> None:
    f = getattr(owner, name, None)
    if f is None:  # a part this revision does not have (the script also times older revisions)
        return

    def part(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            totals[label] += time.perf_counter() - t
            calls[label] += 1
    setattr(owner, name, part)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    target, tok, drafter, _ = load_models(dtype="bfloat16")
    engine = DFlashEngine(target, drafter, tokenizer=tok)
    prompts = [encode_chat(tok, it[0]) for it in load_dataset("sharegpt-heldout", args.prompts + 1)]
    totals, calls = collections.Counter(), collections.Counter()
    for owner, name, label in PARTS:
        timed(totals, calls, owner, name, label)
    timed(totals, calls, target, "forward", "target.forward")
    timed(totals, calls, target, "logits", "target.logits")
    configs = {"ar": DecodeConfig.autoregressive(), "default": DecodeConfig.recommended()}
    for c in configs.values():  # warm-up (kernels, the cost model, the corpus index)
        engine.generate(prompts[:1], max_new_tokens=8, config=c)
    b, result = args.batch_size, {}
    with torch.inference_mode():
        for name, c in configs.items():
            totals.clear(), calls.clear()
            for i in range(1, len(prompts), b):
                engine.generate(prompts[i:i + b], max_new_tokens=args.max_new_tokens, config=c)
            n = calls["step"]
            result[name] = {"steps": n, "step_ms": 1000 * totals["step"] / n,
                            "parts": {k: {"ms_per_step": 1000 * v / n, "calls": calls[k], "us_per_call":
                                          1e6 * v / calls[k]} for k, v in sorted(totals.items(), key=lambda x: -x[1])
                                      if k != "step"}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"command": "python bench/host_work.py " + " ".join(sys.argv[1:]), "batch_size": b, "result": result}
    (out / "host_work.json").write_text(json.dumps(report, indent=1))
    lines = [f"# Host work per step\n\n`{report['command']}`\n",
             "Timers around each part (inclusive); target.forward and target.logits include the prefill's calls.\n"]
    for name, r in result.items():
        lines += [f"\n## {name}: {r['steps']} steps, {r['step_ms']:.3f} ms a step\n", "| part | ms per step | calls | "
                  "us per call |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['ms_per_step']:.3f} | {v['calls']} | {v['us_per_call']:.1f} |" for k, v in
                  r["parts"].items()]
    (out / "host_work.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
