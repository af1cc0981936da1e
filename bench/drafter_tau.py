"""Chain acceptance of drafters on prompts they were never tuned on: tau and first-slot acceptance per dataset.

    .venv/bin/python bench/drafter_tau.py --drafter runs/dflash2-selector/drafter --prompts 16 \
        --max-new-tokens 128 --out bench/results/dflash2-selector/tau

Every drafter (the bundled one first, then each --drafter) decodes the same prompts with the plain chain (block
16, every step drafted: `policy="fixed"`, no tree, no lookup), the prompts of a dataset batched together; greedy,
bf16. tau = committed tokens per verify step (the bonus token included); first slot = the share of steps whose
first draft was accepted. Each output is compared with AR's (0 differing is the lossless check). A ratio of taus
needs no quiet host: the numbers are counts, not times. Writes drafter_tau.json (after each dataset; a rerun
continues with the datasets not yet measured) and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflashkit import DecodeConfig, DFlashEngine
from dflashkit.bench.datasets import load_dataset
from dflashkit.checkpoint import load_drafter
from dflashkit.loader import encode_chat, load_models


def chain_tau(engine, prompts: list[list[int]], max_new: int, ar: list) -> dict:
    gens = engine.generate(prompts, max_new_tokens=max_new, config=DecodeConfig(block_size=16, policy="fixed"))
    acc = [a for g in gens for a in g.stats.accepted]
    return {"tau": round(sum(a + 1 for a in acc) / max(len(acc), 1), 4),
            "first_slot": round(sum(a >= 1 for a in acc) / max(len(acc), 1), 4), "steps": len(acc),
            "differ_from_ar": sum(g.tokens != r.tokens for g, r in zip(gens, ar))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", action="append", default=[], help="a drafter directory (repeatable)")
    ap.add_argument("--datasets", default="sharegpt-heldout,humaneval,mt-bench-t1")
    ap.add_argument("--prompts", type=int, default=16, help="per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--quant", default="auto", choices=("auto", "none", "int4", "int4-a8"),
                    help="the target, as `dflashkit generate --quant` (default: %(default)s)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    target, tok, bundled, _ = load_models(dtype="bfloat16", quant=args.quant)
    drafters = {"bundled": bundled, **{d: load_drafter(d, dtype=target.dtype, num_target_layers=target.num_layers)
                                       for d in args.drafter}}
    plain = DFlashEngine(target, None, tokenizer=tok)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(["bench/drafter_tau.py"] + sys.argv[1:]), "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens, "dtype": "bfloat16", "block_size": 16,
            "target": target.engine_name}
    done = out / "drafter_tau.json"  # resumable: a dataset already measured with the same drafters is kept
    res = json.loads(done.read_text())["results"] if done.is_file() else {}
    for name in args.datasets.split(","):
        if set(res.get(name, {})) == set(drafters):
            continue
        prompts = [encode_chat(tok, it[0]) for it in load_dataset(name, args.prompts)]
        ar = plain.generate(prompts, max_new_tokens=args.max_new_tokens, config=DecodeConfig.autoregressive())
        res[name] = {d: chain_tau(DFlashEngine(target, dr, tokenizer=tok), prompts, args.max_new_tokens, ar)
                     for d, dr in drafters.items()}
        print(json.dumps({name: res[name]}), flush=True)
        done.write_text(json.dumps({"meta": meta, "results": res}, indent=2) + "\n")
    names = list(drafters)
    md = [f"# Chain tau on untuned prompts (`{meta['command']}`)", "",
          f"{args.prompts} prompts per dataset, {args.max_new_tokens} new tokens, greedy, bf16, block 16, every step "
          "drafted (the plain chain). tau (first-slot acceptance); differing = outputs not equal to AR.", "",
          "| dataset | " + " | ".join(names) + " | " + " | ".join(f"{n} / bundled" for n in names[1:]) + " |",
          "|---" * (1 + 2 * len(names) - 1) + "|"]
    for name, r in res.items():
        cells = [f"{r[n]['tau']:.3f} ({r[n]['first_slot']:.2f}; differing {r[n]['differ_from_ar']})" for n in names]
        ratios = [f"**{r[n]['tau'] / r['bundled']['tau']:.3f}**" for n in names[1:]]
        md.append(f"| {name} | " + " | ".join(cells + ratios) + " |")
    (out / "drafter_tau.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
