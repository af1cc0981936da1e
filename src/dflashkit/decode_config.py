"""`DecodeConfig`: how each decoding step drafts. One set of defaults for the API, the CLI, the server and the bench.

`DecodeConfig()` is the paper's plain DFlash block (the drafter's argmax chain, no lookup).
`DecodeConfig.recommended()` is the default system everywhere (`DFlashEngine`, `dflashkit generate / serve /
bench`): a pruned tree of the drafter's likeliest paths plus an adaptive n-gram lookup branch, chosen on tuning
slices (bench/results/tree-sweeps.md) and reported on prompts never tuned on (bench/results/tree-256-untuned).
`DecodeConfig.autoregressive()` is the baseline: block size 1, no lookup.

Validated once, at construction; `resolve(drafter)` fills the drafter-dependent fields (block size, draft
vocabulary) and checks that the drafter can serve them.

Why the server's default temperature differs from the CLI's: the server follows the OpenAI API, whose default is
1.0 (`server.py`); `dflashkit generate` and the bench default to greedy, where output is judged token for token.
Sampling is exact too (same distribution), so both defaults run the same system.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .errors import DFlashError
from .lookup import LookupParams

# The draft vocabulary of `recommended()`: the drafter's 4,096 most frequent training ids, when it ships a token
# ranking that long. They hold 92 % of the bundled drafter's training response tokens but nearly all the drafts the
# target accepts: tau within 1.1 % of 16,384 ids on held-out prompts, and a head of 4.7 MB instead of 18.9 (a drafting
# step at blocks 2-4: 0.20-0.24x a one-token target step instead of 0.28-0.30x; bench/results/draft-vocab/).
RECOMMENDED_DRAFT_VOCAB = 4096
POLICIES = ("adaptive", "fixed")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class DecodeConfig:
    block_size: int | None = None  # tokens per DFlash block; None = the drafter's own (1 without a drafter)
    tree: int = 0  # drafter tree nodes (the n likeliest paths through its top-k per slot); 0 = the argmax chain
    tree_min_prob: float = 0.0  # drop tree paths the drafter gives less than this probability; 0 = keep all
    draft_vocab: int | None = 0  # draft over the N most frequent training ids; 0 = all; None = the drafter's default
    lookup: LookupParams = field(default_factory=LookupParams)  # the n-gram lookup branch (max_tokens 0 = off)
    # what each step verifies: "fixed" = all of the above, every step; "adaptive" = what pays on this machine at
    # this load (`policy/`): the above is then the most a step may draft
    policy: str = "fixed"

    def __post_init__(self):
        b = self.block_size
        if b is not None and (not _is_int(b) or b < 1):
            raise DFlashError(f"block size must be an integer >= 1 (got {b!r}); 1 means plain autoregressive decoding.")
        if not _is_int(self.tree) or self.tree < 0:
            raise DFlashError(f"tree size must be an integer >= 0 (got {self.tree!r}); 0 drafts the plain chain.")
        p = self.tree_min_prob
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= p < 1.0:
            raise DFlashError(f"tree_min_prob must be in [0, 1) (got {p!r}); 0 keeps all `tree` nodes.")
        v = self.draft_vocab
        if v is not None and (not _is_int(v) or v < 0):
            raise DFlashError(f"draft_vocab must be an integer >= 1, or 0 for the full vocabulary (got {v!r}).")
        if not isinstance(self.lookup, LookupParams):
            raise DFlashError(f"lookup must be a LookupParams (got {type(self.lookup).__name__}).")
        if self.policy not in POLICIES:
            raise DFlashError(f"policy must be one of {', '.join(POLICIES)} (got {self.policy!r}).")

    @classmethod
    def recommended(cls, **overrides) -> "DecodeConfig":
        """The default system: up to a 20-node drafter tree + a lookup branch of up to 16 tokens (from the sequence,
        or from the target's earlier answers where the drafter ships them and the sequence's own match is short),
        each step cut to what pays on this machine at this load (the adaptive policy; `policy="fixed"`: a 20-node
        tree pruned at probability 0.03 every step)."""
        base = dict(tree=20, tree_min_prob=0.03, draft_vocab=None,
                    lookup=LookupParams(max_tokens=16, tokens_per_n=4, skip_drafter_n=3, corpus_n=2), policy="adaptive")
        return cls(**{**base, **overrides})

    @classmethod
    def autoregressive(cls) -> "DecodeConfig":
        """Plain autoregressive decoding (block size 1, no lookup): the baseline of every speedup."""
        return cls(block_size=1)

    def replace(self, **changes) -> "DecodeConfig":
        """A copy with `changes` (None values are ignored), validated."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    # ---- resolved against a drafter -----------------------------------------------------------------------
    def resolve(self, drafter) -> "DecodeConfig":
        """Concrete block size and draft vocabulary for `drafter` (None: no drafter), checked against it."""
        b = self.block_size if self.block_size is not None else (drafter.config.block_size if drafter else 1)
        if b > 1 and drafter is None:
            raise DFlashError("block size > 1 needs a drafter; pass --drafter or use --block-size 1.")
        vocab = self.draft_vocab
        if vocab is None:  # the drafter's default
            ok = drafter is not None and drafter.d2t is None and drafter.token_ranking is not None
            vocab = RECOMMENDED_DRAFT_VOCAB if ok and len(drafter.token_ranking) >= RECOMMENDED_DRAFT_VOCAB else 0
        return dataclasses.replace(self, block_size=b, draft_vocab=vocab if drafter is not None else 0)

    @property
    def drafted(self) -> tuple[int, int]:
        """(drafter nodes per step, their deepest depth): the chain's B-1, or a tree's n nodes within B-1 slots."""
        b = self._resolved_block()
        if b == 1:
            return 0, 0
        return (self.tree, min(self.tree, b - 1)) if self.tree else (b - 1, b - 1)

    @property
    def verify_width(self) -> int:
        """Tokens one verify pass holds: the anchor, the drafter's nodes and the lookup branch."""
        return 1 + self.drafted[0] + self.lookup.max_tokens

    @property
    def depth_span(self) -> int:
        """1 + the deepest draft position: the most tokens one target pass can commit."""
        return 1 + max(self.drafted[1], self.lookup.max_tokens)

    @property
    def speculative(self) -> bool:
        return self._resolved_block() > 1 or self.lookup.enabled

    def _resolved_block(self) -> int:
        if self.block_size is None:
            raise DFlashError("this DecodeConfig is not resolved yet; call resolve(drafter) first.")
        return self.block_size
