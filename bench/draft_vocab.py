"""How large a draft vocabulary does the drafter need? Acceptance and drafting cost by draft vocabulary.

    .venv/bin/python bench/draft_vocab.py --out bench/results/draft-vocab [--vocabs 16384,8192,4096] [--time]

The drafter's logits come from the target's LM head; `DecodeConfig(draft_vocab=N)` reads only the rows of the
drafter's N most frequent training ids (its token_ranking.json), so a drafting pass reads fewer head bytes (the
bundled drafter: 18.9 MB of bf16 rows at 16,384 ids, 4.7 MB at 4,096, beside ~35 MB of its layers). A token outside
the N ids is never drafted; verification keeps the full vocabulary, so output is exact at any N.
1. Acceptance (counts, no quiet host needed): the bundled drafter's plain chain at block 4 and the default's
   20-node tree at block 4 (every step drafted, the fixed policy, greedy, bf16) on prompts never tuned on, per
   draft vocabulary; outputs compared with AR's.
2. Cost (`--time`, on a quiet host): the drafting step at 1 and 4 rows, blocks 2, 3, 4 and 16, as the default
   system drafts (its tree, path scores), per vocabulary, beside a one-token target step; medians of `--repeats`
   rounds, every callable timed back to back in each round.
Writes draft_vocab.json (resumable per dataset), draft_vocab.md and draft_vocab.png into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dflashkit import DecodeConfig, DFlashEngine
from dflashkit.bench.datasets import load_dataset
from dflashkit.loader import encode_chat, load_models
from dflashkit.measurements import cpu_name

sys.path.insert(0, str(Path(__file__).parent))
from draft_block import accepted_lengths, add_run_args, median_ms, step_ms, target_step, tau  # noqa: E402  (bench/ is not a package)

BLOCKS = (2, 3, 4, 16)
SHAPES = {"chain": dict(block_size=4, tree=0), "tree": dict(block_size=4, tree=20, tree_min_prob=0.03)}


def timings(engine, vocabs: list[int], ctx: int, repeats: int, inner: int = 5) -> dict:
    """ms per drafting step by (vocabulary, rows, block), and a one-token target step: medians over rounds."""
    fns = {"target_1x1": target_step(engine.target, ctx)}
    base = engine.config
    for v in vocabs:
        engine.config = base.replace(draft_vocab=v)  # `step_ms` drafts with the engine's config at each block
        for rows in (1, 4):
            fns.update({f"draft_{v}_{rows}x{b}": step_ms(engine, b, rows, ctx) for b in BLOCKS})
    engine.config = base
    return median_ms(fns, repeats, inner)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocabs", default="16384,8192,4096", help="draft vocabularies to compare")
    add_run_args(ap, prompts=20)
    args = ap.parse_args()
    vocabs = [int(v) for v in args.vocabs.split(",")]
    if any(v < 1 for v in vocabs):
        ap.error("--vocabs: positive integers (the drafter's N most frequent ids)")
    target, tok, drafter, _ = load_models(dtype="bfloat16")
    if drafter.token_ranking is None or len(drafter.token_ranking) < max(vocabs):
        ap.error(f"the drafter's token ranking holds fewer than {max(vocabs)} ids")
    engine = DFlashEngine(target, drafter, tokenizer=tok)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "draft_vocab.json"
    res = json.loads(path.read_text()) if path.is_file() else {}
    res["meta"] = {"command": " ".join(["bench/draft_vocab.py"] + sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
                   "cpu": cpu_name(), "threads": torch.get_num_threads(), "engine": target.engine_name,
                   "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "vocabs": vocabs}
    acc = res.setdefault("accepted", {})
    want = {f"{shape}-{v}" for shape in SHAPES for v in vocabs}
    for name in args.datasets.split(","):
        if set(acc.get(name, {})) >= want:
            continue
        prompts = [encode_chat(tok, it[0]) for it in load_dataset(name, args.prompts)]
        ar = engine.generate(prompts, max_new_tokens=args.max_new_tokens, config=DecodeConfig.autoregressive())
        acc[name] = {f"{shape}-{v}": accepted_lengths(engine, prompts, args.max_new_tokens,
                                                      DecodeConfig(policy="fixed", draft_vocab=v, **SHAPES[shape]), ar)
                     for shape in SHAPES for v in vocabs}
        path.write_text(json.dumps(res) + "\n")
        print(name, {k: tau(r["accepted"]) for k, r in acc[name].items()}, flush=True)
    if args.time:
        with torch.inference_mode():
            res["ms"] = timings(engine, vocabs, args.context, args.repeats)
        res["meta"]["context"] = args.context
    path.write_text(json.dumps(res) + "\n")
    (out / "draft_vocab.md").write_text(report(res))
    plot(out / "draft_vocab.png", res)
    print(report(res))
    return 0


def report(res: dict) -> str:
    mt = res["meta"]
    vocabs = mt["vocabs"]
    lines = [f"# Draft vocabulary: acceptance and cost ({mt['date']}, {mt['cpu']}, {mt['threads']} threads)", "",
             f"`{mt['command']}`. The bundled drafter at block 4, its plain chain and the default's 20-node tree, "
             f"every step drafted, {mt['prompts']} prompts per dataset, {mt['max_new_tokens']} new tokens, greedy, "
             f"bf16, engine {mt['engine']}. tau per draft vocabulary (first-slot acceptance; outputs differing "
             "from AR).", "",
             "| dataset | drafts | " + " | ".join(f"{v} ids" for v in vocabs) + " |",
             "|---|---|" + "---|" * len(vocabs)]
    for name, by in res["accepted"].items():
        for shape in SHAPES:
            cells = []
            for v in vocabs:
                a = by[f"{shape}-{v}"]["accepted"]
                first = sum(x >= 1 for x in a) / max(len(a), 1)
                cells.append(f"{tau(a):.3f} ({first:.2f}; {by[f'{shape}-{v}']['differ_from_ar']})")
            lines.append(f"| {name} | {shape} | " + " | ".join(cells) + " |")
    ms = res.get("ms")
    if ms:
        one = ms["target_1x1"]
        lines += ["", f"Drafting step, ms (x a one-token target step, {one:.2f} ms), context {mt['context']} tokens, "
                  "as the default system drafts (its tree, path scores):", "",
                  "| ids | rows | " + " | ".join(f"block {b}" for b in BLOCKS) + " |",
                  "|---|---|" + "---|" * len(BLOCKS)]
        for v in vocabs:
            for rows in (1, 4):
                cells = [ms[f"draft_{v}_{rows}x{b}"] for b in BLOCKS]
                lines.append(f"| {v} | {rows} | " + " | ".join(f"{c:.2f} ({c / one:.2f}x)" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def plot(path: Path, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vocabs, ms = res["meta"]["vocabs"], res.get("ms")
    fig, axes = plt.subplots(1, 2 if ms else 1, figsize=(11 if ms else 6, 4), squeeze=False)
    ax = axes[0][0]
    for name, by in res["accepted"].items():
        for shape, style in (("chain", "o-"), ("tree", "s--")):
            ax.plot(vocabs, [tau(by[f"{shape}-{v}"]["accepted"]) for v in vocabs], style, label=f"{name}, {shape}")
    ax.set(xscale="log", xlabel="draft vocabulary (ids)", ylabel="tau (block 4, every step drafted)",
           title="acceptance")
    ax.legend(fontsize=7)
    if ms:
        one = ms["target_1x1"]
        for v in vocabs:
            axes[0][1].plot(BLOCKS, [ms[f"draft_{v}_1x{b}"] / one for b in BLOCKS], "o-", label=f"{v} ids, 1 row")
        axes[0][1].axhline(0.25, color="grey", ls="--", lw=1)
        axes[0][1].set(xlabel="block", ylabel="drafting step / one-token target step", title="cost at one row")
        axes[0][1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
