"""The decoding loop: batched, streaming, lossless DFlash speculative decoding.

One cycle per step, for every active sequence at once (dflash-spec §2-3):
  1. draft:  the drafter ingests the context features committed last step, then runs ONE forward over
             `[anchor, MASK x (B-1)]` and proposes B-1 argmax tokens;
  2. verify: the target runs ONE forward over `[anchor, drafts]` and chooses its own token at each slot;
  3. commit: the longest agreeing prefix plus the bonus token (`verify.py`); each row advances by its
             own count. The only host sync per step is reading those choices and counts.
`block_size == 1` skips the drafter: the same loop is then plain autoregressive decoding (the baseline).
With a drafter tree (`tree > 0`: the drafter's `tree` most likely paths through its top-k tokens per slot)
or n-gram lookup on (`lookup.py`: a branch copied from earlier in the sequence), step 2 verifies a draft TREE
instead (`tree.py`), still in one target pass.

`DFlashEngine.stream` is THE generator; `generate`, the CLI, the benchmark and the server consume it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from .cache import PositionCache
from .drafter import DFlashDrafter
from .errors import DFlashError
from .sampling import Sampler, SamplingParams
from .stats import GenerationStats
from .lookup import LookupParams, propose
from .target import Target
from .tree import accept, build, chain_nodes, topk_tree, verify_mask
from .verify import accepted_lengths

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one step added to one sequence."""

    index: int  # the sequence's index in the prompts given to `stream`
    tokens: list[int]  # newly committed tokens (already cut at EOS / stop string / max_new_tokens)
    finished: bool
    finish_reason: str | None  # "stop" (EOS or stop string) or "length"
    stats: GenerationStats


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str | None
    stats: GenerationStats
    text: str | None = None


@dataclass
class _Seq:
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


def cache_positions(prompt_len: int, max_new_tokens: int, width: int) -> int:
    """Cache slots a sequence can touch: its prompt, its new tokens, and one verify pass (`width` slots:
    the block, or the whole draft tree) past the last one."""
    return prompt_len + max_new_tokens + width + 1


def check_compatible(drafter: DFlashDrafter, target: Target) -> None:
    c = drafter.config
    remedy = "the drafter was built for another target: train one for this target (`dflashkit train`) or pick its own target."
    if c.hidden_size != target.hidden_size:
        raise DFlashError(f"drafter hidden_size {c.hidden_size} != target hidden_size {target.hidden_size}; {remedy}")
    if c.vocab_size != target.vocab_size:
        raise DFlashError(f"drafter vocab_size {c.vocab_size} != target vocabulary {target.vocab_size}; {remedy}")
    if c.num_target_layers != target.num_layers:
        raise DFlashError(f"drafter expects a target with {c.num_target_layers} layers, this one has {target.num_layers}; {remedy}")
    d2t = drafter.draft_to_target_ids()
    if d2t is not None and (d2t.min() < 0 or d2t.max() >= target.vocab_size):
        raise DFlashError("the drafter's draft->target vocabulary map points outside the target vocabulary; re-export the drafter.")


class DFlashEngine:
    def __init__(self, target: Target, drafter: DFlashDrafter | None = None, tokenizer=None,
                 block_size: int | None = None, eos_token_ids: Sequence[int] | None = None,
                 lookup: LookupParams | None = None, tree: int = 0, tree_min_prob: float = 0.0,
                 draft_vocab: int = 0):
        self.target = target
        self.lookup = lookup or LookupParams()
        self.tree = self._check_tree(tree)
        if not 0.0 <= tree_min_prob < 1.0:
            raise DFlashError(f"tree_min_prob must be in [0, 1) (got {tree_min_prob}); 0 keeps all `tree` nodes.")
        self.tree_min_prob = float(tree_min_prob)
        self.drafter = drafter
        self.tokenizer = tokenizer
        if drafter is not None:
            check_compatible(drafter, target)
            target.set_taps(drafter.config.target_layer_ids)
            drafter.to(device=target.device, dtype=target.dtype).eval()
            d2t = drafter.draft_to_target_ids()
            if draft_vocab:
                d2t = self._frequent_ids(drafter, draft_vocab)
            # Reduced draft vocabulary: draft logits over a row subset of the target's LM head. Verification
            # still uses the full vocabulary, so output stays exact; only the proposals are restricted.
            self._d2t = d2t.to(target.device) if d2t is not None else None
            self._draft_head = target.lm_head_weight[self._d2t] if d2t is not None else None
        self.block_size = self._check_block_size(block_size if block_size is not None else
                                                 (drafter.config.block_size if drafter else 1))
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
            eos_token_ids = [] if eos is None else [eos]
        self.eos_token_ids = set(eos_token_ids)

    @staticmethod
    def _frequent_ids(drafter: DFlashDrafter, n) -> torch.Tensor:
        """The drafter's n most frequent training ids: drafting over them only reads n rows of the LM head."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise DFlashError(f"draft_vocab must be an integer >= 1, or 0 for the full vocabulary (got {n!r}).")
        if drafter.d2t is not None:
            raise DFlashError("this drafter was trained with its own reduced draft vocabulary; leave draft_vocab at 0.")
        ranking = drafter.token_ranking
        if ranking is None:
            raise DFlashError("draft_vocab needs the drafter's token_ranking.json (its training ids by frequency; see "
                              "docs/training.md); this drafter has none, so use draft_vocab 0 (the full vocabulary).")
        if n > len(ranking):
            raise DFlashError(f"draft_vocab {n} exceeds the {len(ranking)} ids the drafter's token ranking holds.")
        return torch.tensor(sorted(ranking[:n]), dtype=torch.long)

    def _drafted(self, block_size: int, tree: int | None) -> tuple[int, int]:
        """(drafter nodes per step, their deepest depth): the chain's B-1, or a tree's n nodes within B-1 slots."""
        tree = self.tree if tree is None else tree
        if block_size == 1:
            return 0, 0
        return (tree, min(tree, block_size - 1)) if tree else (block_size - 1, block_size - 1)

    def verify_width(self, block_size: int, lookup: LookupParams | None = None, tree: int | None = None) -> int:
        """Tokens one verify pass holds: the anchor, the drafter's nodes, and the lookup branch when lookup is on."""
        return 1 + self._drafted(block_size, tree)[0] + (lookup or self.lookup).max_tokens

    def depth_span(self, block_size: int, lookup: LookupParams | None = None, tree: int | None = None) -> int:
        """1 + the deepest draft position (the most tokens one step can commit)."""
        return 1 + max(self._drafted(block_size, tree)[1], (lookup or self.lookup).max_tokens)

    @staticmethod
    def _check_tree(n) -> int:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise DFlashError(f"tree size must be an integer >= 0 (got {n!r}); 0 drafts the plain chain.")
        return n

    def _check_block_size(self, b) -> int:
        if not isinstance(b, int) or b < 1:
            raise DFlashError(f"block size must be an integer >= 1 (got {b}); 1 means plain autoregressive decoding.")
        if b > 1 and self.drafter is None:
            raise DFlashError("block size > 1 needs a drafter; pass --drafter or use --block-size 1.")
        return b

    # ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def stream(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
               max_new_tokens: int | Sequence[int] = 256, stop: Sequence[str] | None = None,
               block_size: int | None = None, lookup: LookupParams | None = None,
               tree: int | None = None) -> Iterator[list[StepOutput]]:
        """Decode a batch of token-id prompts; yields, per step, the new tokens of each sequence that got some.

        lookup, tree: override the engine's lookup setting (`LookupParams()` = off) and drafter tree size
        (0 = the chain) for this call."""
        lookup = lookup or self.lookup
        tree = self.tree if tree is None else self._check_tree(tree)
        Q = self._check_block_size(block_size if block_size is not None else self.block_size)
        n = len(prompts)
        if n == 0:
            return
        params = [sampling] * n if isinstance(sampling, SamplingParams) else list(sampling)
        max_new = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(params) != n or len(max_new) != n:
            raise DFlashError("give one sampling setting and one max_new_tokens per prompt (or a single one for all).")
        stop = [x for x in (stop or []) if x]
        for i, p in enumerate(prompts):  # validate all before any work starts
            try:
                self.validate(p, max_new[i], stop)
            except DFlashError as e:
                raise DFlashError(f"prompt {i}: {e}") from None

        seqs = [self.sequence(i, p, params[i], max_new[i], stop, Q, lookup, tree) for i, p in enumerate(prompts)]
        W = self.verify_width(Q, lookup, tree)
        batch = DecodeBatch(self, Q, max(cache_positions(len(p), m, W) for p, m in zip(prompts, max_new)), lookup, tree)
        yield batch.add(seqs)
        while batch.alive:
            yield batch.step()

    def sequence(self, index: int, prompt: Sequence[int], sampling: SamplingParams = SamplingParams(),
                 max_new_tokens: int = 256, stop: Sequence[str] | None = None, block_size: int | None = None,
                 lookup: LookupParams | None = None, tree: int | None = None) -> _Seq:
        """A validated sequence ready to join a `DecodeBatch` (the server's entry point)."""
        stop = [x for x in (stop or []) if x]
        self.validate(prompt, max_new_tokens, stop)
        Q = block_size if block_size is not None else self.block_size
        return _Seq(index, list(prompt), max_new_tokens, GenerationStats(block_size=self.depth_span(Q, lookup, tree), prompt_tokens=len(prompt)),
                    sampling, stop, t_arrival=time.perf_counter())

    def validate(self, prompt: Sequence[int], max_new_tokens: int, stop: Sequence[str] | None = None) -> None:
        """Raise DFlashError if one request cannot run (the server checks requests before queueing them)."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise DFlashError(f"max_new_tokens must be an integer >= 1 (got {max_new_tokens}).")
        if len(prompt) == 0:
            raise DFlashError("the prompt is empty; give at least one token.")
        if len(prompt) + max_new_tokens > self.target.max_positions:
            raise DFlashError(
                f"the prompt has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} it exceeds the target's "
                f"context of {self.target.max_positions} positions. Shorten the prompt or lower max_new_tokens.")
        if stop and self.tokenizer is None:
            raise DFlashError("stop strings need a tokenizer; create the engine with one.")

    def _draft_cache(self, n: int, max_len: int) -> PositionCache:
        c = self.drafter.config
        return PositionCache(c.num_hidden_layers, n, c.num_key_value_heads, max_len, c.head_dim,
                             self.target.dtype, self.target.device)

    def _draft(self, dcache, feats, feat_pos, anchor, blk_pos, start, ctx_len: int, seqs: list[_Seq],
               k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Ingest pending context features [b, R, k*H] at feat_pos [b, R]; draft from `anchor` [b] at blk_pos [b, Q].

        Returns the drafter's k best tokens per block slot 1..B-1 as target ids [b, Q-1, k], best first, and
        their log-probabilities [b, Q-1, k] (float32). (`seqs`, the rows' host state with their committed
        tokens, is unused here; test oracles that replace this method read it.)
        """
        dr, c = self.drafter, self.drafter.config
        self._ingest(dcache, feats, feat_pos)
        b, Q = blk_pos.shape
        # Why mask_token_id: slots 1..B-1 are embedded as the mask token the drafter was trained with;
        # a different id does not crash, it just drafts garbage.
        block = torch.full((b, Q), c.mask_token_id, dtype=torch.long, device=anchor.device)
        block[:, 0] = anchor
        # Block queries see context slots strictly before the anchor (its own feature does not exist yet)
        # and all B block tokens (bidirectional).
        ctx_vis = torch.arange(ctx_len, device=anchor.device) < start[:, None]  # [b, ctx_len]
        mask = torch.cat([ctx_vis[:, None, None, :].expand(b, 1, Q, ctx_len),
                          torch.ones((b, 1, Q, Q), dtype=torch.bool, device=anchor.device)], dim=-1)
        ctx_kv = [(dcache.keys[l][:, :, :ctx_len], dcache.values[l][:, :, :ctx_len]) for l in range(c.num_hidden_layers)]
        h = dr(self.target.embed(block), blk_pos, ctx_kv, mask)
        # Same-position prediction: output slot j (j >= 1) proposes the token AT position anchor + j;
        # slot 0 (the anchor itself) is discarded.
        logits = self.target.logits(h[:, 1:], self._draft_head)
        if k == 1:  # the chain needs no probabilities: skip the softmax (max, not bf16 argmax: see sampling.py)
            drafts = logits.max(-1, keepdim=True).indices
            logp = torch.zeros(drafts.shape, dtype=torch.float32, device=drafts.device)
        else:
            logp, drafts = logits.float().log_softmax(-1).topk(k, dim=-1)
        return (self._d2t[drafts] if self._d2t is not None else drafts), logp

    def _ingest(self, dcache, feats, feat_pos) -> None:
        """Write the context K/V of features [b, R, k*H] at positions feat_pos [b, R] into the draft cache."""
        dr = self.drafter
        for layer, (k, v) in enumerate(dr.context_kv(dr.fuse(feats), feat_pos)):
            dcache.write(layer, k, v, feat_pos)

    def _commit(self, s: _Seq, tokens: list[int]) -> StepOutput:
        """Append tokens to `s`, cutting at EOS, max_new_tokens, or a stop string (also mid-block)."""
        before = len(s.generated)
        for tok in tokens:
            s.generated.append(tok)
            if tok in self.eos_token_ids:
                s.finished, s.finish_reason = True, "stop"
                break
            if len(s.generated) >= s.max_new_tokens:
                s.finished, s.finish_reason = True, "length"
                break
        if s.stop:
            cut = self._stop_cut(s.generated, before, s.stop)
            if cut is not None:
                del s.generated[cut:]
                s.finished, s.finish_reason = True, "stop"
        s.stats.new_tokens = len(s.generated)
        return StepOutput(s.index, s.generated[before:], s.finished, s.finish_reason, s.stats)

    def _stop_cut(self, gen: list[int], before: int, stop: list[str]) -> int | None:
        """Smallest token count k > before such that the tail of gen[:k] contains a stop string."""
        ctx = max(len(x) for x in stop) + 2  # tokens of look-back: a stop string may straddle the step boundary
        lo = max(0, before - ctx)
        dec = self.tokenizer.decode
        if not any(x in dec(gen[lo:]) for x in stop):
            return None
        for k in range(before + 1, len(gen) + 1):
            if any(x in dec(gen[lo:k]) for x in stop):
                return k
        return None

    # ---------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], **kwargs) -> list[Generation]:
        """Run `stream` to the end; returns one Generation per prompt, in order."""
        toks: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        last: dict[int, StepOutput] = {}
        for step in self.stream(prompts, **kwargs):
            for o in step:
                toks[o.index].extend(o.tokens)
                last[o.index] = o
        gens = []
        for i in range(len(prompts)):
            g = Generation(toks[i], last[i].finish_reason, last[i].stats)
            if self.tokenizer is not None:
                g.text = self.decode(toks[i], kwargs.get("stop"))
            gens.append(g)
        return gens

    def decode(self, tokens: list[int], stop: Sequence[str] | None = None) -> str:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        for x in stop or []:
            if x and x in text:
                text = text[: text.index(x)]
        return text


class DecodeBatch:
    """The running batch: the device state of every sequence in it plus their host-side records.

    Sequences join between steps (`add`: prefilled on their own, then concatenated) and leave between steps
    (finished or cancelled rows are dropped by `index_select`). `DFlashEngine.stream` runs one closed batch
    through it; the server keeps one open and lets requests come and go (continuous batching).
    """

    def __init__(self, engine: DFlashEngine, block_size: int, max_len: int, lookup: LookupParams | None = None,
                 tree: int | None = None):
        self.engine, self.Q, self.max_len = engine, block_size, max_len
        self.lookup = lookup or engine.lookup
        self.use_draft = block_size > 1
        self.tree = (engine.tree if tree is None else tree) if self.use_draft else 0
        self.use_tree = self.lookup.enabled or self.tree > 0
        self.width = engine.verify_width(block_size, self.lookup, self.tree)
        # Pending context features are kept at one width for all rows (rows join and leave): a block, or
        # the deepest path a draft tree can accept.
        self.pend_width = engine.depth_span(block_size, self.lookup, self.tree) if self.use_tree else block_size
        self.seqs: list[_Seq] = []
        self.starts: list[int] = []  # host copy of `start`
        self.tcache = self.dcache = self.sampler = None
        self.start = self.anchor = self.pend_feats = self.pend_pos = None
        self._arange_q = torch.arange(block_size, device=engine.target.device)

    @property
    def alive(self) -> bool:
        return any(not s.finished for s in self.seqs)

    def cancel(self, index: int) -> None:
        """Stop a sequence (e.g. its client went away); its row leaves the batch at the next compaction."""
        for s in self.seqs:
            if s.index == index and not s.finished:
                s.finished, s.finish_reason = True, "cancelled"

    @torch.inference_mode()
    def add(self, seqs: list[_Seq]) -> list[StepOutput]:
        """Prefill new sequences and join them to the batch; returns their first tokens."""
        eng, tgt = self.engine, self.engine.target
        dev, n = tgt.device, len(seqs)
        lens = [len(s.prompt) for s in seqs]
        P = max(lens)
        if any(cache_positions(l, s.max_new_tokens, self.width) > self.max_len for l, s in zip(lens, seqs)):
            raise DFlashError(f"a request needs more than the batch's {self.max_len} cache positions; "
                              "shorten the prompt or lower max_new_tokens.")
        tcache = tgt.new_cache(n, self.max_len)
        # Right-padded prompts at positions 0..P-1 (padding slots are never visible, see cache.py).
        ids = torch.zeros((n, P), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : lens[i]] = torch.tensor(s.prompt, dtype=torch.long)
        pos = torch.arange(P, device=dev).expand(n, P)
        hidden, feats = tgt.forward(ids.to(dev), pos, tcache, kv_len=P, taps=self.use_draft)
        last = torch.tensor(lens, device=dev) - 1
        sampler = Sampler([s.params for s in seqs], dev)
        first = sampler(tgt.logits(hidden[torch.arange(n, device=dev), last][:, None]))[:, 0]  # [n]
        dcache = pend_feats = pend_pos = None
        if self.use_draft:
            # The prompt's features go into the new rows' draft cache right away. What stays "pending" for
            # the next draft call is a harmless rewrite: the last prompt feature at its own position, repeated
            # so that pending rows have the same width for every sequence in the batch.
            dcache = eng._draft_cache(n, self.max_len)
            dr = eng.drafter
            for layer, (k, v) in enumerate(dr.context_kv(dr.fuse(feats), pos)):
                dcache.write(layer, k, v, pos)
            rows = torch.arange(n, device=dev)
            R = self.pend_width
            pend_feats = feats[rows, last][:, None].expand(n, R, feats.shape[-1]).contiguous()
            pend_pos = last[:, None].expand(n, R).contiguous()
        self._join(seqs, tcache, dcache, sampler, last + 1, first, pend_feats, pend_pos, lens)
        host_first = first.tolist()
        now = time.perf_counter()
        out = []
        for s, tok in zip(seqs, host_first):
            s.t_first = now
            s.stats.ttft_s = now - s.t_arrival
            out.append(eng._commit(s, [tok]))
        return out

    def _join(self, seqs, tcache, dcache, sampler, start, anchor, pend_feats, pend_pos, starts) -> None:
        if not self.seqs:
            self.seqs, self.starts = list(seqs), list(starts)
            self.tcache, self.dcache, self.sampler = tcache, dcache, sampler
            self.start, self.anchor, self.pend_feats, self.pend_pos = start, anchor, pend_feats, pend_pos
            return
        self.tcache.extend(tcache)
        if dcache is not None:
            self.dcache.extend(dcache)
            self.pend_feats = torch.cat([self.pend_feats, pend_feats])
            self.pend_pos = torch.cat([self.pend_pos, pend_pos])
        self.sampler.extend(sampler)
        self.start, self.anchor = torch.cat([self.start, start]), torch.cat([self.anchor, anchor])
        self.seqs += seqs
        self.starts += list(starts)

    def _compact(self) -> None:
        keep = [i for i, s in enumerate(self.seqs) if not s.finished]
        rows = torch.tensor(keep, dtype=torch.long, device=self.engine.target.device)
        self.tcache.select(rows)
        if self.dcache is not None:
            self.dcache.select(rows)
            self.pend_feats, self.pend_pos = self.pend_feats[rows], self.pend_pos[rows]
        self.start, self.anchor = self.start[rows], self.anchor[rows]
        self.sampler.select(keep)
        self.seqs = [self.seqs[i] for i in keep]
        self.starts = [self.starts[i] for i in keep]

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One draft -> verify -> commit cycle for every sequence in the batch."""
        eng, tgt, Q = self.engine, self.engine.target, self.Q
        n_alive = sum(not s.finished for s in self.seqs)
        # Finished rows leave the batch, but compaction copies every cache, so a big batch waits until a
        # quarter of its rows are done; until then they ride along frozen (start does not advance).
        if n_alive < len(self.seqs) and (n_alive == 0 or (len(self.seqs) - n_alive) * 4 >= len(self.seqs)):
            self._compact()
        if not self.seqs:
            return []
        b, dev = len(self.seqs), tgt.device
        live = torch.tensor([not s.finished for s in self.seqs], device=dev) if n_alive < b else None
        if self.use_tree:
            return self._tree_step(live)
        blk_pos = self.start[:, None] + self._arange_q  # [b, Q] positions of the block
        if self.use_draft:
            drafts, _ = eng._draft(self.dcache, self.pend_feats, self.pend_pos, self.anchor, blk_pos, self.start,
                                   max(self.starts), self.seqs)
            ids = torch.cat([self.anchor[:, None], drafts[..., 0]], dim=1)  # [b, Q]
        else:
            ids = self.anchor[:, None]
        hidden, feats = tgt.forward(ids, blk_pos, self.tcache, kv_len=max(self.starts) + Q, taps=self.use_draft)
        choices = self.sampler(tgt.logits(hidden))  # [b, Q] the target's own token for positions start+1 .. start+Q
        acc = accepted_lengths(ids[:, 1:], choices) if self.use_draft else torch.zeros(b, dtype=torch.long, device=dev)
        host = torch.cat([choices, acc[:, None].to(choices.dtype)], dim=1).tolist()  # the one host sync
        # Commit: tokens p_0..p_a (d_1..d_a equal p_0..p_{a-1}); the bonus p_a is the next anchor.
        self.anchor = choices.gather(1, acc[:, None].long())[:, 0]
        step = acc.long() + 1
        self.start = self.start + (step if live is None else step * live)
        # Features of the whole block go to the draft cache next step; rows past the accepted prefix sit
        # at positions >= the new start, invisible until those positions are committed and rewritten.
        self.pend_feats, self.pend_pos = feats, blk_pos
        now = time.perf_counter()
        out = []
        for i, (s, row) in enumerate(zip(self.seqs, host)):
            if s.finished:
                continue
            a = int(row[-1])
            self.starts[i] += a + 1
            s.stats.accepted.append(a)
            out.append(eng._commit(s, row[: a + 1]))
            s.stats.decode_s = now - s.t_first
        return out

    def _tree_step(self, live: torch.Tensor | None) -> list[StepOutput]:
        """One cycle with a draft tree: the drafter's chain or tree + the lookup branch, verified in one pass (`tree.py`)."""
        eng, tgt, lk = self.engine, self.engine.target, self.lookup
        b, dev = len(self.seqs), tgt.device
        # 1. lookup proposals, on the host where the committed tokens are (finished rows get none).
        props = [propose(s.prompt + s.generated, lk) if lk.enabled and not s.finished else ([], 0) for s in self.seqs]
        k = max(len(p) for p, _ in props)  # the branch is only as wide as the longest proposal (known on the host)
        branch = torch.zeros((b, k), dtype=torch.long)
        for i, (p, _) in enumerate(props):
            branch[i, :len(p)] = torch.tensor(p, dtype=torch.long)
        branch_len = torch.tensor([len(p) for p, _ in props], device=dev)
        branch = branch.to(dev)
        # 2. the DFlash chain, unless every live row has a long lookup match (then skip the drafter's forward;
        #    its context features are still ingested, or the draft cache would miss these positions).
        draft = None
        if self.use_draft:
            strong = lk.skip_drafter_n and all(n >= lk.skip_drafter_n for (_, n), s in zip(props, self.seqs)
                                               if not s.finished)
            if strong:
                eng._ingest(self.dcache, self.pend_feats, self.pend_pos)
            else:
                blk_pos = self.start[:, None] + self._arange_q
                # A tree of n nodes needs at most the n best tokens per slot (its beam is then exact, `topk_tree`).
                toks, logp = eng._draft(self.dcache, self.pend_feats, self.pend_pos, self.anchor, blk_pos, self.start,
                                        max(self.starts), self.seqs, k=min(self.tree, 16) if self.tree else 1)
                draft = (topk_tree(toks, logp, self.tree, eng.tree_min_prob) if self.tree
                         else chain_nodes(toks[..., 0]))
        tree = build(self.anchor, draft, branch, branch_len)
        # 3. verify: node i sits in slot start + i at position start + depth(i) (RoPE), sees its ancestors.
        W = tree.width
        kv_len = max(self.starts) + W
        slots = self.start[:, None] + torch.arange(W, device=dev)
        hidden, feats = tgt.forward(tree.tokens, self.start[:, None] + tree.depth, self.tcache, kv_len=kv_len,
                                    taps=self.use_draft, slots=slots, visible=verify_mask(tree, self.start, kv_len))
        choices = self.sampler(tgt.logits(hidden))  # [b, W] the target's token after each node
        a, path = accept(tree, choices)  # path: [b, D+1] node per depth (repeats the end past a)
        path = torch.cat([path, path[:, -1:].expand(b, self.pend_width - path.shape[1])], dim=1)
        committed = choices.gather(1, path)  # [b, R]; the first a+1 are this step's tokens
        host = torch.cat([committed, a[:, None], path], dim=1).tolist()  # the one host sync
        R = self.pend_width
        depth = torch.arange(R, device=dev)
        # 4. bring the accepted path to slot == position (a branch node's K/V sits m slots further right).
        if any(row[R + 1 + d] != d for row in host for d in range(row[R] + 1)):
            keep = depth[None] <= a[:, None]
            src = self.start[:, None] + torch.where(keep, path, depth[None])
            self.tcache.move(src, self.start[:, None] + depth[None])
        if self.use_draft:
            # The drafter's context for the next step: the features of the accepted path, at its positions
            # (entries past a sit at positions >= the new start: invisible until rewritten).
            self.pend_feats = feats.gather(1, path[:, :, None].expand(b, R, feats.shape[-1]))
            self.pend_pos = self.start[:, None] + depth[None]
        self.anchor = committed.gather(1, a[:, None])[:, 0]
        step = a + 1
        self.start = self.start + (step if live is None else step * live)
        now = time.perf_counter()
        out = []
        for i, (s, row) in enumerate(zip(self.seqs, host)):
            if s.finished:
                continue
            a_i = int(row[R])
            self.starts[i] += a_i + 1
            s.stats.accepted.append(a_i)
            out.append(eng._commit(s, row[: a_i + 1]))
            s.stats.decode_s = now - s.t_first
        return out
