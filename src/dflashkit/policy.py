"""The step policy: how much to draft and verify this step, so that speculation never costs a user time.

Every verified token costs time (on 2 CPU cores a pass of 16 tokens can cost 6x a pass of one), and the drafter's
forward costs time too. A draft is worth verifying only where its expected accepted tokens buy back its cost, and
that depends on the machine, the batch size, the context length and how well the drafter is doing right now.

- `CostModel` (`step_cost.py`): ms of a target pass by the tokens it verifies (all rows, padded width) and the
  context length, plus the drafter's by its rows, context and pending features. Calibrated once per machine and
  model, then corrected online from every measured step.
- `Acceptance`: the expected acceptance of each node, calibrated from what verification observed: a drafter node
  by its path probability (binned, observed rate per bin; a prior at the drafter's own claim), a lookup token by
  its match length (the rate at which the next copied token is right); both times each row's own observed /
  predicted ratio (`_row_factor`).
- `AdaptivePolicy`: before drafting, runs the drafter only where it has been paying at this batch size (with
  back-off probes so it can find out it pays again); after drafting, keeps the nodes worth more than a threshold
  chosen to maximise committed tokens per millisecond of the whole batch (`best_cut`). Keeping only the anchor is
  a plain AR step, always among the choices: by its own model the policy never picks a step slower than AR.
  Where recent looks (lookup + cut, host time) found nothing worth their cost, the next 1, 2, 4, then 8 steps
  are plain AR steps without looking (`looks`).
  Exact by construction: it only chooses which nodes are verified, from the drafter, the lookup and the past (never
  from this step's target samples); verification and commit are unchanged (`tree.py`).
- `FixedPolicy`: today's shape, every step (`--policy fixed`).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from .step_cost import CostModel, batch_bucket

# A cut's time beyond the AR step counts this much more when cuts are compared (the models are estimates): at 1.05
# the small bets (a lookup token here, a probe there) summed to 5-15 % below AR where nothing paid (MT-Bench, b4).
MARGIN = 1.15
PROB_EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)  # drafter path-probability bins
ANCHOR = 1e9  # the anchor's value: always kept (its verification is the AR step itself)


# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Acceptance:
    """Calibrated acceptance. Drafter nodes: per path-probability bin, nodes verified and accepted, with `prior`
    pseudo-nodes at the bin's mean claimed probability. Lookup: per match length n, the chance that a copied token
    is right given the ones before it were (prior 0.2 n, at most 0.9: observed 0.15 / 0.47 / 0.76 / 0.90 for
    n = 1-4 over both benchmark sets)."""

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

    def table(self) -> np.ndarray:
        """The calibrated acceptance of each bin."""
        mids = np.array((0.0,) + PROB_EDGES) / 2 + np.array(PROB_EDGES + (1.0,)) / 2
        mean_p = np.where(self.drafted > 0, self.claimed / np.maximum(self.drafted, 1), mids)
        return (self.accepted + self.prior * mean_p) / (self.drafted + self.prior)

    def drafter_values(self, p: torch.Tensor) -> torch.Tensor:
        """p: drafter path probabilities [b, m] -> calibrated acceptance [b, m]."""
        t = torch.tensor(self.table(), dtype=torch.float32, device=p.device)
        return t[torch.bucketize(p.float().contiguous(), torch.tensor(PROB_EDGES, device=p.device))]

    def lookup_rate(self, n: int) -> float:
        tried, right = self.lookup_tried.get(n, 0), self.lookup_right.get(n, 0)
        return (right + 4 * min(0.2 * n, 0.9)) / (tried + 4)

    def observe_drafter(self, p: list[float], accepted: list[bool]) -> None:
        bins = np.searchsorted(PROB_EDGES, p, side="right")
        np.add.at(self.drafted, bins, 1)
        np.add.at(self.accepted, bins, np.asarray(accepted, dtype=float))
        np.add.at(self.claimed, bins, p)

    def observe_lookup(self, n: int, branch: list[int], committed: list[int]) -> None:
        """branch: the proposed tokens; committed: the step's tokens (a + 1: what the target chose after the anchor
        along the accepted path). A copied token counts once the ones before it were right and it was decided."""
        for j, tok in enumerate(branch[:len(committed)]):
            self.lookup_tried[n] = self.lookup_tried.get(n, 0) + 1
            if committed[j] != tok:
                return
            self.lookup_right[n] = self.lookup_right.get(n, 0) + 1

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


# ---------------------------------------------------------------------------------------------------------------
def best_cut(values: np.ndarray, live: int, cost_of, sunk: float = 0.0,
             margin: float = 1.0) -> tuple[float, int, float, float, float]:
    """values: [b, W] each node's expected acceptance (made prefix-closed: at most its parent's), the anchor column
    ANCHOR, -inf for nodes that cannot be verified; cost_of(w): ms of a pass w nodes wide; sunk: ms already spent
    (the drafter). Keeping the nodes worth >= a threshold gives, per threshold, a width (the widest row) and a gain
    (the expected accepted tokens); returns (threshold, width, gain, committed tokens per ms, the same judged
    with the margin) of the best one.
    The AR step (the anchors alone) is always a candidate; the others are judged with their time beyond it
    multiplied by `margin`."""
    base = cost_of(1)
    best = (math.inf, 1, 0.0, live / (sunk + base), live / (base + margin * sunk))
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
    if judged[k] > best[4]:
        best = (float(cands[k]), int(widths[k]), float(gains[k]), float((live + gains[k]) / spent[k]),
                float(judged[k]))
    return best


@dataclass
class PolicyStats:
    """What the policy chose, summed over steps (the server's /metrics, the bench report)."""

    steps: int = 0
    drafter_steps: int = 0  # steps that ran the drafter
    probe_steps: int = 0  # ... of which probes: run on the budget (`wants_drafter`), not because drafting paid
    plain_steps: int = 0  # steps taken as plain AR steps without looking (`AdaptivePolicy.looks`)
    rows: int = 0  # live rows summed over steps
    nodes: int = 0  # draft nodes verified (live rows, the anchor not counted)
    width: int = 0  # verify pass widths summed over steps
    committed: int = 0

    def since(self, before: "PolicyStats | None") -> "PolicyStats":
        """The counts added after `before` (a copy taken earlier)."""
        if before is None:
            return self
        return PolicyStats(**{k: v - getattr(before, k) for k, v in asdict(self).items()})

    def summary(self) -> dict:
        s = max(self.steps, 1)
        return {**asdict(self), "drafter_fraction": round(self.drafter_steps / s, 4),
                "plain_fraction": round(self.plain_steps / s, 4),
                "nodes_per_row": round(self.nodes / max(self.rows, 1), 3), "mean_width": round(self.width / s, 3)}


@dataclass
class Plan:
    """One step's choice, kept from `choose` to `observe`: per row the kept node indices, the nodes' predicted
    values (`own`, before prefix-closing) and drafter probabilities, and what the cost model needs."""

    kept: list  # per row: kept node indices (0 = the anchor)
    own: np.ndarray  # [b, W] each node's predicted acceptance
    p: np.ndarray | None  # [b, W] drafter path probabilities (None: no drafter proposal)
    m: int  # drafter nodes occupy columns 1..m
    width: int
    drafted: bool
    rows: int
    ctx: int
    live: int
    props: list  # per row: the lookup proposal
    matched: list  # per row: its match length
    factor: list  # per row: `_row_factor` when chosen
    draft_in: tuple = (0, 0)  # the drafter's (context, pending features)
    looked: bool = True  # False: a plain step taken without looking
    probe: bool = False  # the drafter ran as a probe


class FixedPolicy:
    """Every step drafts and verifies the configured shape (`--policy fixed`)."""

    adaptive = False

    def looks(self, batch) -> bool:
        return True

    def wants_drafter(self, batch, props, matched) -> bool:
        return True

    def choose(self, batch, tree, draft, props, matched):
        return tree

    def choose_lookup(self, batch, props, matched) -> list[int] | None:
        return None  # every row verifies its whole lookup proposal

    def observe(self, batch, host: list, span: int, ms: float) -> None:
        pass


PROBE_MIN, PROBE_MAX = 4, 64  # steps between probes of a drafter that stopped paying (doubling back-off)
# ... and a probe's extra time (drafter, pending features, wider verify) at most this share of the plain time since
# the last, halved per unpaid probe at this batch size (at 3 %, cells where drafting never paid lost ~2.5 % to it).
PROBE_BUDGET = 0.01
ROW_PRIOR, ROW_DECAY = 3.0, 0.9  # a row's own correction (`_row_factor`): pseudo-nodes, and the history's decay
# Plain steps between looks once looking stops paying (`looks`): doubled per unpaid look, up to PLAIN_MAX (a copy
# is found at most 8 steps late; a look at batch 16, ~3 % of a step, then costs a ninth of that); LOOK_DECAY: EMA.
PLAIN_MAX, LOOK_DECAY = 8, 0.7


def _row_factor(seq) -> float:
    """A row's observed / predicted acceptance of its verified draft nodes (decayed history, shrunk to 1 by
    ROW_PRIOR pseudo-nodes), at most 1: it only shrinks. Why: the calibration table is global, but how predictable a
    text is varies by row (code copies, chat rambles); the table alone over-predicted the marginal 0.4-0.7 nodes
    (bench/results/policy-calibration), exactly the ones whose cost the policy weighs. Why never above 1: a factor
    up to 1.5 made the top bins over-confident (predicted 0.97, observed 0.77)."""
    return min(max((seq.draft_hit + ROW_PRIOR) / (seq.draft_pred + ROW_PRIOR), 0.25), 1.0)


class AdaptivePolicy:
    """The per-step choice of what to draft and verify (module docstring). One per engine and drafting setting;
    its cost model and acceptance calibration carry over from batch to batch."""

    adaptive = True

    def __init__(self, cost: CostModel, acceptance: Acceptance | None = None):
        self.cost, self.acc = cost, acceptance or Acceptance()
        # What drafting has been worth, per live row, in the steps that drafted (EMA): the expected accepted tokens
        # of the chosen cut and its width. With the cost model they predict the rate of drafting at any batch size.
        # The prior, before the drafter has run here: one accepted token per row from a 4-node cut (a modest drafter).
        # Where even that would not pay (a CPU whose wide passes are slow, a big batch) the drafter waits for a probe.
        self.gain, self.width, self.drafted_once = 1.0, 4.0, False
        # steps since the drafter ran, and their predicted plain ms each at its own batch size (not steps x today's)
        self.skipped, self.skipped_ms = 0, 0.0
        self.backoff = PROBE_MIN
        self.unpaid: dict[int, int] = {}  # per batch-size bucket: probes in a row that did not pay
        self.stats = PolicyStats()
        self._plan: Plan | None = None
        self._no_draft_rate = 0.0
        self._draft_in = (0, 0)  # this step's drafter input: (context, pending features), for the cost model
        self._look: tuple | None = None  # this step's lookup values and their best cut (`wants_drafter`)
        # What a look (lookup + cut) is worth and costs, ms per looked step (EMA; `looks`): the value starts high,
        # so the first steps look; plain_left: plain steps still to take; plain_span: the next run's length.
        self.look_value, self.look_ms, self.plain_left, self.plain_span = math.inf, 0.0, 0, 1
        # False: never skip a look. For a cost model in made-up units (tests of the cut with a fixed model), where a
        # look's real host time (wall ms) is not comparable with the model's "ms".
        self.may_skip_looks = True
        self._t_look = 0.0
        self._probe = False  # this step's drafter run is a probe (`wants_drafter`)

    def _cost_of(self, batch):
        rows, ctx = len(batch.seqs), max(batch.starts)
        return self.cost.pass_curve(rows, ctx)  # ms of a pass w nodes wide over every row

    def _lookup_values(self, props: list, matched: list, seqs: list, factor: list) -> np.ndarray:
        """Each row's lookup nodes' expected acceptance [b, 1 + k]: rate(n)^j for its j-th copied token, times the
        row's factor, at most 1; -inf past its proposal (and for finished rows), ANCHOR in column 0."""
        k = max((len(p) for p in props), default=0)
        lens = np.array([0 if s.finished else len(p) for p, s in zip(props, seqs)])
        rates = np.array([self.acc.lookup_rate(n) if n else 0.0 for n in matched])
        j = np.arange(1, k + 1)
        vals = np.minimum(rates[:, None] ** j[None] * np.asarray(factor)[:, None], 1.0)
        v = np.full((len(seqs), 1 + k), ANCHOR)
        v[:, 1:] = np.where(j[None] <= lens[:, None], vals, -np.inf)
        return v

    def looks(self, batch) -> bool:
        """Whether this step looks (lookup, drafter decision, cut) or is a plain AR step straight away: it looks
        unless the recent looks were worth less than they cost (`_learn_look`) and a run of plain steps is under way.
        Exact either way: a plain step is the AR step (the anchor alone). Plain steps count toward a probe."""
        if self.plain_left > 0:
            self.plain_left -= 1
            self.skipped += 1
            self.skipped_ms += self.cost.verify(len(batch.seqs), max(batch.starts) + 1)
            b = len(batch.seqs)
            live = sum(not s.finished for s in batch.seqs)
            self._plan = Plan(kept=[np.zeros(1, dtype=np.int64)] * b, own=np.zeros((b, 1)), p=None, m=0, width=1,
                              drafted=False, rows=b, ctx=max(batch.starts), live=live, props=[[]] * b,
                              matched=[0] * b, factor=[1.0] * b, looked=False)
            return False
        self._t_look = time.perf_counter()
        return True

    def _learn_look(self, batch, cut: tuple, live: int) -> None:
        """After a look without the drafter: its value (ms its cut saves against AR) and cost (host ms since
        `looks`) update their EMAs; value < cost: `plain_span` plain steps (doubling)."""
        spent = 1000 * (time.perf_counter() - self._t_look)
        base = self._cost_of(batch)(1)
        value = max((live + cut[2]) * base / max(live, 1) - (live + cut[2]) / max(cut[3], 1e-9), 0.0)
        first = math.isinf(self.look_value)
        self.look_value = value if first else LOOK_DECAY * self.look_value + (1 - LOOK_DECAY) * value
        self.look_ms = spent if first else LOOK_DECAY * self.look_ms + (1 - LOOK_DECAY) * spent
        if self.may_skip_looks and self.look_value < self.look_ms:
            self.plain_left, self.plain_span = self.plain_span, min(2 * self.plain_span, PLAIN_MAX)
        else:
            self.plain_span = 1

    def wants_drafter(self, batch, props: list, matched: list) -> bool:
        """Run the drafter where drafting is predicted to beat this step's best without it, or when a probe is due:
        after `backoff` skipped steps, once the plain steps since the last run cost enough that the probe's extra
        time (drafter + its pending features + the wider verify) fits PROBE_BUDGET of them."""
        live = sum(not s.finished for s in batch.seqs)
        cost_of = self._cost_of(batch)
        factor = [_row_factor(s) for s in batch.seqs]
        look = self._lookup_values(props, matched, batch.seqs, factor)
        cut = best_cut(look, live, cost_of, margin=MARGIN)
        self._no_draft_rate, self._look = cut[3], (look, cut, factor)  # `choose` reuses them
        rows, w, base = len(batch.seqs), int(self.width), cost_of(1)
        pending = batch.dstate.pending(max(batch.starts)) if batch.dstate is not None else rows
        self._draft_in = (max(batch.starts), pending)
        extra = (self.cost.draft(rows, *self._draft_in) + cost_of(w) - base
                 + (self.width - w) * (cost_of(w + 1) - cost_of(w)))
        judged = live * (1 + self.gain) / (base + MARGIN * extra)  # as `best_cut` judges a cut
        if judged > cut[4]:
            self._probe = False
            return True
        # The engine's first probe comes after `backoff` steps whatever it costs: nothing is known of the drafter
        # yet. Later ones wait for the budget: what drafting earns per row is known then and carries over to other
        # batch sizes through `judged` (measured: an unconditional first probe per batch size cost 5-10 % of a
        # 32-token cell where drafting never paid).
        k = batch_bucket(rows)
        if self.skipped + 1 >= self.backoff and (
                not self.drafted_once
                or (self.skipped_ms + base) * PROBE_BUDGET / 2 ** self.unpaid.get(k, 0) >= extra):
            self._probe = True
            return True
        self.skipped += 1
        self.skipped_ms += base
        return False

    def choose(self, batch, tree, draft, props: list, matched: list):
        """A drafted step: keep the nodes worth their cost (`best_cut`); returns the pruned tree."""
        from .tree import prune

        dev, (b, W) = tree.tokens.device, tree.tokens.shape
        # the drafter ran because `wants_drafter` asked for it, which priced this step's lookup branch
        (look, _, factor), self._look = self._look, None
        m = draft.tokens.shape[1]
        vals = torch.full((b, W), -math.inf, device=dev)
        p = torch.zeros((b, W), device=dev)
        if m:
            p[:, 1:1 + m] = draft.logp.float().exp()
            vals[:, 1:1 + m] = (self.acc.drafter_values(p[:, 1:1 + m])
                                * torch.tensor(factor, device=dev)[:, None]).clamp(max=1.0)
        vals[:, 1 + m:] = torch.as_tensor(look[:, 1:], dtype=torch.float32).to(dev)
        vals[:, 0] = ANCHOR
        live_rows = torch.tensor([not s.finished for s in batch.seqs], device=dev)
        vals = torch.where(tree.alive & live_rows[:, None], vals, -math.inf)
        vals[:, 0] = ANCHOR
        own = vals
        for _ in range(tree.max_depth):  # a node is worth at most its parent: kept sets stay prefix-closed
            vals = torch.minimum(vals, vals.gather(1, tree.parent))
        host = torch.stack([vals, p, tree.depth.float(), own]).cpu().numpy()  # the policy's one host read
        live = int(live_rows.sum())
        sunk = self.cost.draft(b, *self._draft_in)
        lam, width, gain, rate, _ = best_cut(host[0], live, self._cost_of(batch), sunk, MARGIN)
        keep = host[0] >= lam
        keep[:, 0] = True  # the anchor: its verification is the step itself
        depth = int(host[2][keep].max())
        self._learn_drafting(gain / max(live, 1), width, rate > self._no_draft_rate, b)
        kept = [np.flatnonzero(k) for k in keep]
        self._plan = Plan(kept=kept, own=host[3], p=host[1], m=m, width=width, drafted=True, probe=self._probe, rows=b,
                          ctx=max(batch.starts), live=live, props=props, matched=matched, factor=factor,
                          draft_in=self._draft_in)
        self._draft_in = (0, 0)
        return prune(tree, torch.from_numpy(keep).to(dev), width, depth)

    def choose_lookup(self, batch, props: list, matched: list) -> list[int]:
        """A step without the drafter: how many of its lookup tokens each row verifies (its j-th copied token is
        worth rate^j, already prefix-closed, so a row keeps a prefix). Decided on the host BEFORE the tree is built,
        so a plain step builds the anchor alone: this path runs on most steps where speculation does not pay, and
        building then pruning the whole branch cost ~1 ms a step at batch 16."""
        b = len(batch.seqs)
        live = sum(not s.finished for s in batch.seqs)
        looked, self._look = self._look, None
        look, cut, factor = looked or (None, None, None)
        if look is None:  # the drafter was not asked (no drafter, or the lookup alone was enough)
            factor = [_row_factor(s) for s in batch.seqs]
            look = self._lookup_values(props, matched, batch.seqs, factor)
            cut = best_cut(look, live, self._cost_of(batch), 0.0, MARGIN)
        keep = look >= cut[0]
        keep[:, 0] = True
        self._learn_look(batch, cut, live)
        self._plan = Plan(kept=[np.flatnonzero(k) for k in keep], own=look, p=None, m=0, width=cut[1], drafted=False,
                          rows=b, ctx=max(batch.starts), live=live, props=props, matched=matched, factor=factor)
        self._draft_in = (0, 0)
        return (keep.sum(1) - 1).tolist()

    def _learn_drafting(self, gain: float, width: int, paid: bool, rows: int) -> None:
        """A drafted step's best cut (expected accepted per live row, width) and whether it beat not drafting."""
        keep = 0.7 if self.drafted_once else 0.0  # the first measurement replaces the prior
        self.gain = keep * self.gain + (1 - keep) * gain
        self.width = keep * self.width + (1 - keep) * width
        self.drafted_once = True
        self.skipped, self.skipped_ms = 0, 0.0
        self.backoff = PROBE_MIN if paid else min(2 * self.backoff, PROBE_MAX)
        k = batch_bucket(rows)
        self.unpaid[k] = 0 if paid else min(self.unpaid.get(k, 0) + 1, 6)

    def observe(self, batch, host: list, span: int, ms: float) -> None:
        """After the commit: the step's time (cost model) and which kept nodes were accepted (calibration).
        host: `DecodeBatch._commit`'s rows (committed tokens [span], a, path [span]); rows of finished sequences
        are skipped."""
        plan, self._plan = self._plan, None
        if plan is None:
            return
        self.cost.observe_pass(plan.rows, plan.width, plan.ctx, plan.rows if plan.drafted else 0, ms, *plan.draft_in)
        st = self.stats
        st.steps += 1
        st.drafter_steps += plan.drafted
        st.probe_steps += plan.probe
        st.plain_steps += not plan.looked
        st.width += plan.width
        st.rows += plan.live
        if not plan.looked:  # a plain step: the anchors alone, nothing drafted or predicted to learn from
            st.committed += sum(int(row[span]) + 1 for row in host if row is not None)
            return
        ps, ok = [], []
        for r, row in enumerate(host):
            if row is None:
                continue
            a = int(row[span])
            path = set(row[span + 1: span + 2 + a])
            st.committed += a + 1
            st.nodes += len(plan.kept[r]) - 1
            seq, raw, hit = batch.seqs[r], 0.0, 0
            for j, old in enumerate(plan.kept[r]):
                if old:
                    self.acc.observe_prediction(float(plan.own[r, old]), j in path)
                    raw += float(plan.own[r, old]) / plan.factor[r]  # the table's own prediction
                    hit += j in path
                if 1 <= old <= plan.m:
                    ps.append(float(plan.p[r, old]))
                    ok.append(j in path)
            if raw:
                seq.draft_pred = ROW_DECAY * seq.draft_pred + raw
                seq.draft_hit = ROW_DECAY * seq.draft_hit + hit
            if plan.props[r]:
                self.acc.observe_lookup(plan.matched[r], plan.props[r], row[:a + 1])
        if ps:
            self.acc.observe_drafter(ps, ok)
