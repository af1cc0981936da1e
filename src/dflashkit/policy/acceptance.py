"""Acceptance estimates: what the policy expects each draft node to be worth, calibrated by what verification saw.

- `Acceptance` (global, one per policy): a drafter node by its path probability (binned, observed rate per bin; a
  prior at the drafter's own claim), a lookup token by its match length and source (the rate at which the next
  copied token is right).
- `RowHistory` (one per sequence): that row's own observed / predicted ratio, which scales both.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

PROB_EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)  # drafter path-probability bins
ROW_PRIOR, ROW_DECAY = 3.0, 0.9  # a row's own correction (`RowHistory`): pseudo-nodes, and the history's decay


CORPUS_PRIOR = {"lo": 0.18, "mid": 0.4}  # a corpus copy's prior by `CorpusMatch.agreement` (hi, one: by n below)


def lookup_prior(key: int | str) -> float:
    """The prior rate of a copied token: 0.2 n (at most 0.9) for the sequence's own n-token match (observed 0.15 /
    0.47 / 0.76 / 0.90 for n = 1-4 over both benchmark sets). A corpus match ("corpus-n-agreement") predicts less,
    and by how far the corpus agrees more than by n (first token right, held-out ShareGPT prompts, the train
    answers as corpus): "lo" 0.17-0.26, "mid" 0.37-0.57, "hi" 0.53 / 0.69 / 0.75 / 0.94 for n = 2 / 4 / 6 / 8 ->
    0.45 + 0.05 n (at most 0.9), "one" (a single occurrence) 0.22 / 0.42 / 0.53 / 0.89 -> 0.2 + 0.06 n (at most
    0.7)."""
    if isinstance(key, str):
        _, n, agree = key.split("-")
        if agree == "hi":
            return min(0.45 + 0.05 * int(n), 0.9)
        if agree in CORPUS_PRIOR:
            return CORPUS_PRIOR[agree]
        return min(0.2 + 0.06 * int(n), 0.7)  # "one"
    return min(0.2 * key, 0.9)


@dataclass
class Acceptance:
    """Calibrated acceptance. Drafter nodes: per path-probability bin, nodes verified and accepted, with `prior`
    pseudo-nodes at the bin's mean claimed probability. Lookup: per calibration key (match length and source), the
    chance that a copied token is right given the ones before it were (4 pseudo-tokens at `lookup_prior`)."""

    prior: float = 8.0
    drafted: np.ndarray = field(default_factory=lambda: np.zeros(len(PROB_EDGES) + 1))
    accepted: np.ndarray = field(default_factory=lambda: np.zeros(len(PROB_EDGES) + 1))
    claimed: np.ndarray = field(default_factory=lambda: np.zeros(len(PROB_EDGES) + 1))  # sum of p per bin
    lookup_tried: dict = field(default_factory=dict)
    lookup_right: dict = field(default_factory=dict)
    # the honest check: each verified node's value AS PREDICTED when the policy chose it, against its outcome
    predicted: np.ndarray = field(default_factory=lambda: np.zeros(10))  # sum of predictions per 0.1-wide bin
    outcome: np.ndarray = field(default_factory=lambda: np.zeros(10))  # accepted nodes per bin
    verified: np.ndarray = field(default_factory=lambda: np.zeros(10))
    _table: list | None = field(default=None, repr=False)  # `table()` as host floats (`drafter_value`)

    def table(self) -> np.ndarray:
        """The calibrated acceptance of each bin."""
        mids = np.array((0.0,) + PROB_EDGES) / 2 + np.array(PROB_EDGES + (1.0,)) / 2
        mean_p = np.where(self.drafted > 0, self.claimed / np.maximum(self.drafted, 1), mids)
        return (self.accepted + self.prior * mean_p) / (self.drafted + self.prior)

    def drafter_value(self, p: float) -> float:
        """A drafter node of path probability p: its calibrated acceptance. A bin holds the probabilities above its
        lower edge up to and including its upper one. The table is kept as host floats until the next observation
        (`table` is ~6 numpy calls: ~0.15 ms right after a target step)."""
        if self._table is None:
            self._table = self.table().tolist()
        return self._table[bisect.bisect_left(PROB_EDGES, p)]

    def lookup_rate(self, key: int | str) -> float:
        """key: a match length n (the sequence's own lookup) or "corpus-n-agreement" (`LookupProposal.key`)."""
        tried, right = self.lookup_tried.get(key, 0), self.lookup_right.get(key, 0)
        return (right + 4 * lookup_prior(key)) / (tried + 4)

    def observe_drafter(self, p: list[float], accepted: list[bool]) -> None:
        self._table = None
        bins = np.searchsorted(PROB_EDGES, p, side="right")
        np.add.at(self.drafted, bins, 1)
        np.add.at(self.accepted, bins, np.asarray(accepted, dtype=float))
        np.add.at(self.claimed, bins, p)

    def observe_lookup(self, key: int | str, branch: list[int], committed: list[int]) -> None:
        """branch: the proposed tokens; committed: the step's tokens (a + 1: what the target chose after the anchor
        along the accepted path). A copied token counts once the ones before it were right and it was decided."""
        for j, tok in enumerate(branch[:len(committed)]):
            self.lookup_tried[key] = self.lookup_tried.get(key, 0) + 1
            if committed[j] != tok:
                return
            self.lookup_right[key] = self.lookup_right.get(key, 0) + 1

    def observe_prediction(self, value: float, accepted: bool) -> None:
        k = min(int(value * 10), 9)
        self.predicted[k] += value
        self.outcome[k] += accepted
        self.verified[k] += 1

    def report(self) -> dict:
        """For the calibration plot: per drafter-probability bin, the drafter's mean claim and the observed rate;
        per bin of predicted acceptance (drafter and lookup nodes, predicted before verification), the mean
        prediction and the observed rate."""
        n, v = np.maximum(self.drafted, 1), np.maximum(self.verified, 1)
        return {"bins": list(PROB_EDGES), "drafted": self.drafted.tolist(), "claimed": (self.claimed / n).tolist(),
                "observed": (self.accepted / n).tolist(),
                "lookup": {str(k): [self.lookup_tried[k], self.lookup_right.get(k, 0)] for k in self.lookup_tried},
                "predicted_nodes": self.verified.tolist(), "predicted_mean": (self.predicted / v).tolist(),
                "predicted_observed": (self.outcome / v).tolist()}


@dataclass
class RowHistory:
    """One sequence's decayed sums of the table's predicted and the observed accepted nodes (its verified drafter
    and lookup nodes)."""

    predicted: float = 0.0
    hit: float = 0.0

    def factor(self) -> float:
        """Observed / predicted (shrunk to 1 by ROW_PRIOR pseudo-nodes), in [0.25, 1]: it only shrinks. Why: the
        calibration table is global, but how predictable a text is varies by row (code copies, chat rambles); the
        table alone over-predicted the marginal 0.4-0.7 nodes (bench/results/policy-calibration), exactly the ones
        whose cost the policy weighs. Why never above 1: a factor up to 1.5 made the top bins over-confident
        (predicted 0.97, observed 0.77)."""
        return min(max((self.hit + ROW_PRIOR) / (self.predicted + ROW_PRIOR), 0.25), 1.0)

    def observe(self, predicted: float, hit: int) -> None:
        self.predicted = ROW_DECAY * self.predicted + predicted
        self.hit = ROW_DECAY * self.hit + hit
