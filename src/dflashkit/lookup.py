"""N-gram lookup: a second, free source of draft tokens taken from the sequence itself.

Small models repeat themselves and copy their prompt (code signatures, docstrings, lists), and the
drafter does not always see it. The lookup finds the most recent earlier occurrence of the longest
suffix of the committed tokens (up to `max_n` tokens long, at least `min_n`) and proposes the tokens
that followed it ("prompt lookup decoding"). It runs on the host, where the committed tokens live.

The proposal is verified in the same target pass as the DFlash block, as a second branch of the draft
tree (`tree.py`), so the output stays exactly the target's own: a proposal only decides how many target
choices one pass can commit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import DFlashError

CORPUS_BELOW = 2  # the corpus is asked only where the sequence's own match is shorter (`LookupParams.corpus_n`)


@dataclass(frozen=True)
class LookupParams:
    """max_tokens: longest proposal (0 = lookup off). max_n/min_n: suffix lengths tried, longest first.
    skip_drafter_n: when every live sequence's match is at least this long, the step verifies the lookup
    branch alone and skips the drafter's forward (0 = always draft).
    tokens_per_n: propose at most this many tokens per matched suffix token (0 = always max_tokens): a
    1-token match is a weak guess, and every proposed token widens the verify pass.
    corpus_n: where the sequence's own match is shorter than CORPUS_BELOW tokens, copy from the engine's corpus
    of the target's earlier answers instead (`corpus.py`) if it matches at least this many (0 = never)."""

    max_tokens: int = 0
    max_n: int = 4
    min_n: int = 1
    skip_drafter_n: int = 0
    tokens_per_n: int = 0
    corpus_n: int = 0

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise DFlashError(f"lookup length must be an integer >= 0 (got {self.max_tokens}); 0 turns lookup off.")
        if not 1 <= self.min_n <= self.max_n:
            raise DFlashError(f"lookup n-gram sizes need 1 <= min_n <= max_n (got min_n={self.min_n}, "
                              f"max_n={self.max_n}).")
        if self.tokens_per_n < 0:
            raise DFlashError(f"tokens_per_n must be >= 0 (got {self.tokens_per_n}); 0 proposes max_tokens "
                              "whatever the match.")
        if not isinstance(self.corpus_n, int) or self.corpus_n < 0:
            raise DFlashError(f"corpus_n must be an integer >= 0 (got {self.corpus_n}); 0 turns the corpus lookup off.")
        if self.skip_drafter_n < 0:
            raise DFlashError(f"skip_drafter_n must be >= 0 (got {self.skip_drafter_n}); 0 means always draft.")

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0


@dataclass
class LookupProposal:
    """One step's lookup branch for every row of a batch (`LookupProposer.propose`)."""

    matched: list[int]  # per row: the length of the suffix that matched (0: no proposal)
    tokens: list[list[int]]  # per row: the proposal (host lists: `tree.build` takes them as they are)
    skips_drafter: bool  # every live row matched a suffix of at least `skip_drafter_n`: verify the branch alone
    # per row: `CorpusMatch.agreement` where the proposal came from the corpus (`corpus.py`), "" where not
    agreement: list[str] = field(default_factory=list)

    @property
    def corpus(self) -> list[bool]:
        """Per row: its proposal came from the corpus."""
        return [bool(a) for a in self.agreement]

    def key(self, row: int) -> int | str:
        """What the policy calibrates the row's proposal under: its match length n, and for a corpus copy (which
        predicts less than the sequence's own) how far the corpus agrees on it: "corpus-n-hi" etc."""
        n = self.matched[row]
        agree = self.agreement[row] if self.agreement else ""
        return f"corpus-{n}-{agree}" if agree else n


def propose(tokens: list[int] | np.ndarray, params: LookupParams) -> tuple[list[int], int]:
    """tokens: the committed sequence (prompt + generated; its last token is the anchor).

    Returns (proposal for the positions after the anchor, length n of the matched suffix); ([], 0) if
    no suffix of length >= min_n occurs earlier."""
    ids = np.asarray(tokens)
    t = len(ids) - 1
    if t < 1 or params.max_tokens == 0:
        return [], 0
    # Candidate match ends: earlier positions holding the anchor token, most recent first.
    ends = np.flatnonzero(ids[:-1] == ids[-1])[::-1]
    if ends.size == 0:
        return [], 0
    # The match length at each end, all ends at once: how many of the last `span` tokens agree going backwards
    # (the first disagreement stops it: cumprod). Why `span` <= t: a suffix as long as the whole sequence has no
    # earlier occurrence, and index t - j must stay >= 1.
    span = min(params.max_n, t)
    back = np.arange(span)
    idx = ends[:, None] - back[None]  # [E, span] positions of the candidate's tokens, newest first
    same = (idx >= 0) & (ids[np.maximum(idx, 0)] == ids[t - back][None])
    length = np.cumprod(same, axis=1).sum(1)  # [E]
    best = int(np.argmax(length))  # the first maximum: the most recent end with the longest match
    n = int(length[best])
    if n < params.min_n:
        return [], 0
    e = int(ends[best])
    k = min(params.max_tokens, params.tokens_per_n * n) if params.tokens_per_n else params.max_tokens
    return ids[e + 1:e + 1 + k].tolist(), n


class SuffixIndex:
    """One sequence's n-grams (n = 1..max_n) -> the latest position where each ends, kept as the sequence grows.

    `propose` through it equals the function `propose` above (a test checks them on random sequences) at O(new
    tokens) host work per step instead of a scan of the whole sequence: at batch 16 the scan cost ~1 ms per step.
    Why equal: an n-gram's latest end is the most recent end whose match is >= n, and when no (n+1)-gram matched,
    every such end's match is exactly n — the scan's "most recent end with the longest match". The index holds ends
    before the anchor only (`upto`), so the anchor never matches itself. It assumes the sequence only grows: the
    owner discards it when tokens are cut (`SeqState.history`)."""

    def __init__(self, max_n: int):
        self.max_n = max_n
        self.ends: dict[tuple, int] = {}
        self.upto = 0  # ends at positions < upto are indexed

    def propose(self, ids: np.ndarray, params: LookupParams) -> tuple[list[int], int]:
        """ids [T] the committed sequence (its last token is the anchor) -> (proposal, matched suffix length)."""
        if params.max_n != self.max_n:
            raise DFlashError(f"this index holds n-grams up to {self.max_n}, not {params.max_n}; make a new one.")
        t = len(ids) - 1
        if t < self.upto:  # the sequence was cut: start over (a cut that regrows is the owner's to catch)
            self.ends, self.upto = {}, 0
        if t < 1 or params.max_tokens == 0:
            return [], 0
        # Only the tail the new n-grams and the suffix need goes to Python (`o` = its offset in ids).
        o = max(0, min(self.upto, t) - self.max_n + 1)
        tail, ends = np.asarray(ids[o:]).tolist(), self.ends
        for e in range(self.upto, t):  # index the ends committed since the last call (anchor excluded)
            for n in range(1, min(self.max_n, e + 1) + 1):
                ends[tuple(tail[e - n + 1 - o:e + 1 - o])] = e
        self.upto = max(self.upto, t)
        for n in range(min(params.max_n, t), params.min_n - 1, -1):
            e = ends.get(tuple(tail[t - n + 1 - o:]))
            if e is not None:
                k = min(params.max_tokens, params.tokens_per_n * n) if params.tokens_per_n else params.max_tokens
                return np.asarray(ids[e + 1:e + 1 + k]).tolist(), n
        return [], 0
