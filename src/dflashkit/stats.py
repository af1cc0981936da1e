"""Per-request generation statistics: tau, cumulative per-position acceptance, histogram, speed."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    block_size: int
    prompt_tokens: int = 0
    new_tokens: int = 0
    # one entry per verify cycle: accepted drafts a (0..block_size-1); a + 1 tokens came from that pass
    accepted: list[int] = field(default_factory=list)
    ttft_s: float = 0.0  # request start -> first token (prefill + first choice)
    decode_s: float = 0.0  # first token -> last token

    @property
    def target_passes(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean tokens per verify pass, bonus included (1.0 for plain decoding)."""
        return sum(a + 1 for a in self.accepted) / len(self.accepted) if self.accepted else 0.0

    @property
    def acceptance(self) -> list[float]:
        """Cumulative per-position acceptance: [j] = share of cycles whose first j+1 drafts were all accepted.

        1 + sum(acceptance) == tau.
        """
        n = len(self.accepted)
        return [sum(a > j for a in self.accepted) / n if n else 0.0 for j in range(self.block_size - 1)]

    @property
    def histogram(self) -> list[int]:
        """[L-1] = number of cycles with acceptance length L (1..block_size), bonus included."""
        h = [0] * self.block_size
        for a in self.accepted:
            h[a] += 1
        return h

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first / decode time (prefill excluded, as in TPOT)."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 and self.new_tokens > 1 else 0.0

    @property
    def tpot_ms(self) -> float:
        return 1000.0 / self.tokens_per_s if self.tokens_per_s else 0.0

    def to_dict(self) -> dict:
        return {
            "block_size": self.block_size,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "target_passes": self.target_passes,
            "tau": round(self.tau, 4),
            "acceptance": [round(x, 4) for x in self.acceptance],
            "accepted_length_histogram": self.histogram,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "tpot_ms": round(self.tpot_ms, 3),
            "ttft_ms": round(self.ttft_s * 1000, 3),
        }
