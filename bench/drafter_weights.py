"""The drafter's stacked layers on bf16 weights, or on Q8_0 / Q4_1 copies with 8-bit activations: acceptance and
cost, A/B in one process.

    .venv/bin/python bench/drafter_weights.py --out bench/results/draft-q8 [--quant int4-a8] [--prompts 40]
        [--variants bf16,q8_0,q4_1]

`drafter.layer_stack(drafter, weights)` builds the drafter's layers each way; the engine's proposers are rebuilt for
each. Acceptance: the bundled drafter's plain chain (block 16, every step drafted, greedy, bf16) on held-out
prompts, its tau and per-slot acceptance, and outputs differing from AR (must be 0: the drafter's numbers never
change the output). Cost (a quiet host): the drafting step as the default system drafts (its tree, path scores) at
blocks 2, 4 and 16 and 1 row, beside a one-token target step, every callable timed back to back in each round
(`draft_block.median_ms`). Writes drafter_weights.json, .md and .png into --out.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from dflashkit import DecodeConfig, DFlashEngine
from dflashkit.bench.datasets import load_dataset
from dflashkit.drafter import layer_stack
from dflashkit.loader import encode_chat, load_models
from dflashkit.measurements import cpu_name

from draft_block import accepted_lengths, chain, median_ms, step_ms, target_step, tau  # noqa: E402  (bench/ is not a package)

VARIANTS = ["bf16", "q8_0", "q4_1"]
BLOCKS = [2, 4, 16]


def use(engine, weights: str) -> None:
    """The engine's drafter on stacked layers of this kind; proposers built from now on take them."""
    engine.drafter.stack = layer_stack(engine.drafter, weights)
    engine.set_proposers()


def acceptance(engine, prompts: list[list[int]], max_new: int, variants: list[str]) -> dict:
    ar = engine.generate(prompts, max_new_tokens=max_new, config=DecodeConfig.autoregressive())
    out = {}
    for name in variants:
        use(engine, name)
        r = accepted_lengths(engine, prompts, max_new, chain(16), ar)
        acc = r["accepted"]
        out[name] = {"tau": tau(acc), "steps": len(acc), "differ_from_ar": r["differ_from_ar"],
                     "slot_acceptance": [round(sum(a > i for a in acc) / len(acc), 4) for i in range(4)]}
    return out


def costs(engine, ctx: int, repeats: int, variants: list[str]) -> dict:
    fns = {"target_1x1": target_step(engine.target, ctx)}
    for name in variants:
        use(engine, name)
        fns.update({f"{name}_b{b}": step_ms(engine, b, 1, ctx) for b in BLOCKS})
    return median_ms(fns, repeats)


def main() -> int:
    from dflashkit.bench.report import write_result

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quant", default=None, choices=("int4-a8",), help="the target (default: the default target)")
    ap.add_argument("--dataset", default="sharegpt-heldout")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--context", type=int, default=176)
    ap.add_argument("--variants", default="bf16,q8_0", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--isa", default="auto", choices=("auto", "avx512bf16", "avx2"),
                    help="the kernels' instruction path (`kernels.set_isa`; avx2: as on an AVX2-only host)")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if not set(variants) <= set(VARIANTS):
        ap.error(f"--variants: each of {', '.join(VARIANTS)}")
    from dflashkit.kernels import set_isa

    set_isa(args.isa)  # before the target loads: the plan (and the bits) follow the path
    target, tok, drafter, _ = load_models(dtype="bfloat16", quant=args.quant)
    engine = DFlashEngine(target, drafter, tokenizer=tok)
    prompts = [encode_chat(tok, t[0]) for t in load_dataset(args.dataset, args.prompts)]
    with torch.inference_mode():
        res = {"acceptance": acceptance(engine, prompts, args.max_new_tokens, variants),
               "ms": costs(engine, args.context, args.repeats, variants)}
    res["meta"] = {"command": "bench/drafter_weights.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
                   "cpu": cpu_name(), "threads": torch.get_num_threads(), "engine": engine.target.engine_name,
                   "isa": args.isa,
                   "dataset": args.dataset, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens}
    write_result(args.out, "drafter_weights", res, report(res), plot)
    print(report(res))
    return 0


def report(res: dict) -> str:
    mt, acc, ms = res["meta"], res["acceptance"], res["ms"]
    one = ms["target_1x1"]
    lines = [f"# The drafter's layers on {' / '.join(acc)} weights "
             f"({mt['date']}, {mt['cpu']}, {mt['threads']} threads)", "",
             f"`{mt['command']}`. Target {mt['engine']}; {mt['prompts']} {mt['dataset']} prompts, "
             f"{mt['max_new_tokens']} new tokens, the plain chain at block 16.", "",
             "| layers | chain tau | slots 1-4 accepted | outputs differing from AR | " +
             " | ".join(f"drafting step, block {b}: ms (x a target step)" for b in BLOCKS) + " |",
             "|---|---|---|---|" + "---|" * len(BLOCKS)]
    for name, a in acc.items():
        lines.append(f"| {name} | {a['tau']:.4f} | {', '.join(f'{x:.3f}' for x in a['slot_acceptance'])} | "
                     f"{a['differ_from_ar']} | " + " | ".join(f"{ms[f'{name}_b{b}']:.2f} ({ms[f'{name}_b{b}'] / one:.2f}x)"
                                                             for b in BLOCKS) + " |")
    lines += ["", f"A one-token target step: {one:.2f} ms."]
    return "\n".join(lines) + "\n"


def plot(res: dict):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    n = len(res["acceptance"])
    for i, name in enumerate(res["acceptance"]):
        ax.bar([j + 0.8 * i / n for j in range(len(BLOCKS))], [res["ms"][f"{name}_b{b}"] for b in BLOCKS],
               width=0.8 / n,
               label=f"{name} (tau {res['acceptance'][name]['tau']:.3f})")
    ax.axhline(res["ms"]["target_1x1"], color="gray", ls="--", label="one-token target step")
    ax.set_xticks([j + 0.4 - 0.4 / n for j in range(len(BLOCKS))], [f"block {b}" for b in BLOCKS])
    ax.set_ylabel("drafting step, ms (1 row)")
    ax.legend()
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    raise SystemExit(main())
