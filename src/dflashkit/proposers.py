"""Proposers: where a step's draft comes from. Each returns part of a draft tree (`tree.py`); a chain is a tree
with one path. The batch verifies the merged tree in one target pass and commits through one function.

- `DrafterProposer`: the DFlash drafter. ONE forward over `[anchor, MASK x (B-1)]` conditioned on the target's
  tapped features, then either the argmax chain or a tree of its likeliest paths (`tree.topk_tree`).
- `LookupProposer`: an n-gram lookup branch copied from earlier in each sequence (`lookup.py`), on the host.

Tests inject an oracle by wrapping `DrafterProposer.draft` (the drafter's top-k per slot) in a subclass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import kernels
from .cache import PositionCache
from .corpus import Corpus
from .drafter import DFlashDrafter, rope_cos_sin
from .errors import DFlashError
from .kernel_plan import plan_of
from .lookup import CORPUS_BELOW, LookupParams, LookupProposal, SuffixIndex, propose
from .tree import DraftNodes, chain_nodes, topk_tree


def check_compatible(drafter: DFlashDrafter, target) -> None:
    c = drafter.config
    remedy = ("the drafter was built for another target: train one for this target (`dflashkit train`) "
              "or pick its own target.")
    if c.hidden_size != target.hidden_size:
        raise DFlashError(f"drafter hidden_size {c.hidden_size} != target hidden_size {target.hidden_size}; {remedy}")
    if c.vocab_size != target.vocab_size:
        raise DFlashError(f"drafter vocab_size {c.vocab_size} != target vocabulary {target.vocab_size}; {remedy}")
    if c.num_target_layers != target.num_layers:
        raise DFlashError(f"drafter expects a target with {c.num_target_layers} layers, this one has "
                          f"{target.num_layers}; {remedy}")
    d2t = drafter.draft_to_target_ids()
    if d2t is not None and (d2t.min() < 0 or d2t.max() >= target.vocab_size):
        raise DFlashError("the drafter's draft->target vocabulary map points outside the target vocabulary; "
                          "re-export the drafter.")


def frequent_ids(drafter: DFlashDrafter, n: int) -> torch.Tensor:
    """The drafter's n most frequent training ids (sorted): drafting over them reads only n rows of the LM head."""
    if drafter.d2t is not None:
        raise DFlashError("this drafter was trained with its own reduced draft vocabulary; leave draft_vocab at 0.")
    ranking = drafter.token_ranking
    if ranking is None:
        raise DFlashError("draft_vocab needs the drafter's token_ranking.json (its training ids by frequency; see "
                          "docs/training.md); this drafter has none, so use draft_vocab 0 (the full vocabulary).")
    if n > len(ranking):
        raise DFlashError(f"draft_vocab {n} exceeds the {len(ranking)} ids the drafter's token ranking holds.")
    return torch.tensor(sorted(ranking[:n]), dtype=torch.long)


class DraftState:
    """The drafter's per-batch state, row-aligned with the batch: its K/V cache of context features, and every
    committed target feature of each row by position (`feats`, a row store like the K/V caches), of which
    positions >= `lo[r]` are not in the drafter's cache yet (pending).

    Why features may stay pending: a step that skips the drafter does not pay for writing them; its next forward
    ingests them all at once (`DrafterProposer.ingest`). A joining prompt's features start out pending too, and the
    drafter's cache is allocated only when the drafter first runs: under continuous batching a row the policy never
    drafts for costs the drafter nothing. Why a store by position, not a list of pending chunks padded to one width:
    while the drafter does not run, such a width grows by a column per step for the batch's whole life (a row joining
    late padded to it), and every join and leave copies the whole pile - in a server whose drafter does not pay,
    without bound. By position, a step writes its rows' features at their positions, a join copies the new rows'
    prompt features, a leave moves one row's used slots, and the store is bounded by the cache length."""

    def __init__(self, new_cache, feats: PositionCache, lo: list[int]):
        self._new_cache = new_cache  # rows -> an empty PositionCache for that many rows
        self.cache: PositionCache | None = None  # allocated by `ensure_cache` (the drafter's first run)
        self.feats = feats  # keys[0]: [rows, 1, max_len, k*H] each row's committed features at their positions
        self.lo = lo  # per row: the first position not written into `cache` yet

    @property
    def rows(self) -> int:
        return self.feats.batch_size

    def ensure_cache(self) -> PositionCache:
        if self.cache is None:
            self.cache = self._new_cache(self.rows)
        return self.cache

    def empty(self, max_len: int) -> "DraftState":
        """A state of no rows, its feature store `max_len` positions long (a batch's, which rows then join)."""
        k = self.feats.keys[0]
        return DraftState(self._new_cache, feature_store(0, max_len, k.shape[-1], k.dtype, k.device), [])

    def pending(self, upto: int) -> int:
        """The features the next ingest writes (all rows, through position `upto` - 1, the batch's max start): a
        rectangle from the lowest pending position, as `DrafterProposer.ingest` writes it."""
        return self.rows * max(upto - min(self.lo), 0) if self.lo else 0

    def select(self, rows: torch.Tensor, used: int | None = None) -> None:
        """Keep rows `rows`; used: the slots any kept row still needs (`PositionCache.select`)."""
        if self.cache is not None:
            self.cache.select(rows, used)
        self.feats.select(rows, used)
        self.lo = [self.lo[i] for i in rows.tolist()]

    def extend(self, other: "DraftState") -> None:
        if other.cache is not None:  # the joining rows' drafter has run (a batch joined whole)
            self.ensure_cache().extend(other.cache)
        elif self.cache is not None:
            # Rows the drafter has not run for: every feature of theirs is pending, so each slot they can see is
            # written at their first ingest; no cache of zeros to build and copy (~4 MB per row at 1,024 slots)
            self.cache.grow(other.rows)
        self.feats.extend(other.feats)
        self.lo = self.lo + other.lo

    def append(self, feats: torch.Tensor, pos: torch.Tensor) -> None:
        """Write one step's committed features [b, R', k*H] at their positions [b, R'] (a position given twice
        carries the same feature: a harmless rewrite)."""
        self.feats.write(0, feats[:, None], feats[:, None, :, :0], pos)

    def append_path(self, feats: torch.Tensor, nodes: list[list[int]], positions: list[list[int]]) -> None:
        """Row r's features feats[r, nodes[r][t]] ([b, W, k*H], a verify pass's taps) at positions[r][t]: a step's
        accepted paths. On the CPU in one C++ call (kernels/rowcopy.cpp), else a gather and `append`."""
        store = self.feats.keys[0]  # [rows, 1, max_len, k*H]
        mod = kernels.on_cpu(feats, store)
        if mod is not None and feats.dtype == store.dtype and feats.stride(-1) == 1:
            mod.copy_rows(store, positions, feats, nodes)
            return
        idx = torch.tensor(nodes, device=feats.device)
        self.append(feats.gather(1, idx[..., None].expand(*idx.shape, feats.shape[-1])),
                    torch.tensor(positions, device=feats.device))

    def ingested(self, starts: list[int]) -> None:
        """Every row's features below its start are now in the drafter's cache."""
        self.lo = list(starts)


def feature_store(rows: int, max_len: int, width: int, dtype: torch.dtype, device) -> PositionCache:
    """A row store of `width`-wide features by position: a one-layer, one-head PositionCache without values."""
    return PositionCache(1, rows, 1, max_len, width, dtype, device, value_dim=0)


def draft_head(target, d2t: torch.Tensor):
    """The LM-head rows `d2t` the drafter's logits use: a bf16 tensor, or where the target reads its head as 4/8-bit
    codes on our kernels, those rows of the codes (a `RowLinear`: the same weights, since a codes head is used only
    where its codes decode to the bf16 head bit for bit, `kernel_plan.choose`; about half the bytes a drafting step
    reads for its head: 9.8 vs 18.9 MB for the bundled drafter's 16,384 ids). Not on an AMX CPU: there the bf16 rows
    run on the tile instructions for a block of slots, cheaper than the codes' dot products (a drafting step at
    block 16: 3.7 vs 4.8 ms on a 2-core Xeon)."""
    head = getattr(target, "head", None)
    if head is not None and head.kind != "bf16" and not head.int8_acts and kernels.isa() != "amx":
        return head.select_rows(d2t.cpu())
    return target.lm_head_weight[d2t]


@dataclass
class DraftView:
    """What a proposer sees of the batch at one step."""

    anchor: torch.Tensor  # [b] the last committed token of each row (no target K/V yet)
    start: torch.Tensor  # [b] the anchor's position
    ctx_len: int  # max(start) on the host: the draft cache slots any row can see
    seqs: list  # the rows' host state (`batch.SeqState`: prompt + generated); oracles read it
    starts: list[int] | None = None  # `start` on the host (None: every row at ctx_len)


class DrafterProposer:
    """The DFlash drafter as a proposer of the chain (tree = 0) or a tree of its `tree` likeliest paths."""

    def __init__(self, drafter: DFlashDrafter, target, block_size: int, tree: int = 0, tree_min_prob: float = 0.0,
                 draft_vocab: int = 0):
        check_compatible(drafter, target)
        target.set_taps(drafter.config.target_layer_ids)
        self.drafter = drafter.to(device=target.device, dtype=target.dtype).eval()
        self.target, self.block_size, self.tree, self.tree_min_prob = target, block_size, tree, tree_min_prob
        d2t = frequent_ids(drafter, draft_vocab) if draft_vocab else drafter.draft_to_target_ids()
        # Reduced draft vocabulary: draft logits over a row subset of the target's LM head. Verification still
        # uses the full vocabulary, so output stays exact; only the proposals are restricted.
        self.d2t = d2t.to(target.device) if d2t is not None else None
        self.head = draft_head(target, self.d2t) if d2t is not None else None
        self._arange_q = torch.arange(block_size, device=target.device)
        # The drafter's layers in one C++ call (`drafter.layer_stack`), where the engine built it for a stacked
        # target; its draft cache then holds value rows of hd + 1 (the stack's layout) and B more slots.
        self.stack = getattr(drafter, "stack", None) if plan_of(target).stack else None
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # `_rope`'s cos, sin [positions, hd]

    # ---- per-batch state ------------------------------------------------------------------------------------
    def prefill(self, feats: torch.Tensor, pos: torch.Tensor, last: torch.Tensor, max_len: int) -> DraftState:
        """New rows' state from their prompt features [n, P, k*H] at pos [n, P]; last [n] = each prompt's last
        position. Nothing is computed here: the prompt stays pending until the drafter first runs for these rows
        (`ingest`), and a row's right padding past `last` becomes a repeat of its last prompt feature."""
        c, n, P = self.drafter.config, feats.shape[0], feats.shape[1]
        # Why clamp to `last`: slots past a row's prompt hold padding features at positions the row will later
        # commit real tokens to; ingesting them could overwrite a real feature written in the same pass.
        idx = torch.minimum(torch.arange(P, device=feats.device)[None], last[:, None])  # [n, P]
        dev, dtype = self.target.device, self.target.dtype
        # Stacked: the block's own K/V are written at its positions (`_stacked`), up to B - 1 past the context.
        extra, vdim = (self.block_size, c.head_dim + 1) if self.stack is not None else (0, None)

        def new_cache(rows: int) -> PositionCache:
            return PositionCache(c.num_hidden_layers, rows, c.num_key_value_heads, max_len + extra, c.head_dim, dtype,
                                 dev, value_dim=vdim)
        store = feature_store(n, P, feats.shape[-1], dtype, dev)  # the prompts' own: `extend` copies them in
        state = DraftState(new_cache, store, [0] * n)
        state.append(feats.gather(1, idx[..., None].expand(n, P, feats.shape[-1])), pos.gather(1, idx))
        return state

    def ingest(self, state: DraftState, starts: list[int] | None = None) -> None:
        """Write the pending context features into the draft cache (allocating it on first use); starts: each
        row's anchor position (its features exist below it; default: the whole store, a state of prompts alone).
        One rectangle, positions [min(lo), max(starts)) of every row: a row's slots past its own start get stale
        features, invisible to its queries (they see slots < start; the stacked forward first writes its block's
        own K/V over [start, start + B)) and written again once committed, as `lo` = start marks them pending."""
        cache = state.ensure_cache()
        upto = max(starts) if starts else state.feats.max_len
        lo = min(state.lo, default=upto)
        if upto > lo:
            feats = state.feats.keys[0][:, 0, lo:upto]  # [b, R, k*H]
            self._write(cache, feats, torch.arange(lo, upto, device=feats.device).expand(state.rows, -1))
        state.ingested(list(starts) if starts else [upto] * state.rows)

    def _write(self, cache: PositionCache, feats: torch.Tensor, pos: torch.Tensor) -> None:
        dr = self.drafter
        if self.stack is not None:  # the fuse and every layer's K/V in one C++ call, at slot == position
            cos, sin = self._rope(pos)  # [b, R, hd]
            self.stack.context_taps(feats, cos, sin, cache.keys, cache.values, pos.contiguous())
            return
        for layer, (k, v) in enumerate(dr.context_kv(dr.fuse(feats), pos)):
            cache.write(layer, k, v, pos)

    # ---- drafting -------------------------------------------------------------------------------------------
    def propose(self, state: DraftState, view: DraftView, scores: bool = False,
                block: int | None = None) -> DraftNodes:
        """Ingest the pending features, draft one block, and return the chain or the tree of likeliest paths.
        scores: also give each node's path log-probability (the adaptive policy prunes the tree itself then).
        block: this pass's block, 2 .. block_size (None: block_size): [anchor, MASK x (block - 1)], so nodes reach
        depth block - 1 at most, and the drafter's layers and head run over `block` queries per row, not all
        block_size (measured: the first slots' acceptance does not change, bench/results/draft-block/)."""
        self.ingest(state, view.starts)
        if self.drafter.candidate_selector is not None:
            return self._selected(state, view, scores, block)
        # A tree of n nodes needs at most the n best tokens per slot (its beam is then exact, `topk_tree`).
        toks, logp = self.draft(state, view, k=min(self.tree, 16) if self.tree else 1, probs=scores, block=block)
        if self.tree:
            return topk_tree(toks, logp, self.tree, 0.0 if scores else self.tree_min_prob)
        return chain_nodes(toks[..., 0], logp[..., 0] if scores else None)

    def _selected(self, state: DraftState, view: DraftView, scores: bool, block: int | None = None) -> DraftNodes:
        """DFlash2: the chain is the candidate selector's path through each slot's top-k (`dflash2.CandidateSelector`);
        a tree holds the paths the selector scores highest (each slot's candidates scored after its parent's token).
        scores: each node's path log-probability (the chain: under the drafter's unary distribution)."""
        h = self._hidden(state, view, block)[:, 1:]
        logits = self.target.logits(h, self.head)  # [b, B-1, V']
        selector = self.drafter.candidate_selector
        if self.tree:
            toks, step = selector.conditional(h, logits, view.anchor, self.d2t)
            return topk_tree(toks, toks.new_zeros(toks.shape, dtype=torch.float32), self.tree,
                             0.0 if scores else self.tree_min_prob, conditional=step)
        sel = selector.select(h, logits, view.anchor, self.d2t)
        logp = None
        if scores:
            logp = logits.float().log_softmax(-1).gather(-1, sel.columns[..., None])[..., 0]
        return chain_nodes(sel.path, logp)

    def draft(self, state: DraftState, view: DraftView, k: int = 1, probs: bool = False,
              block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's k best tokens per block slot 1..B-1 as target ids [b, B-1, k], best first, and their
        log-probabilities [b, B-1, k] (float32; zeros for k = 1 unless probs, where only the argmax is needed).
        block: this pass's B (None: block_size)."""
        # Same-position prediction: output slot j (j >= 1) proposes the token AT position anchor + j; slot 0
        # (the anchor itself) is discarded.
        logits = self.target.logits(self._hidden(state, view, block)[:, 1:], self.head)
        if k == 1 and not probs:  # no probabilities needed: skip the softmax (max, not bf16 argmax: see sampling.py)
            drafts = logits.max(-1, keepdim=True).indices
            logp = torch.zeros(drafts.shape, dtype=torch.float32, device=drafts.device)
        else:
            fast = kernels.draft_topk(logits, k)  # one call instead of an fp32 copy, log_softmax and topk
            logp, drafts = fast if fast is not None else logits.float().log_softmax(-1).topk(k, dim=-1)
        return (self.d2t[drafts] if self.d2t is not None else drafts), logp

    def _hidden(self, state: DraftState, view: DraftView, block: int | None = None) -> torch.Tensor:
        """The drafter's final-normed states [b, B, H] of the block [anchor, MASK x (B-1)] at the anchors (B: block,
        default block_size)."""
        c, anchor = self.drafter.config, view.anchor
        Q = self.block_size if block is None else block
        if not 2 <= Q <= self.block_size:
            raise DFlashError(f"a drafting block must hold 2 .. {self.block_size} tokens (got {Q})")
        b, dev = anchor.shape[0], anchor.device
        blk_pos = view.start[:, None] + self._arange_q[:Q]  # [b, Q]
        # Why mask_token_id: slots 1..B-1 are embedded as the mask token the drafter was trained with; a different
        # id does not crash, it just drafts garbage.
        block = torch.full((b, Q), c.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = anchor
        if self.stack is not None:
            h = self._stacked(state.cache, self.target.embed(block), blk_pos, view)
        else:
            # Block queries see context slots strictly before the anchor (its own feature does not exist yet) and
            # all B block tokens (bidirectional).
            ctx_vis = torch.arange(view.ctx_len, device=dev) < view.start[:, None]  # [b, ctx_len]
            mask = torch.cat([ctx_vis[:, None, None, :].expand(b, 1, Q, view.ctx_len),
                              torch.ones((b, 1, Q, Q), dtype=torch.bool, device=dev)], dim=-1)
            ctx_kv = [(state.cache.keys[l][:, :, :view.ctx_len], state.cache.values[l][:, :, :view.ctx_len])
                      for l in range(c.num_hidden_layers)]
            h = self.drafter(self.target.embed(block), blk_pos, ctx_kv, mask)
        return h


    def _stacked(self, cache: PositionCache, x: torch.Tensor, blk_pos: torch.Tensor, view: DraftView) -> torch.Tensor:
        """The drafter's layers in one C++ call: x [b, Q, H] the embedded block at blk_pos [b, Q] -> the final-normed
        states [b, Q, H]. The block's K/V are written into the draft cache at the block's own positions: slots the
        context has not reached yet (the context ends at start - 1), each rewritten with a committed token's feature
        before any query can see it. Each query sees every slot before its row's start + B: the context before the
        anchor and the whole block (bidirectional), as the per-op forward's mask."""
        dev = x.device
        b, Q = blk_pos.shape
        S = view.ctx_len + Q
        head = (torch.arange(S, device=dev)[None, None] < (view.start[:, None, None] + Q)).expand(b, Q, S)
        cos, sin = self._rope(blk_pos)
        out, _ = self.stack.forward(x, cos, sin, cache.keys, cache.values, blk_pos, head.contiguous(),
                                    torch.empty((b, Q, 0), dtype=torch.long, device=dev), [])
        return out  # final-normed in the stack (`drafter.layer_stack`)

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [b, R] -> the drafter's rotary cos, sin [b, R, hd], read from a table of `rope_cos_sin` rows (each
        position's row is elementwise the same whatever else is computed beside it): two gathers a step instead
        of the ~10 small ops that compute them, each slow right after a target step."""
        need = int(pos.max()) + 1
        have = 0 if self._rope_table is None else self._rope_table[0].shape[0]
        if have < need:
            c, n = self.drafter.config, max(need, 2 * have)
            cos, sin = rope_cos_sin(torch.arange(n, device=pos.device)[None], c.head_dim, c.rope_theta,
                                    self.target.dtype)
            self._rope_table = (cos[0, 0], sin[0, 0])  # [n, hd]
        return self._rope_table[0][pos], self._rope_table[1][pos]


class LookupProposer:
    """The n-gram lookup branch: for each live row, the tokens that followed the latest earlier occurrence of its
    longest matching suffix, or (`LookupParams.corpus_n`) the continuation of its suffix in the corpus of the
    target's earlier answers where the row's own match is short. Runs on the host, where the committed tokens live."""

    def __init__(self, params: LookupParams, corpus: Corpus | None = None):
        self.params = params
        self.corpus = corpus if params.corpus_n else None

    def propose(self, seqs: list) -> LookupProposal:
        """Every row's proposal; the branch is never wider than the longest one."""
        on = self.params.enabled
        props, agreement = [], []
        for s in seqs:
            h = s.history() if on and not s.finished else None
            p, n = self.suggest(h, s.suffixes(self.params.max_n)) if h is not None else ([], 0)
            agree = ""
            if self.corpus is not None and h is not None and n < CORPUS_BELOW:
                m = self.corpus.match(h, self.params.max_tokens, self.params.corpus_n)
                if m.n:
                    p, n, agree = m.tokens, m.n, m.agreement
            props.append((p, n))
            agreement.append(agree)
        matched = [n for _, n in props]
        own = [0 if a else n for n, a in zip(matched, agreement)]  # only the row's own matches may skip the drafter
        return LookupProposal(matched, [list(p) for p, _ in props], self.skips_drafter(own, seqs), agreement)

    def suggest(self, tokens: np.ndarray, index: SuffixIndex | None = None) -> tuple[list[int], int]:
        """One row's (proposal, matched suffix length) for its committed tokens, through the row's n-gram index
        when given (tests override it with oracles)."""
        return index.propose(tokens, self.params) if index is not None else propose(tokens, self.params)

    def skips_drafter(self, matched: list[int], seqs: list) -> bool:
        """Every live row matched a suffix of at least `skip_drafter_n` tokens: verify the branch alone."""
        n = self.params.skip_drafter_n
        return bool(n) and all(m >= n for m, s in zip(matched, seqs) if not s.finished)
