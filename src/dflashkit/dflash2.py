"""What DFlash2 adds to the DFlash drafter (Z Lab with Inco AI; `DFlash2DraftModel` in Z Lab's `dflash` package,
`dflash2` in speculators):

- `DynamicConv`: a grouped dynamic causal convolution over the block's slots, twice per layer: one mixes each slot
  with the slots before it in the block before the attention (`prepare`) and one after it (`finish`), the same
  around the MLP. Tap o of slot t weighs slot t - o by a learned per-channel base plus a per-group value computed
  from slot t itself (the "dynamic" kernel). It never reaches outside its block: the context enters through the
  attention only.
- `CandidateSelector`: instead of each slot's argmax, a path through the drafter's top-k candidates per slot,
  chosen slot by slot: candidate c after predecessor p scores unary(c) + <P[p] * W h_t, S[c]> (low-rank codebooks
  P, S over the vocabulary; h_t the slot's final hidden state). The slots' drafts then agree with each other.
Both reduce to the v1 drafter exactly at `init_from_v1`'s values (identity taps, a selector that scores the unary
logits alone), which is where `dflashkit train --arch dflash2 --init-from` starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class DynamicConv(nn.Module):
    """Tensor names as Z Lab's: `base_kernel` [2, K, H] (0: `prepare`'s, 1: `finish`'s), `kernel_projection`."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def prepare(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, Q, H], Q = n blocks of `block` slots -> (x convolved with kernel 0, kernel 1's dynamic part
        [B, Q, K, G] for `finish`). Both dynamic parts come from this x (the normed input of the sublayer)."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, -1)
        return self._convolve(x, dynamic[..., 0, :, :], self.base_kernel[0], block), dynamic[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor, block: int) -> torch.Tensor:
        return self._convolve(x, dynamic, self.base_kernel[1], block)

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block: int) -> torch.Tensor:
        """out[t] = sum_o (base[o] + dynamic[t, o, group]) * x[t - o], x[t - o] = 0 before the block's first slot.
        Why per block: training packs many blocks into one query axis; a tap across a block boundary would read
        another anchor's slots, which decoding never sees. The sum's order is Z Lab's (base, then dynamic, per tap)."""
        B, Q, H = x.shape
        G, n = H // self.group_size, Q // block
        xs = x.view(B, n, block, G, self.group_size)
        dyn = dynamic.view(B, n, block, self.kernel_size, G, 1)
        out = torch.zeros_like(xs)
        for o in range(self.kernel_size):
            shifted = xs if o == 0 else F.pad(xs[:, :, :-o], (0, 0, 0, 0, o, 0))
            out = out + base[o].view(1, 1, 1, G, self.group_size).to(x.dtype) * shifted
            out = torch.addcmul(out, dyn[:, :, :, o], shifted)
        return out.view(B, Q, H)

    def init_identity(self) -> None:
        """Tap 0 passes the slot through, the others and the dynamic part are zero: the layer is v1's."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()


class CandidateSelector(nn.Module):
    """Tensor names as Z Lab's: `predecessor_codebook`, `successor_codebook` (embeddings [V, r]; Z Lab's checkpoints
    may store them without the `.weight` suffix, `checkpoint.load_drafter` maps both), `hidden_projection`."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor,
               to_target: torch.Tensor | None = None) -> "Selection":
        """hidden: [b, D, H] the drafter's final states of slots 1..D; logits: [b, D, V'] their unary logits; anchor:
        [b] the token before slot 1 (a target id); to_target: [V'] target id of each logit column (a reduced draft
        vocabulary; None: the columns are target ids). Greedy: at each slot the best-scoring candidate given the
        one chosen before it."""
        unary, columns = logits.topk(self.top_k, dim=-1)  # [b, D, k], best first
        candidates = columns if to_target is None else to_target[columns]
        h = self.hidden_projection(hidden)  # [b, D, r]
        prev, chosen, scores = anchor, [], []
        for j in range(hidden.shape[1]):
            s = unary[:, j] + self.pairwise(prev[:, None], h[:, j], self.successor_codebook(candidates[:, j]))[:, 0]
            index = s.argmax(-1)
            prev = candidates[:, j].gather(-1, index[:, None])[:, 0]
            chosen.append(index)
            scores.append(s)
        pick = torch.stack(chosen, 1)[..., None]  # [b, D, 1]
        return Selection(candidates.gather(-1, pick)[..., 0], columns.gather(-1, pick)[..., 0], candidates,
                         torch.stack(scores, 1))

    def conditional(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor,
                    to_target: torch.Tensor | None = None):
        """For a selector-ranked draft tree (`tree.topk_tree(conditional=...)`): each slot's top-k candidates
        [b, D, k] (target ids) and a function (j, beam tokens [b, K'] or None for the anchor) -> [b, K', k] the
        log-softmax over the candidates of slot j after each beam's last token."""
        unary, columns = logits.topk(self.top_k, dim=-1)
        candidates = columns if to_target is None else to_target[columns]
        h = self.hidden_projection(hidden)  # [b, D, r]
        succ = self.successor_codebook(candidates)  # [b, D, k, r]

        def step(j: int, beam: torch.Tensor | None) -> torch.Tensor:
            prev = anchor[:, None] if beam is None else beam  # [b, K']
            s = unary[:, j, None, :] + self.pairwise(prev, h[:, j], succ[:, j])
            return s.float().log_softmax(-1)
        return candidates, step

    def pairwise(self, prev: torch.Tensor, h: torch.Tensor, succ: torch.Tensor) -> torch.Tensor:
        """The low-rank pairwise score, the one place it is written (decoding, trees, the training objective):
        prev [..., P] predecessor ids, h [..., r] the slot's projected drafter state, succ [..., k, r] the
        candidates' successor codes -> [..., P, k] <pred(prev) * h, succ(candidate)>."""
        return torch.einsum("...pr,...kr->...pk", self.predecessor_codebook(prev) * h[..., None, :], succ)

    def init_unary(self) -> None:
        """Pairwise scores 0: the selector picks each slot's argmax, v1's chain."""
        with torch.no_grad():
            self.predecessor_codebook.weight.zero_()


@dataclass
class Selection:
    """The selector's walk over one block."""

    path: torch.Tensor  # [b, D] the chosen token per slot (target ids)
    columns: torch.Tensor  # [b, D] ... as the logits' column (a reduced draft vocabulary's id)
    candidates: torch.Tensor  # [b, D, k] each slot's top-k unary candidates, best first
    scores: torch.Tensor  # [b, D, k] the candidates' scores given the chosen predecessor
