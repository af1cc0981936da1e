"""Greedy speculative output vs the engine's own AR output, token for token, in the dtype users run (bfloat16).

For every prompt (first turns of HumanEval and MT-Bench), AR and each speculative configuration decode it (alone,
or `--batch N` prompts together, AR and speculation alike); the row records whether the token ids are identical
and, if not, where they part. Resumable: one JSON line per (prompt, config) in rows.jsonl; rerun the same command
to continue. Writes summary.json, summary.md and identical.png into --out. Exactness is judged WITHOUT any near-tie
allowance.

    .venv/bin/python bench/bitwise_check.py --humaneval 164 --mtbench 80 --out bench/results/bitwise-bf16
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from tqdm import tqdm

from dflashkit import DecodeConfig, DFlashEngine
from dflashkit.bench.datasets import load_dataset
from dflashkit.invariance import mode as exactness_mode
from dflashkit.loader import encode_chat, load_models

CONFIGS = {"chain": DecodeConfig, "default": DecodeConfig.recommended}


def first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summarize(rows: list[dict], meta: dict) -> dict:
    out = {}
    for cfg in sorted({r["config"] for r in rows}):
        rs = [r for r in rows if r["config"] == cfg]
        out[cfg] = {"outputs": len(rs), "identical": sum(r["identical"] for r in rs),
                    "differing": [r["id"] for r in rs if not r["identical"]],
                    "tokens": sum(r["tokens"] for r in rs), "tau": round(sum(r["tau"] for r in rs) / len(rs), 3)}
    return {"meta": meta, "configs": out}


def write_reports(summary: dict, out: Path) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    m = summary["meta"]
    lines = [f"Greedy output vs the same engine's AR output, {m['dtype']}, backend {m['backend']}, "
             f"{m['max_new_tokens']} new tokens, prompts decoded {m.get('batch', 1)} at a time (AR and every config "
             f"alike), exactness measured at start-up: {m['exactness']}. Command: `{m['command']}`.", "",
             "| config | outputs | identical to AR | differing | tokens | mean tau |", "|---|---|---|---|---|---|"]
    for cfg, r in summary["configs"].items():
        lines.append(f"| {cfg} | {r['outputs']} | {r['identical']} | {len(r['differing'])} | {r['tokens']} | "
                     f"{r['tau']:.2f} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["configs"])
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(names, [summary["configs"][n]["identical"] for n in names], label="identical to AR")
    ax.bar(names, [len(summary["configs"][n]["differing"]) for n in names],
           bottom=[summary["configs"][n]["identical"] for n in names], label="differing")
    ax.set_ylabel("outputs")
    ax.set_title(f"greedy speculative vs AR, {m['dtype']} ({m['backend']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "identical.png", dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--humaneval", type=int, default=164)
    ap.add_argument("--mtbench", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--configs", default="chain,default", help=f"comma-separated, of {sorted(CONFIGS)}")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--out", default="bench/results/bitwise-bf16")
    ap.add_argument("--batch", type=int, default=1,
                    help="decode this many prompts together (AR and every config alike; on a batch-invariant engine "
                         "each row's tokens equal its output decoded alone: tests/test_lean.py, test_kernels.py)")
    ap.add_argument("--report-only", action="store_true", help="summarise rows.jsonl without decoding more")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:  # summarise what the decoding runs wrote, with their settings (meta.json)
        rows = [json.loads(x) for x in (out / "rows.jsonl").open()]
        write_reports(summarize(rows, json.loads((out / "meta.json").read_text())), out)
        print((out / "summary.md").read_text())
        return 0
    target, tok, drafter, _ = load_models(dtype=args.dtype, backend=args.backend)
    he = [(f"humaneval/{i}", t[0]) for i, t in enumerate(load_dataset("humaneval", args.humaneval))]
    mt = [(f"mtbench/{i}", t[0]) for i, t in enumerate(load_dataset("mt-bench", args.mtbench))]
    # interleaved (2 HumanEval : 1 MT-Bench), so a run stopped early still covers both sets
    items = [x for i in range(max(len(he), 2 * len(mt)))
             for x in he[i:i + 1] + (mt[i // 2:i // 2 + 1] if i % 2 else [])]
    configs = [c.strip() for c in args.configs.split(",")]
    meta = {"dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
            "backend": getattr(target, "engine_name", type(target).__name__),
            "exactness": exactness_mode(target), "command": " ".join(sys.argv), "batch": args.batch}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    path = out / "rows.jsonl"
    done = {(r["id"], r["config"]) for r in map(json.loads, path.open())} if path.exists() else set()
    engines = {c: DFlashEngine(target, drafter, tokenizer=tok, config=CONFIGS[c]()) for c in configs}
    ar_engine = DFlashEngine(target, drafter, tokenizer=tok, config=DecodeConfig.autoregressive())
    todo = [(pid, prompt) for pid, prompt in items if any((pid, c) not in done for c in configs)]
    for k in tqdm(range(0, len(todo), args.batch), desc=f"prompts (batches of {args.batch})"):
        chunk = todo[k:k + args.batch]
        ids = [encode_chat(tok, prompt) for _, prompt in chunk]
        ar = ar_engine.generate(ids, max_new_tokens=args.max_new_tokens)
        with path.open("a") as f:
            for c in configs:
                rows = [i for i, (pid, _) in enumerate(chunk) if (pid, c) not in done]
                if not rows:
                    continue
                t0 = time.perf_counter()
                gs = engines[c].generate([ids[i] for i in rows], max_new_tokens=args.max_new_tokens)
                for i, g in zip(rows, gs):
                    row = {"id": chunk[i][0], "config": c, "identical": g.tokens == ar[i].tokens,
                           "first_difference": first_difference(ar[i].tokens, g.tokens), "tokens": len(g.tokens),
                           "tau": round(g.stats.tau, 3), "batch": len(rows),
                           "seconds": round(time.perf_counter() - t0, 2)}
                    f.write(json.dumps(row) + "\n")  # one line per finished output: a rerun resumes after it
    rows = [json.loads(x) for x in path.open()]
    summary = summarize(rows, meta)
    write_reports(summary, out)
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
