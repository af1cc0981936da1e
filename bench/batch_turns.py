"""The default system vs plain decoding at one batch size, by turns, long enough to read a few per cent.

    python bench/batch_turns.py --limit 80 --batch-size 8 --rounds 3 --warm-b1 16 --out bench/results/NAME

Why: `dflashkit bench --batch-size 8` runs each chunk of N prompts once per method; with 5-10 chunks its ratio moves
by +-5 % between runs of the same code, so it cannot say whether the default holds issue 34's 0.95x floor. Here
every chunk runs `--rounds` times on every arm in `runner.turn_order` (who goes first rotates, the cycle flips), and a
second plain arm ("ar-again", the same config) is the A/A control: its ratio to "ar" is the noise the default's
ratio is read against. Per arm: tokens / wall seconds (prefill included, as the sweep counts them), and the wall
split into prefill (`DecodeBatch.add`) and steps (`DecodeBatch.step`). Ratios come with 95 % bootstrap intervals
over the chunk-rounds (paired: a resample takes the same chunk-rounds for every arm).

--warm-b1 K first decodes K prompts one at a time on each arm (the bench's batch-1 rows come before its sweep, and
the default's policy carries what it learned there into batch 8); --fresh-policy then drops the engine's policies,
so the sweep's default starts from a new one. Writes batch_turns.json, .md and .png.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dflashkit import DecodeConfig, DFlashEngine
from dflashkit import batch as batch_mod
from dflashkit.bench.datasets import load_dataset
from dflashkit.bench.runner import turn_order
from dflashkit.loader import encode_chat, load_models

from host_work import timed  # noqa: E402  (bench/ is not a package)

ARMS = {"ar": DecodeConfig.autoregressive, "ar-again": DecodeConfig.autoregressive,
        "default": DecodeConfig.recommended}


def bootstrap(wall: np.ndarray, toks: np.ndarray, a: int, b: int, n: int = 2000) -> list[float]:
    """95 % interval of arm a's tokens/s over arm b's; wall, toks: [arms, chunk-rounds], resampled in pairs."""
    rng = np.random.default_rng(0)
    idx = rng.integers(0, wall.shape[1], size=(n, wall.shape[1]))
    r = (toks[a][idx].sum(1) / wall[a][idx].sum(1)) / (toks[b][idx].sum(1) / wall[b][idx].sum(1))
    return [round(float(x), 4) for x in np.percentile(r, [2.5, 97.5])]


def run(args) -> dict:
    target, tok, drafter, _ = load_models(dtype="bfloat16")
    engine = DFlashEngine(target, drafter, tokenizer=tok)
    prompts = [encode_chat(tok, it[0]) for it in load_dataset(args.dataset, args.limit)]
    configs = {name: make() for name, make in ARMS.items()}
    clock, calls = collections.Counter(), collections.Counter()  # seconds in DecodeBatch.add / .step, their calls
    for name in ("add", "step"):
        timed(clock, calls, batch_mod.DecodeBatch, name, name)
    with torch.inference_mode():
        for c in configs.values():  # warm-up: kernels, the cost model, the corpus index
            engine.generate(prompts[:1], max_new_tokens=8, config=c)
        for p in prompts[:args.warm_b1]:
            for c in configs.values():
                engine.generate([p], max_new_tokens=args.max_new_tokens, config=c)
        if args.fresh_policy:  # the sweep's default starts from a new policy, nothing carried over from batch 1
            engine._policies.clear()
        before = engine.policy_stats()
        n = args.batch_size
        chunks = [prompts[i:i + n] for i in range(0, len(prompts), n)]
        names = list(configs)
        cells = {m: [] for m in names}  # per chunk-round: wall, tokens, prefill and step seconds
        from tqdm import tqdm
        for k in tqdm(range(args.rounds * len(chunks)), desc=f"batch {n}, {len(names)} arms by turns", unit="chunk"):
            chunk = chunks[k % len(chunks)]
            for m in turn_order(names, k):  # who goes first rotates and the cycle flips: no arm always follows one
                clock.clear()
                t0 = time.perf_counter()
                outs = engine.generate(chunk, max_new_tokens=args.max_new_tokens, config=configs[m])
                cells[m].append({"wall": time.perf_counter() - t0, "tokens": sum(len(o.tokens) for o in outs),
                                 "add": clock["add"], "step": clock["step"]})
    wall = np.array([[c["wall"] for c in cells[m]] for m in names])
    toks = np.array([[c["tokens"] for c in cells[m]] for m in names])
    arms = {}
    for i, m in enumerate(names):
        arms[m] = {"tokens_per_s": round(float(toks[i].sum() / wall[i].sum()), 3),
                   "wall_s": round(float(wall[i].sum()), 3), "tokens": int(toks[i].sum()),
                   "prefill_s": round(sum(c["add"] for c in cells[m]), 3),
                   "steps_s": round(sum(c["step"] for c in cells[m]), 3)}
        if i:
            arms[m]["vs_ar"] = round(arms[m]["tokens_per_s"] / arms["ar"]["tokens_per_s"], 4)
            arms[m]["vs_ar_95"] = bootstrap(wall, toks, i, 0)
    return {"command": "python bench/batch_turns.py " + " ".join(sys.argv[1:]), "batch_size": n,
            "prompts": len(prompts), "chunks": len(chunks), "rounds": args.rounds, "arms": arms,
            "policy_before_sweep": before, "policy_after": engine.policy_stats(), "cells": cells}


def report(res: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "batch_turns.json").write_text(json.dumps(res, indent=1))
    lines = [f"# Batch {res['batch_size']} by turns: {res['prompts']} prompts, {res['chunks']} chunks x "
             f"{res['rounds']} rounds\n", f"`{res['command']}`\n",
             "| arm | tokens/s | vs ar (95 % interval) | wall s | prefill s | steps s | tokens |", "|---|---|---|---|---|---|---|"]
    for m, a in res["arms"].items():
        vs = f"{a['vs_ar']:.3f}x ({a['vs_ar_95'][0]:.3f}-{a['vs_ar_95'][1]:.3f})" if "vs_ar" in a else "1"
        lines.append(f"| {m} | {a['tokens_per_s']:.1f} | {vs} | {a['wall_s']:.1f} | {a['prefill_s']:.1f} | "
                     f"{a['steps_s']:.1f} | {a['tokens']} |")
    lines.append(f"\nThe default's policy after the sweep: `{json.dumps(res['policy_after'])}`")
    (out / "batch_turns.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    rel = [(m, a) for m, a in res["arms"].items() if "vs_ar" in a]
    for y, (m, a) in enumerate(rel):
        lo, hi = a["vs_ar_95"]
        ax.errorbar(a["vs_ar"], y, xerr=[[a["vs_ar"] - lo], [hi - a["vs_ar"]]], fmt="o", capsize=4)
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.axvline(0.95, color="red", lw=0.8, ls="--", label="0.95x floor")
    ax.set_yticks(range(len(rel)), [m for m, _ in rel])
    ax.set_xlabel(f"tokens/s vs ar at batch {res['batch_size']} (95 % bootstrap)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "batch_turns.png", dpi=120)
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="sharegpt-heldout")
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm-b1", type=int, default=16, help="prompts decoded one at a time per arm first")
    ap.add_argument("--fresh-policy", action="store_true",
                    help="after the warm-up, drop the engine's step policies (what the default learned at batch 1)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    report(run(args), Path(args.out))


if __name__ == "__main__":
    main()
