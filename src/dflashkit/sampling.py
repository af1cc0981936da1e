"""Sampling parameters and the target's token choice (greedy or temperature / top-k / top-p).

The draft never samples: it proposes argmax tokens. Only the TARGET's choice goes through here, and every
emitted token is one of these choices, which is why speculative output keeps the target's distribution exactly
(`tree.accept` walks the tree along them).

Why the randomness is a function of (seed, position) alone: the token a sampled row commits at position p is
drawn by inverse-CDF sampling with one uniform u(seed, p), whatever node of whatever tree (or plain step, or
prefill) asks for it. Every node at depth d of a step shares u(seed, start + d + 1); only one of them lies on
the accepted path, and its choice is the target's own draw given exactly the committed prefix. So a row commits,
token for token, what plain decoding with the same seed commits: the tree, the verify width, the batch and the
step policy change how fast, never what. Each u is independent of the others (a counter-based hash), so each
position is a fresh draw from the target's distribution. A row without a seed gets a random one when it joins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .errors import DFlashError
from .kernels import argmax


# Bounds that keep every field representable: a seed is taken modulo 2^64 (one uint64 key), and top_k becomes an
# int64 tensor (any k above the vocabulary size means "off").
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1
MAX_TOP_K = 2 ** 31 - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (numpy's uint64 arithmetic wraps modulo 2^64, as the hash needs)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """keys [b] uint64 (one per row, `seed_key`), positions [b, n] int64 -> u [b, n] float64 in [0, 1): one
    independent uniform per (row's seed, position), the same wherever and whenever it is computed."""
    with np.errstate(over="ignore"):
        h = _mix(keys[:, None] + positions.astype(np.uint64))
    return (h >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def seed_key(seed: int) -> np.uint64:
    """A request's seed (SEED_MIN..SEED_MAX) as the key of its uniforms."""
    with np.errstate(over="ignore"):
        return _mix(np.array([seed % 2 ** 64], dtype=np.uint64))[0]


def check_seed(sd) -> None:
    """Raise DFlashError unless `sd` is None or an integer in [SEED_MIN, SEED_MAX]."""
    if sd is not None and (not isinstance(sd, int) or isinstance(sd, bool) or not SEED_MIN <= sd <= SEED_MAX):
        raise DFlashError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (got {sd}); omit it for a "
                          "random draw.")


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
        check_seed(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Per-row sampling parameters for a batch, as device tensors (rows may differ: server batches)."""

    def __init__(self, params: list[SamplingParams], device: torch.device):
        self.params = list(params)
        self.device = device
        for p in self.params:  # checked here too: a request forced past validation fails alone, at admission
            check_seed(p.seed)
        # A sampled row without a seed draws one from torch's generator (torch.manual_seed makes a run repeatable).
        free = [p.seed is None and not p.greedy for p in self.params]
        drawn = iter(torch.randint(0, 2 ** 62, (sum(free),)).tolist())
        self.keys = np.array([seed_key(next(drawn) if f else p.seed or 0) for p, f in zip(self.params, free)],
                             dtype=np.uint64)
        self._refresh()

    def _refresh(self):
        ps = self.params
        self.all_greedy = all(p.greedy for p in ps)
        # Floored at 1e-30: a positive temperature that float32 would round to 0 must not divide 0 by 0.
        self.temperature = torch.tensor([max(p.temperature, 1e-30) if not p.greedy else 1.0 for p in ps],
                                        device=self.device)
        self.top_p = torch.tensor([p.top_p for p in ps], device=self.device)
        self.top_k = torch.tensor([p.top_k for p in ps], device=self.device)
        self.filtered = any(p.top_p < 1 or p.top_k > 0 for p in ps)

    def select(self, rows: list[int]) -> None:
        self.params = [self.params[i] for i in rows]
        self.keys = self.keys[np.asarray(rows, dtype=np.int64)]
        self._refresh()

    def extend(self, other: "Sampler") -> None:
        self.params += other.params
        self.keys = np.concatenate([self.keys, other.keys])
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

    def __call__(self, logits: torch.Tensor, first: list[int], depth: torch.Tensor | None = None,
                 max_depth: int = 0) -> torch.Tensor:
        """logits: [B, Q, V] -> chosen token ids [B, Q] (argmax for greedy rows).

        first: per row, the position of the token chosen after a depth-0 node (the anchor's position + 1; after a
        prompt, its length); depth: [B, Q] each node's depth (default 0: one node per row), at most max_depth. The
        node's choice is the token at position first + depth, drawn with that position's uniform."""
        choice = argmax(logits)  # torch's argmax; bf16 rows scanned as they are where our kernels run
        if self.all_greedy:
            return choice
        B, Q = choice.shape
        pos = np.asarray(first, dtype=np.int64)[:, None] + np.arange(max_depth + 1, dtype=np.int64)[None]
        u = torch.from_numpy(uniforms(self.keys, pos)).to(self.device)  # [B, D + 1]
        u = u[:, :1].expand(B, Q) if depth is None else u.gather(1, depth)  # [B, Q]
        probs = self.probs(logits)
        sampled = choice.clone()
        for r in range(B):  # row by row: a float64 CDF of one row's nodes, not of the whole batch at once
            if self.params[r].greedy:
                continue
            # Inverse CDF in float64: the first token whose cumulative mass exceeds u * total. Capped at the last
            # token of positive mass (cdf.argmax: where the CDF first reaches its maximum), so a token the target
            # gives no mass (filtered, or underflowed) is never drawn even if u * total rounds up to the total.
            cdf = probs[r].double().cumsum(-1)  # [Q, V]
            x = (u[r] * cdf[:, -1])[:, None]
            sampled[r] = torch.minimum(torch.searchsorted(cdf, x, right=True)[:, 0], cdf.argmax(-1))
        return sampled
