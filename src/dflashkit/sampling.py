"""Sampling parameters and the target's token choice (greedy or temperature / top-k / top-p).

The draft never samples: it proposes argmax tokens. Only the TARGET's choice goes through here, and
every emitted token is one of these choices, which is why speculative output keeps the target's
distribution exactly (see `verify.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import DFlashError


# Bounds that keep every field representable on the device: torch generators take 64-bit seeds, and top_k
# becomes an int64 tensor (any k above the vocabulary size means "off").
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1
MAX_TOP_K = 2 ** 31 - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self):
        t, p, k = self.temperature, self.top_p, self.top_k
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            raise DFlashError(f"temperature must be a finite number >= 0 (got {t}); use 0 for greedy decoding.")
        if not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise DFlashError(f"top_p must be in (0, 1] (got {p}); use 1 to disable nucleus sampling.")
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_TOP_K:
            raise DFlashError(f"top_k must be an integer in [0, {MAX_TOP_K}] (got {k}); use 0 to disable top-k.")
        sd = self.seed
        if sd is not None and (not isinstance(sd, int) or isinstance(sd, bool) or not SEED_MIN <= sd <= SEED_MAX):
            raise DFlashError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (got {sd}); omit it for a "
                              "random draw.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Per-row sampling parameters for a batch, as device tensors (rows may differ: server batches)."""

    def __init__(self, params: list[SamplingParams], device: torch.device):
        self.params = list(params)
        self.device = device
        self._refresh()

    def _refresh(self):
        ps = self.params
        self.all_greedy = all(p.greedy for p in ps)
        self.greedy = torch.tensor([p.greedy for p in ps], device=self.device)
        # Floored at 1e-30: a positive temperature that float32 would round to 0 must not divide 0 by 0.
        self.temperature = torch.tensor([max(p.temperature, 1e-30) if not p.greedy else 1.0 for p in ps],
                                        device=self.device)
        self.top_p = torch.tensor([p.top_p for p in ps], device=self.device)
        self.top_k = torch.tensor([p.top_k for p in ps], device=self.device)
        self.filtered = any(p.top_p < 1 or p.top_k > 0 for p in ps)
        if not hasattr(self, "generators"):
            self.generators = [torch.Generator(self.device).manual_seed(p.seed) if p.seed is not None else None
                               for p in ps]

    def select(self, rows: list[int]) -> None:
        self.params = [self.params[i] for i in rows]
        self.generators = [self.generators[i] for i in rows]
        self._refresh()

    def extend(self, other: "Sampler") -> None:
        self.params += other.params
        self.generators += other.generators
        self._refresh()

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [B, Q, V] -> the target's sampling distribution [B, Q, V] (float32) for sampled rows."""
        # Shift by the row maximum first: a tiny temperature (1e-45) would otherwise overflow logits / T to inf and
        # the softmax to NaN. Shifted, the top token stays at 0 and the others go to -inf: the greedy limit.
        x = logits.float()
        x = (x - x.amax(-1, keepdim=True)) / self.temperature[:, None, None]
        if self.filtered:
            sorted_x, order = x.sort(dim=-1, descending=True)
            rank = torch.arange(x.shape[-1], device=x.device)
            k = torch.where(self.top_k > 0, self.top_k, x.shape[-1])[:, None, None]
            drop = rank >= k
            # Top-p acts on the top-k survivors, renormalised (the order transformers applies them in).
            sp = sorted_x.masked_fill(drop, -math.inf).softmax(-1)
            # Nucleus: drop a token when the mass BEFORE it already reaches top_p (the top token always stays).
            drop = drop | ((sp.cumsum(-1) - sp) >= self.top_p[:, None, None])
            drop[..., 0] = False  # the top token always stays, however small top_p is (1e-300 rounds to 0 here)
            sorted_x = sorted_x.masked_fill(drop, -math.inf)
            x = torch.full_like(x, -math.inf).scatter(-1, order, sorted_x)
        return x.softmax(-1)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [B, Q, V] -> chosen token ids [B, Q] (argmax for greedy rows)."""
        # float32 first: exact for bf16/fp16 (same order, same first maximum), and torch's CPU argmax over
        # bf16 is ~5x slower than the conversion plus a float32 argmax (2 ms for a 24 x 49K verify pass).
        choice = logits.float().argmax(-1)
        if self.all_greedy:
            return choice
        probs = self.probs(logits)
        # Exponential race (Gumbel-max in another form): argmax p / E with E ~ Exp(1) draws from p with no
        # host sync. Rows with a seed use their own generator, so a seeded request is reproducible in any batch.
        noise = torch.empty_like(probs)
        for i, g in enumerate(self.generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        if any(g is None for g in self.generators):
            free = torch.tensor([g is None for g in self.generators], device=probs.device)
            noise = torch.where(free[:, None, None], torch.empty_like(probs).exponential_(), noise)
        sampled = (probs / noise).argmax(-1)
        return torch.where(self.greedy[:, None], choice, sampled)
