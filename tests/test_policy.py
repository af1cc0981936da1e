"""The adaptive step policy: its cost model, its calibration, the cut it chooses, and exactness with it on."""

import json
import math

import numpy as np
import pytest
import torch

from conftest import make_drafter, make_target
from dflashkit import DecodeConfig, DFlashEngine, DFlashError
from dflashkit.lookup import LookupParams
from dflashkit.lookup import LookupProposal
from dflashkit.policy import ANCHOR, Acceptance, AdaptivePolicy, RowHistory, StepView, best_cut
from dflashkit.policy.probes import PLAIN_MAX, PROBE_BUDGET
from dflashkit.step_cost import DRAFT_GRID, VERIFY_GRID, CostModel, load_or_calibrate
from dflashkit.tree import accept, build, prune, topk_tree
from test_engine import PROMPTS, check_caches_while_decoding, reference_runs, with_oracle


def cost(verify_floor: float, per_token: float, draft: float) -> CostModel:
    """A fixed (not learning) cost model: a pass costs floor + per_token * tokens; the drafter `draft` ms."""
    return CostModel([verify_floor + per_token * n for n in VERIFY_GRID], 0.0, [draft] * len(DRAFT_GRID),
                     learn=False)


FLAT = cost(10.0, 0.01, 0.001)  # drafting and verifying are nearly free: keep every node worth anything
STEEP = cost(10.0, 10.0, 30.0)  # every verified token costs a full pass: plain AR, with probes of the drafter
MID = cost(10.0, 0.5, 2.0)  # in between: the cut falls inside the tree

ADAPTIVE = DecodeConfig(block_size=8, tree=6, lookup=LookupParams(max_tokens=4), policy="adaptive")


# ---- the cut ------------------------------------------------------------------------------------------------
def test_best_cut_is_plain_ar_when_no_node_pays():
    v = np.array([[ANCHOR, 0.3, 0.2], [ANCHOR, 0.1, -np.inf]])
    c = best_cut(v, 2, lambda w: 10.0 * w)  # each extra column costs a full pass
    assert (c.threshold, c.width, c.gain) == (math.inf, 1, 0.0) and c.rate == pytest.approx(2 / 10)


def test_best_cut_keeps_what_pays_and_counts_the_widest_row():
    v = np.array([[ANCHOR, 0.9, 0.8, 0.05], [ANCHOR, 0.7, -np.inf, -np.inf]])
    c = best_cut(v, 2, lambda w: 10.0 + 1.0 * w)  # a column costs 1/11 of a pass
    assert c.threshold == pytest.approx(0.7) and c.width == 3 and c.gain == pytest.approx(0.9 + 0.8 + 0.7)
    c = best_cut(v, 2, lambda w: 10.0)  # free columns: every node that can be verified
    assert c.threshold == pytest.approx(0.05) and c.width == 4


def test_best_cut_margin_weighs_the_extra_time_not_the_total():
    v = np.array([[ANCHOR, 0.5]])
    assert best_cut(v, 1, lambda w: 10.0 + 4.0 * (w - 1)).width == 2  # 1.5 tokens / 14 ms beats 1 / 10 ms
    assert best_cut(v, 1, lambda w: 10.0 + 4.0 * (w - 1), margin=1.5).width == 1  # not by enough for 1.5x the extra
    assert best_cut(v, 1, lambda w: 10.0 + 0.001 * (w - 1), margin=1.5).width == 2  # nearly free: still taken


def test_best_cut_is_the_best_threshold_of_all():
    """The definition: every distinct value tried as the threshold (keep the nodes worth >= it), judged with the
    time beyond the AR step times the margin; the AR step unless one is strictly better; the first best."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        b, W = int(rng.integers(1, 5)), int(rng.integers(1, 9))
        drawn = rng.choice([0.0, 0.1, 0.25, 0.5, 0.9], (b, W)) if rng.random() < 0.5 else rng.random((b, W))
        v = np.where(rng.random((b, W)) < 0.2, -np.inf, drawn)  # ties, zeros and nodes that cannot be verified
        v[:, 0] = ANCHOR
        live, sunk, margin = int(rng.integers(1, b + 1)), float(rng.choice([0.0, 2.0])), float(rng.choice([1.0, 1.15]))
        slope = float(rng.choice([0.05, 0.5, 3.0]))

        def cost(w, slope=slope):
            return 10.0 + slope * (w - 1) ** 1.5
        base = cost(1)
        want = (math.inf, 1, 0.0, live / (base + margin * sunk))
        for th in sorted({x for x in v[:, 1:].ravel() if 0 < x < math.inf}, reverse=True):
            keep = v[:, 1:] >= th
            width, gain = 1 + int(keep.sum(1).max()), float(v[:, 1:][keep].sum())
            judged = (live + gain) / (base + margin * (sunk + cost(width) - base))
            if judged > want[3] * (1 + 1e-12):
                want = (th, width, gain, judged)
        got = best_cut(v, live, cost, sunk, margin)
        assert (got.threshold, got.width) == want[:2] and got.gain == pytest.approx(want[2])
        assert got.judged == pytest.approx(want[3])
        assert got.rate == pytest.approx((live + got.gain) / (sunk + cost(got.width)))


def test_cost_model_interpolates_extrapolates_and_learns():
    c = CostModel([10.0 * n for n in VERIFY_GRID], 2.0, [5.0, 8.0, 20.0])
    assert c.verify(1, 3, 0) == pytest.approx(30.0) and c.verify(3, 1, 0) == pytest.approx(30.0)
    assert c.verify(1, 128, 0) == pytest.approx(1280.0)  # the last segment's slope beyond the grid
    assert c.verify(1, 4, 500) == pytest.approx(40.0 + 2.0 * 4 * 0.5)  # a number: ms per verified token
    assert c.draft(2) == pytest.approx(6.0)
    for _ in range(60):  # the machine is really twice as slow at 8 tokens: the model follows
        c.observe(1, 8, 0, 0, 160.0)
    assert c.verify(1, 8, 0) == pytest.approx(160.0, rel=0.02)
    # every width alike: a slower AR step must not make the unmeasured wide passes look cheap by comparison
    assert c.verify(1, 1, 0) == pytest.approx(20.0, rel=0.02)
    assert c.verify(1, 64, 0) / c.verify(1, 1, 0) == pytest.approx(64)
    for _ in range(60):  # a drafting step that takes 100 ms more than predicted: verify and draft share the error
        c.observe(1, 8, 0, 4, c.verify(1, 8, 0) + c.draft(4) + 100.0)
    assert c.draft(4) > 8.0 * 1.5
    d = CostModel([10.0] * len(VERIFY_GRID), 0.0, [5.0, 8.0, 20.0], draft_ctx_ms=3.0, ingest_ms=4.0)
    # one row at a 1,064-token context: +3 ms; 16 rows with 64 features pending each: 16 x 63 extra features
    assert d.draft(1, 64 + 1000) == pytest.approx(8.0) and d.draft(16, 64, 16 * 64) == pytest.approx(20.0 + 4.032)
    frozen = CostModel([1.0] * len(VERIFY_GRID), 0.0, [1.0] * 3, learn=False)
    frozen.observe(1, 8, 0, 1, 1e6)
    assert frozen.verify(1, 8, 0) == 1.0


def test_the_context_term_is_per_row_and_width():
    """Past ~2k keys a row's queries share their reads of the cache, so a row's context cost grows less than its
    width: the term is timed per width (CTX_WIDTHS) and charged per row, not per verified token."""
    c = CostModel([10.0] * len(VERIFY_GRID), [3.0, 5.0, 11.0], [5.0, 8.0, 20.0])
    assert c.verify(1, 1, 8000) == pytest.approx(10.0 + 24.0)
    assert c.verify(1, 2, 8000) == pytest.approx(10.0 + (3.0 + 2.0 / 3) * 8)  # between the timed widths
    assert c.verify(4, 1, 1000) == pytest.approx(10.0 + 4 * 3.0)  # four rows: each reads its own cache
    assert c.verify(1, 32, 1000) == pytest.approx(10.0 + 11.0 + 6.0 / 12 * 16)  # the last slope beyond
    assert c.pass_ms(1, 2, 8000) - c.pass_ms(1, 1, 8000) == pytest.approx((2.0 / 3) * 8.002 + 3.0 * 0.001)
    # noise only adds time: a wider row is never priced below a narrower one, nor a term below 0
    assert CostModel([10.0] * 7, [3.0, 2.5, -1.0], [5.0] * 3).ctx_ms == [3.0, 3.0, 3.0]
    assert CostModel([10.0] * 7, [-0.5, 1.0, 4.0], [5.0] * 3).ctx_ms == [0.0, 1.0, 4.0]


def test_the_drafter_is_priced_by_its_block():
    c = CostModel([10.0] * len(VERIFY_GRID), 0.0, [8.0, 20.0, 80.0], draft_short_ms=[2.0, 5.0, 20.0], draft_block=16)
    assert c.draft(1) == c.draft(1, block=16) == pytest.approx(8.0)  # the configured block
    assert c.draft(1, block=2) == pytest.approx(2.0) and c.draft(4, block=9) == pytest.approx(5.0 + 15.0 / 2)
    # a short block timed slower than the full one (noise) never prices a full block below it
    assert CostModel([10.0] * 7, 0.0, [8.0] * 3, draft_short_ms=[9.0] * 3, draft_block=16).draft(1, block=4) == 8.0
    assert CostModel([10.0] * 7, 0.0, [8.0] * 3).draft(1, block=2) == 8.0  # a model without the short timing


def test_a_noisy_calibration_never_makes_a_wider_pass_look_free():
    """Timing noise only adds time: the model keeps the points' lower convex hull, so one slow point cannot make
    the next width free (24.0 ms at 4 tokens, 23.9 at 8 was measured) and the width factor has a difference to
    scale."""
    c = CostModel([15.9, 17.5, 24.0, 23.9, 34.8, 72.8, 128.6], 0.0, [10.0, 30.0, 40.0])
    assert c.verify_ms[0] == 15.9 and c.verify_ms[3] == 23.9 and c.verify_ms[-1] == 128.6  # points on the hull
    steps = np.diff(c.verify_ms) / np.diff(VERIFY_GRID)
    assert np.all(steps > 0) and np.all(np.diff(steps) >= -1e-3)  # increasing and convex (to the rounding)
    assert c.pass_ms(4, 2, 0) - c.pass_ms(4, 1, 0) > 4.0  # not ~0 as the raw points said
    assert c.draft_ms == [10.0, 16.0, 40.0]  # the drafter's points too (a concave middle point is lowered)
    assert CostModel(list(c.verify_ms), 0.0, [5.0] * 3).verify_ms == c.verify_ms  # idempotent


def test_the_cost_of_a_wide_pass_is_learned_per_batch_size():
    """Wide steps that cost twice their predicted width (per-row work outside the forward) raise the price of width
    at that batch size only; plain steps leave it alone."""
    c = CostModel([10.0 * n for n in VERIFY_GRID], 0.0, [5.0, 8.0, 20.0])
    one, two = c.pass_ms(16, 1, 100), c.pass_ms(16, 2, 100)
    assert one == pytest.approx(160.0) and two == pytest.approx(320.0)
    for _ in range(60):
        c.observe_pass(16, 2, 100, 0, one + 2 * (two - one))
        c.observe_pass(16, 1, 100, 0, one)  # plain steps as predicted
    assert c.pass_ms(16, 2, 100) == pytest.approx(one + 2 * (two - one), rel=0.05)
    assert c.pass_ms(16, 1, 100) == pytest.approx(one, rel=0.02)
    assert c.pass_ms(4, 2, 100) == pytest.approx(80.0)  # another batch size: unchanged
    for _ in range(200):  # a wildly slow wide step now and then cannot run the factor away
        c.observe_pass(4, 3, 100, 0, 1e6)
    assert c.pass_ms(4, 3, 100) <= 40.0 + 4.0 * 80.0


def test_acceptance_calibrates_toward_what_verification_observed():
    acc = Acceptance()
    assert acc.drafter_value(0.92) == pytest.approx(0.925, abs=0.03)  # the prior: the drafter's own claim
    acc.observe_drafter([0.92] * 200, [False] * 180 + [True] * 20)  # overconfident drafter
    assert acc.drafter_value(0.92) == pytest.approx(0.13, abs=0.03)
    assert acc.lookup_rate(4) > acc.lookup_rate(1)  # prior: a longer match copies better
    for _ in range(50):
        acc.observe_lookup(4, [7, 8, 9], [7, 5])  # first token right, second wrong, third undecided
    assert acc.lookup_rate(4) == pytest.approx(0.5, abs=0.03)
    r = acc.report()
    assert r["drafted"][-2] == 200 and r["observed"][-2] == pytest.approx(0.1)


def test_prune_keeps_a_prefix_closed_subtree_with_its_paths():
    gen = torch.Generator().manual_seed(0)
    b, D, K = 3, 4, 3
    toks = torch.randint(20, 90, (b, D, K), generator=gen)
    logp = torch.rand(b, D, K, generator=gen).log().sort(dim=-1, descending=True).values
    tree = build(torch.tensor([1, 2, 3]), topk_tree(toks, logp, 8), [[5, 6], [7], []])
    keep = torch.zeros_like(tree.alive)
    keep[:, 0] = True
    keep[0, 1:4] = True  # the first drafter nodes of row 0 (parents come first: prefix-closed)
    keep[1, tree.width - 2] = True  # row 1's lookup token (its parent: the anchor or a drafter node)
    par = int(tree.parent[1, tree.width - 2])
    keep[1, par] = True
    keep = keep & (tree.alive | (torch.arange(tree.width) == 0))
    width = int(keep.sum(1).max())
    small = prune(tree, keep, width, tree.max_depth)
    assert small.width == width
    for r in range(b):
        old = keep[r].nonzero()[:, 0].tolist()
        assert small.tokens[r, :len(old)].tolist() == tree.tokens[r, old].tolist()
        assert small.depth[r, :len(old)].tolist() == tree.depth[r, old].tolist()
        for new, o in enumerate(old):  # parents map to the same tokens
            assert small.tokens[r, small.parent[r, new]] == tree.tokens[r, tree.parent[r, o]]
        assert not small.alive[r, len(old):].any()
    # accepting along a kept path gives the same tokens in both trees
    choices = torch.randint(20, 90, (b, tree.width), generator=gen)
    a, _ = accept(small, choices[:, :width])
    assert (a <= small.max_depth).all()


# ---- with the engine ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", [FLAT, MID, STEEP], ids=["flat", "mid", "steep"])
def test_adaptive_greedy_equals_ar(arch, backend, model):
    t = make_target(arch, backend=backend)
    eng = DFlashEngine(t, make_drafter(t, block_size=8), eos_token_ids=[], config=ADAPTIVE, cost=model)
    ar, ref = reference_runs(eng, PROMPTS, 40)
    with_oracle(eng, ref, keep=0.8)
    out = eng.generate(PROMPTS, max_new_tokens=40)
    assert [g.tokens for g in out] == [g.tokens for g in ar]
    single = eng.generate(PROMPTS[1:2], max_new_tokens=40)
    assert single[0].tokens == ar[1].tokens
    st = eng.policy_stats()["b8-tree6-lookup4"]
    tau = sum(g.stats.tau for g in out) / len(out)
    if model is FLAT:  # nothing to lose: about as many tokens per pass as verifying the whole tree every step
        fixed = eng.generate(PROMPTS, max_new_tokens=40, config=ADAPTIVE.replace(policy="fixed"))
        assert [g.tokens for g in fixed] == [g.tokens for g in ar]
        assert tau > 0.85 * sum(g.stats.tau for g in fixed) / len(fixed) and st["drafter_fraction"] > 0.5
    if model is STEEP:  # the drafter stopped running (probes only) and steps are mostly plain AR
        assert st["drafter_fraction"] < 0.3 and st["nodes_per_row"] < 0.5
    if model is MID:
        assert 1 < st["mean_width"] < 1 + 6 + 4


def test_the_drafting_block_follows_the_depth_the_cuts_keep(arch):
    """Where verifying more than a node or two does not pay, the drafter drafts short blocks (one slot past the
    deepest drafter node recent cuts kept); where cuts fill the block it grows back. Output stays AR's."""
    t = make_target(arch)
    eng = DFlashEngine(t, make_drafter(t, block_size=8), eos_token_ids=[], config=DecodeConfig(
        block_size=8, policy="adaptive"), cost=CostModel([10.0 + 10.0 * (n - 1) for n in VERIFY_GRID], 0.0,
                                                         [0.01] * 3, draft_short_ms=[0.01] * 3, draft_block=8,
                                                         learn=False))  # a step per verified token: cut short
    ar, ref = reference_runs(eng, PROMPTS, 40)
    with_oracle(eng, ref, keep=1.0)
    blocks = []

    class Spy(eng.drafter_factory):
        def propose(self, state, view, scores=False, block=None):
            nodes = super().propose(state, view, scores, block)
            blocks.append(block or self.block_size)
            assert nodes.max_depth <= blocks[-1] - 1  # no node deeper than its block
            return nodes
    eng.set_proposers(drafter=Spy)
    assert [g.tokens for g in eng.generate(PROMPTS, max_new_tokens=40)] == [g.tokens for g in ar]
    assert blocks[0] == 8 and max(blocks[1:]) < 8 and min(blocks) >= 2
    # verifying becomes nearly free and every draft is right: the cuts fill the block, which grows back to 8
    eng.policy(eng.config).cost = CostModel(list(FLAT.verify_ms), 0.0, [0.001] * 3, draft_short_ms=[0.001] * 3,
                                            draft_block=8, learn=False)
    del blocks[:]
    assert [g.tokens for g in eng.generate(PROMPTS, max_new_tokens=40)] == [g.tokens for g in ar]
    assert blocks[:4] != [8] * 4 and blocks[-1] == 8 and blocks.count(8) > len(blocks) // 2


def test_adaptive_caches_hold_the_committed_context_when_the_drafter_skips_steps(arch):
    """The drafter's pending features pile up over skipped steps and are ingested at its next forward: its cache
    must still equal a fresh computation at every draft call."""
    t = make_target(arch)
    dr = make_drafter(t, block_size=4)
    eng = DFlashEngine(t, dr, eos_token_ids=[], config=DecodeConfig(block_size=4, policy="adaptive"),
                       cost=cost(10.0, 1.0, 12.0))
    ar, ref = reference_runs(eng, PROMPTS, 30)
    with_oracle(eng, ref, keep=0.7)
    checked, _ = check_caches_while_decoding(eng, t, dr, PROMPTS, 30)
    st = eng.policy_stats()["b4-tree0-lookup0"]
    assert checked["draft"] >= 3 and st["drafter_steps"] < st["steps"]


def test_the_cost_model_is_calibrated_once_and_cached(tmp_path, monkeypatch):
    t = make_target("llama", dtype=torch.float32)
    dr = make_drafter(t, block_size=4)
    dr.to(torch.float32)
    file = tmp_path / "cost.json"
    eng = DFlashEngine(t, dr, eos_token_ids=[], config=DecodeConfig(block_size=4, policy="adaptive"),
                       cost_file=str(file))
    c1 = eng.policy(eng.config).cost
    assert file.is_file() and all(x > 0 for x in c1.verify_ms + c1.draft_ms)
    # the drafter's context and pending-feature terms were timed and cached (a difference of two timings of a tiny
    # model: >= 0, not necessarily > 0 on a busy machine)
    stored = next(iter(json.loads(file.read_text()).values()))
    assert {"draft_ctx_ms", "ingest_ms"} <= stored.keys() and min(c1.ingest_ms, c1.draft_ctx_ms) >= 0
    assert stored["draft_block"] == 4 and len(stored["draft_short_ms"]) == len(DRAFT_GRID)  # and a block of 2
    import dflashkit.step_cost as step_cost

    monkeypatch.setattr(step_cost, "calibrate", lambda *a: pytest.fail("measured again instead of reading the cache"))
    c2 = load_or_calibrate(t, eng.drafter_proposer(eng.config), file)
    assert c2.verify_ms == c1.verify_ms


def test_policy_is_validated():
    with pytest.raises(DFlashError, match="policy must be one of"):
        DecodeConfig(policy="greedy")
    assert DecodeConfig.recommended().policy == "adaptive" and DecodeConfig().policy == "fixed"


def view(rows: int, ctx: int, props: list | None = None, matched: list | None = None, drafter: bool = True,
         pending: int | None = None):
    """A StepView of `rows` live rows at context `ctx` whose lookup proposes `props` (matched suffix lengths
    `matched`; default: nothing) and whose drafter has `pending` features to ingest (default: one per row)."""
    props = props or [[]] * rows
    lk = LookupProposal(matched or [0] * rows, props, False)
    return StepView([True] * rows, list(range(rows)), ctx, rows if pending is None else pending, drafter, lambda: lk)


def test_probes_of_a_drafter_that_never_pays_fit_the_budget():
    """At 16 rows a drafting step here costs 6x a plain one. Probes (the drafter, then a wider verify) that never
    pay must cost at most PROBE_BUDGET of the plain steps' time, plus the one first probe (the old rule, which
    counted the drafter only and probed every 64 steps at most, spent ~6x more here)."""
    c = CostModel([100.0 + 2.0 * n for n in VERIFY_GRID], 0.0, [50.0, 200.0, 500.0], learn=False)
    pol, probes, spent = AdaptivePolicy(c), 0, 0.0
    base = c.verify(16, 1, 101)
    for _ in range(2000):
        plan = pol.plan(view(16, 100))
        if plan.draft:
            probes += 1
            assert plan.record.probe
            spent += c.draft(16, 100, 16) + c.verify(16, 4, 104) - base
            pol.probes.learn(0.0, 1, False, 16)  # it did not pay
    assert 1 <= probes and spent <= c.draft(16, 100, 16) + c.verify(16, 4, 104) + PROBE_BUDGET * 2000 * base
    assert probes <= 4  # the budget halves per unpaid probe: probing fades out
    one = AdaptivePolicy(c)  # a single row, where drafting is cheap, still gets its own first probe
    assert any(one.plan(view(1, 100)).draft for _ in range(8))


def test_the_first_probe_waits_where_a_long_prompt_makes_it_dear():
    """The engine's first probe ingests every pending feature: after a short prompt it comes within a few steps;
    after an 8k-token prompt (here 80 ms of ingest against 10.5 ms plain steps) it waits for the budget."""
    c = CostModel([10.0 + 0.5 * n for n in VERIFY_GRID], 0.0, [5.0, 8.0, 20.0], ingest_ms=10.0, learn=False)
    short = AdaptivePolicy(c)
    assert any(short.plan(view(1, 100, pending=100)).draft for _ in range(8))
    long = AdaptivePolicy(c)
    plans = [long.plan(view(1, 8000, pending=8000)) for _ in range(1000)]
    first = next(i for i, p in enumerate(plans) if p.draft)
    # the budget: PROBE_BUDGET of the plain steps' time since must cover the probe's extra time
    extra = c.draft(1, 8000, 8000) + c.verify(1, 4, 8004) - c.verify(1, 1, 8001)
    assert plans[first].record.probe and first >= extra / (PROBE_BUDGET * c.verify(1, 1, 8001)) - 2


def test_a_row_whose_drafts_fail_is_predicted_lower():
    h = RowHistory()
    assert h.factor() == 1.0  # no history: the table as it is
    h.observe(10.0, 1)  # predicted 10 accepted nodes, saw 1
    low = h.factor()
    h.predicted, h.hit = 4.0, 6.0
    assert 0.25 <= low < 0.5 and h.factor() == 1.0  # a row doing better than predicted is not boosted


def test_looking_stops_where_it_never_pays_and_resumes_where_it_does():
    """A look (lookup + cut) costs host time. Where every look chooses the AR step, the policy takes plain steps
    between looks (runs of 1, 2, 4, then PLAIN_MAX); a look whose lookup pays ends the run at once."""
    c = CostModel([10.0 + 0.5 * n for n in VERIFY_GRID], 0.0, [5.0, 8.0, 20.0], learn=False)
    ticks = iter(range(10 ** 6))
    pol = AdaptivePolicy(c, clock=lambda: next(ticks) / 1000)  # every look costs 1 ms of host time
    looked = [pol.plan(view(4, 100, drafter=False)).look for _ in range(200)]  # nothing to copy: worth 0
    gaps = np.diff(np.flatnonzero(looked)) - 1  # plain steps between looks
    assert gaps[:4].tolist() == [1, 2, 4, PLAIN_MAX] and set(gaps[4:].tolist()) == {PLAIN_MAX}
    assert pol.probes.skipped >= 170  # plain steps count toward the drafter's probe
    while not pol.plan(view(4, 100, [[5] * 8] * 4, [4] * 4, drafter=False)).look:
        pass  # a long match: verifying it is worth far more than a look
    assert pol.looks.plain_left == 0 and all(pol.plan(view(4, 100, drafter=False)).look for _ in range(3))


def test_plain_steps_keep_greedy_output_and_caches_exact(arch):
    """Forced to plain steps between looks (a look priced at 1e9 ms), the output still equals AR and the drafter's
    cache still holds the committed context whenever it runs."""
    t = make_target(arch)
    dr = make_drafter(t, block_size=4)
    config = DecodeConfig(block_size=4, policy="adaptive", lookup=LookupParams(max_tokens=4))
    eng = DFlashEngine(t, dr, eos_token_ids=[], config=config, cost=cost(10.0, 1.0, 12.0))
    ar, ref = reference_runs(eng, PROMPTS, 30)
    with_oracle(eng, ref, keep=0.7)
    pol = eng.policy(eng.resolve(config))
    pol.looks.value, pol.looks.ms = 0.0, 1e9
    checked, steps = check_caches_while_decoding(eng, t, dr, PROMPTS, 30)
    tokens = [[] for _ in PROMPTS]
    for step in steps:
        for o in step:
            tokens[o.index] += o.tokens
    assert tokens == [g.tokens for g in ar]
    st = pol.stats.summary()
    assert st["plain_steps"] >= 0.5 * st["steps"] and checked["draft"] >= 1


def test_the_cost_model_is_measured_again_when_the_kernels_change(monkeypatch):
    """A cached cost model is keyed by the target's kernel plan and the kernels' sources: an upgraded kernel keeps
    the plan's name, and priced by its predecessor's times the policy would misjudge every step."""
    from dflashkit import kernels
    from dflashkit.step_cost import cost_key

    if not kernels.available():
        pytest.skip(f"our kernels are unavailable: {kernels.why_unavailable()}")
    t = make_target("llama", torch.bfloat16, backend="lean")
    torch_key = cost_key(t, None)
    t.use_rowlinear()
    before = cost_key(t, None)
    assert before != torch_key and cost_key(t, None) == before  # another plan; stable for the same sources
    monkeypatch.setitem(kernels._state, "source_id", "0123456789ab")
    assert cost_key(t, None) != before
    # torch's kernels: our sources do not set the costs
    assert cost_key(make_target("llama", torch.bfloat16, backend="lean"), None) == torch_key
