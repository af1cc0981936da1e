"""Acceptance arithmetic, defined once (the engine, the bench and the server all use these), and per-request stats.

Per verify cycle a row accepts a drafted tokens (0 .. span-1) and commits a + 1 (the bonus included).
- tau: mean tokens per verify pass = (passes + accepted) / passes; 1.0 when there was no pass (nothing drafted).
- acceptance[j]: cumulative per-position acceptance, the share of cycles accepting >= j + 1 drafts
  (1 + sum(acceptance) == tau).
- histogram[L-1]: cycles that committed L tokens (1 .. span).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def tau_from_counts(passes: int, accepted: int) -> float:
    """Tokens per target pass from counters: `passes` verify cycles that accepted `accepted` drafts in all."""
    return (passes + accepted) / passes if passes else 1.0


def tau(accepted: list[int]) -> float:
    return tau_from_counts(len(accepted), sum(accepted))


def acceptance(accepted: list[int], span: int) -> list[float]:
    n = len(accepted)
    return [sum(a > j for a in accepted) / n for j in range(span - 1)] if n else []


def histogram(accepted: list[int], span: int) -> list[int]:
    h = [0] * span
    for a in accepted:
        h[a] += 1
    return h


@dataclass
class GenerationStats:
    span: int  # the most tokens one target pass can commit: 1 + the deepest draft position (block or tree)
    prompt_tokens: int = 0
    new_tokens: int = 0
    # one entry per verify cycle: accepted drafts a (0..span-1); a + 1 tokens came from that pass
    accepted: list[int] = field(default_factory=list)
    ttft_s: float = 0.0  # request start -> first token (prefill + first choice)
    decode_s: float = 0.0  # first token -> last token
    # draft nodes the target verified, and those it accepted, per source (the drafter's, the lookup branch's)
    drafted_drafter: int = 0
    drafted_lookup: int = 0
    accepted_drafter: int = 0
    accepted_lookup: int = 0

    def count_drafts(self, drafted_drafter: int, drafted_lookup: int, accepted_drafter: int,
                     accepted_lookup: int) -> None:
        """One verify cycle's draft nodes (`tree.source_counts`)."""
        self.drafted_drafter += drafted_drafter
        self.drafted_lookup += drafted_lookup
        self.accepted_drafter += accepted_drafter
        self.accepted_lookup += accepted_lookup

    @property
    def target_passes(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean tokens per verify pass, bonus included (1.0 for plain decoding)."""
        return tau(self.accepted)

    @property
    def acceptance(self) -> list[float]:
        return acceptance(self.accepted, self.span)

    @property
    def histogram(self) -> list[int]:
        return histogram(self.accepted, self.span)

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first / decode time (prefill excluded, as in TPOT)."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 and self.new_tokens > 1 else 0.0

    @property
    def tpot_ms(self) -> float:
        return 1000.0 / self.tokens_per_s if self.tokens_per_s else 0.0

    def to_dict(self) -> dict:
        return {
            "max_tokens_per_pass": self.span,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "target_passes": self.target_passes,
            "tau": round(self.tau, 4),
            "acceptance": [round(x, 4) for x in self.acceptance],
            "accepted_length_histogram": self.histogram,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "tpot_ms": round(self.tpot_ms, 3),
            "ttft_ms": round(self.ttft_s * 1000, 3),
            # per source: draft nodes the target verified, and those it accepted
            "draft_nodes": {"drafter": {"verified": self.drafted_drafter, "accepted": self.accepted_drafter},
                            "lookup": {"verified": self.drafted_lookup, "accepted": self.accepted_lookup}},
        }
