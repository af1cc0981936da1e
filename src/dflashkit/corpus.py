"""Corpus lookup: draft tokens copied from the target's own earlier answers to other prompts.

The n-gram lookup (`lookup.py`) copies from the sequence itself; on a fresh chat answer it often finds nothing
(about a third of held-out positions match no suffix of two tokens or more). A small model answers in set phrases
("Here are some", "I'm sorry, but"), so the continuations it chose after the same words in other answers are a
free guess: the corpus is the target's own outputs (the regenerated answers its drafter was trained on), and the
proposal is verified like any other branch, so the output stays exactly the target's.

`Corpus` indexes every corpus position by the tokens that end there, read backwards (a suffix array of the
reversed text, `MAX_N` tokens deep). A query extends the match one token back at a time from the anchor, each a
binary search inside the previous range, so the longest matching suffix comes out of one pass; the proposal is
the continuation most of its occurrences share, token by token.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import kernels
from .errors import DFlashError

MAX_N = 8  # the deepest match the index sorts by (and so the longest suffix a query matches)
SAMPLED = 64  # occurrences read to choose the continuation (evenly spaced over the match's range)
FORWARD = 64  # the longest proposal (tokens read past a match)


@dataclass(frozen=True)
class CorpusMatch:
    """One query's answer: `tokens` to propose after the anchor, the matched suffix length `n` (0 = none),
    `support`, how many occurrences of the match continue with the proposal's first token, and `occurrences`, how
    many were read (at most SAMPLED)."""

    tokens: list[int]
    n: int
    support: int
    occurrences: int = 0

    @property
    def agreement(self) -> str:
        """How far the occurrences agree on the first token: "one" (a single occurrence), "hi" (>= 90 % of them),
        "mid" (>= 50 %) or "lo". Why the policy calibrates by it: on held-out prompts it predicts a copy far better
        than the match length does (first token right 0.12 of the time under 30 % agreement, 0.71 from 90 %)."""
        if self.occurrences <= 1:
            return "one"
        share = self.support / self.occurrences
        return "hi" if share >= 0.9 else "mid" if share >= 0.5 else "lo"


class Corpus:
    """tokens [T] int: answers joined with -1 between them (`from_answers`)."""

    def __init__(self, tokens: np.ndarray):
        t = np.asarray(tokens, dtype=np.int64)
        if t.ndim != 1 or t.size == 0 or t.min() < -1:
            raise DFlashError("a lookup corpus needs a non-empty 1-D array of token ids (-1 between answers).")
        top = int(t.max()) + 2  # stored ids are 0 (a border) .. max + 1
        self.bits = 16 if top <= 1 << 16 else 32
        dtype = np.uint16 if self.bits == 16 else np.uint32
        # Why the padding: a position's key reads MAX_N tokens back and a proposal reads forward; 0 (= -1 + 1)
        # on both sides ends a match or a continuation at the corpus' edges as at a border between answers.
        self.padded = np.concatenate([np.zeros(MAX_N, dtype), (t + 1).astype(dtype), np.zeros(FORWARD, dtype)])
        self.size, self.top = int(t.size), top
        self.order = self.starts = None  # the index, sorted on first use (~1.4 s for 3.3 M tokens)

    def prepare(self) -> "Corpus":
        """Build the index now (~1.4 s for 3.3 M tokens) rather than on the first `match`, e.g. at engine start,
        so the first request does not wait for it."""
        if self.order is None:
            self._index()
        return self

    def _index(self) -> None:
        pos = np.arange(self.size, dtype=np.int64) + MAX_N  # positions in `padded`
        per = 64 // self.bits  # tokens per 64-bit sort key
        keys = [self._pack(pos, per * j, per) for j in range(MAX_N // per)]
        self.order = pos[np.lexsort(keys[::-1])]  # lexsort: the last key is the primary one
        # Where each token's block starts in `order` (the anchor's range comes straight from here).
        self.starts = np.zeros(self.top + 1, dtype=np.int64)
        np.cumsum(np.bincount(self.padded[self.order], minlength=self.top), out=self.starts[1:])
        # The same arrays as tensors for the C++ match (views: no copy); its tokens read back as unsigned.
        signed = np.int16 if self.bits == 16 else np.int32
        self._tensors = tuple(torch.from_numpy(a) for a in (self.padded.view(signed), self.order, self.starts))

    def _pack(self, pos: np.ndarray, back: int, per: int) -> np.ndarray:
        """The tokens at pos - back .. pos - back - per + 1 as one uint64, the nearest in the high bits."""
        key = np.zeros(pos.size, dtype=np.uint64)
        for j in range(per):
            key = (key << np.uint64(self.bits)) | self.padded[pos - back - j].astype(np.uint64)
        return key

    @classmethod
    def from_answers(cls, answers: list[np.ndarray]) -> "Corpus":
        parts = []
        for a in answers:
            parts += [np.asarray(a, dtype=np.int64), np.array([-1])]
        if not parts:
            raise DFlashError("a lookup corpus needs at least one answer.")
        return cls(np.concatenate(parts))

    @classmethod
    def from_shards(cls, shards: list) -> "Corpus":
        """The answers (prompts left out) of `dflashkit data generate`'s shards (`data.load_shards`)."""
        examples = (s.example(i) for s in shards for i in range(len(s)))
        return cls.from_answers([toks[plen:] for toks, plen in examples])  # the answer: past the prompt

    def answers(self) -> list[np.ndarray]:
        t = self.padded[MAX_N:MAX_N + self.size].astype(np.int64) - 1
        cuts = np.flatnonzero(t < 0)
        return [t[a + 1:b] for a, b in zip(np.r_[-1, cuts[:-1]], cuts)]

    def save(self, path: str | Path) -> None:
        """An .npz of the answers (tokens in 16 or 32 bits, and their offsets), written atomically."""
        answers = self.answers()
        offsets = np.cumsum([0] + [len(a) for a in answers])
        tmp = Path(f"{path}.tmp.npz")
        np.savez_compressed(tmp, tokens=np.concatenate(answers).astype(self.padded.dtype), offsets=offsets)
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "Corpus":
        try:
            with np.load(path) as z:
                tokens, offsets = z["tokens"].astype(np.int64), z["offsets"]
            if offsets.size < 2:
                raise ValueError("no answers")
            joined = np.insert(tokens, offsets[1:], -1)  # a -1 after each answer, as `from_answers` joins them
        except (OSError, KeyError, ValueError, IndexError) as e:
            raise DFlashError(f"cannot read the lookup corpus {path} ({e}); write it again with `Corpus.save` or "
                              "move it out of the drafter's directory.") from None
        return cls(joined)

    def match(self, ids: list[int] | np.ndarray, max_tokens: int, min_n: int = 1) -> CorpusMatch:
        """ids: the committed sequence, its last token the anchor -> the continuation of its longest suffix
        (at most MAX_N tokens) found in the corpus, if at least `min_n` long."""
        self.prepare()
        ids = np.asarray(ids)
        if ids.size == 0 or max_tokens <= 0:
            return CorpusMatch([], 0, 0)
        max_tokens = min(max_tokens, FORWARD)
        mod = kernels.on_cpu()
        if mod is not None:  # the same rules in one C++ call (kernels/corpusmatch.cpp); only the last MAX_N ids count
            tail = torch.from_numpy(np.ascontiguousarray(ids[-MAX_N:], dtype=np.int64))
            tokens, n, support, seen = mod.corpus_match(*self._tensors, tail, max_tokens, min_n, MAX_N, SAMPLED)
            return CorpusMatch(tokens, n, support, seen)
        a = int(ids[-1]) + 1
        if not 0 < a < self.starts.size - 1:  # a token the corpus never holds
            return CorpusMatch([], 0, 0)
        lo, hi = int(self.starts[a]), int(self.starts[a + 1])
        n = 1 if hi > lo else 0
        padded, order = self.padded, self.order
        while lo < hi and n < min(MAX_N, ids.size):
            t = int(ids[-1 - n]) + 1
            key = (lambda p, j=n: padded[p - j])
            a_, b_ = bisect_left(order, t, lo, hi, key=key), bisect_right(order, t, lo, hi, key=key)
            if a_ >= b_:
                break
            lo, hi, n = a_, b_, n + 1
        if n < min_n or n == 0:
            return CorpusMatch([], 0, 0)
        pick = order[lo:hi] if hi - lo <= SAMPLED else order[np.linspace(lo, hi - 1, SAMPLED).astype(np.int64)]
        nxt = padded[pick[:, None] + np.arange(1, max_tokens + 1)[None]]  # [m, k] continuations (+ 1)
        out, support, j = [], 0, 0
        while j < max_tokens:
            rest = nxt[:, j:]
            agree = (rest == rest[0]).all(0)  # columns on which every occurrence left continues alike
            run = agree.size if agree.all() else int(agree.argmin())
            if run:  # their tokens need no vote (a vote would pick them with every occurrence's count)
                border = np.flatnonzero(rest[0, :run] == 0)
                take = rest[0, :border[0] if border.size else run]
                if j == 0 and take.size:
                    support = len(nxt)
                out.extend(int(v) - 1 for v in take)
                if border.size:  # every occurrence ends here (a border)
                    break
                j += run
                continue
            vals, counts = np.unique(nxt[:, j], return_counts=True)
            best = int(np.argmax(counts))
            if vals[best] == 0:  # most occurrences end here (a border)
                break
            if j == 0:
                support = int(counts[best])
            out.append(int(vals[best]) - 1)
            nxt = nxt[nxt[:, j] == vals[best]]
            j += 1
        # a match with nothing to copy: none
        return CorpusMatch(out, n, support, len(pick)) if out else CorpusMatch([], 0, 0)
