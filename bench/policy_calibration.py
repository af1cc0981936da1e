"""Is the adaptive policy's acceptance model calibrated? Predicted acceptance (made before each verification) vs
what verification then observed, per bin, on benchmark prompts.

    .venv/bin/python bench/policy_calibration.py --prompts 8 --max-new-tokens 64 --out bench/results/policy-calibration

The step policy here runs with a cost model where verifying is nearly free, so that it verifies (nearly) every
node it is offered and the model is tested across the whole probability range; on a machine where verifying is
expensive it verifies only the likeliest nodes, and those bins are the ones that matter. Writes calibration.json,
calibration.md and calibration.png (the left panel: the drafter's own claim vs observed; right: the calibrated
prediction vs observed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dflashkit import DecodeConfig, DFlashEngine
from dflashkit.bench.datasets import load_dataset
from dflashkit.bench.report import _calibration
from dflashkit.loader import encode_chat, load_models
from dflashkit.step_cost import DRAFT_GRID, VERIFY_GRID, CostModel


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8, help="per dataset (HumanEval, MT-Bench first turns)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench/results/policy-calibration")
    args = ap.parse_args()
    target, tok, drafter, _ = load_models()
    free = CostModel([10.0 + 0.01 * n for n in VERIFY_GRID], 0.0, [0.01] * len(DRAFT_GRID), learn=False)
    engine = DFlashEngine(target, drafter, tokenizer=tok, cost=free)
    config = DecodeConfig.recommended()
    items = load_dataset("humaneval", args.prompts) + load_dataset("mt-bench-t1", args.prompts)
    for it in tqdm(items, desc="decode", unit="prompt"):
        engine.generate([encode_chat(tok, it[0])], max_new_tokens=args.max_new_tokens, config=config)
    rep = engine.policy(engine.resolve(config)).acc.report()
    n = np.array(rep["predicted_nodes"])
    ece = float(np.abs(np.array(rep["predicted_mean"]) - np.array(rep["predicted_observed"])) @ n / max(n.sum(), 1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(sys.argv), "prompts": len(items), "max_new_tokens": args.max_new_tokens,
            "expected_calibration_error": round(ece, 4), "nodes": int(n.sum())}
    (out / "calibration.json").write_text(json.dumps({"meta": meta, "default": rep}, indent=2) + "\n")
    md = [f"# Acceptance model calibration (`{meta['command']}`)", "",
          f"{len(items)} prompts (HumanEval + MT-Bench first turns), {args.max_new_tokens} tokens, bf16, the default "
          f"system with verification made nearly free; {meta['nodes']} verified nodes; expected calibration error "
          f"(count-weighted mean |predicted - observed|) {ece:.3f}.", "",
          "| predicted acceptance bin | nodes | mean predicted | observed |", "|---|---|---|---|"]
    md += [f"| {k / 10:.1f}-{(k + 1) / 10:.1f} | {int(c)} | {p:.3f} | {o:.3f} |"
           for k, (c, p, o) in enumerate(zip(n, rep["predicted_mean"], rep["predicted_observed"])) if c]
    md += ["", "The drafter's own claim (its path probability) vs observed, per probability bin:", "",
           "| claimed bin upper edge | nodes | mean claimed | observed |", "|---|---|---|---|"]
    md += [f"| {e} | {int(c)} | {p:.3f} | {o:.3f} |" for e, c, p, o in
           zip(rep["bins"] + [1.0], rep["drafted"], rep["claimed"], rep["observed"]) if c]
    (out / "calibration.md").write_text("\n".join(md) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = _calibration(plt, {"calibration": {"default": rep}})
    fig.tight_layout()
    fig.savefig(out / "calibration.png", dpi=120)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
