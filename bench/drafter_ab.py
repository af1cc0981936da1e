"""Two drafters for one target, side by side: the default system's decode speed with each, IN LOCKSTEP with AR.

    .venv/bin/python bench/drafter_ab.py --drafter-b src/dflashkit/drafters/smollm2-135m-instruct-dflash2 \
        --dataset sharegpt-heldout --prompts 16 --batch-size 1 --batch-size 8 --out bench/results/dflash2-selector/speed

    .venv/bin/python bench/drafter_ab.py --weights-b q4_1 --out bench/results/draft-q4/speed

What it answers: does a new drafter (B) make the default system (the adaptive policy, tree + lookup) faster than
the current one (A) on prompts neither was tuned on? Per batch size, every chunk of prompts is decoded by AR, AR
again (the A/A control: the host's noise), the default with A and the default with B, one step of each in turn
(`runner.run_lockstep`; who goes first balanced by `turn_order`), so the host's drift hits all four alike. Reported:
decode tokens/s (tokens after the first / time after the prefill), tau, and per-chunk medians of B / A and
default / AR. Both engines share one target; greedy; the outputs of all four are checked equal (lossless).
--weights-a / --weights-b: the drafter's stacked layers as these copies (`drafter.layer_stack`: bf16, q8_0, q4_1;
default: the engine's choice), so B may be the same drafter on other weights. Writes drafter_ab.json, .md and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from dflashkit import DecodeConfig, DFlashEngine
from dflashkit.bench import turn_order
from dflashkit.bench.datasets import load_dataset
from dflashkit.bench.runner import run_lockstep
from dflashkit.checkpoint import load_drafter
from dflashkit.drafter import layer_stack
from dflashkit.loader import encode_chat, load_default_drafter, load_models

NAMES = ("ar", "ar-again", "default-a", "default-b")


def chunk_outputs(engines: dict, prompts: list[list[int]], max_new: int) -> dict:
    """Greedy token ids per method: the lossless check (every method must give AR's)."""
    return {m: [g.tokens for g in eng.generate(prompts, max_new_tokens=max_new, config=cfg)]
            for m, (eng, cfg) in engines.items()}


def measure(engines: dict, prompts: list[list[int]], n: int, max_new: int, min_chunks: int) -> dict:
    use = prompts[:max(len(prompts), n * min_chunks)]
    chunks = [use[i:i + n] for i in range(0, len(use), n)]
    tot = {m: [0, 0.0, []] for m in NAMES}
    b_vs_a, a_vs_ar, b_vs_ar, aa, differ = [], [], [], [], 0
    for k, chunk in enumerate(tqdm(chunks, desc=f"batch {n}", unit="chunk")):
        order = turn_order(list(NAMES), k)
        runs = run_lockstep({m: engines[m][0].stream(chunk, max_new_tokens=max_new, config=engines[m][1])
                             for m in order})
        for m, r in runs.items():
            tot[m][0] += r.tokens
            tot[m][1] += r.decode_s
            tot[m][2] += r.accepted
        rate = {m: r.tokens_per_s for m, r in runs.items()}
        b_vs_a.append(rate["default-b"] / rate["default-a"])
        a_vs_ar.append(rate["default-a"] / rate["ar"])
        b_vs_ar.append(rate["default-b"] / rate["ar"])
        aa.append(rate["ar-again"] / rate["ar"])
        outs = chunk_outputs({m: engines[m] for m in ("ar", "default-a", "default-b")}, chunk, max_new)
        differ += sum(a != x or a != y for a, x, y in zip(outs["ar"], outs["default-a"], outs["default-b"]))
    cell = {m: {"tokens_per_s": round(t[0] / t[1], 3) if t[1] else 0.0,
                "tau": round(sum(a + 1 for a in t[2]) / max(len(t[2]), 1), 3)} for m, t in tot.items()}
    med = statistics.median
    cell.update(b_vs_a_median=round(med(b_vs_a), 4), a_vs_ar_median=round(med(a_vs_ar), 4),
                b_vs_ar_median=round(med(b_vs_ar), 4), aa_median=round(med(aa), 4),
                b_vs_a_chunks=[round(x, 4) for x in b_vs_a], aa_chunks=[round(x, 4) for x in aa],
                prompts=len(use), outputs_differing_from_ar=differ)
    return cell


def report(meta: dict, res: dict, out: Path) -> None:
    md = [f"# Two drafters, one target: the default system (`{meta['command']}`)", "",
          f"A = `{meta['drafter_a']}`, B = `{meta['drafter_b']}` (the lookup's corpus: "
          f"{meta.get('corpus_b', 'its own')}; the token ranking: {meta.get('ranking_b', 'its own')}); "
          f"dataset {meta['dataset']}, {meta['max_new_tokens']} new tokens, greedy, {meta['dtype']}, "
          f"{meta['threads']} threads. Lockstep per chunk: AR, AR again, the default (adaptive policy) with A, with B. "
          "tokens/s = decode throughput.", "",
          "| batch | prompts | AR tok/s | default A tok/s (tau) | default B tok/s (tau) | B / A (median chunk) "
          "| A / AR | B / AR | A/A | outputs differing from AR |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n, r in res.items():
        md.append(f"| {n} | {r['prompts']} | {r['ar']['tokens_per_s']:.1f} | {r['default-a']['tokens_per_s']:.1f} "
                  f"({r['default-a']['tau']:.2f}) | {r['default-b']['tokens_per_s']:.1f} ({r['default-b']['tau']:.2f})"
                  f" | **{r['b_vs_a_median']:.3f}** | {r['a_vs_ar_median']:.3f} | {r['b_vs_ar_median']:.3f} | "
                  f"{r['aa_median']:.3f} | {r['outputs_differing_from_ar']} |")
    (out / "drafter_ab.md").write_text("\n".join(md) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6))
    sizes = list(res)
    for m in NAMES:
        ax.plot(sizes, [res[n][m]["tokens_per_s"] for n in sizes], marker="o", label=m)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.legend(fontsize=8)
    ax.set_title("default system, drafter A vs B (lockstep)")
    fig.tight_layout()
    fig.savefig(out / "drafter_ab.png", dpi=110)
    plt.close(fig)


def main() -> int:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter-a", default=None, help="drafter directory (default: the bundled drafter)")
    ap.add_argument("--drafter-b", default=None, help="the drafter to compare with A (default: A's drafter)")
    ap.add_argument("--weights-a", default=None, choices=("bf16", "q8_0", "q4_1"), help="A's stacked layers")
    ap.add_argument("--weights-b", default=None, choices=("bf16", "q8_0", "q4_1"), help="B's stacked layers")
    ap.add_argument("--dataset", default="sharegpt-heldout")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, action="append", default=None)
    ap.add_argument("--min-chunks", type=int, default=2, help="at least this many chunks per batch size")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.drafter_b is None and args.weights_b is None:
        ap.error("give --drafter-b, --weights-b or both: B must differ from A")
    sizes = args.batch_size or [1, 8]
    target, tok, drafter_a, _ = load_models(drafter=args.drafter_a, dtype=args.dtype)
    source_b = args.drafter_b or args.drafter_a  # only --weights-b: A's drafter again, its own layer stack
    drafter_b = (load_drafter(source_b, dtype=target.dtype) if source_b else load_default_drafter(target, tok)[0])
    # The token ranking (the target's answer tokens by frequency: the draft vocabulary) likewise: without it B
    # would draft over the whole vocabulary, a costlier drafting step than A's for the same layers.
    ranking_b = "its own" if drafter_b.token_ranking is not None or drafter_b.d2t is not None else "A's"
    if ranking_b == "A's":
        drafter_b.token_ranking = drafter_a.token_ranking
    a = DFlashEngine(target, drafter_a, tokenizer=tok)
    # The corpus (the target's earlier answers, for the lookup) ships in a drafter's directory; a drafter without
    # one gets A's: it belongs to the target, and B's default system would otherwise differ by its lookup as well.
    corpus_b = "its own" if getattr(drafter_b, "corpus", None) is not None else ("A's" if a.corpus else "none")
    b = DFlashEngine(target, drafter_b, tokenizer=tok, corpus=None if corpus_b == "its own" else a.corpus)
    for eng, weights in ((a, args.weights_a), (b, args.weights_b)):
        if weights is not None:  # the drafter's layers on these copies; the engine's proposers rebuilt for them
            eng.drafter.stack = layer_stack(eng.drafter, weights)
            eng.set_proposers()
    default = DecodeConfig.recommended()
    engines = {"ar": (a, DecodeConfig.autoregressive()), "ar-again": (a, DecodeConfig.autoregressive()),
               "default-a": (a, default), "default-b": (b, default)}
    need = max([args.prompts] + [n * args.min_chunks for n in sizes])
    prompts = [encode_chat(tok, it[0]) for it in load_dataset(args.dataset, need)]
    for eng, cfg in engines.values():  # warm-up (and the cost models' calibration, if not cached)
        eng.generate([prompts[0]], max_new_tokens=4, config=cfg)
    res = {str(n): measure(engines, prompts[:args.prompts], n, args.max_new_tokens, args.min_chunks)
           for n in sizes}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(["bench/drafter_ab.py"] + sys.argv[1:]),
            "drafter_a": (args.drafter_a or "bundled") + (f" ({args.weights_a} layers)" if args.weights_a else ""),
            "drafter_b": (source_b or "bundled") + (f" ({args.weights_b} layers)" if args.weights_b else ""),
            "corpus_b": corpus_b, "ranking_b": ranking_b,
            "dataset": args.dataset,
            "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "threads": torch.get_num_threads(),
            "policy": {"a": a.policy_stats(), "b": b.policy_stats()}}
    (out / "drafter_ab.json").write_text(json.dumps({"meta": meta, "results": res}, indent=2) + "\n")
    report(meta, res, out)
    print((out / "drafter_ab.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
