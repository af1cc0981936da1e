"""The DFlash training objective (dflash-spec §4.3-4.6): many random anchors per sequence, trained in
ONE drafter forward through a sparse block mask, with a position-decayed cross-entropy.

For a sequence of S tokens with target features for all S positions and anchors a_1..a_N:
- block n = `[token at a_n, MASK x (B-1)]` at positions a_n .. a_n+B-1 (absolute, shared with the target);
- slot j (j >= 1) predicts the token AT a_n + j (same-position labels; slot 0 is unsupervised);
- block n sees context positions t < a_n (strictly: the anchor's own feature is what inference lacks)
  plus all B slots of its own block (bidirectional); never another block;
- padding blocks (fewer candidates than N) see nothing and weigh zero;
- loss = sum_j w_j CE_j / sum_j w_j with w_j = exp(-(j-1)/gamma), or D-PACE's weights (`dpace_weights`):
  each slot weighed by the expected accepted length it still contributes to.
The drafter forward is the very one inference uses (`DFlashDrafter.forward`), only the mask differs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .drafter import DFlashDrafter


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None):
    """loss_mask: [B, S] bool (assistant tokens). Anchors only where the anchor AND the next token are
    supervised. Returns anchors [B, N] (sorted; padding = 0) and valid [B, N] bool."""
    B, S = loss_mask.shape
    cand = loss_mask[:, :-1] & loss_mask[:, 1:]  # [B, S-1]
    keys = torch.rand(cand.shape, generator=generator, device=loss_mask.device)
    keys = keys.masked_fill(~cand, 2.0)  # non-candidates sort last
    order = keys.argsort(dim=1)[:, :num_anchors]
    valid = torch.gather(cand, 1, order)
    anchors = torch.where(valid, order, torch.zeros_like(order))
    # sort valid anchors ascending, padding last
    anchors, idx = torch.sort(torch.where(valid, anchors, torch.full_like(anchors, S)), dim=1)
    valid = torch.gather(valid, 1, idx)
    anchors = torch.where(valid, anchors, torch.zeros_like(anchors))
    if anchors.shape[1] < num_anchors:  # fewer positions than anchors asked for
        pad = num_anchors - anchors.shape[1]
        anchors = F.pad(anchors, (0, pad))
        valid = F.pad(valid, (0, pad), value=False)
    return anchors, valid


def block_mask(anchors: torch.Tensor, valid: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """anchors, valid: [B, N] -> visibility [B, 1, N*Bq, S + N*Bq] bool (True = may attend), vectorised."""
    B, N = anchors.shape
    Q = N * block_size
    blk = torch.arange(Q, device=anchors.device) // block_size  # block index of each query
    a = anchors[:, blk]  # [B, Q] anchor of each query's block
    v = valid[:, blk]  # [B, Q]
    ctx = torch.arange(seq_len, device=anchors.device)[None, None, :] < a[:, :, None]  # [B, Q, S]
    own = (blk[:, None] == blk[None, :])[None].expand(B, Q, Q)  # [B, Q, Q]
    return (torch.cat([ctx, own], dim=-1) & v[:, :, None])[:, None]


def decay_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[Bq] loss weight per slot: 0 for slot 0 (the anchor), exp(-(j-1)/gamma) for j >= 1."""
    j = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(j >= 1, torch.exp(-(j - 1) / gamma), torch.zeros_like(j))


@dataclass
class Blocks:
    ids: torch.Tensor  # [B, N*Bq] block token ids
    positions: torch.Tensor  # [B, N*Bq]
    labels: torch.Tensor  # [B, N*Bq] token at the same position (0 where unsupervised)
    weights: torch.Tensor  # [B, N*Bq] loss weight (0 = unsupervised)
    mask: torch.Tensor  # [B, 1, N*Bq, S + N*Bq]
    block_size: int  # Bq: slots per block (DFlash2's convolutions stay inside each block)


def build_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                 block_size: int, mask_token_id: int, gamma: float) -> Blocks:
    """input_ids, loss_mask: [B, S]; anchors, valid: [B, N]."""
    B, S = input_ids.shape
    N, Bq = anchors.shape[1], block_size
    j = torch.arange(Bq, device=input_ids.device)
    pos = anchors[:, :, None] + j  # [B, N, Bq] absolute positions
    ids = torch.full((B, N, Bq), mask_token_id, dtype=torch.long, device=input_ids.device)
    ids[:, :, 0] = torch.where(valid, torch.gather(input_ids, 1, anchors), mask_token_id)
    inside = pos < S
    lab_pos = pos.clamp(max=S - 1)
    labels = torch.gather(input_ids, 1, lab_pos.view(B, -1)).view(B, N, Bq)
    supervised = torch.gather(loss_mask, 1, lab_pos.view(B, -1)).view(B, N, Bq) & inside & valid[:, :, None]
    w = decay_weights(Bq, gamma, input_ids.device) * supervised  # slot 0 weight is 0 by construction
    return Blocks(ids.view(B, -1), pos.view(B, -1), torch.where(supervised, labels, 0).view(B, -1),
                  w.view(B, -1), block_mask(anchors, valid, S, Bq), Bq)


def training_forward(drafter: DFlashDrafter, embed, taps: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """The training forward: context = fused features of ALL positions, queries = all blocks.

    taps: [B, S, k*H]. Returns hidden states [B, N*Bq, H] for the block slots.
    """
    B, S = taps.shape[:2]
    mask = blocks.mask
    # A padding block sees nothing; SDPA turns an all-masked row into NaN, which would poison the gradient
    # even at weight 0. Let such rows see their own slot only (their outputs are discarded, weight 0).
    empty = ~mask.any(-1, keepdim=True)  # [B, 1, Q, 1]
    if empty.any():
        Q = mask.shape[2]
        self_slot = torch.zeros_like(mask)
        self_slot[..., S:] = torch.eye(Q, dtype=torch.bool, device=mask.device)
        mask = mask | (empty & self_slot)
    return drafter(embed(blocks.ids), blocks.positions, None, mask,
                   taps=taps, tap_positions=torch.arange(S, device=taps.device).expand(B, S),
                   block=blocks.block_size)


def teacher_rows(final: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """final: [B, S, H] the target's final normed hidden states -> [B, N*Bq, H], each block slot's teacher row.
    Why position - 1: slot j holds the token AT anchor + j, whose distribution the target computes one position
    earlier (the label shift; slot 0's row is unused: it weighs zero)."""
    idx = (blocks.positions - 1).clamp(0, final.shape[1] - 1)
    return torch.gather(final, 1, idx[..., None].expand(-1, -1, final.shape[-1]))


def head_logits(rows: torch.Tensor, head: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """rows: [M, H]; head: [V, H] -> float32 logits [M, V], soft-capped as the target caps its own (Gemma 3)."""
    logits = (rows @ head.T).float()
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def dpace_weights(confidence: torch.Tensor, supervised: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights (as speculators' `dpace_loss_decay`). confidence, supervised: [M, Bq] per block: the
    drafter's probability of the slot's label, and whether the slot is supervised. With c_k = (1 - alpha) q_k + alpha
    (1 on unsupervised slots), slot i weighs sum_{j >= i, supervised} prod_{k <= j} c_k: how much of the block's
    expected accepted length still depends on slot i, so early slots, whose miss ends the block, weigh most.
    Returns [M, Bq], zero where unsupervised. No gradient flows through the weights."""
    m = supervised.float()
    smooth = torch.where(supervised, (1 - alpha) * confidence.detach().float() + alpha, torch.ones_like(m))
    prefix = torch.cumprod(smooth, -1)
    return (prefix * m).flip(-1).cumsum(-1).flip(-1) * m


def dflash_loss(hidden: torch.Tensor, blocks: Blocks, lm_head: torch.Tensor, block_size: int,
                chunk: int = 8192, softcap: float | None = None, d2t_head: torch.Tensor | None = None,
                t2d: torch.Tensor | None = None, teacher: torch.Tensor | None = None, dpace_alpha: float | None = None):
    """hidden: [B, N*Bq, H]; lm_head: [V, H] frozen. Weighted CE over supervised slots only (logits are
    computed just for those rows, in chunks). With a reduced draft vocabulary pass d2t_head [Vd, H] (rows of
    the LM head) and t2d [V] (target id -> draft id, -1 if absent): labels outside it weigh zero.
    With teacher [B, N*Bq, H] (`teacher_rows`): the weighted KL(target || drafter) over the same vocabulary rows
    instead of the CE to the data's token (the target's whole distribution, not its argmax).
    With dpace_alpha: D-PACE's weights (`dpace_weights`, from the drafter's probability of each label) replace the
    blocks' exponential decay.

    Returns (loss, stats) where stats has per-slot correct/total counts [Bq] and the loss sums."""
    w = blocks.weights
    sel = w > 0
    h = hidden[sel]  # [M, H]
    t = teacher[sel] if teacher is not None else None  # [M, H]
    labels = blocks.labels[sel]
    weights = w[sel]
    slot = torch.nonzero(sel)[:, 1] % block_size
    head = lm_head if d2t_head is None else d2t_head
    if t2d is not None:
        labels = t2d[labels]
        weights = weights * (labels >= 0)
        labels = labels.clamp(min=0)
    rows, confidence = [], []
    correct = torch.zeros(block_size, device=h.device)
    for lo in range(0, h.shape[0], chunk):
        logits = head_logits(h[lo:lo + chunk], head, softcap)
        logp = F.log_softmax(logits, -1)
        lab = labels[lo:lo + chunk]
        if t is None:
            rows.append(-logp.gather(1, lab[:, None])[:, 0])
        else:
            teacher_log = F.log_softmax(head_logits(t[lo:lo + chunk], head, softcap), -1)
            rows.append(F.kl_div(logp, teacher_log, reduction="none", log_target=True).sum(-1))
        confidence.append(logp.detach().gather(1, lab[:, None])[:, 0].exp())
        hit = (logits.argmax(-1) == lab) & (weights[lo:lo + chunk] > 0)
        correct.index_add_(0, slot[lo:lo + chunk], hit.float())
    per_row = torch.cat(rows) if rows else h.new_zeros(0, dtype=torch.float32)
    if dpace_alpha is not None:
        # Why scatter back to [blocks, Bq]: D-PACE's products run along each block's slots in order.
        grid = torch.zeros(sel.shape, device=h.device)
        if confidence:
            grid[sel] = torch.cat(confidence)
        held = torch.zeros(sel.shape, dtype=torch.bool, device=h.device)
        held[sel] = weights > 0
        Bq = block_size
        weights = dpace_weights(grid.view(-1, Bq), held.view(-1, Bq), dpace_alpha).view(sel.shape)[sel]
    count = torch.zeros(block_size, device=h.device).index_add_(0, slot, (weights > 0).float())
    loss = (per_row * weights).sum() / weights.sum().clamp(min=1e-6)
    return loss, {"correct": correct.detach(), "count": count.detach()}


def simulated_tau(correct_prefix: torch.Tensor) -> float:
    """correct_prefix: [M, Bq-1] bool per block (slot j correct) -> mean of 1 + the leading run of correct slots,
    every anchor weighted alike. Optimistic: decoding does not visit anchors uniformly (see `decode_path_tau`)."""
    if correct_prefix.numel() == 0:
        return math.nan
    return float((correct_prefix.int().cumprod(1).sum(1) + 1).float().mean())


def decode_path_tau(runs: list[int]) -> tuple[int, int]:
    """runs[i]: tokens one verification would commit with the block anchored at response position i (1 + leading
    correct slots). Walks the path greedy decoding takes (next anchor = anchor + run) and returns
    (tokens, target passes); tau = tokens / passes.

    Why not the mean of `runs`: decoding lands right after every rejection, so anchors in hard stretches are
    visited once per token while easy stretches are crossed in a few long jumps. On the default drafter the
    uniform mean over-states the real tau by about 1.5x (2.36 vs 1.87 on held-out ShareGPT, first 128 tokens).
    """
    i = passes = 0
    while i < len(runs):
        i += max(1, runs[i])
        passes += 1
    return min(i, len(runs)), passes


def selector_loss(hidden: torch.Tensor, blocks: Blocks, lm_head: torch.Tensor, selector, softcap: float | None = None,
                  chunk: int = 4096, unary_stats: bool = False):
    """DFlash2's selector objective (speculators' `dflash2`): at each supervised slot, a top_k-way cross-entropy over
    the drafter's top-k unary candidates (the label put in the last place where the top-k misses it), scored by the
    selector with the TRUE previous token as predecessor (teacher forcing: the anchor before slot 1), weighted by the
    slots' decayed weights. hidden: [B, N*Bq, H]. Returns (loss, stats: selector hits on slots whose top-k held the
    label, and those slots; with unary_stats also `dflash_loss`'s per-slot argmax counts, from the same logits)."""
    w, Bq = blocks.weights, blocks.block_size
    sel = w > 0
    # Why the roll: slot s's predecessor is the token at s - 1: the anchor (`ids`) for s = 1, else the label there.
    first = (torch.arange(w.shape[1], device=w.device) % Bq == 1)[None]
    prev_all = torch.where(first, blocks.ids.roll(1, dims=1), blocks.labels.roll(1, dims=1))
    h, labels, weights, prev = hidden[sel], blocks.labels[sel], w[sel], prev_all[sel]
    slot = torch.nonzero(sel)[:, 1] % Bq
    correct = torch.zeros(Bq, device=h.device)
    k = selector.top_k
    total = h.new_zeros((), dtype=torch.float32)
    hits = held = h.new_zeros((), dtype=torch.float32)
    for lo in range(0, h.shape[0], chunk):
        hc, lab, pc = h[lo:lo + chunk], labels[lo:lo + chunk], prev[lo:lo + chunk]
        logits = head_logits(hc, lm_head, softcap)
        unary, cand = logits.topk(k, dim=-1)  # [m, k]
        if unary_stats:
            correct.index_add_(0, slot[lo:lo + chunk], (cand[:, 0] == lab).float())
        match = cand == lab[:, None]
        has = match.any(-1)
        place = torch.where(has, match.int().argmax(-1), k - 1)  # the label's place among the candidates
        last = torch.where(has, unary[:, -1], logits.gather(1, lab[:, None])[:, 0])
        cand = torch.cat([cand[:, :-1], torch.where(has, cand[:, -1], lab)[:, None]], 1)
        unary = torch.cat([unary[:, :-1], last[:, None]], 1)
        scores = unary + selector.pairwise(pc[:, None], selector.hidden_projection(hc),
                                           selector.successor_codebook(cand))[:, 0].float()
        total = total + (F.cross_entropy(scores, place, reduction="none") * weights[lo:lo + chunk]).sum()
        hits = hits + ((scores.argmax(-1) == place) & has).sum().float()
        held = held + has.sum().float()
    stats = {"selector_hits": hits.detach(), "selector_held": held.detach()}
    if unary_stats:
        stats.update(correct=correct, count=torch.zeros(Bq, device=h.device).index_add_(0, slot, torch.ones_like(
            slot, dtype=torch.float32)))
    return total / weights.sum().clamp(min=1e-6), stats
