"""The cut: which draft nodes to verify, chosen to maximise committed tokens per millisecond of the whole batch.

Keeping the nodes worth at least a threshold gives, per threshold, a verify width and an expected gain; the AR step
(the anchors alone) is always among the choices, so by its own model the policy never picks a step slower than AR.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

# A cut's time beyond the AR step counts this much more when cuts are compared (the models are estimates): at 1.05
# the small bets (a lookup token here, a probe there) summed to 5-15 % below AR where nothing paid (MT-Bench, b4).
MARGIN = 1.15
ANCHOR = 1e9  # the anchor's value: always kept (its verification is the AR step itself)


@dataclass(frozen=True)
class CutChoice:
    """The best cut of one step."""

    threshold: float  # keep the nodes worth >= this (inf: the anchors alone)
    width: int  # the widest row's kept nodes, the anchor included: the verify pass's width
    gain: float  # expected accepted draft tokens, summed over rows
    rate: float  # expected committed tokens per ms
    judged: float  # the same with the time beyond the AR step inflated by the margin (what cuts are compared by)


def best_cut(values: np.ndarray, live: int, cost_of: Callable[[int], float], sunk: float = 0.0,
             margin: float = 1.0) -> CutChoice:
    """values: [b, W] each node's expected acceptance (made prefix-closed: at most its parent's), the anchor column
    ANCHOR, -inf for nodes that cannot be verified; live: rows still decoding; cost_of(w): ms of a pass w nodes
    wide; sunk: ms already spent (the drafter). The AR step is always a candidate; the others are judged with their
    time beyond it multiplied by `margin`."""
    base = cost_of(1)
    best = CutChoice(math.inf, 1, 0.0, live / (sunk + base), live / (base + margin * sunk))
    v = values[:, 1:]
    cands = np.unique(v[np.isfinite(v) & (v > 0)])[::-1]
    if cands.size == 0:
        return best
    keep = v[None] >= cands[:, None, None]  # [K, b, W-1]
    widths = 1 + keep.sum(2).max(1)
    gains = np.where(keep, v[None], 0.0).sum((1, 2))
    costs = {w: cost_of(int(w)) for w in np.unique(widths)}
    spent = sunk + np.array([costs[w] for w in widths])
    # Judged with the time beyond the AR step inflated by `margin`: the extra cost must be clearly paid for (where
    # verifying is nearly free, any gain still is).
    judged = (live + gains) / (base + margin * (spent - base))
    k = int(np.argmax(judged))  # first maximum: the highest threshold, the narrowest pass
    if judged[k] > best.judged:
        best = CutChoice(float(cands[k]), int(widths[k]), float(gains[k]), float((live + gains[k]) / spent[k]),
                         float(judged[k]))
    return best
