"""The Hugging Face backend: `HFTarget` implements `TargetModel` (backends/__init__.py) for any HF causal LM.

`HFTarget.forward(ids, positions, cache)` runs an `AutoModelForCausalLM` decoder over a block of tokens at
explicit absolute positions, writes their K/V into a position-indexed cache, and returns the final hidden
states plus the tapped layer outputs the drafter needs. It is the reference backend and the fallback for
any architecture; a faster backend implements the same protocol.

Position-indexed cache (gpt-fast style): slot s of a sequence holds the K/V of its token at absolute
position s. A forward writes slots `positions` and every query at position p attends to slots <= p.
Slots below the sequence's committed length are valid; slots above it may hold K/V of rejected
drafts or prompt padding, but a query never sees a slot beyond its own position, and every slot in
[committed, p] was rewritten by the current forward. So rollback after verification is pure
bookkeeping (the engine's `start`), and ragged batches need no per-row cropping.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import PositionCache
from ..errors import DFlashError


def _layer_output(out):
    return out[0] if isinstance(out, tuple) else out


def architecture_of(model) -> str:
    """The model family's name as its config writes it (e.g. LlamaForCausalLM), else its class name."""
    return (getattr(model.config, "architectures", None) or [type(model).__name__])[0]


@dataclass
class SequenceFeatures:
    taps: torch.Tensor  # [B, S, k*H] the tapped layers' outputs, concatenated in tap order
    final: torch.Tensor  # [B, S, H] after the final norm: position p's row gives the target's logits for token p + 1


class _HFCacheView:
    """What HF attention layers call on a cache (`update`), mapped onto a `PositionCache` for one forward:
    each layer's new K/V go to `slots` [B, Q], and the layer reads slots [0, kv_len)."""

    def __init__(self, cache: PositionCache, slots: torch.Tensor, kv_len: int):
        self.cache, self.slots, self.kv_len = cache, slots, kv_len

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states: [B, kvh, Q, hd] for the tokens at self.slots [B, Q]
        self.cache.write(layer_idx, key_states, value_states, self.slots)
        return self.cache.keys[layer_idx][:, :, :self.kv_len], self.cache.values[layer_idx][:, :, :self.kv_len]

    # transformers may probe these on a cache object; answer consistently.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len

    @property
    def is_compileable(self) -> bool:
        return False


class HFTarget:
    """Wraps an HF causal LM (`model.model` = decoder, `model.lm_head` = head).

    tap_ids: 0-based decoder-layer ids whose OUTPUT feeds the drafter. Why output-of-layer: HF's
    `hidden_states` tuple starts with the embeddings, so layer id i is `hidden_states[i + 1]`; an
    off-by-one here does not crash, it silently collapses acceptance.
    """

    def __init__(self, model: nn.Module, tap_ids: list[int] | None = None):
        self.model = model.eval()
        self._embedding: tuple | None = None  # `embed`'s (module, its weight where plain), found on first use
        self._lm_head: torch.Tensor | None = None  # `lm_head_weight`, found on first use
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.decoder = model.model if hasattr(model, "model") else model.base_model
        self.layers = self.decoder.layers
        self.num_layers = len(self.layers)
        self.hidden_size = self.config.hidden_size
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.num_kv_heads = self.config.num_key_value_heads
        self.head_dim = getattr(self.config, "head_dim", None) or self.hidden_size // self.config.num_attention_heads
        self.max_positions = getattr(self.config, "max_position_embeddings", None) or 1 << 30
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        layer_types = getattr(self.config, "layer_types", None) or ["full_attention"] * self.num_layers
        self.sliding_window = getattr(self.config, "sliding_window", None)
        self._sliding = "sliding_attention" in layer_types
        # transformers renamed `past_key_values` to `cache` (5.2x); accept both releases.
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._taps: dict[int, torch.Tensor] = {}
        self._capture = False  # hooks record tapped outputs only inside forward()/taps()
        self.batch_invariant: bool | None = None  # measured by invariance.check (loader.check_exactness)
        self.tap_ids: list[int] = []
        self.set_taps(tap_ids or [])

    # ---- properties of the frozen target the drafter borrows ---------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head_weight.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output embedding's weight, found once: HF's module lookup cost ~15 us a call, and a step reads
        `device` and `dtype` several times. The same Parameter follows `.to()` (which replaces its data in place)."""
        if self._lm_head is None:
            self._lm_head = self.model.get_output_embeddings().weight
        return self._lm_head

    @property
    def architecture(self) -> str:
        return architecture_of(self.model)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [B, T] -> [B, T, H], through the target's own embedding module (incl. any scaling, e.g. Gemma). A
        plain `nn.Embedding` (no scaling, no max_norm) is read with its forward's own `F.embedding` on a weight
        found once: HF's module lookup and the module call cost ~35 us more right after a step has streamed the
        weights through the caches, at every step of the lean target and every drafting pass."""
        if self._embedding is None:
            m = self.model.get_input_embeddings()
            self._embedding = (m, m.weight if type(m) is nn.Embedding and m.max_norm is None else None)
        module, weight = self._embedding
        return F.embedding(ids, weight) if weight is not None else module(ids)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [..., H] final-normed states -> [..., V] logits (optionally over a row subset `weight`)."""
        # Flatten to 2-D first: a 3-D input such as h[:, 1:] (odd batch stride) sends the product down a bmm
        # path that copies the whole 49K x H head on every call (measured on CPU, bf16: 40 ms instead of 4 ms).
        flat = hidden.reshape(-1, hidden.shape[-1])
        logits = F.linear(flat, self.lm_head_weight if weight is None else weight).view(*hidden.shape[:-1], -1)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def set_taps(self, tap_ids: list[int]) -> None:
        bad = [i for i in tap_ids if not 0 <= i < self.num_layers]
        if bad:
            raise DFlashError(
                f"tapped layer ids {bad} do not exist: the target has decoder layers 0..{self.num_layers - 1}. "
                "Use a drafter trained for this target, or fix dflash_config.target_layer_ids."
            )
        for h in getattr(self, "_hooks", []):
            h.remove()
        self.tap_ids = list(tap_ids)
        self._hooks = [self.layers[i].register_forward_hook(self._make_hook(i)) for i in set(tap_ids)]

    def require_taps(self) -> None:
        """Raise unless `set_taps` has chosen the layers a features pass taps."""
        if not self.tap_ids:
            raise DFlashError("no tapped layers are set; call set_taps(drafter.config.target_layer_ids) first.")

    def _make_hook(self, i: int):
        def hook(module, args, out):
            if self._capture:
                self._taps[i] = _layer_output(out)
        return hook

    @torch.no_grad()
    def taps(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [B, S] (right-padded is fine: attention is causal) -> tapped features [B, S, k*H], no cache.

        The training path: one plain causal forward over whole sequences."""
        return self.features(ids).taps

    @torch.no_grad()
    def features(self, ids: torch.Tensor) -> "SequenceFeatures":
        """ids: [B, S] -> the taps and the final normed hidden states of one plain causal forward."""
        self.require_taps()
        self._capture, self._taps = True, {}
        try:
            out = self.decoder(input_ids=ids, use_cache=False)
            return SequenceFeatures(torch.cat([self._taps[i] for i in self.tap_ids], dim=-1), out.last_hidden_state)
        finally:
            self._capture, self._taps = False, {}

    # ---- caches and the forward ---------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int) -> PositionCache:
        return PositionCache(self.num_layers, batch, self.num_kv_heads, max_len, self.head_dim, self.dtype, self.device)

    def _mask(self, positions: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
        # positions: [B, Q] -> [B, 1, Q, kv_len] bool: slot s visible to the query at p iff s <= p (and within the
        # window).
        slots = torch.arange(kv_len, device=positions.device)
        p = positions[:, None, :, None]
        m = slots <= p
        if window:
            m = m & (slots > p - window)
        return m

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: PositionCache, kv_len: int | None = None,
                taps: bool = True, slots: torch.Tensor | None = None, visible: torch.Tensor | None = None):
        """ids, positions: [B, Q]. Writes K/V of these tokens into `cache` at `positions`.

        kv_len: 1 + the largest slot written (pass it when the caller knows it, to avoid a host sync).
        Draft trees (`tree.py`) put two nodes at one position, so they pass `slots` [B, Q] (where each
        token's K/V goes; default: its position) and `visible` [B, 1, Q, kv_len] bool (which slots each
        token attends to; default: slots <= its position). RoPE always uses `positions`.

        Returns hidden [B, Q, H] (final-normed; apply `logits`) and, if `taps`, the concatenated tapped
        layer outputs [B, Q, k*H] in `tap_ids` order (None otherwise).
        """
        slots = positions if slots is None else slots
        kv_len = int(slots.max()) + 1 if kv_len is None else kv_len
        if kv_len > cache.max_len:
            raise DFlashError(f"position {kv_len - 1} exceeds the cache ({cache.max_len}); allocate a longer cache.")
        if visible is None:
            full = self._mask(positions, kv_len, None)
            window = self._mask(positions, kv_len, self.sliding_window) if self._sliding else None
        else:
            full = visible
            if self._sliding:
                # The window counts positions, not slots: a tree slot holds a token of another position.
                slot_pos = torch.arange(kv_len, device=slots.device).expand(slots.shape[0], kv_len).clone()
                slot_pos.scatter_(1, slots, positions)
                window = visible & (slot_pos[:, None, None, :] > positions[:, None, :, None] - self.sliding_window)
        mask = {"full_attention": full, "sliding_attention": window} if self._sliding else full
        self._capture, self._taps = taps, {}
        try:
            out = self.decoder(input_ids=ids, attention_mask=mask, position_ids=positions,
                               use_cache=True, **{self._cache_kw: _HFCacheView(cache, slots, kv_len)})
        finally:
            self._capture = False
        feats = torch.cat([self._taps[i] for i in self.tap_ids], dim=-1) if taps and self.tap_ids else None
        self._taps = {}
        return out.last_hidden_state, feats

    @torch.no_grad()
    def reference_logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits

    @torch.no_grad()
    def hf_generate(self, ids: list[int], max_new_tokens: int, eos: int | None, sampling=None,
                    prompt_lookup: int | None = None) -> list[int]:
        """transformers' own `generate` (the `hf` / `hf-lookup` bench peers): the new token ids."""
        x = torch.tensor([ids], device=self.device)
        kw = dict(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos if eos is not None else 0,
                  do_sample=sampling is not None and not sampling.greedy)
        if kw["do_sample"]:
            kw.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
        if prompt_lookup:
            kw["prompt_lookup_num_tokens"] = prompt_lookup
        # An explicit all-ones mask: SmolLM2's pad id equals EOS, and without it generate() masks prompt tokens.
        return self.model.generate(x, attention_mask=torch.ones_like(x), **kw)[0, len(ids):].tolist()
