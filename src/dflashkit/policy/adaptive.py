"""The adaptive step policy (`--policy adaptive`, the default): per step, what to draft and verify so that
speculation never costs a user time (the package docstring says how)."""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..step_cost import DRAFT_MIN_BLOCK, CostModel
from ..tree import SOURCE_DRAFTER, DraftTree
from .acceptance import Acceptance, RowHistory
from .cut import ANCHOR, MARGIN, CutChoice, best_cut
from .probes import Looks, Probes
from .step import Plan, PolicyStats, StepOutcome, StepView, TreeCut

ROWS_KEPT = 4096  # per-row histories kept (least recently used dropped): far more than any batch's rows
DEPTH_WINDOW = 8  # drafted steps whose cut depths set the next drafting block (`_block`)


@dataclass
class StepRecord:
    """What the policy predicted at one step (`Plan.record`), from `plan` through `cut` to `observe`."""

    rows: int
    ctx: int
    live: int  # rows still decoding
    live_rows: list[bool]  # per row: still decoding
    keys: list[int]  # per row: its sequence's key
    looked: bool = True  # False: a plain step taken without looking
    values: np.ndarray | None = None  # [b, 1 + k] the lookup nodes' predicted acceptance (ANCHOR in column 0)
    factor: list[float] = field(default_factory=list)  # per row: `RowHistory.factor` when chosen
    props: list[list[int]] = field(default_factory=list)  # per row: the lookup proposal
    lookup_keys: list = field(default_factory=list)  # per row: its proposal's calibration key (`LookupProposal.key`)
    no_draft_rate: float = 0.0  # committed tokens per ms of the best cut without the drafter
    draft_in: tuple = (0, 0, None)  # the drafter's (context, pending features, block), for the cost model
    probe: bool = False  # the drafter runs as a probe
    kept: list = field(default_factory=list)  # per row: kept node indices (0 = the anchor), ascending
    own: np.ndarray | list | None = None  # [b, W] each node's predicted acceptance (before prefix-closing)
    p: list | None = None  # [b][W] drafter path probabilities (0: not a drafter node)
    drafter_node: list | None = None  # [b][W] bool: proposed by the drafter
    width: int = 1


class AdaptivePolicy:
    """One per engine and drafting setting: its cost model, acceptance calibration and per-row histories carry over
    from batch to batch. clock: seconds (a look's host time is weighed against the cost model's ms; a test whose
    cost model is in made-up units passes a clock that stands still)."""

    def __init__(self, cost: CostModel, acceptance: Acceptance | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.cost, self.acc, self.clock = cost, acceptance or Acceptance(), clock
        self.probes, self.looks = Probes(), Looks()
        self.histories: OrderedDict[int, RowHistory] = OrderedDict()
        self.depths: deque[tuple[int, int]] = deque(maxlen=DEPTH_WINDOW)  # recent cuts: (deepest drafter node, block)
        self.stats = PolicyStats()

    # ---- the three calls ----------------------------------------------------------------------------------
    def plan(self, view: StepView) -> Plan:
        """Look, or take a plain step straight away (`Looks`); looking, price the lookup branch (its best cut), then
        run the drafter where drafting is predicted to beat that, or as a probe (`_wants_drafter`); else verify the
        lookup tokens worth their cost, decided on the host before the tree is built (a plain step then builds the
        anchor alone: building then pruning the whole branch cost ~1 ms a step at batch 16)."""
        live = sum(view.live)
        rec = StepRecord(view.rows, view.ctx, live, view.live, view.keys)
        if self.looks.plain():
            self.probes.skip(self.cost.verify(view.rows, 1, view.ctx + 1))  # plain steps count toward a probe
            rec.looked, rec.kept = False, [[0]] * view.rows
            return Plan(look=False, draft=False, record=rec)
        t0 = self.clock()
        lk = view.lookup()
        rec.factor = [self._history(k).factor() for k in view.keys]
        rec.props, rec.lookup_keys = lk.tokens, [lk.key(r) for r in range(view.rows)]
        rec.values = self._lookup_values(lk.tokens, rec.lookup_keys, view.live, rec.factor)
        cost_of = self.cost.pass_curve(view.rows, view.ctx)
        cut = best_cut(rec.values, live, cost_of, margin=MARGIN)
        if view.drafter and not lk.skips_drafter and self._wants_drafter(view, rec, cut, cost_of):
            rec.no_draft_rate = cut.rate
            return Plan(look=True, draft=True, scores=True, block=rec.draft_in[2], record=rec)
        # each row's nodes worth the cut's threshold (the anchor always): its first ones, as values fall along a copy
        kept = [[0] + [j for j, v in enumerate(row[1:], 1) if v >= cut.threshold] for row in rec.values.tolist()]
        self._learn_look(cut, live, cost_of(1), 1000 * (self.clock() - t0))
        rec.kept, rec.own, rec.width = kept, rec.values, cut.width
        return Plan(look=True, draft=False, lookup_keep=[len(k) - 1 for k in kept], record=rec)

    def cut(self, plan: Plan, tree: DraftTree) -> TreeCut:
        """A drafted step: keep the nodes worth their cost (`best_cut`), counting the drafter's time as spent.
        Computed on the host's floats from one read of the tree's per-node fields. Why: as ~20 small torch ops (one
        per depth to close the values over prefixes), or as numpy's, it cost 0.6-1.2 ms a drafted step on a CPU:
        each op ~20-50 us right after a target step has streamed its weights through the caches (AMD EPYC, AVX2);
        on a GPU each op is a launch."""
        rec: StepRecord = plan.record
        dev, (b, W) = tree.tokens.device, tree.tokens.shape
        logp, source, parent, depth, alive = _on_host(tree.logp, tree.source, tree.parent, tree.depth, tree.alive)
        # Why the lookup's columns are the last ones: a drafted tree is [anchor, m drafter nodes, the whole lookup
        # branch of k = values' width - 1 tokens] (`tree.build`; nothing of the branch was cut before drafting).
        first = W - (rec.values.shape[1] - 1)
        lookup = rec.values.tolist()  # [b, 1 + k]: column 0 the anchor
        own, probs, drafter = [], [], []
        for r in range(b):
            vr, pr, dr = [ANCHOR], [0.0], [False]
            for j in range(1, W):
                d = source[r][j] == SOURCE_DRAFTER
                pj = math.exp(logp[r][j]) if d else 0.0
                if not (rec.live_rows[r] and alive[r][j]):
                    v = -math.inf
                elif j >= first:
                    v = lookup[r][1 + j - first]
                else:
                    v = min(self.acc.drafter_value(pj) * rec.factor[r], 1.0) if d else -math.inf
                vr.append(v)
                pr.append(pj)
                dr.append(d)
            own.append(vr)
            probs.append(pr)
            drafter.append(dr)
        vals = [list(vr) for vr in own]
        for row, up in zip(vals, parent):
            for j in range(1, W):  # a node is worth at most its parent (parents first): kept sets stay prefix-closed
                if row[up[j]] < row[j]:
                    row[j] = row[up[j]]
        sunk = self.cost.draft(b, *rec.draft_in)
        best = best_cut(vals, rec.live, self.cost.pass_curve(rec.rows, rec.ctx), sunk, MARGIN)
        # the anchor always: its verification is the step itself
        keep = [[j == 0 or v >= best.threshold for j, v in enumerate(row)] for row in vals]
        rec.kept = [[j for j, k in enumerate(row) if k] for row in keep]
        deepest = max((depth[r][j] for r, ks in enumerate(rec.kept) for j in ks if drafter[r][j]), default=0)
        self.depths.append((deepest, rec.draft_in[2] or self.cost.draft_block))
        self.probes.learn(best.gain / max(rec.live, 1), best.width, best.rate > rec.no_draft_rate, b)
        rec.own, rec.p, rec.drafter_node, rec.width = own, probs, drafter, best.width
        return TreeCut(torch.tensor(keep, dtype=torch.bool, device=dev), best.width,
                       max(depth[r][j] for r, ks in enumerate(rec.kept) for j in ks))

    def observe(self, plan: Plan, outcome: StepOutcome) -> None:
        """After the commit: the step's time (cost model) and which kept nodes were accepted (calibration)."""
        rec: StepRecord = plan.record
        self.cost.observe_pass(rec.rows, rec.width, rec.ctx, rec.rows if plan.draft else 0, outcome.ms,
                               *rec.draft_in)
        st = self.stats
        st.steps += 1
        st.drafter_steps += plan.draft
        st.probe_steps += rec.probe
        st.plain_steps += not rec.looked
        st.width += rec.width
        st.rows += rec.live
        rows = [r for r in range(rec.rows) if outcome.live[r]]
        if not rec.looked:  # a plain step: the anchors alone, nothing drafted or predicted to learn from
            st.committed += sum(outcome.accepted[r] + 1 for r in rows)
            return
        ps, ok = [], []
        for r in rows:
            a = outcome.accepted[r]
            path = set(outcome.path[r][:a + 1])
            st.committed += a + 1
            st.nodes += len(rec.kept[r]) - 1
            raw, hit = 0.0, 0
            for j, old in enumerate(rec.kept[r]):
                if old:
                    self.acc.observe_prediction(float(rec.own[r][old]), j in path)
                    raw += float(rec.own[r][old]) / rec.factor[r]  # the table's own prediction
                    hit += j in path
                if rec.drafter_node is not None and rec.drafter_node[r][old]:
                    ps.append(float(rec.p[r][old]))
                    ok.append(j in path)
            if raw:
                self._history(rec.keys[r]).observe(raw, hit)
            if rec.props[r]:
                self.acc.observe_lookup(rec.lookup_keys[r], rec.props[r], outcome.tokens[r][:a + 1])
        if ps:
            self.acc.observe_drafter(ps, ok)

    # ---- parts --------------------------------------------------------------------------------------------
    def _history(self, key: int) -> RowHistory:
        """A sequence's history (made on first use; the least recently used dropped past ROWS_KEPT)."""
        h = self.histories.get(key)
        if h is None:
            h = self.histories[key] = RowHistory()
            if len(self.histories) > ROWS_KEPT:
                self.histories.popitem(last=False)
        else:
            self.histories.move_to_end(key)
        return h

    def _lookup_values(self, props: list, keys: list, live: list[bool], factor: list) -> np.ndarray:
        """Each row's lookup nodes' expected acceptance [b, 1 + k]: rate(key)^j for its j-th copied token, times
        the row's factor, at most 1; -inf past its proposal (and for finished rows), ANCHOR in column 0."""
        k = max((len(p) for p in props), default=0)
        rows = []
        for p, on, key, f in zip(props, live, keys, factor):  # host floats: numpy's calls cost more on these sizes
            rate, n = (self.acc.lookup_rate(key) if key else 0.0), (len(p) if on else 0)  # key 0: no match
            rows.append([ANCHOR] + [min(rate ** j * f, 1.0) if j <= n else -math.inf for j in range(1, k + 1)])
        return np.array(rows, dtype=np.float64).reshape(len(live), 1 + k)

    def _wants_drafter(self, view: StepView, rec: StepRecord, cut: CutChoice, cost_of) -> bool:
        """Run the drafter where drafting is predicted to beat this step's best without it (judged as `best_cut`
        judges a cut), or when a probe is due (`Probes.due`): the probe's extra time is the drafter, its pending
        features and the wider verify."""
        pr = self.probes
        rows, w, base = view.rows, int(pr.width), cost_of(1)
        rec.draft_in = (view.ctx, view.pending, self._block())
        extra = (self.cost.draft(rows, *rec.draft_in) + cost_of(w) - base
                 + (pr.width - w) * (cost_of(w + 1) - cost_of(w)))
        if rec.live * (1 + pr.gain) / (base + MARGIN * extra) > cut.judged:
            return True
        if pr.due(rows, base, extra):
            rec.probe = True
            return True
        pr.skip(base)
        rec.draft_in = (0, 0, None)
        return False

    def _block(self) -> int | None:
        """The next drafting pass's block: one slot past the deepest drafter node the recent cuts kept, or twice
        the block where a cut kept a node in its last slot (so the block grows back when deeper drafts start to
        pay); the configured block (None) until a cut is seen. Why: a drafting pass costs about linearly in its
        block (`CostModel.draft`), on a CPU a verify of more than a few nodes rarely pays, and the first slots of a
        short block accept as those of a full one (bench/results/draft-block/)."""
        B = self.cost.draft_block
        if B <= DRAFT_MIN_BLOCK or not self.depths:
            return None
        need = max(d + 2 if d < b - 1 else 2 * b for d, b in self.depths)
        return None if need >= B else max(need, DRAFT_MIN_BLOCK)

    def _learn_look(self, cut: CutChoice, live: int, base: float, spent: float) -> None:
        """After a look without the drafter: its value (ms its cut saves against AR) and its host cost."""
        value = max((live + cut.gain) * base / max(live, 1) - (live + cut.gain) / max(cut.rate, 1e-9), 0.0)
        self.looks.learn(value, spent)


def _on_host(*ts: torch.Tensor) -> list[list]:
    """[b, W] tensors as nested host lists: one read each on a CPU, one stacked read (one sync) from a device."""
    if ts[0].device.type == "cpu":
        return [t.tolist() for t in ts]
    host = torch.stack([t.double() for t in ts]).cpu()
    return [h.tolist() if t.is_floating_point() else h.long().tolist() for h, t in zip(host, ts)]
