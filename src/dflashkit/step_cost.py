"""The machine's step cost: milliseconds of a target pass by its rows, their width and the context, and of the
drafter by its rows, its context and the features it first ingests. Calibrated once per machine and model in a few
seconds (`calibrate`, cached in ~/.cache/dflashkit/cost.json under `cost_key`), corrected online from measured steps
(`CostModel.observe`). The step policy (`policy/`) weighs every draft against it.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from itertools import accumulate

import torch

from .measurements import engine_identity, lookup, machine_key, store

log = logging.getLogger(__name__)

VERIFY_GRID = (1, 2, 4, 8, 16, 32, 64)  # tokens per target pass timed by `calibrate` (linear beyond the last)
CTX_WIDTHS = (1, 4, 16)  # tokens per row whose context term `calibrate` times (linear beyond the last) ...
CTX_LONG = 4096  # ... at this context, on a cache filled at random (a real prefill of it takes 15-70 s on 2 cores)
DRAFT_GRID = (1, 4, 16)  # batch rows of the drafter's forward timed by `calibrate`
DRAFT_CTX = 64  # ... at this context length (a context term and the pending features' cost are timed apart)
DRAFT_MIN_BLOCK = 2  # ... and at this short block beside the configured one (a pass of B tokens: in between)


def batch_bucket(rows: int) -> int:
    """A batch size's bucket for what is learned per batch size: 1, 2-3, 4-7, 8-15, 16-31, ..."""
    return max(rows, 1).bit_length()


def _interp(grid: tuple, ys: list[float], x: float) -> float:
    """Piecewise-linear through (grid, ys); the last segment's slope beyond the ends."""
    i = min(max(bisect.bisect_left(grid, x) - 1, 0), len(grid) - 2)  # bisect: the policy calls this ~25x a step
    x0, x1 = grid[i], grid[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


def lower_hull(grid: tuple, ys: list[float]) -> list[float]:
    """The greatest convex function of `grid` below the points (ys on it). Why: a timing is the true cost plus
    noise that only ever adds time, and a pass's cost is convex in its tokens (flat while reading the weights
    dominates, then linear in the compute); one slow point must not make the next width look free. Measured: a
    calibration read 24.0 ms at 4 tokens and 23.9 at 8, so verifying a second node per row at batch 4 looked free
    (the online width factor multiplies that difference: it could not learn), and the policy verified lookup tokens
    on 23 % of steps at 0.88x AR; the real forward cost +28 %."""
    hull: list[int] = []
    for i in range(len(grid)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]  # drop b if it lies on or above the chord from a to i
            if (ys[b] - ys[a]) * (grid[i] - grid[a]) >= (ys[i] - ys[a]) * (grid[b] - grid[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    if len(hull) == 1:
        return [ys[hull[0]]] * len(grid)
    xs, hs = tuple(grid[h] for h in hull), [ys[h] for h in hull]
    # a point on the hull keeps its own value (not the interpolation's, which may differ in the last bit), so that
    # the hull of a hull is itself: a cached model reloads to the same numbers
    return [y if h >= y - 1e-9 * abs(y) else h for y, h in ((y, _interp(xs, hs, x)) for x, y in zip(grid, ys))]


@dataclass
class CostModel:
    """Milliseconds of one decoding step here. verify_ms: a target pass (forward + LM head) of VERIFY_GRID tokens
    at a short context; ctx_ms: extra ms per row per 1,000 context positions for a row of CTX_WIDTHS tokens (a
    number: that many ms per verified token, every width alike); draft_ms: the drafter's proposal for DRAFT_GRID
    rows at a DRAFT_CTX context, one feature pending per row, at the configured block (`draft_block`) and at
    DRAFT_MIN_BLOCK (`draft_short_ms`; None: not timed, every block priced as the configured one). learn: correct
    online from measured steps (`observe`)."""

    verify_ms: list[float]
    ctx_ms: list[float] | float
    draft_ms: list[float]
    draft_ctx_ms: float = 0.0  # the drafter: extra ms per row per 1,000 context positions beyond DRAFT_CTX ...
    ingest_ms: float = 0.0  # ... and ms per 1,000 pending features written into its cache (`DraftState`)
    draft_short_ms: list[float] | None = None  # the drafter's proposal at a block of DRAFT_MIN_BLOCK, DRAFT_GRID rows
    draft_block: int = 0  # the block draft_ms was timed at
    learn: bool = True
    rate: float = 0.15  # how far one measured step moves the model toward itself

    scale: float = 1.0  # learned: measured / calibrated, for the target pass (all widths alike) ...
    draft_scale: float = 1.0  # ... and for the drafter
    # learned, per batch-size bucket (`batch_bucket`): measured / predicted cost of a pass's nodes beyond the first
    # per row (`pass_ms`, `observe_pass`)
    wide: dict = field(default_factory=dict)

    def __post_init__(self):
        # the calibrated points as their lower convex hull (`lower_hull`); models cached before it get it on load
        self.verify_ms = lower_hull(VERIFY_GRID, list(self.verify_ms))
        if isinstance(self.ctx_ms, (int, float)):
            self.ctx_ms = [self.ctx_ms * w for w in CTX_WIDTHS]
        # never less for a wider row: a timing is the true cost plus noise (as `lower_hull` says)
        self.ctx_ms = list(accumulate((max(x, 0.0) for x in self.ctx_ms), max))
        self.draft_ms = lower_hull(DRAFT_GRID, list(self.draft_ms))
        if self.draft_short_ms is not None:
            self.draft_short_ms = lower_hull(DRAFT_GRID, list(self.draft_short_ms))

    def verify(self, rows: int, width: int, ctx: int) -> float:
        """A target pass of `width` tokens in each of `rows` rows at context `ctx`. Why the context term per row and
        width, not per token: past ~2k keys a row's queries share their reads of each kv head (the attention kernel),
        so at 8k tokens a 2-token row costs ~1.25x a 1-token row, where a term per token said ~1.6x (measured)."""
        base = max(_interp(VERIFY_GRID, self.verify_ms, rows * width), 1e-3)
        return self.scale * (base + rows * max(_interp(CTX_WIDTHS, self.ctx_ms, width), 0.0) * ctx / 1000)

    def pass_ms(self, rows: int, width: int, ctx: int) -> float:
        """A verify pass of `width` nodes in each of `rows` rows whose anchors sit at position `ctx`: the plain step
        (`rows` tokens) plus the width beyond it, the latter times what wide passes at this batch size measured."""
        return self.pass_curve(rows, ctx)(width)

    def pass_curve(self, rows: int, ctx: int):
        """`pass_ms` for these rows and context as a function of the width, memoised: the policy prices many widths
        per step (a closure of one step; the model moves between steps)."""
        one, factor, memo = self.verify(rows, 1, ctx + 1), self.wide.get(batch_bucket(rows), 1.0), {}

        def cost_of(width: int) -> float:
            if width <= 1:
                return one
            if width not in memo:
                memo[width] = one + factor * (self.verify(rows, width, ctx + width) - one)
            return memo[width]
        return cost_of

    def draft(self, rows: int, ctx: int = 0, pending: int = 0, block: int | None = None) -> float:
        """The drafter's step for `rows` rows at context `ctx` with `pending` features (all rows) to ingest first,
        drafting a block of `block` tokens (None: the configured block). Why the context and the pending features
        count: its attention reads every context feature (a 4,000-token prompt costs it more than the target's
        verify) and a drafter skipped for k steps first writes k features per row; timed at a short context only,
        the policy drafted at a loss on long prompts and big batches. Why the block: the drafter's layers and head
        run over the block's queries; linear in the block between the two timed ones (measured on two CPUs within
        ~10 %: bench/results/draft-block/)."""
        base = max(_interp(DRAFT_GRID, self.draft_ms, rows), 1e-3)
        if block is not None and self.draft_short_ms is not None and DRAFT_MIN_BLOCK <= block < self.draft_block:
            short = min(max(_interp(DRAFT_GRID, self.draft_short_ms, rows), 1e-3), base)
            base = short + (base - short) * (block - DRAFT_MIN_BLOCK) / (self.draft_block - DRAFT_MIN_BLOCK)
        extra = (self.draft_ctx_ms * rows * max(ctx - DRAFT_CTX, 0) / 1000
                 + self.ingest_ms * max(pending - rows, 0) / 1000)
        return self.draft_scale * (base + extra)

    def observe(self, rows: int, width: int, ctx: int, draft_rows: int, ms: float, draft_ctx: int = 0,
                pending: int = 0, draft_block: int | None = None) -> None:
        """A measured step moves the scales toward measured / predicted. Why one scale for every width, not a local
        correction at the width measured: most steps are AR steps, and what makes them slower than calibrated (a
        busy host, per-row work outside the forward) slows wider passes alike; raising only the AR point would make
        the never-measured wide passes look cheap by comparison, and the policy would verify at a loss (measured:
        0.64x AR at batch 16 on MT-Bench). The calibrated shape is kept."""
        if self.learn:
            self._move_scales(self.verify(rows, width, ctx), ms, draft_rows, draft_ctx, pending, draft_block)

    def _move_scales(self, verify: float, ms: float, draft_rows: int, draft_ctx: int, pending: int,
                     draft_block: int | None = None) -> None:
        """Move the scales toward measured / predicted; verify: the predicted target pass."""
        pred = verify + (self.draft(draft_rows, draft_ctx, pending, draft_block) if draft_rows else 0.0)
        err = min(max(ms - pred, -0.5 * pred), 0.5 * pred)  # a descheduled step must not wreck the model
        step = 1 + self.rate * err / pred
        self.scale *= step
        if draft_rows:
            self.draft_scale *= step

    def observe_pass(self, rows: int, width: int, ctx: int, draft_rows: int, ms: float, draft_ctx: int = 0,
                     pending: int = 0, draft_block: int | None = None) -> None:
        """A measured step of `pass_ms(rows, width, ctx)` (+ the drafter's, if it ran). A plain or drafted step
        moves the scales (`_move_scales`); a wide step without the drafter moves only the factor of its width beyond
        the plain step, at its batch size. Why a factor of its own: calibrated on one row, a wide pass over many rows
        also pays per-row work outside the forward (tree masks, moving an accepted branch, longer commits), and
        the plain steps around it say nothing about that (measured: at batch 16 the policy verified lookup branches
        on ~20 % of steps and lost 7 % against AR, in two sessions' sweeps)."""
        if not self.learn:
            return
        if width <= 1 or draft_rows:  # predicted as the policy priced it: the width factor included
            self._move_scales(self.pass_ms(rows, width, ctx), ms, draft_rows, draft_ctx, pending, draft_block)
            return
        one = self.verify(rows, 1, ctx + 1)
        extra = max(self.pass_ms(rows, width, ctx) - one, 1e-3)
        # the error as a share of the width's own cost, at most +-1: a descheduled step must not wreck the factor
        err = min(max((ms - one - extra) / extra, -1.0), 1.0)
        k = batch_bucket(rows)
        self.wide[k] = min(max(self.wide.get(k, 1.0) * (1 + self.rate * err), 0.5), 4.0)


def _best_of(fn, reps: int = 3) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


@torch.inference_mode()
def calibrate(target, proposer) -> CostModel:
    """Time target passes over VERIFY_GRID tokens (one row, a 64-token context) and CTX_WIDTHS tokens at a CTX_LONG
    context (the context term per width), and the drafter's proposal (if any) at DRAFT_GRID rows (a DRAFT_CTX
    context), at one row with a CTX_LONG context (its context term) and with 256 features pending (its ingest term)."""
    dev, vocab = target.device, min(target.vocab_size, 1000)
    gen = torch.Generator().manual_seed(0)
    long_ctx = max(min(CTX_LONG, target.max_positions - CTX_WIDTHS[-1]), 128)

    def verify_fn(n: int, ctx: int):
        # Why a cache filled at random, not prefilled: a pass's cost does not depend on the values it reads, and a
        # real prefill of CTX_LONG tokens would make calibration minutes long on a CPU (a value's extra column, where
        # a backend keeps one, gets no special value: nothing here reads the outputs)
        cache = target.new_cache(1, ctx + n)
        for t in cache.keys + cache.values:
            t.uniform_(0.5, 1.5, generator=gen)
        ids = torch.randint(4, vocab, (1, n), generator=gen).to(dev)
        pos = torch.arange(ctx, ctx + n, device=dev)[None]
        vis = torch.ones((1, 1, n, ctx + n), dtype=torch.bool, device=dev)
        taps = proposer is not None
        return lambda: target.logits(target.forward(ids, pos, cache, kv_len=ctx + n, taps=taps, slots=pos,
                                                    visible=vis)[0])

    verify = [_best_of(verify_fn(n, 64)) for n in VERIFY_GRID]
    # ms per row per 1,000 positions beyond the short context, per width
    ctx_ms = [round(max(_best_of(verify_fn(w, long_ctx)) - _interp(VERIFY_GRID, verify, w), 0.0)
                    / ((long_ctx - 64) / 1000), 4) for w in CTX_WIDTHS]
    if proposer is None:
        return CostModel([round(x, 3) for x in verify], ctx_ms, [0.0] * len(DRAFT_GRID))
    draft = [_best_of(_draft_fn(target, proposer, b)) for b in DRAFT_GRID]
    B = proposer.block_size
    short = [round(_best_of(_draft_fn(target, proposer, b, block=DRAFT_MIN_BLOCK)), 3) for b in DRAFT_GRID] \
        if B > DRAFT_MIN_BLOCK else None
    draft_ctx = max(_best_of(_draft_fn(target, proposer, 1, ctx=long_ctx)) - draft[0], 0.0) \
        / ((long_ctx - DRAFT_CTX) / 1000)
    # ms per 1,000 pending features: 257 against 1 at one context (a feature per position: the context holds them)
    long = DRAFT_CTX + 256
    ingest = max(_best_of(_draft_fn(target, proposer, 1, ctx=long, pending=257))
                 - _best_of(_draft_fn(target, proposer, 1, ctx=long)), 0.0) / 0.256
    return CostModel([round(x, 3) for x in verify], ctx_ms, [round(x, 3) for x in draft],
                     round(draft_ctx, 4), round(ingest, 4), draft_short_ms=short, draft_block=B)


def _draft_fn(target, proposer, rows: int, ctx: int = DRAFT_CTX, pending: int = 1, block: int | None = None):
    """A drafter step for `rows` rows at context `ctx`, first ingesting `pending` features per row (restored before
    every call, so that each timed call does the same work), drafting a block of `block` (None: the configured)."""
    from .proposers import DraftView

    c = proposer.drafter.config
    feats = torch.randn(rows, ctx, len(c.target_layer_ids) * target.hidden_size, generator=torch.Generator()
                        .manual_seed(1)).to(device=target.device, dtype=target.dtype)
    pos = torch.arange(ctx, device=target.device).expand(rows, ctx)
    state = proposer.prefill(feats, pos, pos[:, -1], ctx + 2 * proposer.block_size)
    proposer.ingest(state)
    view = DraftView(torch.zeros(rows, dtype=torch.long, device=target.device),
                     torch.full((rows,), ctx, device=target.device), ctx, [], [ctx] * rows)

    def step():
        state.lo = [ctx - min(pending, ctx)] * rows  # the last `pending` context features of each row not ingested
        return proposer.propose(state, view, scores=True, block=block)
    return step


def cost_key(target, proposer) -> str:
    """What the costs depend on: the machine, torch, threads, the target's and drafter's shapes, dtype, backend."""
    d = proposer.drafter.config if proposer is not None else None
    draft = (d.num_hidden_layers, d.hidden_size, proposer.block_size, proposer.tree,
             None if proposer.d2t is None else len(proposer.d2t)) if d is not None else None
    if d is not None and getattr(proposer, "stack", None) is not None:  # its stacked layers' weights (bf16 / Q8_0)
        draft += (getattr(proposer.drafter, "stack_weights", "bf16"),)
    if d is not None and d.arch != "dflash":  # DFlash2's convolutions and selector walk cost their own time
        draft += (d.arch, d.conv_kernel_size, d.selector_rank, d.selector_top_k)
    # The kernels set the costs (the drafter runs the target's, `kernel_plan.apply_to_drafter`). Why their sources
    # too (in the plan's identity): a faster kernel keeps the plan's name; priced by its predecessor's times, the
    # policy would misjudge every step (a 1-token step measured at 11.7 ms, now 8.5). "draft-ctx": models calibrated
    # before the drafter's context and ingest terms lack them; "draft-block": ... and its short-block timing;
    # "ctx-width": ... and the target's context term per width, timed at CTX_LONG.
    engine = engine_identity(target) + "/draft-ctx/draft-block/ctx-width"
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
    log.info("step cost: verify %s ms at %s tokens (+%s ms per row per 1K context at %s tokens a row), "
             "drafter %s ms at %s rows "
             "(block %s; %s ms at block %d; +%s ms per row per 1K context, +%s ms per 1K pending features)",
             cost.verify_ms, VERIFY_GRID, cost.ctx_ms, CTX_WIDTHS, cost.draft_ms, DRAFT_GRID, cost.draft_block,
             cost.draft_short_ms, DRAFT_MIN_BLOCK, cost.draft_ctx_ms, cost.ingest_ms)
    store(cache_file, key, {k: v for k, v in asdict(cost).items() if k not in ("learn", "rate")})
    return cost
