"""Target backends: everything decoding, the benchmark and the server need from a target LLM.

`TargetModel` is the checklist a backend implements. Nothing outside a backend reaches into the model it wraps:
the engine, the proposers, the bench and the server call only these members, and a K/V cache only through
`PositionCache`'s public methods (`write`, `select`, `extend`, `move`).

Backends: `lean.LeanTarget` (our batch-invariant forward for Llama, Qwen3 and Gemma 3; the default where it
applies) and `hf.HFTarget` (any Hugging Face causal LM, the reference and the fallback).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..cache import PositionCache


@runtime_checkable
class TargetModel(Protocol):
    """A frozen target LLM, seen through positions and a position-indexed cache (see `cache.py`)."""

    num_layers: int  # decoder layers; tap ids are 0-based layer ids whose OUTPUT feeds the drafter
    hidden_size: int
    vocab_size: int
    max_positions: int  # the context the target supports
    tap_ids: list[int]  # the layers `forward` / `taps` return, in this order
    # Whether a token's logits have the same bits verified in a block / tree as decoded alone, as measured on this
    # machine (`invariance.check`); None = not measured. True makes greedy speculative output equal AR bitwise.
    batch_invariant: bool | None

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, H] the frozen LM head the drafter borrows (a row subset of it for a reduced draft vocabulary)."""

    @property
    def architecture(self) -> str:
        """The model family's name as its config writes it (e.g. LlamaForCausalLM): exports record it."""

    def set_taps(self, tap_ids: list[int]) -> None:
        """Which decoder layers' outputs `forward` returns (raises DFlashError for a layer that does not exist)."""

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> [B, T, H] through the target's own embedding (incl. any scaling)."""

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., H] final-normed -> [..., V] (or [..., V'] over a row subset `weight` of the head)."""

    def new_cache(self, batch: int, max_len: int) -> PositionCache:
        """An empty position-indexed K/V cache for `batch` rows of `max_len` slots."""

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: PositionCache, kv_len: int | None = None,
                taps: bool = True, slots: torch.Tensor | None = None,
                visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids, positions [B, Q] -> (final-normed hidden [B, Q, H], tapped features [B, Q, k*H] or None).

        Writes the tokens' K/V into `cache` at `slots` (default: their positions); each token attends to the
        slots `visible` [B, 1, Q, kv_len] marks (default: slots <= its position). RoPE uses `positions`."""

    def taps(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, S] -> tapped features [B, S, k*H] of one plain causal forward, no cache (training)."""

    def reference_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, S] -> logits [B, S, V] of one plain causal forward over whole sequences, no cache: the
        reference a divergence audit compares the decoding paths with."""


__all__ = ["PositionCache", "TargetModel"]
