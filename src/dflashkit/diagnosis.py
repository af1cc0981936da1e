"""`dflashkit check-drafter`: does the acceptance training predicts show up when decoding, and if not, why?

The most common drafter failure is silent: high training accuracy, almost no acceptance when decoding (z-lab/dflash
#41; SpecForge #470/#472). The causes are a handful of off-by-ones between the training forward and the decode
path, and each leaves a fingerprint: the drafter does better under the wrong setting than under its own.

1. Decode: the target answers held-out prompts greedily through the plain DFlash chain; tau as measured.
2. Predict: the training objective's view of the same text (`objective.py`: blocks at every response position,
   teacher-forced target features, the decode path `decode_path_tau` walks). In exact arithmetic this is the
   decoded tau; a gap means the decode path differs from the training forward.
3. Probe, on the same text: taps earlier / later (one layer: the classic `hidden_states[i]` offset; the probe walks
   up to 3 layers while acceptance rises), other mask
   token ids (the block's MASK slots), labels one slot earlier / later (a label shift), and context that leaks the
   block's own positions (a drafter trained with a cross-block leak relies on features decoding never has).
A probe that beats the drafter's own setting names the fix.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import torch

from .decode_config import DecodeConfig
from .objective import build_blocks, decode_path_tau, sample_anchors, training_forward

log = logging.getLogger(__name__)

BETTER = 1.25  # a probe must reach this multiple of the drafter's own predicted tau (and +0.25) to count
MAX_TAP_OFFSET = 3  # how many layers the tap probe walks each way (only while acceptance keeps rising)


@dataclass
class Diagnosis:
    decoded_tau: float  # measured by decoding (plain chain)
    predicted_tau: float  # the training objective's view of the same text
    acc1: float  # predicted first-slot accuracy
    probes: dict = field(default_factory=dict)  # probe name -> predicted tau under it
    findings: list = field(default_factory=list)  # what is wrong, each naming its fix
    prompts: int = 0
    tokens: int = 0

    @property
    def ok(self) -> bool:
        return not self.findings

    def summary(self) -> str:
        head = (f"decoded tau {self.decoded_tau:.2f} vs predicted by the training objective {self.predicted_tau:.2f} "
                f"(first-slot accuracy {self.acc1:.2f}) on {self.prompts} held-out prompts, {self.tokens} tokens")
        if self.ok:
            return head + "\nok: training and decoding agree, and no known silent failure fits this drafter better."
        return head + "\n" + "\n".join(f"PROBLEM: {f}" for f in self.findings)

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def decode(engine, prompts: list[list[int]], max_new: int) -> tuple[list[tuple[list[int], int]], float]:
    """Greedy plain-chain decoding of `prompts`: ([(prompt + response, prompt length)], tau over all steps)."""
    gens = engine.generate(prompts, max_new_tokens=max_new, config=DecodeConfig(policy="fixed"))
    steps = [a for g in gens for a in g.stats.accepted]
    tau = sum(a + 1 for a in steps) / max(len(steps), 1)
    return [(list(p) + g.tokens, len(p)) for p, g in zip(prompts, gens)], tau


class TeacherView:
    """The training objective over fixed texts, under a chosen setting (taps, mask id, label shift, leak)."""

    def __init__(self, target, drafter, seqs: list[tuple[list[int], int]]):
        self.target, self.drafter = target, drafter
        self.seqs = [(torch.tensor([ids], device=target.device), plen) for ids, plen in seqs if len(ids) - plen >= 2]
        self._taps: dict[tuple, list[torch.Tensor]] = {}

    def taps(self, layers: tuple) -> list[torch.Tensor]:
        if layers not in self._taps:
            own = list(self.drafter.config.target_layer_ids)
            self.target.set_taps(list(layers))
            try:
                self._taps[layers] = [self.target.taps(ids) for ids, _ in self.seqs]
            finally:
                self.target.set_taps(own)
        return self._taps[layers]

    @torch.inference_mode()
    def tau(self, layers: tuple | None = None, mask_id: int | None = None, shift: int = 0,
            leak: bool = False) -> tuple[float, float]:
        """(decode-path tau, first-slot accuracy) the objective predicts under this setting."""
        c = self.drafter.config
        B, mask_id = c.block_size, c.mask_token_id if mask_id is None else mask_id
        tokens = passes = hits = total = 0
        for (ids, plen), taps in zip(self.seqs, self.taps(layers or tuple(c.target_layer_ids))):
            S = ids.shape[1]
            lm = torch.arange(S, device=ids.device)[None] >= plen
            anchors, valid = sample_anchors(lm, S)  # every response position, ascending
            blocks = build_blocks(ids, lm, anchors, valid, B, mask_id, gamma=7.0)
            if leak:  # context may see the block's own positions: features decoding never has
                a, v = anchors.repeat_interleave(B, dim=1), valid.repeat_interleave(B, dim=1)  # [1, Q]
                ctx = torch.arange(S, device=ids.device)[None, None] < (a + B)[:, :, None]
                blocks.mask[..., :S] = (ctx & v[:, :, None])[:, None]
            hidden = training_forward(self.drafter, self.target.embed, taps.to(self.target.dtype), blocks)
            pred = self.target.logits(hidden).argmax(-1).view(-1, B)[..., 1:]  # [N, B-1] slots 1..B-1
            labels = blocks.labels.view(-1, B)[..., 1:]
            sup = (blocks.weights > 0).view(-1, B)[..., 1:]
            # Why a shift compares slot j with the label of slot j + shift: a drafter trained one position off
            # predicts its neighbour's token; a run then counts slots whose neighbour matched.
            if shift > 0:
                pred, labels, sup = pred[:, :-shift], labels[:, shift:], sup[:, shift:]
            elif shift < 0:
                pred, labels, sup = pred[:, -shift:], labels[:, :shift], sup[:, :shift]
            ok = (pred == labels) & sup
            runs = (ok.int().cumprod(-1).sum(-1) + 1)[valid[0]]
            t, p = decode_path_tau(runs.tolist())
            tokens, passes = tokens + t, passes + p
            hits, total = hits + int(ok[:, 0].sum()), total + int(sup[:, 0].sum())
        return tokens / max(passes, 1), hits / max(total, 1)


def _mask_candidates(tokenizer, own: int, limit: int = 6) -> list[int]:
    """Other plausible MASK ids: the tokenizer's mask / pad / unk / eos and its special added tokens."""
    ids = [_rule_mask(tokenizer)] + [getattr(tokenizer, a, None) for a in ("mask_token_id", "pad_token_id",
                                                                          "unk_token_id", "eos_token_id")]
    specials = sorted(i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special)
    out = []
    for i in ids + specials[::-1]:
        if i is not None and i != own and i not in out:
            out.append(int(i))
    return out[:limit]


def _rule_mask(tokenizer) -> int | None:
    from .errors import DFlashError
    from .loader import choose_mask_token_id

    try:
        return choose_mask_token_id(tokenizer)
    except DFlashError:  # a tokenizer without a spare special token: no rule to prefer
        return None


def check(engine, prompts: list[list[int]], max_new: int = 64) -> Diagnosis:
    """Decode `prompts` with the engine's drafter, compare with the objective's prediction, run every probe."""
    target, drafter, tok = engine.target, engine.drafter, engine.tokenizer
    seqs, decoded = decode(engine, prompts, max_new)
    view = TeacherView(target, drafter, seqs)
    pred, acc1 = view.tau()
    d = Diagnosis(round(decoded, 3), round(pred, 3), round(acc1, 3), prompts=len(prompts),
                  tokens=sum(len(s) - p for s, p in seqs))
    own = tuple(drafter.config.target_layer_ids)

    def better(tau: float) -> bool:
        return tau >= BETTER * pred and tau >= pred + 0.25

    best = (pred, 0, own)  # (tau, offset, layers)
    for step in (-1, 1):
        # Walk away from the configured taps while acceptance keeps rising (a one-layer offset is the classic
        # bug; a config edited by hand or a wrong target can be several layers off).
        prev = pred
        for k in range(1, MAX_TAP_OFFSET + 1):
            layers = tuple(i + step * k for i in own)
            if not all(0 <= i < target.num_layers for i in layers):
                break
            tau = d.probes[f"taps {list(layers)}"] = round(view.tau(layers=layers)[0], 3)
            if tau > best[0]:
                best = (tau, step * k, layers)
            if tau <= prev:
                break
            prev = tau
    tau, off, layers = best
    if off and better(tau):
        d.findings.append(
            f"with taps of layers {list(layers)} the drafter accepts tau {tau:.2f}, with its configured "
            f"{list(own)} only {pred:.2f}: it was trained on taps {abs(off)} layer{'s' if abs(off) > 1 else ''} "
            f"{'later' if off > 0 else 'earlier'} (one layer: the classic hidden_states[i] = INPUT of layer i "
            f"offset). Set target_layer_ids to {list(layers)} in its config.json.")
    masks = {m: view.tau(mask_id=m)[0] for m in (_mask_candidates(tok, drafter.config.mask_token_id)
                                                 if tok is not None else [])}
    d.probes.update({f"mask id {m}": round(t, 3) for m, t in masks.items()})
    if masks and better(max(masks.values())):
        best = max(masks, key=masks.get)
        rule = _rule_mask(tok)  # what `dflashkit train` picks for this tokenizer: named when it does about as well
        m = rule if rule in masks and masks[rule] >= 0.98 * masks[best] else best
        d.findings.append(f"with mask token id {m} the drafter accepts tau {masks[m]:.2f}, with its configured "
                          f"{drafter.config.mask_token_id} only {pred:.2f}: set mask_token_id to {m} in its "
                          "config.")
    for shift in (-1, 1):
        tau = d.probes[f"label shift {shift:+d}"] = round(view.tau(shift=shift)[0], 3)
        if better(tau):
            d.findings.append(f"the drafter's slot j predicts the token at anchor + j {shift:+d} (tau {tau:.2f} read "
                              f"that way, {pred:.2f} as decoding reads it): its training labels were shifted by one "
                              "position; DFlash labels slot j with the token AT anchor + j. Retrain.")
    leak_tau, leak_acc = view.tau(leak=True)
    d.probes["leak"] = round(leak_tau, 3)
    if leak_acc >= 0.9 and acc1 < 0.5:
        d.findings.append(f"given features of its own block's positions the drafter is right {leak_acc:.0%} of the "
                          f"time at slot 1, without them {acc1:.0%}: it was trained with a cross-block leak (context "
                          "visible at or after the anchor). Fix the training mask and retrain.")
    if pred > 1.2 * decoded + 0.2:
        d.findings.append(f"the training objective predicts tau {pred:.2f} on the very text decoding produced, "
                          f"decoding measured {decoded:.2f}: the decode path feeds the drafter differently from "
                          "training (positions, context features or masks).")
    if not d.findings and decoded < 1.15:
        d.findings.append(f"the drafter accepts almost nothing (tau {decoded:.2f}) and no known off-by-one explains "
                          "it: it is undertrained, or trained for another target or chat template.")
    return d
