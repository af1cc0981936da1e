"""Chain verification of a drafted block (`tree.py` generalises it to a draft tree). Terms, defined once:

- block: `[anchor, d_1 .. d_{B-1}]` at positions `start .. start+B-1`; the anchor is the last committed
  token (no target K/V yet); d_i are the drafter's argmax proposals.
- target choice p_i (i = 0..B-1): the target's own token for position start+i+1, chosen by its sampler
  from the verify logits (argmax at T=0, a sample at T>0), given the block prefix up to slot i.
- accepted: the longest prefix with d_{i+1} == p_i; its length a is in 0..B-1.
- bonus: p_a, the target's choice right after the accepted prefix (always emitted).
- acceptance length = a + 1 tokens per target pass, the bonus included; tau is its mean.

Why lossless at any temperature: the committed tokens are exactly p_0..p_a, each one the target's own
choice given a prefix equal to the committed text. The draft only decides how many of them one target
pass yields. (With an argmax proposal this equals rejection sampling: d is kept w.p. p(d), and on a
mismatch p_a is a draw from p with d removed.)
"""

from __future__ import annotations

import torch


def accepted_lengths(drafts: torch.Tensor, choices: torch.Tensor) -> torch.Tensor:
    """drafts: [B, Q-1] proposals d_1..d_{Q-1}; choices: [B, Q] target choices p_0..p_{Q-1} -> a: [B] in 0..Q-1."""
    match = (drafts == choices[:, :-1]).to(torch.int32)
    return match.cumprod(dim=1).sum(dim=1)
