"""What a benchmark method returns for one turn (`Turn`), and how a peer says it cannot run here (`Skip`)."""

from __future__ import annotations

from dataclasses import dataclass, field


class Skip(Exception):
    """A peer that cannot run here; the message names the remedy."""


@dataclass
class Turn:
    """One generated turn of one method."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # per verify cycle (empty for non-speculative peers)
    new_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
