"""The reduced draft vocabulary: the target ids a drafter proposes from (the most frequent response tokens of its
training data), and the same weights with such a vocabulary attached. Verification stays over the full vocabulary."""

from __future__ import annotations

import numpy as np
import torch

from .data import TokenShard
from .drafter import DFlashDrafter


def token_counts(shards: list[TokenShard], vocab_size: int) -> np.ndarray:
    """[vocab_size] how often each target id occurs among response tokens (what the drafter learns to propose)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in shards:
        for i in range(len(s)):
            toks, plen = s.example(i)
            counts += np.bincount(toks[plen:], minlength=vocab_size)
    return counts


def frequent_tokens(shards: list[TokenShard], k: int, vocab_size: int) -> torch.Tensor:
    """The k most frequent target ids among response tokens, ascending id order."""
    top = np.argsort(-token_counts(shards, vocab_size), kind="stable")[:k]
    return torch.from_numpy(np.sort(top))


def with_draft_vocab(drafter: DFlashDrafter, ids: torch.Tensor) -> DFlashDrafter:
    """The same weights with a reduced draft vocabulary `ids` (target ids) attached."""
    new = DFlashDrafter(drafter.config.replace(draft_vocab_size=int(ids.numel())))
    state = {k: v for k, v in drafter.state_dict().items() if k != "d2t"}
    new.load_state_dict(state, strict=False)
    new.d2t.copy_(ids - torch.arange(ids.numel()))
    return new
