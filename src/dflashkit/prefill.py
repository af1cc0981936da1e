"""How prompts enter a batch's cache: grouped by length when prefilled whole, or in chunks between decoding steps.

`DecodeBatch.add` prefills prompts whole, in groups of similar length (`prefill_groups`); the server prefills a long
prompt in chunks (`PromptPrefill`, `DecodeBatch.prefill_chunk`) so the running streams go on between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def prefill_context(seq) -> list[int]:
    """The tokens a joining sequence prefills. Why generated[:-1]: the anchor (the last committed token) never has
    K/V before the step that verifies it (a resumed sequence's last token is its anchor)."""
    return seq.prompt + seq.generated[:-1]


@dataclass
class PromptPrefill:
    """A prompt prefilled in chunks between decoding steps (the server's chunked prefill): its own cache and its
    tapped features so far. It joins a batch with its last chunk (`DecodeBatch.prefill_chunk`)."""

    seq: object  # batch.SeqState
    ctx: list[int]  # the tokens to prefill (`prefill_context`)
    tcache: object  # PositionCache of 1 row and len(ctx) slots
    done: int = 0  # tokens prefilled so far
    feats: list = field(default_factory=list)  # per chunk [1, c, k*H] tapped features (when a drafter runs)

    @property
    def remaining(self) -> int:
        return len(self.ctx) - self.done


# Padding a prompt group may add, as a share of its real tokens (`prefill_groups`). Why: one forward over n
# right-padded prompts computes n x the longest; a prompt of 40 tokens beside one of 240 paid 6x its own prefill.
# A forward of its own costs a read of the weights (~10 ms, a few prompt tokens' worth on 2 cores) instead.
PAD_SHARE = 0.25


def prefill_groups(lens: list[int]) -> list[list[int]]:
    """Indices of prompts of lengths `lens` in groups prefilled together: longest first, a prompt joins the
    current group while the group's padding stays within PAD_SHARE of its real tokens."""
    groups, real, longest = [], 0, 0
    for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
        if groups and (len(groups[-1]) + 1) * longest <= (1 + PAD_SHARE) * (real + lens[i]):
            groups[-1].append(i)
            real += lens[i]
            continue
        groups.append([i])
        real = longest = lens[i]
    return groups
