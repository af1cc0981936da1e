"""How many block slots does the drafter need? Chain acceptance and drafting cost by block size.

    .venv/bin/python bench/draft_block.py --out bench/results/draft-block [--blocks 2,3,4,6,8,16] [--prompts 16]

The drafter is trained on blocks of 16 ([anchor, MASK x 15], bidirectional attention inside the block), but a
drafting pass may run a shorter block: `DecodeConfig(block_size=B)` feeds [anchor, MASK x (B-1)] and the drafter's
cost falls with B (its layers, attention and head run over B queries per row, not 16). The masks see each other, so
a shorter block also changes what the first slots draft. This measures both sides:

1. Acceptance (counts, no quiet host needed): the bundled drafter's plain chain (every step drafted, greedy, bf16,
   its default draft vocabulary)
   on held-out prompts at each block size B, against the block of 16 with its accepted length capped at B - 1
   (what a verify of B - 1 of its drafts would have accepted: min(a, B - 1) + 1 per step). If the short block's
   tau equals the capped tau, a step that verifies only B - 1 drafts loses nothing by drafting only B - 1 slots.
2. Cost (`--time`, run on a quiet host): the drafting step (`DrafterProposer.propose`, the context ingested) at
   1 and 4 rows for each B as the default system drafts (its tree, with path scores), beside a one-token target
   step, medians of `--repeats` rounds with every B timed back to back in each round; kept per kernel path
   (`--isa`), so one host's paths can be compared.

Writes draft_block.json (resumable per dataset), draft_block.md and draft_block.png into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dflashkit import DecodeConfig, DFlashEngine
from dflashkit.bench.datasets import load_dataset
from dflashkit.loader import encode_chat, load_models
from dflashkit.measurements import cpu_name
from dflashkit.proposers import DraftView


def chain(block: int) -> DecodeConfig:
    """The drafter's plain chain at block `block`, every step drafted, over its default draft vocabulary."""
    return DecodeConfig(block_size=block, policy="fixed", draft_vocab=None)


def accepted_lengths(engine, prompts: list[list[int]], max_new: int, config: DecodeConfig, ar: list) -> dict:
    """Every step's accepted draft count a under `config`, and how many outputs differ from AR's."""
    gens = engine.generate(prompts, max_new_tokens=max_new, config=config)
    return {"accepted": [a for g in gens for a in g.stats.accepted],
            "differ_from_ar": sum(g.tokens != r.tokens for g, r in zip(gens, ar))}


def tau(accepted: list[int], cap: int | None = None) -> float:
    """Committed tokens per verify step: a + 1, the draft count capped at `cap`."""
    return round(sum(min(a, cap if cap is not None else a) + 1 for a in accepted) / max(len(accepted), 1), 4)


def step_ms(engine, block: int, rows: int, ctx: int) -> callable:
    """A drafting step of `rows` rows at block `block` after a ctx-token prompt (the prompt's features ingested
    once before): the callable the timing loop runs."""
    return drafting_step(engine, block, rows, ctx)[1]


def drafting_step(engine, block: int, rows: int, ctx: int) -> tuple[object, callable]:
    """(the proposer, `step_ms`'s callable): A/B scripts swap the proposer's parts between calls."""
    prop = engine.drafter_proposer(engine.resolve(engine.config.replace(block_size=block)))  # the default's tree
    batch = engine.new_batch(ctx + 64)
    prompt = torch.randint(4, engine.target.vocab_size, (ctx,), generator=torch.Generator().manual_seed(1)).tolist()
    batch.add([engine.sequence(i, prompt, max_new_tokens=8) for i in range(rows)])
    view = DraftView(batch.anchor, batch.start, max(batch.starts), batch.seqs, batch.starts)
    prop.propose(batch.dstate, view, scores=True)  # as the adaptive policy asks: the nodes' path scores too
    return prop, (lambda: prop.propose(batch.dstate, view, scores=True))


def target_step(target, ctx: int, w: int = 1) -> callable:
    """A w-token target step (forward + LM head over every new token, as a verify computes it) after a ctx-token
    prompt; w = 1: a plain decoding step."""
    cache = target.new_cache(1, ctx + w + 1)
    ids = torch.randint(4, target.vocab_size, (1, ctx + w), generator=torch.Generator().manual_seed(0))
    target.forward(ids[:, :ctx], torch.arange(ctx)[None], cache, kv_len=ctx, taps=False)
    pos = torch.arange(ctx, ctx + w)[None]

    def step():
        h, _ = target.forward(ids[:, ctx:], pos, cache, kv_len=ctx + w, taps=False)
        return target.logits(h)
    return step


def timings(engine, blocks: list[int], ctx: int, repeats: int, inner: int = 5) -> dict:
    """ms per call, medians over rounds; each round times every callable back to back (drift hits all alike)."""
    fns = {"target_1x1": target_step(engine.target, ctx)}
    for rows in (1, 4):
        fns.update({f"draft_{rows}x{b}": step_ms(engine, b, rows, ctx) for b in blocks})
    return median_ms(fns, repeats, inner)


def median_ms(fns: dict, repeats: int, inner: int = 5) -> dict:
    """ms per call of each callable, the median over `repeats` rounds; each round calls them all back to back."""
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            runs[k].append((time.perf_counter() - t0) / inner * 1000)
    return {k: round(statistics.median(v), 3) for k, v in runs.items()}


def add_run_args(ap: argparse.ArgumentParser, prompts: int) -> None:
    """The flags this script and bench/draft_vocab.py share: what they decode and how they time."""
    ap.add_argument("--datasets", default="sharegpt-heldout,humaneval,mt-bench-t1")
    ap.add_argument("--prompts", type=int, default=prompts, help="per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--time", action="store_true", help="also time the drafting steps (needs a quiet host)")
    ap.add_argument("--repeats", type=int, default=7, help="timing rounds")
    ap.add_argument("--context", type=int, default=176, help="prompt tokens before the timed steps")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--blocks", default="2,3,4,6,8,16", help="block sizes to compare (16 is always included)")
    add_run_args(ap, prompts=16)
    ap.add_argument("--isa", default="auto", choices=("auto", "avx512bf16", "avx2"),
                    help="rowlinear's instruction path for the timing (`kernels.set_isa`; timings are kept per path)")
    args = ap.parse_args()
    blocks = sorted({int(b) for b in args.blocks.split(",")} | {16})
    from dflashkit.kernels import isa, set_isa

    set_isa(args.isa)  # before the models load: the kernel plan follows the path
    target, tok, drafter, _ = load_models(dtype="bfloat16")
    engine = DFlashEngine(target, drafter, tokenizer=tok)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "draft_block.json"
    res = json.loads(path.read_text()) if path.is_file() else {}
    res["meta"] = {"command": " ".join(["bench/draft_block.py"] + sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
                   "cpu": cpu_name(), "threads": torch.get_num_threads(), "engine": target.engine_name,
                   "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "blocks": blocks}
    acc = res.setdefault("accepted", {})
    for name in args.datasets.split(","):
        if set(acc.get(name, {})) >= {str(b) for b in blocks}:
            continue
        prompts = [encode_chat(tok, it[0]) for it in load_dataset(name, args.prompts)]
        ar = engine.generate(prompts, max_new_tokens=args.max_new_tokens, config=DecodeConfig.autoregressive())
        acc[name] = {str(b): accepted_lengths(engine, prompts, args.max_new_tokens, chain(b), ar) for b in blocks}
        path.write_text(json.dumps(res) + "\n")
        print(name, {b: tau(r["accepted"]) for b, r in acc[name].items()}, flush=True)
    if args.time:
        with torch.inference_mode():
            res.setdefault("ms", {})[isa()] = timings(engine, blocks, args.context, args.repeats)
        res["meta"]["context"] = args.context
    path.write_text(json.dumps(res) + "\n")
    (out / "draft_block.md").write_text(report(res))
    plot(out / "draft_block.png", res)
    print(report(res))
    return 0


def table(res: dict) -> list[dict]:
    """Per dataset and block B: tau at B, the block of 16 capped at B - 1, their ratio, first-slot acceptance."""
    rows = []
    for name, by_block in res["accepted"].items():
        full = by_block["16"]["accepted"]
        for b, r in sorted(by_block.items(), key=lambda kv: int(kv[0])):
            a = r["accepted"]
            rows.append({"dataset": name, "block": int(b), "tau": tau(a), "tau16_capped": tau(full, int(b) - 1),
                         "first_slot": round(sum(x >= 1 for x in a) / max(len(a), 1), 4), "steps": len(a),
                         "differ_from_ar": r["differ_from_ar"]})
    return rows


def report(res: dict) -> str:
    mt = res["meta"]
    lines = [f"# Drafting block size: acceptance and cost ({mt['date']}, {mt['cpu']}, {mt['threads']} threads)", "",
             f"`{mt['command']}`. The bundled drafter's plain chain, {mt['prompts']} prompts per dataset, "
             f"{mt['max_new_tokens']} new tokens, greedy, bf16, engine {mt['engine']}. tau at block B beside the block "
             "of 16 with its accepted length capped at B - 1 (what verifying B - 1 of its drafts accepts).", "",
             "| dataset | block | tau | block 16 capped at B - 1 | ratio | first slot | steps | differing |",
             "|---|---|---|---|---|---|---|---|"]
    for r in table(res):
        lines.append(f"| {r['dataset']} | {r['block']} | {r['tau']:.3f} | {r['tau16_capped']:.3f} | "
                     f"{r['tau'] / r['tau16_capped']:.3f} | {r['first_slot']:.2f} | {r['steps']} | "
                     f"{r['differ_from_ar']} |")
    for path, ms in res.get("ms", {}).items():
        one, blocks = ms["target_1x1"], mt["blocks"]
        lines += ["", f"Drafting step on rowlinear's {path} path, ms (x a one-token target step, {one:.2f} ms), "
                  f"context {mt['context']} tokens, as the default system drafts (its tree, path scores):", "",
                  "| rows \\ block | " + " | ".join(map(str, blocks)) + " |", "|---|" + "---|" * len(blocks)]
        for rows in (1, 4):
            cells = [ms[f"draft_{rows}x{b}"] for b in blocks]
            lines.append(f"| {rows} | " + " | ".join(f"{c:.2f} ({c / one:.2f}x)" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def plot(path: Path, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = table(res)
    timed = res.get("ms", {})
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(11 if timed else 6, 4), squeeze=False)
    ax = axes[0][0]
    for name in res["accepted"]:
        rs = [r for r in rows if r["dataset"] == name]
        line, = ax.plot([r["block"] for r in rs], [r["tau"] for r in rs], "o-", label=f"{name}: block B")
        ax.plot([r["block"] for r in rs], [r["tau16_capped"] for r in rs], "x--", color=line.get_color(),
                label=f"{name}: block 16, capped at B - 1")
    ax.set(xlabel="block size B", ylabel="chain tau", title="acceptance")
    ax.legend(fontsize=7)
    for isa_name, ms in timed.items():
        blocks, one = res["meta"]["blocks"], ms["target_1x1"]
        for rows_n in (1, 4):
            axes[0][1].plot(blocks, [ms[f"draft_{rows_n}x{b}"] / one for b in blocks], "o-",
                            label=f"{isa_name}, {rows_n} rows")
        axes[0][1].axhline(0.25, color="grey", ls="--", lw=1)
        axes[0][1].set(xlabel="block size B", ylabel="x a one-token target step", title="drafting step cost")
        axes[0][1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
