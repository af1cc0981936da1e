"""The step policy: how much to draft and verify this step, so that speculation never costs a user time.

Every verified token costs time (on 2 CPU cores a pass of 16 tokens can cost 6x a pass of one), and the drafter's
forward costs time too. A draft is worth verifying only where its expected accepted tokens buy back its cost, and
that depends on the machine, the batch size, the context length and how well the drafter is doing right now.

- `CostModel`: ms of a target pass as a function of the tokens it verifies (all rows, padded width) and the context
  length, plus the drafter's ms per batch size. Calibrated once per machine and model (`calibrate`, a few seconds,
  cached in `~/.cache/dflashkit/cost.json`), then corrected online from every measured step.
- `Acceptance`: the expected acceptance of each node, calibrated from what verification observed: a drafter node
  by its path probability (binned, observed rate per bin; a prior at the drafter's own claim), a lookup token by
  its match length (the rate at which the next copied token is right).
- `AdaptivePolicy`: before drafting, runs the drafter only where it has been paying at this batch size (with
  back-off probes so it can find out it pays again); after drafting, keeps the nodes worth more than a threshold
  chosen to maximise committed tokens per millisecond of the whole batch (`best_cut`). Keeping only the anchor is
  a plain AR step, always among the choices: by its own model the policy never picks a step slower than AR.
  Exact by construction: it only chooses which nodes are verified, from the drafter, the lookup and the past (never
  from this step's target samples); verification and commit are unchanged (`tree.py`).
- `FixedPolicy`: today's shape, every step (`--policy fixed`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from .measurements import lookup, machine_key, store

log = logging.getLogger(__name__)

VERIFY_GRID = (1, 2, 4, 8, 16, 32, 64)  # tokens per target pass timed by `calibrate` (linear beyond the last)
DRAFT_GRID = (1, 4, 16)  # batch rows of the drafter's forward timed by `calibrate`
# The time a cut costs beyond the AR step counts this much more when cuts are compared: the cost and acceptance
# models are estimates, and a guess may only risk time where the predicted win is clear.
MARGIN = 1.05
PROB_EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)  # drafter path-probability bins
ANCHOR = 1e9  # the anchor's value: always kept (its verification is the AR step itself)


def _interp(grid: tuple, ys: list[float], x: float) -> float:
    """Piecewise-linear through (grid, ys); the last segment's slope beyond the ends."""
    i = min(max(int(np.searchsorted(grid, x)) - 1, 0), len(grid) - 2)
    x0, x1 = grid[i], grid[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


@dataclass
class CostModel:
    """Milliseconds of one decoding step here. verify_ms: a target pass (forward + LM head) of VERIFY_GRID tokens
    at a short context; ctx_ms: extra ms per verified token per 1,000 context positions; draft_ms: the drafter's
    proposal for DRAFT_GRID rows. learn: correct online from measured steps (`observe`)."""

    verify_ms: list[float]
    ctx_ms: float
    draft_ms: list[float]
    learn: bool = True
    rate: float = 0.15  # how far one measured step moves the model toward itself

    scale: float = 1.0  # learned: measured / calibrated, for the target pass (all widths alike) ...
    draft_scale: float = 1.0  # ... and for the drafter

    def verify(self, tokens: int, ctx: int) -> float:
        base = max(_interp(VERIFY_GRID, self.verify_ms, tokens), 1e-3) + self.ctx_ms * tokens * ctx / 1000
        return self.scale * base

    def draft(self, rows: int) -> float:
        return self.draft_scale * max(_interp(DRAFT_GRID, self.draft_ms, rows), 1e-3)

    def observe(self, tokens: int, ctx: int, draft_rows: int, ms: float) -> None:
        """A measured step moves the scales toward measured / predicted. Why one scale for every width, not a local
        correction at the width measured: most steps are AR steps, and what makes them slower than calibrated (a
        busy host, per-row work outside the forward) slows wider passes alike; raising only the AR point would make
        the never-measured wide passes look cheap by comparison, and the policy would verify at a loss (measured:
        0.64x AR at batch 16 on MT-Bench). The calibrated shape is kept."""
        if not self.learn:
            return
        pred = self.verify(tokens, ctx) + (self.draft(draft_rows) if draft_rows else 0.0)
        err = min(max(ms - pred, -0.5 * pred), 0.5 * pred)  # a descheduled step must not wreck the model
        step = 1 + self.rate * err / pred
        self.scale *= step
        if draft_rows:
            self.draft_scale *= step


def _best_of(fn, reps: int = 2) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


@torch.inference_mode()
def calibrate(target, proposer) -> CostModel:
    """Time target passes over VERIFY_GRID tokens (one row, a 64-token context; and 8 tokens at a 1,088-token
    context for the context term) and the drafter's proposal (if any) at DRAFT_GRID rows."""
    dev, vocab = target.device, min(target.vocab_size, 1000)
    gen = torch.Generator().manual_seed(0)

    def verify_fn(n: int, ctx: int):
        cache = target.new_cache(1, ctx + n)
        ids = torch.randint(4, vocab, (1, ctx + n), generator=gen).to(dev)
        pos = torch.arange(ctx + n, device=dev)[None]
        target.forward(ids[:, :ctx], pos[:, :ctx], cache, kv_len=ctx, taps=False)
        vis = torch.ones((1, 1, n, ctx + n), dtype=torch.bool, device=dev)
        taps = proposer is not None
        return lambda: target.logits(target.forward(ids[:, ctx:], pos[:, ctx:], cache, kv_len=ctx + n, taps=taps,
                                                    slots=pos[:, ctx:], visible=vis)[0])

    verify = [_best_of(verify_fn(n, 64)) for n in VERIFY_GRID]
    long_ctx = _best_of(verify_fn(8, 1088))
    ctx_ms = max((long_ctx - _interp(VERIFY_GRID, verify, 8)) / 8, 0.0)  # per token per 1,000 positions
    draft = [_best_of(_draft_fn(target, proposer, b)) for b in DRAFT_GRID] if proposer is not None else [0.0] * 3
    return CostModel([round(x, 3) for x in verify], round(ctx_ms, 4), [round(x, 3) for x in draft])


def _draft_fn(target, proposer, rows: int, ctx: int = 64):
    from .proposers import DraftView

    c = proposer.drafter.config
    feats = torch.randn(rows, ctx, len(c.target_layer_ids) * target.hidden_size, generator=torch.Generator()
                        .manual_seed(1)).to(device=target.device, dtype=target.dtype)
    pos = torch.arange(ctx, device=target.device).expand(rows, ctx)
    state = proposer.prefill(feats, pos, pos[:, -1], ctx + 2 * proposer.block_size, 1)
    view = DraftView(torch.zeros(rows, dtype=torch.long, device=target.device),
                     torch.full((rows,), ctx, device=target.device), ctx, [])
    return lambda: proposer.propose(state, view, scores=True)


def cost_key(target, proposer) -> str:
    """What the costs depend on: the machine, torch, threads, the target's and drafter's shapes, dtype, backend."""
    d = proposer.drafter.config if proposer is not None else None
    draft = (d.num_hidden_layers, d.hidden_size, proposer.block_size, proposer.tree,
             None if proposer.d2t is None else len(proposer.d2t)) if d is not None else None
    # The kernels set the costs; on our kernels the drafter runs them too (engine.py), "v2" since it does.
    engine = getattr(target, "engine_name", type(target).__name__)
    if getattr(target, "kernel", "torch") != "torch":
        engine += "/drafter-rowlinear-v2"
    return machine_key("step-cost", engine, target.architecture, target.hidden_size, target.num_layers,
                       target.vocab_size, target.dtype, target.device, draft)


def load_or_calibrate(target, proposer, cache_file: str | os.PathLike | None) -> CostModel:
    """`calibrate`, cached in `cache_file` (JSON) under `cost_key`."""
    key = cost_key(target, proposer)
    stored = lookup(cache_file, key)
    if stored is not None:
        return CostModel(**stored)
    log.info("calibrating the step cost model on this machine (once; cached in %s)", cache_file)
    cost = calibrate(target, proposer)
    log.info("step cost: verify %s ms at %s tokens, drafter %s ms at %s rows", cost.verify_ms, VERIFY_GRID,
             cost.draft_ms, DRAFT_GRID)
    store(cache_file, key, {k: v for k, v in asdict(cost).items() if k not in ("learn", "rate")})
    return cost


# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Acceptance:
    """Calibrated acceptance. Drafter nodes: per path-probability bin, nodes verified and accepted, with `prior`
    pseudo-nodes at the bin's mean claimed probability. Lookup: per match length n, the chance that a copied token
    is right given the ones before it were (prior 0.3 + 0.15 n)."""

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
        return (right + 4 * min(0.3 + 0.15 * n, 0.9)) / (tried + 4)

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
                "nodes_per_row": round(self.nodes / max(self.rows, 1), 3), "mean_width": round(self.width / s, 3)}


class FixedPolicy:
    """Every step drafts and verifies the configured shape (`--policy fixed`)."""

    adaptive = False

    def wants_drafter(self, batch, props, matched) -> bool:
        return True

    def choose(self, batch, tree, draft, props, matched, drafted: bool):
        return tree

    def observe(self, batch, host: list, span: int, ms: float) -> None:
        pass


PROBE_MIN, PROBE_MAX = 4, 64  # steps between probes of a drafter that stopped paying (doubling back-off)
PROBE_BUDGET = 0.03  # and at least enough steps that probing costs at most this share of plain decoding time


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
        self.skipped = 0  # steps since the drafter last ran
        self.backoff = PROBE_MIN
        self.stats = PolicyStats()
        self._plan: dict | None = None
        self._no_draft_rate = 0.0

    def _cost_of(self, batch):
        rows, ctx = len(batch.seqs), max(batch.starts)
        return lambda w: self.cost.verify(rows * w, ctx + w)  # a pass w nodes wide over every row

    def _lookup_values(self, props: list, matched: list, seqs: list) -> np.ndarray:
        k = max((len(p) for p in props), default=0)
        v = np.full((len(seqs), 1 + k), -np.inf)
        v[:, 0] = ANCHOR
        for r, (p, n, s) in enumerate(zip(props, matched, seqs)):
            if p and not s.finished:
                v[r, 1:1 + len(p)] = self.acc.lookup_rate(n) ** np.arange(1, len(p) + 1)
        return v

    def wants_drafter(self, batch, props: list, matched: list) -> bool:
        """Run the drafter where drafting is predicted to beat this step's best without it, or when a probe is due
        (after `backoff` skipped steps, and never more often than PROBE_BUDGET of plain decoding time allows)."""
        live = sum(not s.finished for s in batch.seqs)
        cost_of = self._cost_of(batch)
        cut = best_cut(self._lookup_values(props, matched, batch.seqs), live, cost_of, margin=MARGIN)
        self._no_draft_rate = cut[3]
        rows, w, base = len(batch.seqs), int(self.width), cost_of(1)
        spent = self.cost.draft(rows) + cost_of(w) + (self.width - w) * (cost_of(w + 1) - cost_of(w))
        judged = live * (1 + self.gain) / (base + MARGIN * (spent - base))  # as `best_cut` judges a cut
        budget = self.cost.draft(rows) / (PROBE_BUDGET * base)
        if judged > cut[4] or self.skipped + 1 >= max(self.backoff, budget):
            return True
        self.skipped += 1
        return False

    def choose(self, batch, tree, draft, props: list, matched: list, drafted: bool):
        """Keep the nodes worth their cost (`best_cut`); returns the pruned tree."""
        from .tree import prune

        dev, (b, W) = tree.tokens.device, tree.tokens.shape
        m = draft.tokens.shape[1] if draft is not None else 0
        vals = torch.full((b, W), -math.inf, device=dev)
        p = torch.zeros((b, W), device=dev)
        if m:
            p[:, 1:1 + m] = draft.logp.float().exp()
            vals[:, 1:1 + m] = self.acc.drafter_values(p[:, 1:1 + m])
        look = self._lookup_values(props, matched, batch.seqs)
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
        sunk = self.cost.draft(b) if drafted else 0.0
        lam, width, gain, rate, _ = best_cut(host[0], live, self._cost_of(batch), sunk, MARGIN)
        keep = host[0] >= lam
        keep[:, 0] = True  # the anchor: its verification is the step itself
        depth = int(host[2][keep].max())
        if drafted:
            self._learn_drafting(gain / max(live, 1), width, rate > self._no_draft_rate)
        kept = [np.flatnonzero(k) for k in keep]
        self._plan = dict(kept=kept, p=host[1], own=host[3], m=m, width=width, drafted=drafted, rows=b,
                          ctx=max(batch.starts), props=props, matched=matched, live=live)
        return prune(tree, torch.from_numpy(keep).to(dev), width, depth)

    def _learn_drafting(self, gain: float, width: int, paid: bool) -> None:
        """A drafted step's best cut (expected accepted per live row, width) and whether it beat not drafting."""
        keep = 0.7 if self.drafted_once else 0.0  # the first measurement replaces the prior
        self.gain = keep * self.gain + (1 - keep) * gain
        self.width = keep * self.width + (1 - keep) * width
        self.drafted_once = True
        self.skipped = 0
        self.backoff = PROBE_MIN if paid else min(2 * self.backoff, PROBE_MAX)

    def observe(self, batch, host: list, span: int, ms: float) -> None:
        """After the commit: the step's time (cost model) and which kept nodes were accepted (calibration).
        host: `DecodeBatch._commit`'s rows (committed tokens [span], a, path [span]); rows of finished sequences
        are skipped."""
        plan, self._plan = self._plan, None
        if plan is None:
            return
        self.cost.observe(plan["rows"] * plan["width"], plan["ctx"] + plan["width"],
                          plan["rows"] if plan["drafted"] else 0, ms)
        st = self.stats
        st.steps += 1
        st.drafter_steps += plan["drafted"]
        st.width += plan["width"]
        st.rows += plan["live"]
        ps, ok = [], []
        for r, row in enumerate(host):
            if row is None:
                continue
            a = int(row[span])
            path = set(row[span + 1: span + 2 + a])
            st.committed += a + 1
            st.nodes += len(plan["kept"][r]) - 1
            for j, old in enumerate(plan["kept"][r]):
                if old:
                    self.acc.observe_prediction(float(plan["own"][r, old]), j in path)
                if 1 <= old <= plan["m"]:
                    ps.append(float(plan["p"][r, old]))
                    ok.append(j in path)
            if plan["props"][r]:
                self.acc.observe_lookup(plan["matched"][r], plan["props"][r], row[:a + 1])
        if ps:
            self.acc.observe_drafter(ps, ok)
