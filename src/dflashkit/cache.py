"""PositionCache: preallocated K/V indexed by absolute position, shared by the target and the drafter.

Slot s of a sequence holds the K/V of its token at absolute position s. Writers put rows at explicit
positions; readers mask by position. Why this works for speculative decoding without any undo:
slots below a sequence's committed length are valid; slots above it may hold K/V of rejected drafts
or prompt padding, but no query ever sees a slot beyond its own position, and every slot between the
committed length and the query was rewritten by the same forward. Rollback is bookkeeping (the
engine's per-row `start`), and ragged batches need no per-row cropping.
"""

from __future__ import annotations

import torch


class PositionCache:
    """Preallocated K/V, one [B, kvh, S, hd] pair per layer (values [B, kvh, S, value_dim] when a backend stores
    more per value row, see backends/lean.py), indexed by absolute position.

    Its public methods are the whole cache API a backend and the decoding loop use: `write` (a forward's new
    K/V), `select` / `extend` (rows leave / join the batch) and `move` (an accepted tree path to slot == position).
    """

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, value_dim: int | None = None):
        shape = (batch, num_kv_heads, max_len, head_dim)
        vshape = (batch, num_kv_heads, max_len, value_dim or head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(vshape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self._rows = torch.arange(batch, device=device)

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (a finished sequence leaves the batch)."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self._rows = torch.arange(rows.numel(), device=rows.device)

    def extend(self, other: "PositionCache") -> None:
        """Append the rows of `other` (same layers, heads and length): sequences joining a running batch."""
        self.keys = [torch.cat([a, b]) for a, b in zip(self.keys, other.keys)]
        self.values = [torch.cat([a, b]) for a, b in zip(self.values, other.values)]
        self._rows = torch.arange(self.keys[0].shape[0], device=self._rows.device)

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k, v: [B, kvh, T, hd] rows for absolute `positions` [B, T]."""
        rows = self._rows[:, None]
        # Advanced indices (rows, positions) around a slice put the indexed dims first: [B, T, kvh, hd].
        self.keys[layer_idx][rows, :, positions] = k.transpose(1, 2)
        self.values[layer_idx][rows, :, positions] = v.transpose(1, 2)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """src, dst: [B, T] slots. Copies every layer's K/V from slots src to slots dst (all reads happen before
        any write, so src and dst may overlap). Used to bring an accepted tree branch to slot == position."""
        rows = self._rows[:, None]
        for cache in (self.keys, self.values):
            for layer in cache:
                layer[rows, :, dst] = layer[rows, :, src]
