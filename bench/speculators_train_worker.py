"""Train a DFlash or DFlash2 drafter with vLLM speculators' own model, objective and optimizer (speculators 0.9.0),
on batches given by `bench/train_vs_speculators.py`. Runs in speculators' virtualenv (not dflashkit's: its pins
differ), so it imports nothing from dflashkit.

    VENV/bin/python bench/speculators_train_worker.py --target-dir DIR --batches batches.npz --arch dflash \
        --aux-ids 2 15 27 --mask-token-id 0 --steps 300 --seconds 1800 --out OUT

What is speculators' here: the drafter class (`from_training_args`, its layer config from its own
`create_transformer_layer_config` with its defaults: qwen3 layers, sliding window 2048, causal inside the block for
dflash, bidirectional for dflash2), its forward and loss (dflash: cross-entropy to the target's argmax with D-PACE
position weights; dflash2: KL to the target plus its candidate-selector loss, exponential decay), its optimizers
(Muon on matrices + AdamW, lr 1e-3) and its schedule (linear, 1 % warmup), gradient clipping at 1.0.
What is ours: the data (the same padded batches our trainer draws, packed into one row with document ids, as
speculators packs), the target's hidden states (computed here, online, as our trainer does), the step and time
budget. Saves `save_pretrained` output under OUT/drafter, and a checkpoint every --save-every steps (resumable:
rerun the same command).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

log = logging.getLogger("speculators-worker")


class Taps:
    """Forward hooks on the verifier's decoder layers: speculators' hidden-state id i is the OUTPUT of decoder layer
    i - 1 (id 0 = the embeddings); the verifier's last hidden state is the last layer's output BEFORE the final norm
    (speculators applies the verifier norm itself)."""

    def __init__(self, model, aux_ids: list[int]):
        self.layers = model.model.layers
        self.want = sorted(set([i - 1 for i in aux_ids] + [len(self.layers) - 1]))
        self.out: dict[int, torch.Tensor] = {}
        for i in self.want:
            self.layers[i].register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(_module, _args, output):
            self.out[i] = output[0] if isinstance(output, tuple) else output
        return hook


def packed_step(verifier, taps: Taps, aux_ids: list[int], ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray):
    """One padded batch (ids, mask: [B, S]; lengths [B]) -> speculators' packed single-row inputs."""
    x = torch.from_numpy(ids.astype(np.int64))
    with torch.no_grad():
        verifier.model(input_ids=x, use_cache=False)  # right padding is harmless: attention is causal
    rows = [slice(0, int(n)) for n in lengths]
    cat = (lambda t: torch.cat([t[b, r] for b, r in enumerate(rows)])[None])
    hidden = torch.cat([cat(taps.out[i - 1]) for i in aux_ids], dim=-1)  # [1, T, k*H]
    last = cat(taps.out[len(taps.layers) - 1])  # [1, T, H]
    input_ids = cat(x)
    loss_mask = cat(torch.from_numpy(mask.astype(np.int64)))
    doc = torch.cat([torch.full((int(n),), b) for b, n in enumerate(lengths)])[None]
    pos = torch.cat([torch.arange(int(n)) for n in lengths])[None]  # positions restart per document
    return dict(hidden_states=hidden, input_ids=input_ids, loss_mask=loss_mask, verifier_last_hidden_states=last,
                document_ids=doc, position_ids=pos)


def build(args):
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dflash2 import DFlash2DraftModel
    from speculators.train.cli import create_transformer_layer_config

    layer_cfg = create_transformer_layer_config(args.target_dir, num_layers=args.layers, draft_arch="qwen3",
                                                hidden_act=None, sliding_window=2048, full_attention_indices=[])
    cls = DFlash2DraftModel if args.arch == "dflash2" else DFlashDraftModel
    kw = dict(draft_vocab_size=layer_cfg.vocab_size, block_size=args.block_size, verifier_name_or_path=args.target_dir,
              target_layer_ids=args.aux_ids, mask_token_id=args.mask_token_id, draft_attn_impl="sdpa")
    torch.manual_seed(args.seed)
    model = cls.from_training_args(layer_cfg, **kw)
    loss_fn, weight = ("kl_div", "fixed-exp-decay") if args.arch == "dflash2" else ("ce", "dpace")
    train_kw, _ = cls.get_trainer_kwargs(loss_fn=loss_fn, loss_implementation="eager", dflash_decay_gamma=4.0,
                                         max_anchors=args.max_anchors, per_position_loss_weight=weight)
    return model, train_kw


def optimizers(model, steps: int):
    from speculators.train.optimizers import build_optimizers
    from transformers import get_linear_schedule_with_warmup

    cfg = SimpleNamespace(optimizer="muon", lr=1e-3, weight_decay=0.01, muon_lr=1e-3, muon_momentum=0.95,
                          muon_weight_decay=0.1, muon_ns_steps=5, muon_adjust_lr_fn="match_rms_adamw")
    opts = build_optimizers(model, cfg)
    warm = max(1, int(0.01 * steps))
    return opts, [get_linear_schedule_with_warmup(o, warm, steps) for o in opts]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-dir", required=True, help="the target as a Hugging Face directory")
    ap.add_argument("--batches", required=True, help="batches.npz from train_vs_speculators.py (ids, mask, lengths)")
    ap.add_argument("--arch", choices=["dflash", "dflash2"], required=True, help="speculators' drafter type")
    ap.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    ap.add_argument("--aux-ids", type=int, nargs="+", required=True, help="speculators' hidden-state ids to tap")
    ap.add_argument("--mask-token-id", type=int, required=True, help="the block's mask token id")
    ap.add_argument("--block-size", type=int, default=16, help="slots per block")
    ap.add_argument("--max-anchors", type=int, default=64, help="anchors per packed step")
    ap.add_argument("--steps", type=int, required=True, help="steps (the schedule's length)")
    ap.add_argument("--seconds", type=float, required=True, help="stop (and save) after this much training time")
    ap.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps")
    ap.add_argument("--seed", type=int, default=0, help="initialisation seed")
    ap.add_argument("--out", required=True, help="output directory")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    from transformers import AutoModelForCausalLM

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = np.load(args.batches)
    verifier = AutoModelForCausalLM.from_pretrained(args.target_dir, dtype=torch.float32).eval()
    taps = Taps(verifier, args.aux_ids)
    model, train_kw = build(args)
    model.train()
    opts, scheds = optimizers(model, args.steps)
    ckpt, step, spent = out / "checkpoint.pt", 0, 0.0
    if ckpt.exists():  # resume: weights, optimizers, schedules, the step and the time already spent
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        for o, s in zip(opts, state["opts"]):
            o.load_state_dict(s)
        for sc, s in zip(scheds, state["scheds"]):
            sc.load_state_dict(s)
        step, spent = state["step"], state["spent"]
        log.info("resumed at step %d (%.0f s spent)", step, spent)
    logf = open(out / "train_log.jsonl", "a")
    start = time.time() - spent

    def save():
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opts": [o.state_dict() for o in opts],
                    "scheds": [s.state_dict() for s in scheds], "step": step, "spent": time.time() - start}, tmp)
        os.replace(tmp, ckpt)

    while step < args.steps and time.time() - start < args.seconds:
        batch = packed_step(verifier, taps, args.aux_ids, data["ids"][step], data["mask"][step], data["lengths"][step])
        _, loss, metrics = model(**batch, **train_kw)
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o, s in zip(opts, scheds):
            o.step()
            s.step()
        step += 1
        acc = float(metrics["full_acc_sum"]) / max(float(metrics["full_acc_total"]), 1.0)
        logf.write(json.dumps({"step": step, "loss": round(float(loss.detach()), 5), "acc": round(acc, 4),
                               "elapsed_s": round(time.time() - start, 1)}) + "\n")
        logf.flush()
        if step % args.save_every == 0:
            save()
    save()
    model.save_pretrained(out / "drafter")
    (out / "done.json").write_text(json.dumps({"steps": step, "seconds": round(time.time() - start, 1)}) + "\n")
    log.info("saved %s after %d steps", out / "drafter", step)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
