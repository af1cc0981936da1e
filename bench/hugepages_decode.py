"""Real decoding with the kernels' weights on 4 KiB pages vs transparent huge pages, by turns in one process.

    .venv/bin/python bench/hugepages_decode.py --limit 40 --out bench/results/NAME [--aa]

`bench/hugepages.py` times single steps; this decodes held-out prompts (greedy, `--max-new-tokens`) with two
default engines loaded in one process, the first with `kernels/hugepages.py` off, the second on, each prompt
decoded plainly (AR) and by the default system on both engines, the engines' order alternating prompt by prompt.
Why one process: across processes this host's speed moves more than the change (`hugepages-amd/decode-turns`).
--aa loads both on huge pages (the A/A control). The engines' outputs must be equal (the weights are a copy); a
difference stops the run. Writes hugepages_decode.json, .md and .png into --out.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from dflashkit import DecodeConfig, DFlashEngine
from dflashkit.bench.datasets import load_dataset
from dflashkit.kernels import hugepages
from dflashkit.loader import encode_chat, load_models
from dflashkit.measurements import cpu_name

METHODS = {"ar": DecodeConfig.autoregressive, "default": DecodeConfig.recommended}


def engine(on: bool) -> DFlashEngine:
    """The default engine, loaded (and its drafter's kernels applied) with huge pages on or off."""
    hugepages.set_enabled(on)
    target, tok, drafter, _ = load_models(dtype="bfloat16")
    return DFlashEngine(target, drafter, tokenizer=tok)


def run(args) -> dict:
    engines = {"4k": engine(args.aa), "huge": engine(True)}
    tok = engines["huge"].tokenizer
    prompts = [encode_chat(tok, it[0]) for it in load_dataset(args.dataset, args.limit)]
    secs = {(a, m): 0.0 for a in engines for m in METHODS}
    toks = dict.fromkeys(METHODS, 0)
    from tqdm import tqdm
    with torch.inference_mode():
        for a in engines:  # warm-up: the cost model, the corpus index
            for m, make in METHODS.items():
                engines[a].generate(prompts[:1], max_new_tokens=8, config=make())
        for i, p in enumerate(tqdm(prompts, desc="prompts, both engines by turns", unit="prompt")):
            for m, make in METHODS.items():
                outs = {}
                for a in (("4k", "huge") if i % 2 else ("huge", "4k")):
                    t0 = time.perf_counter()
                    outs[a] = engines[a].generate([p], max_new_tokens=args.max_new_tokens, config=make())[0].tokens
                    secs[a, m] += time.perf_counter() - t0
                if outs["4k"] != outs["huge"]:
                    raise SystemExit(f"prompt {i}, {m}: the two engines' outputs differ (the weights are a copy)")
                toks[m] += len(outs["huge"])
    res = {m: {a: round(toks[m] / secs[a, m], 2) for a in engines} for m in METHODS}
    for m, v in res.items():
        v["ratio"] = round(v["huge"] / v["4k"], 4)  # tokens/s: above 1 is faster on huge pages
    return {"tokens_per_s": res, "tokens": toks,
            "meta": {"command": "bench/hugepages_decode.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
                     "cpu": cpu_name(), "threads": torch.get_num_threads(), "prompts": len(prompts),
                     "dataset": args.dataset, "max_new_tokens": args.max_new_tokens, "aa": args.aa,
                     "engine": engines["huge"].target.engine_name}}


def report(res: dict) -> str:
    mt = res["meta"]
    arms = "both on huge pages (A/A control)" if mt["aa"] else "4 KiB pages vs huge pages"
    lines = [f"# Decoding with the weights on 4 KiB vs huge pages ({mt['date']}, {mt['cpu']}, {mt['threads']} threads)",
             "", f"`{mt['command']}`: {arms}; {mt['prompts']} prompts of {mt['dataset']}, {mt['max_new_tokens']} new "
             f"tokens, both engines by turns in one process, outputs equal; target {mt['engine']}.", "",
             "| method | 4 KiB pages, tok/s | huge pages, tok/s | huge / 4 KiB |", "|---|---|---|---|"]
    for m, v in res["tokens_per_s"].items():
        lines.append(f"| {m} | {v['4k']:.2f} | {v['huge']:.2f} | {v['ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(res: dict):
    import matplotlib.pyplot as plt

    ms = res["tokens_per_s"]
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.bar(list(ms), [v["ratio"] for v in ms.values()])
    ax.axhline(1.0, color="gray", ls="--")
    ax.set_ylabel("tokens/s, huge pages / 4 KiB pages")
    ax.set_ylim(0.85, 1.15)
    return fig


def main() -> int:
    from dflashkit.bench.report import write_result

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dataset", default="sharegpt-heldout")
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--aa", action="store_true", help="both engines on huge pages (the A/A control)")
    args = ap.parse_args()
    if not hugepages.enabled():
        raise SystemExit("transparent huge pages are off here (or DFLASHKIT_HUGE_PAGES=0): nothing to compare")
    res = run(args)
    write_result(args.out, "hugepages_decode", res, report(res), plot)
    print(report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
