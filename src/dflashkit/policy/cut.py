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


def best_cut(values: np.ndarray | list, live: int, cost_of: Callable[[int], float], sunk: float = 0.0,
             margin: float = 1.0) -> CutChoice:
    """values: [b, W] (an array, or host lists of rows) each node's expected acceptance (made prefix-closed: at
    most its parent's), the anchor column ANCHOR, -inf for nodes that cannot be verified; live: rows still decoding;
    cost_of(w): ms of a pass w nodes wide; sunk: ms already spent (the drafter). The AR step is always a
    candidate; the others are judged with their time beyond it multiplied by `margin`."""
    base = cost_of(1)
    best = CutChoice(math.inf, 1, 0.0, live / (sunk + base), live / (base + margin * sunk))
    rows = values.tolist() if isinstance(values, np.ndarray) else values
    # Every node that can pay, best first, as (value, row). Why a loop on the host's floats, not numpy over
    # [thresholds, b, W]: at batch 1 this runs every step, right after the target's pass, where each numpy call
    # costs several microseconds (the numpy version took ~130 us a step, AMD EPYC).
    nodes = sorted(((x, r) for r, row in enumerate(rows) for x in row[1:] if 0 < x < math.inf),
                   reverse=True)
    counts, width, gain = [0] * len(rows), 1, 0.0
    for i, (x, r) in enumerate(nodes):  # each distinct value is a threshold: keep the nodes worth >= it
        counts[r] += 1
        width, gain = max(width, 1 + counts[r]), gain + x
        if i + 1 < len(nodes) and nodes[i + 1][0] == x:
            continue  # the same threshold keeps every node of this value
        spent = sunk + cost_of(width)
        # Judged with the time beyond the AR step inflated by `margin`: the extra cost must be clearly paid for
        # (where verifying is nearly free, any gain still is). Strictly better only: among equals the highest
        # threshold, the narrowest pass.
        judged = (live + gain) / (base + margin * (spent - base))
        if judged > best.judged:
            best = CutChoice(x, width, gain, (live + gain) / spent, judged)
    return best
