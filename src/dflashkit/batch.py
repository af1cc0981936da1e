"""The running batch: one draft -> verify -> commit cycle per step for every sequence in it.

Each step (dflash-spec §2-3, generalised to trees):
  1. propose: the lookup branch (host) and the drafter's chain or tree (`proposers.py`) merge into one draft
     tree per row (`tree.build`); a chain is a tree with one path, plain AR a tree of the anchor alone;
  2. verify:  the target runs ONE forward over every row's tree; node i sits in slot start + i at position
     start + depth(i) (RoPE) and sees only its ancestors and the committed context;
  3. commit:  `_commit`, the one place that accepts (walk the tree along the target's own choices), rolls back
     (moves an accepted path to slot == position, advances `start`), and hands each row its tokens
     (`SeqState.commit`: EOS, max_new_tokens and stop strings cut mid-block). The only host sync per step is
     reading the accepted tokens and counts (plus one for a pruned tree's width).

Sequences join between steps (`add`, or `prefill_chunk` after a chunked prefill: their cache slots copied into
free rows of the batch's store, `cache.py`) and leave between steps (a finished or cancelled row's hole is filled
by the last row, `_compact`). `DFlashEngine.stream` runs one closed batch through
it; the server keeps one open and lets requests come and go (continuous batching).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import DFlashError
from .lookup import SuffixIndex
from .policy import FixedPolicy, Plan, StepOutcome, StepView
from .prefill import PromptPrefill, prefill_context, prefill_groups
from .proposers import DraftView, DrafterProposer, LookupProposer
from .sampling import Sampler, SamplingParams
from .stats import GenerationStats
from .tree import DraftTree, accepted, build, prune, verify_inputs

_keys = itertools.count()  # `SeqState.key`: unique in the process


@dataclass
class StepOutput:
    """What one step added to one sequence."""

    index: int  # the sequence's index in the prompts given to `stream`
    tokens: list[int]  # newly committed tokens (already cut at EOS / stop string / max_new_tokens)
    finished: bool
    finish_reason: str | None  # "stop" (EOS or stop string), "length" or "cancelled"
    stats: GenerationStats


def cache_positions(prompt_len: int, max_new_tokens: int, width: int) -> int:
    """Cache slots a sequence can touch: its prompt, its new tokens, and one verify pass (`width` slots: the
    whole draft tree) past the last one."""
    return prompt_len + max_new_tokens + width + 1


@dataclass
class SeqState:
    """Host-side state of one sequence."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    stats: GenerationStats
    params: SamplingParams = SamplingParams()
    stop: list[str] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    t_arrival: float = 0.0
    t_first: float = 0.0
    logprobs_k: int | None = None  # None: no log-probabilities; k: each token's, plus the k most likely
    logprobs: list = field(default_factory=list)  # per generated token: (logprob, [(id, logprob)] * k)
    key: int = field(default_factory=lambda: next(_keys))  # the sequence's identity for the step policy's records
    _history: np.ndarray | None = field(default=None, repr=False)  # `history`'s buffer (capacity >= its length)
    _history_len: int = field(default=0, repr=False)
    _suffixes: SuffixIndex | None = field(default=None, repr=False)  # the lookup's n-gram index of `history`

    def history(self) -> np.ndarray:
        """prompt + generated as an int64 array [T] (a view), kept incrementally: the lookup reads it every step,
        and rebuilding it from the lists cost more than the lookup itself on long prompts."""
        n, p = len(self.prompt) + len(self.generated), len(self.prompt)
        buf, have = self._history, self._history_len
        if buf is None or have > n:  # first use, or the generated tokens were cut (a stop string)
            buf, have = np.empty(max(2 * n, 64), dtype=np.int64), p
            buf[:p] = self.prompt
            self._suffixes = None  # indexes tokens that may be gone
        if n > buf.size:
            buf = np.concatenate([buf[:have], np.empty(n + max(n, 64), dtype=np.int64)])
        buf[have:n] = self.generated[have - p:]
        self._history, self._history_len = buf, n
        return buf[:n]

    def suffixes(self, max_n: int) -> SuffixIndex:
        """The lookup's index of this sequence's n-grams (made on first use; dropped when `history` is cut)."""
        if self._suffixes is None or self._suffixes.max_n != max_n:
            self._suffixes = SuffixIndex(max_n)
        return self._suffixes

    def commit(self, tokens: list[int], eos_ids: set[int], tokenizer, logprobs: list | None = None) -> StepOutput:
        """Append tokens, cutting at EOS, max_new_tokens, or a stop string (also mid-block). `logprobs`: one entry
        per token (when this sequence asked for them), cut with it."""
        before = len(self.generated)
        for i, tok in enumerate(tokens):
            self.generated.append(tok)
            if logprobs is not None:
                self.logprobs.append(logprobs[i])
            if tok in eos_ids:
                self.finished, self.finish_reason = True, "stop"
                break
            if len(self.generated) >= self.max_new_tokens:
                self.finished, self.finish_reason = True, "length"
                break
        if self.stop:
            cut = stop_cut(self.generated, before, self.stop, tokenizer)
            if cut is not None:
                del self.generated[cut:]
                del self.logprobs[cut:]
                self.finished, self.finish_reason = True, "stop"
        self.stats.new_tokens = len(self.generated)
        return StepOutput(self.index, self.generated[before:], self.finished, self.finish_reason, self.stats)


def stop_cut(gen: list[int], before: int, stop: list[str], tokenizer) -> int | None:
    """Smallest token count k > before such that the tail of gen[:k] contains a stop string."""
    ctx = max(len(x) for x in stop) + 2  # tokens of look-back: a stop string may straddle the step boundary
    lo = max(0, before - ctx)
    dec = tokenizer.decode
    if not any(x in dec(gen[lo:]) for x in stop):
        return None
    for k in range(before + 1, len(gen) + 1):
        if any(x in dec(gen[lo:k]) for x in stop):
            return k
    return None


class DecodeBatch:
    """The device state of every sequence in the batch plus their host-side records.

    target: a `TargetModel`; drafter: a `DrafterProposer` or None (block size 1); lookup: a `LookupProposer`;
    width: the widest verify pass (`DecodeConfig.verify_width`); span: the deepest path one step can accept plus 1
    (`DecodeConfig.depth_span`); policy: what each step drafts and verifies (`policy/`; default: all of it).
    """

    def __init__(self, target, drafter: DrafterProposer | None, lookup: LookupProposer, width: int, span: int,
                 max_len: int, eos_ids: set[int] | None = None, tokenizer=None, policy=None):
        self.target, self.drafter, self.lookup = target, drafter, lookup
        self.policy = policy or FixedPolicy()
        self.width, self.span, self.max_len = width, span, max_len
        self.eos_ids, self.tokenizer = set(eos_ids or ()), tokenizer
        self.seqs: list[SeqState] = []
        self.starts: list[int] = []  # host copy of `start`
        self.tcache = self.dstate = self.sampler = None
        self._reserved = 0  # rows `reserve` asked for
        self.start = self.anchor = None  # [b] the anchor's position, [b] the anchor (last committed token)

    @property
    def alive(self) -> bool:
        return any(not s.finished for s in self.seqs)

    def cancel(self, index: int) -> None:
        """Stop a sequence (e.g. its client went away); its row leaves the batch at the next compaction."""
        for s in self.seqs:
            if s.index == index and not s.finished:
                s.finished, s.finish_reason = True, "cancelled"

    # ---- rows join and leave ------------------------------------------------------------------------------
    @torch.inference_mode()
    def add(self, seqs: list[SeqState]) -> list[StepOutput]:
        """Prefill new sequences and join them to the batch; returns their first tokens.

        A sequence that already has tokens (`generated`) resumes: its prompt and all but its last token are
        prefilled, and the last one is the anchor, as if it had decoded here all along (the server's recovery
        after a failed step). Its sampled tokens are drawn by position (`sampling.py`): it goes on as it would have.
        Prompts of similar length are prefilled together (`prefill_groups`); nothing joins until all are done, so a
        failed `add` joins nothing."""
        self._check_fits(seqs)
        ctx = [prefill_context(s) for s in seqs]
        return self._join_parts([self._prefill([seqs[i] for i in g], [ctx[i] for i in g])
                                 for g in prefill_groups([len(c) for c in ctx])])

    def _check_fits(self, seqs: list[SeqState]) -> None:
        if any(cache_positions(len(s.prompt), s.max_new_tokens, self.width) > self.max_len for s in seqs):
            raise DFlashError(f"a request needs more than the batch's {self.max_len} cache positions; "
                              "shorten the prompt or lower max_new_tokens.")

    def begin_prefill(self, seq: SeqState) -> PromptPrefill:
        """A sequence to prefill in chunks (`prefill_chunk`), joining the batch after its last one."""
        self._check_fits([seq])
        ctx = prefill_context(seq)
        return PromptPrefill(seq, ctx, self.target.new_cache(1, len(ctx)))

    @torch.inference_mode()
    def prefill_chunk(self, pp: PromptPrefill, n: int) -> list[StepOutput] | None:
        """Prefill the next `n` tokens of `pp`; after the last chunk the sequence joins the batch and its first
        token is returned as `add` returns it. None while tokens remain.
        Why the result does not depend on the chunks: each token's K/V and hidden state are computed from its own
        row, its position and the keys before it, whatever shares the pass (the lean target's row invariance)."""
        a, z = pp.done, min(pp.done + n, len(pp.ctx))
        dev = self.target.device
        ids = torch.tensor([pp.ctx[a:z]], dtype=torch.long, device=dev)
        # positions a..z-1 at slots a..z-1 of the prompt's own cache; each sees the slots up to its own position
        hidden, feats = self.target.forward(ids, torch.arange(a, z, device=dev)[None], pp.tcache, kv_len=z,
                                            taps=self.drafter is not None)
        if feats is not None:
            pp.feats.append(feats)
        pp.done = z
        if z < len(pp.ctx):
            return None
        feats = torch.cat(pp.feats, 1) if pp.feats else None
        return self._join_parts([self._prefilled([pp.seq], [z], pp.tcache, hidden[:, -1:], feats)])

    def _join_parts(self, parts: list) -> list[StepOutput]:
        """Join prefilled groups (`_prefilled`'s results) to the batch; the fresh sequences' first tokens."""
        firsts = []
        for group, first, lps, state in parts:
            self._join(group, *state)
            firsts += [(s, tok, lps[i] if lps else None) for i, (s, tok) in enumerate(zip(group, first))]
        now = time.perf_counter()
        out = []
        for s, tok, lp in firsts:
            if s.generated:  # a resumed sequence: its anchor is its last token, nothing new to hand out
                continue
            s.t_first = now
            s.stats.ttft_s = now - s.t_arrival
            out.append(s.commit([tok], self.eos_ids, self.tokenizer, lp))
        return out

    def _prefill(self, seqs: list[SeqState], ctx: list[list[int]]):
        """One forward over the contexts `ctx` of `seqs`, right-padded: (seqs, their first tokens, their
        log-probabilities or None, what `_join` takes)."""
        tgt = self.target
        dev, n = tgt.device, len(seqs)
        lens = [len(c) for c in ctx]
        P = max(lens)
        tcache = tgt.new_cache(n, P)  # the prompts' own cache: `_join` copies their P slots into the batch's
        # Right-padded prompts at positions 0..P-1 (padding slots are never visible, see cache.py).
        ids = torch.zeros((n, P), dtype=torch.long)
        for i, c in enumerate(ctx):
            ids[i, : lens[i]] = torch.tensor(c, dtype=torch.long)
        pos = torch.arange(P, device=dev).expand(n, P)
        hidden, feats = tgt.forward(ids.to(dev), pos, tcache, kv_len=P, taps=self.drafter is not None)
        last = torch.tensor(lens, device=dev) - 1
        return self._prefilled(seqs, lens, tcache, hidden[torch.arange(n, device=dev), last][:, None], feats)

    def _prefilled(self, seqs: list[SeqState], lens: list[int], tcache, last_hidden: torch.Tensor,
                   feats: torch.Tensor | None):
        """After the prefill forward of `seqs` (contexts of `lens` tokens in `tcache`): last_hidden [n, 1, H] the last
        context token's final-normed hidden state, feats [n, P, k*H] or None. Returns (seqs, their first tokens,
        their log-probabilities or None, what `_join` takes)."""
        tgt = self.target
        dev, n, P = tgt.device, len(seqs), max(lens)
        pos = torch.arange(P, device=dev).expand(n, P)
        last = torch.tensor(lens, device=dev) - 1
        sampler = Sampler([s.params for s in seqs], dev)
        logits = tgt.logits(last_hidden)  # [n, 1, V]
        first = sampler(logits, lens)  # [n, 1] the token at position len(ctx)
        fresh = torch.tensor([not s.generated for s in seqs], device=dev)
        lps = token_logprobs(logits, first, seqs)
        known = torch.tensor([s.generated[-1] if s.generated else 0 for s in seqs], device=dev)
        anchor = torch.where(fresh, first[:, 0], known)
        dstate = self.drafter.prefill(feats, pos, last, self.max_len) if self.drafter else None
        return seqs, first[:, 0].tolist(), lps, (tcache, dstate, sampler, last + 1, anchor, lens)

    def _own_tcache(self):
        """The batch's target cache: max_len slots per row, reused by the rows that join later."""
        if self.tcache is None:
            self.tcache = self.target.new_cache(0, self.max_len)
        return self.tcache

    def reserve(self, rows: int) -> None:
        """Allocate the target cache's store for `rows` rows now (a server: its --max-batch), not as rows join."""
        self._own_tcache().reserve(rows)
        self._reserved = rows  # the drafter's feature store too, when the first rows join (`_join`)

    def _join(self, seqs, tcache, dstate, sampler, start, anchor, starts) -> None:
        self._own_tcache().extend(tcache)
        if dstate is not None and self.dstate is None:  # the batch's own: features of max_len positions per row
            self.dstate = dstate.empty(self.max_len)
            self.dstate.feats.reserve(self._reserved)
        if dstate is not None:
            self.dstate.extend(dstate)
        if not self.seqs:
            self.seqs, self.starts = list(seqs), list(starts)
            self.sampler, self.start, self.anchor = sampler, start, anchor
            return
        self.sampler.extend(sampler)
        self.start, self.anchor = torch.cat([self.start, start]), torch.cat([self.anchor, anchor])
        self.seqs += seqs
        self.starts += list(starts)

    def _compact(self) -> None:
        """Drop finished rows: each hole is filled by a live row from the end of the batch (so a finished row
        costs one row's move, not a shift of every row after it; row order carries no meaning)."""
        live = [i for i, s in enumerate(self.seqs) if not s.finished]
        n = len(live)
        tail = iter(i for i in live if i >= n)
        keep = [i if not self.seqs[i].finished else next(tail) for i in range(n)]
        rows = torch.tensor(keep, dtype=torch.long, device=self.target.device)
        # Why max(starts) slots: a row's committed context sits at positions < start (the anchor, at start, has no
        # K/V yet, in the target's cache or the drafter's); every slot from start on is rewritten by the forward
        # that next reads it. So only those are copied when a row moves.
        used = max(self.starts, default=0)
        self.tcache.select(rows, used)
        if self.dstate is not None:
            self.dstate.select(rows, used)
        self.start, self.anchor = self.start[rows], self.anchor[rows]
        self.sampler.select(keep)
        self.seqs = [self.seqs[i] for i in keep]
        self.starts = [self.starts[i] for i in keep]

    # ---- one step -----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One propose -> verify -> commit cycle for every sequence in the batch."""
        n_alive = sum(not s.finished for s in self.seqs)
        # Finished rows leave the batch before the next forward: a row riding along frozen costs a row of every
        # pass, while compaction moves at most one row per finished one, its used slots only (`_compact`).
        if n_alive < len(self.seqs):
            self._compact()
        if not self.seqs:
            return []
        t0 = time.perf_counter()
        live = [not s.finished for s in self.seqs]
        plan, tree = self._propose(live)
        # Verify: node i sits in slot start + i at position start + depth(i) (RoPE), sees its ancestors only.
        kv_len = max(self.starts) + tree.width
        where = verify_inputs(tree, self.start, kv_len)
        hidden, feats = self.target.forward(tree.tokens, where.positions, self.tcache, kv_len=kv_len,
                                            taps=self.drafter is not None, slots=where.slots, visible=where.visible)
        logits = self.target.logits(hidden)  # [b, W, V]
        # [b, W] the target's own token after each node: node i's choice is the token at position start + depth + 1
        choices = self.sampler(logits, [s + 1 for s in self.starts], tree.depth, tree.max_depth)
        out, outcome = self._commit(tree, logits, choices, feats, live)
        outcome.ms = 1000 * (time.perf_counter() - t0)
        self.policy.observe(plan, outcome)
        return out

    def _propose(self, live: list[bool]) -> tuple[Plan, DraftTree]:
        """The step's plan and draft tree: the lookup branch merged into the drafter's chain or tree (either may be
        empty), cut to what the policy finds worth verifying. A step that skips the drafter leaves its pending
        features for its next forward (`DraftState`)."""
        ctx = max(self.starts)
        view = StepView(live, [s.key for s in self.seqs], ctx,
                        self.dstate.pending(ctx) if self.dstate is not None else len(self.seqs),
                        self.drafter is not None, lambda: self.lookup.propose(self.seqs))
        plan = self.policy.plan(view)
        # The lookup branch, per row on the host: none on a plain AR step (decided before any host work), else the
        # proposal, cut where the policy cut each row's branch before the tree is built.
        branch = view.lookup().tokens if plan.look else None
        if branch is not None and plan.lookup_keep is not None:
            branch = [p[:n] for p, n in zip(branch, plan.lookup_keep)]
        draft = None
        if plan.draft:
            draft = self.drafter.propose(self.dstate, DraftView(self.anchor, self.start, ctx, self.seqs, self.starts),
                                         scores=plan.scores, block=plan.block)
        tree = build(self.anchor, draft, branch)
        if draft is not None:
            cut = self.policy.cut(plan, tree)
            if cut is not None:
                tree = prune(tree, cut.keep, cut.width, cut.depth)
        return plan, tree

    def _commit(self, tree: DraftTree, logits: torch.Tensor, choices: torch.Tensor, feats: torch.Tensor | None,
                live: list[bool]) -> tuple[list[StepOutput], StepOutcome]:
        """Accept, roll back and commit: the one place where a step's outcome changes the batch's state.

        Every committed token is the target's own choice given exactly the committed prefix (`tree.accept`), so
        output is exact at any temperature. Slots past the accepted path keep stale K/V at positions >= the new
        start: invisible until those positions are committed and rewritten (`cache.py`)."""
        R, dev = self.span, self.target.device
        left = [0 if s.finished else s.max_new_tokens - len(s.generated) for s in self.seqs]  # tokens still owed
        got = accepted(tree, choices, R)  # the path [b, R] on the device; tokens, depths, nodes, counts on the host
        lps = token_logprobs(logits, got.tokens, self.seqs, nodes=got.path)
        # Bring the accepted path to slot == position (a branch node's K/V sits m slots further right).
        # Node d of a row's path sits at slot start + nodes[d]; the nodes off their slot move (host lists).
        moves = [[d for d in range(a + 1) if nodes[d] != d] for nodes, a in zip(got.nodes, got.depth)]
        if any(moves):
            self.tcache.move([[s + nodes[d] for d in m] for s, nodes, m in zip(self.starts, got.nodes, moves)],
                             [[s + d for d in m] for s, m in zip(self.starts, moves)])
        if self.drafter is not None:
            # The drafter's context: the accepted path's features at their positions (self.starts: `start` on the
            # host). Past a, the path repeats the end node: those entries rewrite the last accepted node's feature at
            # its own position, harmlessly. A plain step's path is the anchor alone.
            D1 = tree.max_depth + 1
            self.dstate.append_path(feats, [n[:D1] for n in got.nodes],
                                    [[s + min(d, a) for d in range(D1)] for s, a in zip(self.starts, got.depth)])
        self.anchor = torch.tensor([t[a] for t, a in zip(got.tokens, got.depth)], device=dev)  # the bonus: next anchor
        # Why capped by what each row is still owed: a row whose budget ends inside the accepted path finishes and
        # rides along frozen until compaction; its start must stay within prompt + max_new_tokens, or the next
        # verify's slots (start + tree width) run past the cache, which is sized by exactly that. Finished rows: 0.
        advance = [min(a + 1, n) for a, n in zip(got.depth, left)]
        self.starts = [s + n for s, n in zip(self.starts, advance)]
        self.start = torch.tensor(self.starts, device=dev)
        now = time.perf_counter()
        out = []
        for i, s in enumerate(self.seqs):
            if s.finished:
                continue
            a_i = got.depth[i]
            s.stats.accepted.append(a_i)
            s.stats.count_drafts(*got.counts[i])
            out.append(s.commit(got.tokens[i][: a_i + 1], self.eos_ids, self.tokenizer,
                                lps[i][: a_i + 1] if lps else None))
            s.stats.decode_s = now - s.t_first
        outcome = StepOutcome(tokens=got.tokens, accepted=got.depth, path=got.nodes, live=live, ms=0.0)
        return out, outcome


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor | list, seqs: list[SeqState],
                   nodes: torch.Tensor | None = None) -> list | None:
    """logits [b, W, V] (the rows of `nodes` [b, T] if given, else all W = T), tokens [b, T] -> per row, per token:
    (its log-probability under the target's raw distribution, the k most likely (id, log-probability)), k = the
    row's `logprobs_k`. None when no row asked (the common case: no extra work, no extra host sync)."""
    ks = [s.logprobs_k for s in seqs if s.logprobs_k is not None and not s.finished]
    if not ks:
        return None
    if nodes is not None:
        logits = logits.gather(1, nodes[:, :, None].expand(*nodes.shape, logits.shape[-1]))
    lp = logits.float().log_softmax(-1)
    tokens = torch.as_tensor(tokens, device=logits.device)
    chosen = lp.gather(-1, tokens[..., None])[..., 0].tolist()
    top_v, top_i = lp.topk(max(max(ks), 1), dim=-1)
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [[(chosen[r][t], list(zip(top_i[r][t], top_v[r][t]))[: s.logprobs_k or 0]) for t in range(len(chosen[r]))]
            for r, s in enumerate(seqs)]
