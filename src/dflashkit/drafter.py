"""The DFlash drafter network (dflash-spec §1): a Qwen3-style stack with KV injection.

Block tokens `[anchor, MASK x (B-1)]` are the only queries. Context = fused target features
`hidden_norm(fc(concat taps))`, one row per committed position; in every layer the context goes
through that layer's k/v projections and k-norm and is used as extra keys/values, never as queries.
The embedding and the LM head belong to the target (frozen, never stored here).

This module knows nothing about caches or decoding: callers pass the context K/V they hold and a
boolean visibility mask. Inference (`engine.py`) and training (`objective.py`) call the SAME forward,
which is what makes train/serve parity testable.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from .config import DFlashConfig
from .dflash2 import CandidateSelector, DynamicConv


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Like HF Qwen3RMSNorm: statistics in float32 (at least), weight applied in the input dtype.
        dtype = x.dtype
        xf = x.to(torch.promote_types(dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions: [B, T] absolute positions -> cos, sin: [B, 1, T, head_dim] in `dtype`.

    Why absolute positions: the draft shares the target's position space (context feature of token t
    at t, block slot j at anchor + j). Re-basing them silently ruins acceptance. Computed in float32
    like HF's rotary module, so a Z Lab drafter run by transformers sees the same angles.
    """
    even = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
    inv_freq = 1.0 / (theta ** (even / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [B, T, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, h, T, hd]; neox-style rotate_half, as in Qwen3.
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DraftAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        # [B, T, n*hd] -> [B, n, T, hd]
        return x.view(*x.shape[:2], n, self.head_dim).transpose(1, 2)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [B, T, H] (fused context, or normed block tokens) -> k, v: [B, kvh, T, hd]."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """x: [B, Q, H] normed block tokens; cos/sin: [B, 1, Q, hd] at block positions;
        ctx_k/ctx_v: [B, kvh, S, hd] context K/V (RoPE applied); mask: [B, 1, Q, S + Q] bool, True = visible."""
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)
        k, v = self.kv(x, cos, sin)
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(self.head_dim),
                                           enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(a.transpose(1, 2).reshape(*x.shape[:2], -1))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)
        self.attention_conv = self.mlp_conv = None  # DFlash2: a convolution around each sublayer (`dflash2.py`)
        if cfg.arch == "dflash2":
            self.attention_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask, block: int):
        # The context does NOT pass through input_layernorm: it was normed once by hidden_norm.
        x = x + self._around(self.attention_conv, self.input_layernorm(x), block,
                             lambda h: self.self_attn(h, cos, sin, ctx_k, ctx_v, mask))
        return x + self._around(self.mlp_conv, self.post_attention_layernorm(x), block, self.mlp)

    @staticmethod
    def _around(conv: DynamicConv | None, h: torch.Tensor, block: int, sublayer) -> torch.Tensor:
        if conv is None:
            return sublayer(h)
        h, dynamic = conv.prepare(h, block)
        return conv.finish(sublayer(h), dynamic, block)


class DFlashDrafter(nn.Module):
    """Parameters use Z Lab's tensor names (`fc`, `hidden_norm`, `layers.{i}...`, `norm`)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        # Target ids by training frequency, most frequent first (`checkpoint.RANKING`); lets the engine draft over
        # the most frequent ids only (`DFlashEngine(draft_vocab=N)`). Not a weight: None when the directory has none.
        self.token_ranking: list[int] | None = None
        self.corpus = None  # the target's answers for the corpus lookup (`checkpoint.CORPUS`): not a weight either
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.candidate_selector = None  # DFlash2: the path through each slot's top-k (`dflash2.py`)
        if cfg.arch == "dflash2":
            self.candidate_selector = CandidateSelector(cfg.vocab_size, cfg.hidden_size, cfg.selector_rank,
                                                        cfg.selector_top_k)
        if cfg.draft_vocab_size is not None:
            # d2t[i] = target id of draft id i (stored as offsets target - i, the EAGLE-3 convention).
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None

    def init_weights(self, seed: int, std: float = 0.02) -> "DFlashDrafter":
        """Deterministic Qwen3-style init (normal(0, std) linears, unit norms) from `seed`."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)
        return self

    def draft_to_target_ids(self) -> torch.Tensor | None:
        """[draft_vocab] target ids of the reduced draft vocabulary, or None for the full vocabulary."""
        if self.d2t is None:
            return None
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """taps: [B, T, k*H] concatenated tapped target states -> fused context [B, T, H]."""
        return self.hidden_norm(self.fc(taps))

    def context_kv(self, fused: torch.Tensor, positions: torch.Tensor):
        """fused: [B, T, H]; positions: [B, T] -> per layer (k, v), each [B, kvh, T, hd].

        Context rows are never queries, so their K/V depend on the fused features alone and can be
        computed once when the positions are committed (the draft cache stores exactly these).
        """
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, fused.dtype)
        return [layer.self_attn.kv(fused, cos, sin) for layer in self.layers]

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, ctx_kv, mask: torch.Tensor,
                taps: torch.Tensor | None = None, tap_positions: torch.Tensor | None = None, block: int | None = None):
        """block_embeds: [B, Q, H] target embeddings of the block tokens; block_positions: [B, Q];
        ctx_kv: per layer (k, v) each [B, kvh, S, hd]; mask: [B, 1, Q, S + Q] bool (True = visible).
        Training passes raw `taps` [B, S, k*H] at `tap_positions` [B, S] instead of ctx_kv, so that the whole
        step is one `forward` (what DistributedDataParallel needs to synchronise gradients).
        block: slots per block when Q packs several (training; DFlash2's convolutions stay inside each; default Q).
        Returns the final-normed hidden states [B, Q, H] (feed to the target LM head)."""
        if taps is not None:
            ctx_kv = self.context_kv(self.fuse(taps), tap_positions)
        cos, sin = rope_cos_sin(block_positions, self.config.head_dim, self.config.rope_theta, block_embeds.dtype)
        x = block_embeds
        views: dict = {}  # (window, causal) -> (first context key kept, that layer kind's mask)
        for i, (layer, (ck, cv)) in enumerate(zip(self.layers, ctx_kv)):
            kind = self.config.attention_of(i)
            if kind != (None, False):
                if kind not in views:
                    views[kind] = windowed_mask(mask, block_positions, ck.shape[2], *kind, tap_positions)
                lo, m = views[kind]
                ck, cv = ck[:, :, lo:], cv[:, :, lo:]
            else:
                m = mask
            x = layer(x, cos, sin, ck, cv, m, block or x.shape[1])
        return self.norm(x)


def windowed_mask(mask: torch.Tensor, q_pos: torch.Tensor, S: int, window: int | None, causal: bool,
                  ctx_pos: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
    """A sliding-window or causal layer's view of the keys [context S; block Q]: `mask` [B, 1, Q, S + Q] narrowed to
    what Z Lab's `_attention_mask` lets a query at position q see (q - k < window; causal: k <= q; a bidirectional
    window also k - q < window). q_pos: [B, Q] the block's positions; ctx_pos: [B, S] the context keys' positions
    (training), None when key i sits at position i (decoding's position-indexed cache). Returns (lo, mask'): when
    decoding, the context keys before `lo` are outside every query's window and are dropped from the layer's keys
    and the mask (what keeps a windowed layer's cost flat on long prompts)."""
    lo = 0
    if ctx_pos is None:
        if window is not None:
            lo = max(0, min(int(q_pos.min()) - window + 1, S))
        ctx_pos = torch.arange(lo, S, device=q_pos.device)[None].expand(q_pos.shape[0], -1)
        mask = torch.cat([mask[..., lo:S], mask[..., S:]], dim=-1)
    k = torch.cat([ctx_pos, q_pos], dim=1)[:, None, :]  # [B, 1, S' + Q]
    q = q_pos[:, :, None]  # [B, Q, 1]
    vis = torch.ones_like(mask[:, 0])
    if causal:
        vis &= k <= q
    if window is not None:
        vis &= q - k < window
        if not causal:
            vis &= k - q < window
    return lo, mask & vis[:, None]


def layer_stack(drafter: DFlashDrafter, weights: str | None = None):
    """The drafter's layers as ONE C++ call per drafting step (kernels/layers.cpp, the stack the lean target runs:
    the ~40 small torch ops per layer around the kernels were ~half of a drafting step on a CPU), or None where it
    cannot run them (no kernels, not bf16, attention biases, a width not a multiple of 32, DFlash2 convolutions
    whose groups are not a multiple of 8 channels, sliding-window or causal draft layers). DFlash2's convolutions
    run in the same call (layers.cpp `convolve`, the module's op order and roundings).
    Its fused qkv, gate/up and kv (the context's K/V, `Stack.context`) weights are copies: build it once per drafter
    (`DFlashEngine` does, next to a stacked target).
    weights: what the linears' copies are. "q8_0" (the default): Q8_0 copies on 8-bit activations
    (`RowLinear.q8_from_bf16`, qlinear.cpp): half the bytes a drafting step reads, and a drafter's numbers need not
    match anything, only its acceptance (unchanged: chain tau 1.9266 vs 1.9284 on 40 held-out prompts; a drafting
    step at blocks 2-4 0.6-0.8 ms shorter, `draft-q8/`); "q4_1": Q4_1 copies (`RowLinear.q4_from_bf16`), a quarter of
    the bytes; "bf16": the weights themselves. None: DFLASHKIT_DRAFTER_WEIGHTS, else "bf16" where
    DFLASHKIT_DRAFTER_BF16=1 (A/B runs), else "q8_0". Which ran is `drafter.stack_weights`."""
    from .kernels import RowLinear, load, stack_linear

    c = drafter.config
    widths = (c.hidden_size, c.num_attention_heads * c.head_dim, c.intermediate_size)
    v2 = c.arch == "dflash2"
    if (load() is None or (v2 and (c.conv_group_size % 8 or c.hidden_size % c.conv_group_size)) or c.windowed
            or c.attention_bias
            or drafter.fc.weight.dtype != torch.bfloat16
            or c.head_dim % 8
            or any(w % 32 for w in widths)):
        return None

    if weights is None:
        weights = os.environ.get("DFLASHKIT_DRAFTER_WEIGHTS") or (
            "bf16" if os.environ.get("DFLASHKIT_DRAFTER_BF16") else "q8_0")
    copy = {"bf16": RowLinear.from_bf16, "q8_0": RowLinear.q8_from_bf16, "q4_1": RowLinear.q4_from_bf16}.get(weights)
    if copy is None:
        raise ValueError(f"the drafter's stacked weights are bf16, q8_0 or q4_1, not {weights!r} "
                         "(DFLASHKIT_DRAFTER_WEIGHTS)")
    drafter.stack_weights = weights

    def fused(*mods):
        return stack_linear(copy(torch.cat([m.weight.detach() for m in mods]).contiguous()))

    stack = load().Stack(c.num_attention_heads, c.num_key_value_heads, c.head_dim, float(c.rms_norm_eps))
    for layer in drafter.layers:
        a, m = layer.self_attn, layer.mlp
        stack.add_layer(layer.input_layernorm.weight.detach().contiguous(),
                        layer.post_attention_layernorm.weight.detach().contiguous(),
                        a.q_norm.weight.detach().contiguous(), a.k_norm.weight.detach().contiguous(),
                        [fused(a.q_proj, a.k_proj, a.v_proj), fused(a.o_proj), fused(m.gate_proj, m.up_proj),
                         fused(m.down_proj), fused(a.k_proj, a.v_proj)], 1.0 / math.sqrt(c.head_dim))
    for i, layer in enumerate(drafter.layers if v2 else []):  # DFlash2: a convolution around each sublayer
        convs = (layer.attention_conv, layer.mlp_conv)
        stack.add_convs(i, *[x for cv in convs for x in (fused(cv.kernel_projection),
                                                           cv.base_kernel.detach().bfloat16().contiguous())],
                        c.conv_kernel_size, c.conv_group_size)
    # The final norm in the same call (rms_row: `RMSNorm`'s rounding, its own summation order): its torch ops cost
    # ~20 us each right after a target step has streamed the weights through the caches.
    stack.set_final_norm(drafter.norm.weight.detach().contiguous())
    # The fuse too (`Stack.context_taps`): fc on its bf16 weights (the products `use_rowlinear_in` gives it), the
    # hidden norm as the final norm's.
    stack.set_fuse(stack_linear(RowLinear.from_bf16(drafter.fc.weight.detach().contiguous())),
                   drafter.hidden_norm.weight.detach().contiguous())
    return stack


def dflash2_from(v1: DFlashDrafter, **fields) -> DFlashDrafter:
    """A DFlash2 drafter that drafts exactly what the v1 drafter `v1` drafts: its weights, identity convolutions
    (`DynamicConv.init_identity`) and a selector scoring the unary logits alone (`CandidateSelector.init_unary`;
    its other weights small random, so that training moves them). fields: DFlash2's config fields
    (`config.DFLASH2_FIELDS`), else their defaults."""
    cfg = v1.config.replace(arch="dflash2", **fields)
    v2 = DFlashDrafter(cfg).init_weights(0)
    v2.load_state_dict(v1.state_dict(), strict=False)  # v1's tensors are a subset of v2's: the rest stays as set
    for layer in v2.layers:
        layer.attention_conv.init_identity()
        layer.mlp_conv.init_identity()
    v2.candidate_selector.init_unary()
    v2.token_ranking, v2.corpus = v1.token_ranking, v1.corpus
    return v2.to(next(v1.parameters()).dtype)
