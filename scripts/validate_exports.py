"""Validate `dflashkit export` against the real consumers, each in its own virtualenv.

    .venv/bin/python scripts/validate_exports.py [--out bench/results/export-validation.json]

Needs .venv-zlab (scripts/zlab-env.sh) and .venv-speculators (scripts/speculators-env.sh); a missing one is
reported as skipped. Checks, for the bundled drafter:
1. Z Lab's `dflash` 0.1.0 loads the `zlab` export with no missing/unexpected tensor, and its drafter computes
   the same block logits as ours on the same inputs (random context features, [anchor, MASK...] block, float32).
2. speculators 0.9.0 loads the `speculators` export with no missing/unexpected/mismatched tensor, its draft
   body equals ours tensor for tensor, its aux layer ids are target_layer_ids + 1, it reloads the
   embedding / LM head from the verifier directory named in the config, and its own forward (one anchor)
   computes the same block logits as ours.
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

from dflashkit.export import export_speculators, export_zlab  # noqa: E402
from dflashkit.loader import load_default_drafter, load_target, resolve_target_dir  # noqa: E402

ZLAB_CHECK = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
from dflash.model import DFlashDraftModel
from transformers import DynamicCache
d = torch.load(sys.argv[1])
draft, info = DFlashDraftModel.from_pretrained(sys.argv[2], dtype=torch.float32, attn_implementation="sdpa",
                                               output_loading_info=True)
target = AutoModelForCausalLM.from_pretrained(sys.argv[3], dtype=torch.float32)
S, Q = d["taps"].shape[1], d["block"].shape[1]
with torch.no_grad():
    h = draft(target_hidden=d["taps"], noise_embedding=target.get_input_embeddings()(d["block"]),
              position_ids=torch.arange(S + Q)[None], past_key_values=DynamicCache(), use_cache=True)
    logits = draft.compute_logits(h[:, 1:], target.get_output_embeddings())
diff = float((logits - d["logits"]).abs().max())
print(json.dumps({"missing": sorted(info.get("missing_keys") or []), "unexpected": sorted(info.get("unexpected_keys") or []),
                  "max_abs_logit_diff": diff, "same_argmax": bool(torch.equal(logits.argmax(-1), d["logits"].argmax(-1)))}))
"""

# speculators' training forward with ONE anchor at position S (the only supervised position outside the last
# block): the block sees context < S, exactly our inference block at S. -> (hidden, logits) [1, Q, ...].
ONE_ANCHOR = r"""
def one_anchor(m, taps, block):
    S, Q = taps.shape[1], block.shape[1]
    T = S + Q + 1
    hs = torch.cat([taps, torch.randn(1, T - S, taps.shape[-1])], dim=1)
    ids = torch.zeros(1, T, dtype=torch.long)
    ids[0, S] = block[0, 0]
    lm = torch.zeros(1, T)
    lm[0, S] = 1
    with torch.no_grad():
        hidden, logits, *_ = m._backbone_forward(
            hs, ids, lm, torch.randn(1, T, m.config.transformer_layer_config.hidden_size),
            torch.zeros(1, T, dtype=torch.long), max_anchors=1)
    return hidden, logits
"""

SPEC_CHECK = r"""
import json, sys, torch
from safetensors.torch import load_file
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
""" + ONE_ANCHOR + r"""
cfg = DFlashSpeculatorConfig.from_pretrained(sys.argv[1])
cfg.transformer_layer_config._attn_implementation = "sdpa"  # its default (compiled flex attention) is for GPUs
m, info = DFlashDraftModel.from_pretrained(sys.argv[1], config=cfg, output_loading_info=True)
m.load_verifier_weights()
m = m.float().eval()
sd, ours = m.state_dict(), load_file(sys.argv[1] + "/model.safetensors")
body = all(torch.equal(sd[k].to(v.dtype), v) for k, v in ours.items())
d = torch.load(sys.argv[2])
Q = d["block"].shape[1]
_, logits = one_anchor(m, d["taps"], d["block"])
print(json.dumps({"missing": sorted(info.get("missing_keys") or []), "unexpected": sorted(info.get("unexpected_keys") or []),
                  "mismatched": [list(map(str, x)) for x in (info.get("mismatched_keys") or [])],
                  "body_identical": body, "aux_hidden_state_layer_ids": m.target_layer_ids, "block_size": m.block_size,
                  "lm_head_loaded": bool(sd["lm_head.weight"].float().abs().sum() > 0),
                  "max_abs_logit_diff": float((logits[0, 1:Q].float() - d["logits"][0]).abs().max()),
                  "same_argmax": bool(torch.equal(logits[0, 1:Q].argmax(-1), d["logits"][0].argmax(-1)))}))
"""


def run(python: Path, code: str, *args) -> dict:
    if not python.exists():
        return {"skipped": f"{python} missing: build it with the scripts/*-env.sh script"}
    out = subprocess.run([str(python), "-c", code, *map(str, args)], capture_output=True, text=True, timeout=600)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": out.stderr[-2000:]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench/results/export-validation.json"))
    args = ap.parse_args()
    target, tok = load_target(dtype="float32")
    drafter, _ = load_default_drafter(target, tok)
    drafter = drafter.float()
    target_dir = resolve_target_dir(None)
    tmp = Path(tempfile.mkdtemp())
    export_zlab(drafter, tmp / "zlab", dtype=torch.float32)
    export_speculators(drafter, target, str(target_dir), tmp / "spec", dtype=torch.float32)
    # our block logits for random context features at positions 0..S-1 and a block at S..S+Q-1
    torch.manual_seed(0)
    S, Q, c = 24, drafter.config.block_size, drafter.config
    taps = torch.randn(1, S, c.num_taps * c.hidden_size)
    block = torch.tensor([[1234] + [c.mask_token_id] * (Q - 1)])
    with torch.no_grad():
        kv = drafter.context_kv(drafter.fuse(taps), torch.arange(S)[None])
        h = drafter(target.embed(block), S + torch.arange(Q)[None], kv, torch.ones(1, 1, Q, S + Q, dtype=torch.bool))
        logits = target.logits(h[:, 1:])
    torch.save({"taps": taps, "block": block, "logits": logits}, tmp / "ref.pt")
    report = {
        "zlab": run(ROOT / ".venv-zlab/bin/python", ZLAB_CHECK, tmp / "ref.pt", tmp / "zlab", target_dir),
        "speculators": run(ROOT / ".venv-speculators/bin/python", SPEC_CHECK, tmp / "spec", tmp / "ref.pt"),
        "drafter_target_layer_ids": c.target_layer_ids,
    }
    z, s = report["zlab"], report["speculators"]
    report["zlab_pass"] = (not z.get("missing") and not z.get("unexpected") and z.get("max_abs_logit_diff", 1) < 1e-3
                           and bool(z.get("same_argmax")))
    report["speculators_pass"] = (not s.get("missing") and not s.get("unexpected") and not s.get("mismatched")
                                  and bool(s.get("body_identical")) and s.get("max_abs_logit_diff", 1) < 1e-3
                                  and bool(s.get("same_argmax"))
                                  and s.get("aux_hidden_state_layer_ids") == [i + 1 for i in c.target_layer_ids])
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if report["zlab_pass"] and report["speculators_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
