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

from . import kernels


class PositionCache:
    """Preallocated K/V, one [B, kvh, S, hd] pair per layer (values [B, kvh, S, value_dim] when a backend stores
    more per value row, see backends/lean.py), indexed by absolute position.

    Its public methods are the whole cache API a backend and the decoding loop use: `write` (a forward's new
    K/V), `select` / `extend` (rows leave / join the batch) and `move` (an accepted tree path to slot == position).

    Rows live in a store with room for more (`capacity`): `keys[i]` / `values[i]` are views of its first B rows
    (contiguous: the row is the leading dim). Why: under continuous batching rows join and leave every few steps,
    and rebuilding the whole cache each time (a cat on join, an index_select on leave: B x ~24 MB at 1,024
    positions for SmolLM2, freshly allocated and page-faulted) cost 40-70 ms at 8 rows against an 18 ms decode
    step (measured). Now a joining row is copied into a free row of the store, a leaving one is overwritten by the
    rows after it, and only the slots in use (`used`) are copied. A reused row keeps its last occupant's K/V in its
    higher slots: harmless for the reason above (no query sees a slot that its own forward did not rewrite), and
    the store starts as zeros, so no slot ever holds a non-finite value that a masked attention would multiply by 0.
    """

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, value_dim: int | None = None):
        self._kshape = (num_kv_heads, max_len, head_dim)
        self._vshape = (num_kv_heads, max_len, head_dim if value_dim is None else value_dim)
        self._dtype, self._device, self.max_len = dtype, device, max_len
        self._kstore = [torch.zeros((batch, *self._kshape), dtype=dtype, device=device) for _ in range(num_layers)]
        self._vstore = [torch.zeros((batch, *self._vshape), dtype=dtype, device=device) for _ in range(num_layers)]
        self._resize(batch)

    def _resize(self, rows: int) -> None:
        self.keys = [k[:rows] for k in self._kstore]
        self.values = [v[:rows] for v in self._vstore]
        self._rows = torch.arange(rows, device=self._device)

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self._kstore[0].shape[0]

    def select(self, rows: torch.Tensor, used: int | None = None) -> None:
        """Keep batch rows `rows`, in that order (finished sequences leave the batch). used: slots 0..used-1 are
        the only ones any row still needs (its committed context); only they are copied (default: all)."""
        used = self.max_len if used is None else min(used, self.max_len)
        idx = rows.tolist()
        moves, written = [], set()
        for j, r in enumerate(idx):
            if r != j:
                moves.append((j, r))
                written.add(j)
                if r in written:  # its source was overwritten by an earlier move: gather instead
                    moves = None
                    break
        for store in (self._kstore, self._vstore):
            for layer in store:
                if moves is None:
                    layer[:len(idx), :, :used] = layer[:, :, :used].index_select(0, rows)
                for j, r in moves or ():  # in place: only the rows that move, only their used slots
                    layer[j, :, :used] = layer[r, :, :used]
        self._resize(len(idx))

    def extend(self, other: "PositionCache") -> None:
        """Append the rows of `other` (same layers, heads and head size; its `max_len` may be shorter, e.g. a
        prompt's own cache): sequences joining a running batch. The store grows by half when full."""
        b, n, S = self.batch_size, other.batch_size, other.max_len
        if S > self.max_len:
            raise ValueError(f"cannot join rows of {S} cache positions to a cache of {self.max_len}")
        self.reserve(b + n)
        for mine, theirs in ((self._kstore, other.keys), (self._vstore, other.values)):
            for layer, new in zip(mine, theirs):
                layer[b:b + n, :, :S] = new[:, :, :S]
        self._resize(b + n)

    def grow(self, n: int) -> None:
        """Append n rows without writing them: they hold zeros (a fresh store) or a left row's stale but finite K/V.
        For rows whose every slot is written before any query can see it (the drafter's: a joining prompt's
        features are all pending and ingested before its first draft), where `extend` would copy a cache of zeros.
        Why finite matters: a masked slot's weight is 0, and 0 x NaN is NaN (never `torch.empty` here)."""
        self.reserve(self.batch_size + n)
        self._resize(self.batch_size + n)

    def reserve(self, rows: int) -> None:
        """Room for `rows` rows: the store grows by half (at least to `rows`) when full, keeping its rows. A server
        reserves its batch's rows up front: growing 9 -> 13 -> 19 rows of 1,024 slots under load cost ~0.4 s of
        allocation and copies, in the middle of the first 16 concurrent requests."""
        if rows <= self.capacity:
            return
        b, cap = self.batch_size, max(rows, self.capacity + self.capacity // 2)
        for store, shape in ((self._kstore, self._kshape), (self._vstore, self._vshape)):
            for i, layer in enumerate(store):
                grown = torch.zeros((cap, *shape), dtype=self._dtype, device=self._device)
                grown[:b] = layer[:b]
                store[i] = grown

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k, v: [B, kvh, T, hd] rows for absolute `positions` [B, T]."""
        rows = self._rows[:, None]
        # Advanced indices (rows, positions) around a slice put the indexed dims first: [B, T, kvh, hd].
        self.keys[layer_idx][rows, :, positions] = k.transpose(1, 2)
        if v.shape[-1]:  # a store without values (value_dim 0, the drafter's feature store) skips an empty write
            self.values[layer_idx][rows, :, positions] = v.transpose(1, 2)

    def move(self, src: list[list[int]], dst: list[list[int]]) -> None:
        """src, dst: per row, slots (host lists, a row's two of one length; rows past them untouched). Copies every
        layer's K/V from slots src to slots dst (all reads happen before any write, so src and dst may overlap). Used
        to bring an accepted tree branch to slot == position. On a CPU in one C++ call (kernels/rowcopy.cpp)."""
        mod = kernels.on_cpu(self.keys[0])
        if mod is not None:
            mod.move_slots(self.keys + self.values, src, dst)
            return
        width = max(map(len, src), default=0)
        if width == 0:
            return
        # rows padded with their last pair again (an empty row: slot 0 onto itself): copies that change nothing
        pad = (lambda rows: torch.tensor([r + [r[-1] if r else 0] * (width - len(r)) for r in rows],
                                         device=self._device))
        rows, src, dst = self._rows[:len(src), None], pad(src), pad(dst)
        for cache in (self.keys, self.values):
            for layer in cache:
                layer[rows, :, dst] = layer[rows, :, src]
