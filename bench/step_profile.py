"""Where a decoding step's time goes: target verify, LM head, the drafter, the host's drafting work (lookup, step
policy, tree building), commit, and the rest (Python glue: sampling, stream bookkeeping).

Decodes a few prompts alone with AR, the plain chain and the default system (tree + lookup), and with `--configs
drafted` the default system running its drafter at every step (what a drafted step costs, its cut included), and
times every call of the step's parts (wall clock, the process otherwise quiet). Writes profile.json, profile.md
and profile.png.

    .venv/bin/python bench/step_profile.py --prompts 4 --max-new-tokens 96 --out bench/results/step-profile
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from dflashkit import DecodeConfig, DFlashEngine
from dflashkit.batch import DecodeBatch
from dflashkit.bench.datasets import load_dataset
from dflashkit.dflash2 import CandidateSelector, DynamicConv
from dflashkit.loader import encode_chat, load_models
from dflashkit.policy import AdaptivePolicy
from dflashkit.proposers import DrafterProposer
from dflashkit.step_cost import CostModel

# "lookup+policy+tree" = `_propose` without the drafter's forward and the policy's cut (their own parts, nested
# inside, counted once);
# "selector" and "convolutions": a DFlash2 drafter's parts (its walk over the top-k, its dynamic convolutions), each
# counted once, outside "drafter" (in a tree, the per-slot scoring runs in the tree build: under "drafter")
PARTS = ["target forward", "lm heads", "drafter", "selector", "convolutions", "lookup+policy+tree", "cut", "commit",
         "other"]


class Clock:
    def __init__(self):
        self.total = defaultdict(float)
        self.stack = []  # time spent in nested parts, per open call
        self.saved = []  # (obj, name, what to put back: the class's function, or None to drop an instance attribute)

    def wrap(self, obj, name: str, part: str):
        fn = getattr(obj, name)
        self.saved.append((obj, name, fn if isinstance(obj, type) else None))

        def timed(*a, **k):  # self time: a nested part (the drafter's LM head inside propose) counts once
            self.stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                inner = self.stack.pop()
                self.total[part] += dt - inner
                if self.stack:
                    self.stack[-1] += dt
        setattr(obj, name, timed)

    def restore(self):
        for obj, name, fn in reversed(self.saved):
            setattr(obj, name, fn) if fn is not None else delattr(obj, name)


def always_draft(self, view, rec, cut, cost_of) -> bool:
    """`AdaptivePolicy._wants_drafter` for the "drafted" row: every step drafts (its cut still prunes the tree)."""
    rec.draft_in = (view.ctx, view.pending, self._block())
    return True


def profile(target, drafter, tok, config, prompts, n, force_draft: bool = False, cost: dict | None = None) -> dict:
    clock = Clock()
    eng = DFlashEngine(target, drafter, tokenizer=tok, config=config, cost=None if cost is None else CostModel(**cost))
    if force_draft:  # restored with the other wrapped methods
        clock.saved.append((AdaptivePolicy, "_wants_drafter", AdaptivePolicy._wants_drafter))
        AdaptivePolicy._wants_drafter = always_draft
    eng.generate([prompts[0]], max_new_tokens=8)  # warm-up
    clock.wrap(target, "forward", "target forward")
    clock.wrap(target, "logits", "lm heads")
    clock.wrap(DecodeBatch, "_propose", "lookup+policy+tree")
    clock.wrap(DrafterProposer, "propose", "drafter")
    for name in ("select", "conditional"):
        clock.wrap(CandidateSelector, name, "selector")
    for name in ("prepare", "finish"):
        clock.wrap(DynamicConv, name, "convolutions")
    clock.wrap(DecodeBatch, "_commit", "commit")
    clock.wrap(AdaptivePolicy, "cut", "cut")
    steps = tokens = 0
    wall, spent = 0.0, defaultdict(float)
    try:
        for p in prompts:  # the prefill (a stream's first yield) is left out: this profiles decoding steps
            for i, step in enumerate(eng.stream([p], max_new_tokens=n)):
                if i == 0:
                    before, t0 = dict(clock.total), time.perf_counter()
                    continue
                steps += 1
                tokens += sum(len(o.tokens) for o in step)
            wall += time.perf_counter() - t0
            for k in PARTS[:-1]:
                spent[k] += clock.total[k] - before.get(k, 0.0)
    finally:
        clock.restore()
    ms = {k: 1e3 * spent[k] / steps for k in PARTS[:-1]}
    ms["other"] = 1e3 * wall / steps - sum(ms.values())
    return {"steps": steps, "tokens": tokens, "ms_per_step": {k: round(v, 2) for k, v in ms.items()},
            "tokens_per_step": round(tokens / steps, 3), "tokens_per_s": round(tokens / wall, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--quant", default=None, help="int4: the GGUF's own Q4_1 codes (the lean backend)")
    ap.add_argument("--drafter", default=None, help="a drafter directory (default: the bundled one), e.g. DFlash2")
    ap.add_argument("--dataset", default="humaneval", help="prompts from this benchmark set (e.g. sharegpt-heldout)")
    ap.add_argument("--configs", default="ar,chain,default",
                    help="which of ar, chain, default, drafted to profile (drafted: the default system with the "
                         "drafter run at every step, its cut pruning the tree as the policy prunes it)")
    ap.add_argument("--cost", default=None,
                    help="a JSON file of the step policy's cost model (CostModel's fields, as ~/.cache/dflashkit/"
                         "cost.json stores one): runs of two code versions then price steps alike (default: the "
                         "engine's own calibration)")
    ap.add_argument("--out", default="bench/results/step-profile")
    args = ap.parse_args()
    unknown = set(args.configs.split(",")) - {"ar", "chain", "default", "drafted"}
    if unknown:
        ap.error(f"--configs: unknown {sorted(unknown)}; choose from ar, chain, default, drafted")
    target, tok, drafter, _ = load_models(drafter=args.drafter, dtype=args.dtype, backend=args.backend,
                                          quant=args.quant)
    prompts = [encode_chat(tok, t[0]) for t in load_dataset(args.dataset, args.prompts)]
    every = {"ar": DecodeConfig.autoregressive(), "chain": DecodeConfig(), "default": DecodeConfig.recommended(),
             "drafted": DecodeConfig.recommended()}
    configs = {name: every[name] for name in args.configs.split(",")}
    cost = json.loads(Path(args.cost).read_text()) if args.cost else None
    rows = {name: profile(target, drafter, tok, c, prompts, args.max_new_tokens, force_draft=name == "drafted",
                          cost=cost) for name, c in configs.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"backend": getattr(target, "engine_name", type(target).__name__), "dtype": args.dtype,
            "drafter": args.drafter or "bundled", "drafter_arch": drafter.config.arch,
            "quant": args.quant, "dataset": args.dataset, "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens, "cost": cost, "command": " ".join(sys.argv)}
    (out / "profile.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"ms per step ({meta['backend']}, {args.dtype}, {args.prompts} {args.dataset} prompts decoded alone, "
             f"{args.max_new_tokens} tokens; `{meta['command']}`)", "", "| config | " + " | ".join(PARTS) + " | tokens/step | tok/s |",
             "|---" * (len(PARTS) + 3) + "|"]
    for name, r in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{r['ms_per_step'][k]:.1f}" for k in PARTS)
                     + f" | {r['tokens_per_step']:.2f} | {r['tokens_per_s']:.1f} |")
    (out / "profile.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    bottom = [0.0] * len(rows)
    for k in PARTS:
        vals = [r["ms_per_step"][k] for r in rows.values()]
        ax.bar(list(rows), vals, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms per step")
    ax.set_title(f"step profile, {meta['backend']} {args.dtype}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "profile.png", dpi=120)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
