"""A DFlash2 drafter for the real SmolLM2 target against the two reference implementations, float32.

    .venv/bin/python scripts/dflash2_check.py --drafter DIR [--prompts 20] [--out bench/results/dflash2-check]

1. Z Lab's `dflash` 0.1.0 (installed by `make test`): its `DFlash2DraftModel` loads our `zlab` export, and at every
   checked anchor its `propose` (greedy) gives our selector path and our top-k candidates, its hidden states ours
   within 1e-5. Anchors: every 8th position of each held-out prompt's greedy answer (32 tokens), the context being
   the real target's tapped states.
2. speculators 0.9.0 (its own virtualenv, scripts/speculators-env.sh): its `DFlash2DraftModel` loads our
   `speculators` export (no missing / unexpected / mismatched tensor), its forward (one anchor) gives our block's
   hidden states within 1e-5 and logits within 1e-6 of the largest logit (float32 rounding: its attention runs
   over a longer, masked key set), and its `CandidateSelector.score_candidates` our selector scores for our path.
Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dflashkit import DecodeConfig, DFlashEngine  # noqa: E402
from dflashkit.bench.datasets import load_dataset  # noqa: E402
from dflashkit.checkpoint import load_drafter  # noqa: E402
from dflashkit.export import export_speculators, export_zlab  # noqa: E402
from dflashkit.loader import encode_chat, load_target, resolve_target_dir  # noqa: E402
from validate_exports import ONE_ANCHOR  # noqa: E402  (scripts/: the same one-anchor forward as the v1 check)

SPEC_CHECK = r"""
import json, sys, torch
from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
""" + ONE_ANCHOR + r"""
cfg = DFlash2SpeculatorConfig.from_pretrained(sys.argv[1])
cfg.transformer_layer_config._attn_implementation = "sdpa"  # its default (compiled flex attention) is for GPUs
m, info = DFlash2DraftModel.from_pretrained(sys.argv[1], config=cfg, output_loading_info=True)
m.load_verifier_weights()
m = m.float().eval()
out = {"missing": sorted(info.get("missing_keys") or []), "unexpected": sorted(info.get("unexpected_keys") or []),
       "mismatched": [list(map(str, x)) for x in (info.get("mismatched_keys") or [])], "anchors": 0,
       "max_abs_logit_diff": 0.0, "max_abs_score_diff": 0.0, "max_abs_hidden_diff": 0.0, "max_abs_logit": 0.0}
inputs = torch.load(sys.argv[2])
for d in inputs:
    Q = d["block"].shape[1]
    hidden, logits = one_anchor(m, d["taps"], d["block"])
    h, lg = hidden[0, 1:Q], logits[0, 1:Q].float()
    with torch.no_grad():
        pred = torch.cat([d["block"][0, :1], d["path"][0, :-1]])
        scores = m.candidate_selector.score_candidates(lg, h, pred, d["candidates"][0])
    out["anchors"] += 1
    out["max_abs_logit_diff"] = max(out["max_abs_logit_diff"], float((lg - d["logits"][0]).abs().max()))
    out["max_abs_score_diff"] = max(out["max_abs_score_diff"], float((scores - d["scores"][0]).abs().max()))
    out["max_abs_hidden_diff"] = max(out["max_abs_hidden_diff"], float((h - d["hidden"][0]).abs().max()))
    out["max_abs_logit"] = max(out["max_abs_logit"], float(lg.abs().max()))
# A checkpoint made by speculators itself: its selector and convolutions moved off our values, saved by its own
# save_pretrained; its hidden states, logits and selector scores (predecessors: the unary argmax chain) on the first
# input, for dflashkit to load and match.
torch.manual_seed(1)
with torch.no_grad():
    for n, p in m.named_parameters():
        if "conv" in n or "candidate_selector" in n:
            p.add_(0.02 * torch.randn_like(p))
m.save_pretrained(sys.argv[3])
d = inputs[0]
Q = d["block"].shape[1]
hidden, logits = one_anchor(m, d["taps"], d["block"])
h, lg = hidden[0, 1:Q], logits[0, 1:Q].float()
with torch.no_grad():
    cand = lg.topk(m.candidate_selector.top_k, dim=-1).indices
    pred = torch.cat([d["block"][0, :1], lg.argmax(-1)[:-1]])
    scores = m.candidate_selector.score_candidates(lg, h, pred, cand)
torch.save({"hidden": h, "logits": lg, "candidates": cand, "predecessors": pred, "scores": scores},
           sys.argv[3] + "/theirs.pt")
print(json.dumps(out))
"""


def contexts(target, tok, n: int, answer: int = 32, every: int = 8):
    """(prompt ids + greedy answer [1, T], anchor positions) per held-out prompt."""
    engine = DFlashEngine(target, None, tokenizer=tok)
    for item in load_dataset("sharegpt-heldout", n):
        ids = encode_chat(tok, item[0])
        out = engine.generate([ids], max_new_tokens=answer, config=DecodeConfig.autoregressive())[0].tokens
        full = torch.tensor([ids + list(out)])
        yield full, list(range(len(ids), full.shape[1] - 1, every))


def load_theirs(made: Path, first: dict, target, tok, prompts: int) -> dict:
    """A DFlash2 checkpoint saved by speculators' own code: dflashkit loads it (its layout, the target's layer
    count), matches its hidden states, logits and selector scores, and decodes with it exactly as AR (greedy)."""
    theirs = torch.load(made / "theirs.pt")
    dr = load_drafter(made, dtype=torch.float32, num_target_layers=target.num_layers).eval()
    c, block, taps = dr.config, first["block"], first["taps"]
    S = taps.shape[1]
    pos = torch.arange(S + c.block_size)[None]
    with torch.no_grad():
        h = dr(target.embed(block).float(), pos[:, S:], dr.context_kv(dr.fuse(taps), pos[:, :S]),
               torch.ones(1, 1, c.block_size, S + c.block_size, dtype=torch.bool))[0, 1:]
        lg = target.logits(h[None])[0].float()
        sel = dr.candidate_selector
        pair = sel.pairwise(theirs["predecessors"][:, None], sel.hidden_projection(h),
                            sel.successor_codebook(theirs["candidates"]))[:, 0]
        scores = lg.gather(-1, theirs["candidates"]) + pair
    engine = DFlashEngine(target, dr, tokenizer=tok)
    ids = [encode_chat(tok, it[0]) for it in load_dataset("sharegpt-heldout", prompts)][:4]
    ar = engine.generate(ids, max_new_tokens=32, config=DecodeConfig.autoregressive())
    chain = engine.generate(ids, max_new_tokens=32, config=DecodeConfig(block_size=c.block_size, policy="fixed"))
    return {"max_abs_hidden_diff": float((h - theirs["hidden"]).abs().max()),
            "max_abs_logit_diff": float((lg - theirs["logits"]).abs().max()),
            "max_abs_score_diff": float((scores - theirs["scores"]).abs().max()),
            "greedy_prompts": len(ids),
            "greedy_identical_to_ar": sum(a.tokens == b.tokens for a, b in zip(ar, chain))}


def made_ok(m: dict) -> bool:
    return (m.get("max_abs_hidden_diff", 1) <= 1e-5 and m.get("max_abs_score_diff", 1) <= 1e-4
            and m.get("greedy_prompts", 0) > 0 and m.get("greedy_identical_to_ar") == m.get("greedy_prompts"))


def main() -> int:
    import dflash

    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", required=True, help="a DFlash2 drafter directory for the default target")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench/results/dflash2-check"))
    args = ap.parse_args()
    target, tok = load_target(dtype="float32")
    dr = load_drafter(args.drafter, dtype=torch.float32).eval()
    if dr.config.arch != "dflash2":
        raise SystemExit(f"{args.drafter} is a {dr.config.arch} drafter; give a DFlash2 one")
    target.set_taps(dr.config.target_layer_ids)
    tmp = Path(tempfile.mkdtemp())
    zl = dflash.DFlash2DraftModel.from_pretrained(export_zlab(dr, tmp / "z", dtype=torch.float32)).float().eval()
    head = torch.nn.Linear(target.hidden_size, target.vocab_size, bias=False)
    head.weight.data = target.lm_head_weight.float()
    c, sel = dr.config, dr.candidate_selector
    z = {"anchors": 0, "path_equal": 0, "candidates_equal": 0, "max_abs_hidden_diff": 0.0}
    spec_inputs = []
    for full, anchors in contexts(target, tok, args.prompts):
        with torch.no_grad():
            taps = target.taps(full).float()
            for p in anchors:
                block = torch.tensor([[int(full[0, p])] + [c.mask_token_id] * (c.block_size - 1)])
                embeds, pos = target.embed(block).float(), torch.arange(p + c.block_size)[None]
                h = dr(embeds, pos[:, p:], dr.context_kv(dr.fuse(taps[:, :p]), pos[:, :p]),
                       torch.ones(1, 1, c.block_size, p + c.block_size, dtype=torch.bool))[:, 1:]
                ours = sel.select(h, head(h), block[:, 0])
                ref_h = zl(target_hidden=taps[:, :p], noise_embedding=embeds, position_ids=pos)[:, 1:]
                ref_path, ref_cand, _ = zl.propose(ref_h, block[:, 0], head, 0.0)
                z["anchors"] += 1
                z["path_equal"] += bool(torch.equal(ref_path, ours.path))
                z["candidates_equal"] += bool(torch.equal(ref_cand.sort(-1).values, ours.candidates.sort(-1).values))
                z["max_abs_hidden_diff"] = max(z["max_abs_hidden_diff"], float((h - ref_h).abs().max()))
                if len(spec_inputs) < 2 * args.prompts:
                    spec_inputs.append({"taps": taps[:, :p], "block": block, "logits": head(h), "hidden": h, "path": ours.path,
                                        "candidates": ours.candidates, "scores": ours.scores})
    export_speculators(dr, target, str(resolve_target_dir(None)), tmp / "s", dtype=torch.float32)
    torch.save(spec_inputs, tmp / "ref.pt")
    python = ROOT / ".venv-speculators/bin/python"
    if python.exists():
        run = subprocess.run([str(python), "-c", SPEC_CHECK, str(tmp / "s"), str(tmp / "ref.pt"), str(tmp / "made")],
                             capture_output=True, text=True, timeout=1800)
        lines = [x for x in run.stdout.splitlines() if x.startswith("{")]
        spec = json.loads(lines[-1]) if lines else {"error": run.stderr[-3000:]}
        if lines:
            spec["made_by_speculators"] = load_theirs(tmp / "made", spec_inputs[0], target, tok, args.prompts)
    else:
        spec = {"skipped": "no .venv-speculators: build it with scripts/speculators-env.sh"}
    report = {"drafter": args.drafter, "prompts": args.prompts, "zlab": z, "speculators": spec,
              "zlab_pass": z["anchors"] > 0 and z["path_equal"] == z["candidates_equal"] == z["anchors"]
              and z["max_abs_hidden_diff"] <= 1e-5,
              "speculators_pass": not spec.get("missing") and not spec.get("unexpected")
              and not spec.get("mismatched") and spec.get("anchors", 0) > 0
              and spec.get("max_abs_hidden_diff", 1) <= 1e-5 and spec.get("max_abs_score_diff", 1) <= 1e-5
              # the logits: 1e-6 of the largest (a few float32 ulps; the LM head sums 576 products of hidden states
              # that differ by float32 rounding, its attention running over a longer, masked key set)
              and spec.get("max_abs_logit_diff", 1) <= 1e-6 * max(spec.get("max_abs_logit", 0), 1.0)
              and made_ok(spec.get("made_by_speculators") or {})}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    md = ["# DFlash2 against Z Lab's and speculators' own code (float32, the real SmolLM2 target)", "",
          f"`scripts/dflash2_check.py --drafter {args.drafter} --prompts {args.prompts}`", "",
          "| reference | anchors | result | max abs diff |", "|---|---|---|---|",
          f"| Z Lab `dflash` 0.1.0 `DFlash2DraftModel.propose` | {z['anchors']} | path equal {z['path_equal']}, "
          f"top-k equal {z['candidates_equal']} | hidden {z['max_abs_hidden_diff']:.2e} |",
          f"| speculators 0.9.0 `DFlash2DraftModel` | {spec.get('anchors', 0)} | missing {spec.get('missing')}, "
          f"unexpected {spec.get('unexpected')}, mismatched {spec.get('mismatched')} | hidden "
          f"{spec.get('max_abs_hidden_diff', float('nan')):.2e}, logits {spec.get('max_abs_logit_diff', float('nan')):.2e}"
          f" (largest logit {spec.get('max_abs_logit', float('nan')):.1f}), selector scores "
          f"{spec.get('max_abs_score_diff', float('nan')):.2e} |", "",
          f"A checkpoint saved by speculators' own `save_pretrained` (its selector and convolutions moved off ours), "
          f"loaded by dflashkit: {json.dumps(spec.get('made_by_speculators'))}", "",
          f"Z Lab: {'PASS' if report['zlab_pass'] else 'FAIL'}; speculators: "
          f"{'PASS' if report['speculators_pass'] else 'FAIL'} (thresholds: every path and top-k equal; hidden "
          "states and selector scores 1e-5; logits 1e-6 of the largest logit)."]
    (out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if report["zlab_pass"] and report["speculators_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
