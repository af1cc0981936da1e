"""The lean backend: `LeanTarget`, our own forward over an HF model's weights, built to be batch-invariant.

Why it exists: greedy speculative output must equal the engine's own greedy output token for token in the dtype
users run. That holds by construction when a token's logits have the same bits whether the token is decoded alone
or verified inside a block (or a tree, or a batch of ragged rows). Hugging Face's eager modules do not give that in
bfloat16 (their SDPA kernel changes its reduction with the query count). This forward is built only from kernels
that are row-wise on the CPUs we run on:
- on x86 (the default, `kernel_plan.py`): dflashkit's C++ kernels (`kernels/`): `RowLinear` linears (bf16
  weights or a GGUF's 4/8-bit codes), `attend` (the attention in one call per layer), and for Llama-style models
  the layer stack (every decoder layer in one call); each output element summed in one fixed order;
- elsewhere (`kernel="torch"`): linears as 2-D `F.linear` over flattened rows, attention as two matmuls (q.K^T and
  p.V) around an fp32 row softmax with grouped-query heads folded into rows;
- the model's own row-wise norms, activations and a precomputed RoPE table indexed by position.
Whether the kernels really are row-invariant on a given CPU and torch build is a property, not a law: `self_check`
measures it at load time (`batch_invariant`), and the bench labels outputs accordingly.

It also skips what HF does per call (mask factories, cache objects, hooks, per-layer Python plumbing): qkv and
gate/up are fused into one linear each (HF's projections become views of the fused weights, so nothing is stored
twice), K/V go straight into the position-indexed cache, taps are taken inline.

Supported: Llama (incl. SmolLM2), Qwen3 (q/k norms) and Gemma 3 text (sliding window,
sandwich norms). Anything else stays on `HFTarget`, the reference and the fallback.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
import torch.nn.functional as F

from .. import measurements
from ..cache import PositionCache
from ..errors import DFlashError
from ..kernel_plan import KernelPlan
from ..kernels import RowLinear, attend, hugepages, key_lists
from .hf import HFTarget, SequenceFeatures, architecture_of

log = logging.getLogger(__name__)

SUPPORTED = {"LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"}
STACKED = {"LlamaForCausalLM", "Qwen3ForCausalLM"}  # Llama-style layers: what kernels/layers.cpp implements


def _rows(x: torch.Tensor, w: torch.Tensor | RowLinear) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T as ONE 2-D matmul over flattened rows (a 3-D input with odd strides takes a
    bmm path that copies the weight, and is not guaranteed row-wise); `RowLinear` weights use our own kernel."""
    flat = x.reshape(-1, x.shape[-1])
    y = w(flat) if isinstance(w, RowLinear) else F.linear(flat, w)
    return y.view(*x.shape[:-1], w.shape[0])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, Q, h, hd]; cos/sin [B, Q, 1, hd]: NeoX-style rotary (halves), in x's dtype as HF computes it."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


class _Layer:
    """One decoder layer's weights, fused: wqkv [(h + 2 kvh) hd, H], wgu [2 I, H]; norms are the model's own."""

    def __init__(self, layer, attn_type: str):
        a, m = layer.self_attn, layer.mlp
        self.wqkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        self.wgu = torch.cat([m.gate_proj.weight, m.up_proj.weight])
        self.wo, self.wdown = a.o_proj.weight, m.down_proj.weight
        nq, nk = a.q_proj.weight.shape[0], a.k_proj.weight.shape[0]
        self.split = (nq, nk, nk)
        self._hf = (a, m)
        self._point_hf()
        self.ln_in, self.ln_post_attn = layer.input_layernorm, layer.post_attention_layernorm
        # Gemma 3 "sandwich" norms: post-attention norm BEFORE the residual add, and a pre/post pair around the MLP.
        self.ln_pre_ff = getattr(layer, "pre_feedforward_layernorm", None)
        self.ln_post_ff = getattr(layer, "post_feedforward_layernorm", None)
        self.q_norm, self.k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        self.act = m.act_fn
        self.scaling = float(getattr(a, "scaling", a.head_dim ** -0.5))
        self.attn_type = attn_type

    def _point_hf(self) -> None:
        """HF's projections become views into the fused tensors: the HF model (reference, training taps) keeps
        working and the weights are stored once."""
        (a, m), (nq, nk, _) = self._hf, self.split
        ng = m.gate_proj.weight.shape[0]
        for mod, w in ((a.q_proj, self.wqkv[:nq]), (a.k_proj, self.wqkv[nq:nq + nk]), (a.v_proj, self.wqkv[nq + nk:]),
                       (m.gate_proj, self.wgu[:ng]), (m.up_proj, self.wgu[ng:])):
            mod.weight = torch.nn.Parameter(w, requires_grad=False)

    def place(self, place) -> None:
        """Move the four weights into the memory `place(t) -> copy` gives (kernels/hugepages.py), HF's
        projections following them (o and down are the HF Parameters themselves: their data is replaced in place)."""
        self.wqkv, self.wgu = place(self.wqkv), place(self.wgu)
        self._point_hf()
        for w in (self.wo, self.wdown):
            w.data = place(w.data)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        g, u = _rows(x, self.wgu).chunk(2, dim=-1)
        return _rows(self.act(g) * u, self.wdown)


# Each query's keys are read in two parts, split at a position that depends on the query's position p only:
#   split(p) = max(p - tail_depth, 0),
# the HEAD [0, split) in place (committed tokens: slot == position in every kind of step) and the TAIL [split, p]
# gathered into tail_depth + 1 keys in position order. A draft node at depth <= tail_depth has all its in-block
# ancestors in its tail, so a tree verify computes exactly what one-token decoding computes. A deeper node is still
# verified correctly, only not necessarily bit-identically.
TAIL_DEPTH = 32  # the default: deeper than the deepest default tree (block 16, lookup 16)
ROPE_CHUNK = 1024


class _Split:
    """Where each query's keys are read from: the head part (committed keys before the query's split, slot order)
    and the tail (up to L positions from the split, gathered in position order).
    head_vis [B, Q, S] bool: the key slot is in the query's head part (the fused kernel's input)
    tail_slot [B, Q, L]: the slot of the tail's j-th position, -1 where there is none (the fused kernel's input)
    The per-op attention's inputs are derived from those on first use (the fused kernel and the layer stack, which
    run every step of the default engine, never ask for them: a one-token step need not build them):
    head [B, 1, Q, 1, S] additive mask: 0 where the key is in the head part
    tail [B, 1, Q, 1, L] additive mask over the gathered tail keys
    tail_rows [B * kvh * Q * L]: rows of a cache layer viewed as [B * kvh * max_len, hd] holding the tail's j-th
    position, per kv head (slot 0 where masked)"""

    def __init__(self, head_vis: torch.Tensor, tail_slot: torch.Tensor, dtype: torch.dtype, kvh: int, max_len: int):
        self.head_vis, self.tail_slot = head_vis, tail_slot
        self._dtype, self._kvh, self._max_len = dtype, kvh, max_len

    @staticmethod
    def build(vis: torch.Tensor, rel: torch.Tensor, dtype: torch.dtype, kvh: int, max_len: int, L: int) -> "_Split":
        """vis [B, Q, S] bool: key visible to query; rel [B, Q, S]: key position - query split; L: tail length."""
        B, Q, S = vis.shape
        in_tail = vis & (rel >= 0)
        j = torch.where(in_tail, rel, L).clamp(max=L)  # bucket L collects everything else
        slot = torch.full((B, Q, L + 1), -1, dtype=torch.long, device=vis.device)
        # one visible key per position; positions with none keep -1 (in_tail's keys only land in buckets < L)
        slot.scatter_(2, j, torch.where(in_tail, torch.arange(S, device=vis.device), -1).expand(B, Q, S))
        return _Split(vis & (rel < 0), slot[..., :L], dtype, kvh, max_len)

    @functools.cached_property
    def _zero(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.promote_types(self._dtype, torch.float32), device=self.head_vis.device)

    @functools.cached_property
    def head(self) -> torch.Tensor:
        return torch.where(self.head_vis, self._zero, float("-inf"))[:, None, :, None]

    @functools.cached_property
    def tail(self) -> torch.Tensor:
        return torch.where(self.tail_slot >= 0, self._zero, float("-inf"))[:, None, :, None]

    @functools.cached_property
    def tail_rows(self) -> torch.Tensor:
        # Masked tail entries read slot 0 (finite K/V: exp(-inf) = 0 times a finite value adds an exact zero).
        B, Q, L = self.tail_slot.shape
        dev = self.tail_slot.device
        slot = self.tail_slot.clamp(min=0).view(B, 1, Q * L)
        base = (torch.arange(B, device=dev)[:, None, None] * self._kvh
                + torch.arange(self._kvh, device=dev)[None, :, None]) * self._max_len
        return (base + slot).view(-1)


class LeanTarget(HFTarget):
    """`TargetModel` with our own batch-invariant forward; everything else (embedding, head, the HF generate peer)
    is inherited from `HFTarget`, whose model stays loaded as the reference."""

    def __init__(self, model, tap_ids: list[int] | None = None, tail_depth: int = TAIL_DEPTH):
        """tail_depth: draft nodes up to this depth are verified bit-identically to one-token decoding (the cost: a
        gather of tail_depth + 1 keys per query and layer)."""
        arch = architecture_of(model)
        if arch not in SUPPORTED:
            raise DFlashError(f"the lean backend does not implement {arch}; use --backend hf "
                              f"(supported: {', '.join(sorted(SUPPORTED))}).")
        if getattr(model.config, "attn_logit_softcapping", None):  # Gemma 2 style: not implemented, never ignored
            raise DFlashError("the lean backend does not implement attention logit soft-capping; use --backend hf.")
        super().__init__(model, tap_ids)
        types = getattr(self.config, "layer_types", None) or ["full_attention"] * self.num_layers
        self._layers = [_Layer(layer, t) for layer, t in zip(self.layers, types)]
        self.num_heads = self.config.num_attention_heads
        self.tail_depth = tail_depth
        self.norm = self.decoder.norm
        self._rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rope_len = 0
        # which linear kernels run: "torch" (F.linear), "rowlinear", "int4", "int4-a8" (ours)
        self.kernel = "torch"
        self.codes = False  # rowlinear reads the bf16 weights as the GGUF's codes (quant.attach_gguf_codes, same bits)
        self.head: RowLinear | None = None  # the LM head under our kernel (None: F.linear on lm_head_weight)
        self.fused_attention = False  # attention as one C++ call per layer (kernels/attention.cpp)
        self.stack = None  # all decoder layers as one C++ call per forward (kernels/layers.cpp), or None

    @property
    def kernel_plan(self) -> KernelPlan:
        """The kernels this target runs (`kernel_plan.py`), as its state says."""
        from ..kernels import isa, source_id

        ours = self.kernel != "torch" or self.fused_attention
        return KernelPlan(linear=self.kernel, isa=isa() if ours else "", codes=self.codes,
                          attention="attend" if self.fused_attention else "torch", stack=self.stack is not None,
                          sources=source_id() if ours else "")

    @property
    def engine_name(self) -> str:
        """The backend and its kernels, e.g. LeanTarget+rowlinear.avx2+attend+layers (bench reports, logs)."""
        return "+".join([type(self).__name__] + self.kernel_plan.parts)

    def use_fused_attention(self) -> None:
        """Attention as one row-invariant C++ call per layer (kernels/attention.cpp) instead of ~30 tensor ops."""
        from ..kernels import available, why_unavailable

        if self.dtype != torch.bfloat16 or not available():
            raise DFlashError("the fused attention kernel needs bfloat16 and the dflashkit kernels "
                              f"({why_unavailable() or self.dtype}); use --kernel torch.")
        self.fused_attention = True

    def stack_unsupported(self) -> str:
        """Why the decoder layers cannot run as one C++ call (`use_layer_stack`), or "" where they can."""
        if not self.fused_attention or self.kernel == "torch":
            return "it needs our linear and attention kernels (--kernel rowlinear or --quant)"
        return self.layers_unsupported()

    def layers_unsupported(self) -> str:
        """Why this architecture's layers cannot run as one C++ call whatever the kernels, or "" where they can."""
        if self.architecture not in STACKED:
            return f"{self.architecture} layers are not Llama-style"
        if {layer.attn_type for layer in self._layers} != {"full_attention"}:
            return "it has sliding-window layers"
        if getattr(self.config, "hidden_act", None) not in ("silu", "swish"):
            return "its MLP activation is not SiLU"
        return ""

    def use_layer_stack(self) -> None:
        """Run all decoder layers as ONE C++ call per forward (kernels/layers.cpp: the ~40 small torch ops per layer
        around the kernels become loops over rows); row-invariant like the per-op forward, its own kernel set."""
        from ..kernels import load, stack_linear

        why = self.stack_unsupported()
        if why:
            raise DFlashError(f"the layer stack cannot run this target: {why}.")
        stack = load().Stack(self.num_heads, self.num_kv_heads, self.head_dim, float(self.norm.variance_epsilon))
        empty = torch.empty(0, dtype=torch.bfloat16)
        for layer in self._layers:
            norms = [n.weight.detach() if n is not None else empty for n in (layer.q_norm, layer.k_norm)]
            stack.add_layer(layer.ln_in.weight.detach().contiguous(), layer.ln_post_attn.weight.detach().contiguous(),
                            *norms, [stack_linear(w) for w in (layer.wqkv, layer.wo, layer.wgu, layer.wdown)],
                            layer.scaling)
        stack.set_final_norm(self.norm.weight.detach().contiguous())  # forward's output comes normed (rms_row)
        self.stack = stack

    def use_rowlinear(self) -> None:
        """Run every bf16 linear (and the head) through our row-invariant kernel (kernels/rowlinear.cpp): the same
        weights, moved onto huge pages (stored once); fast at any row count where torch's bf16 GEMM is not (CPUs
        without bf16 units)."""
        from ..kernels import available, why_unavailable

        if self.dtype != torch.bfloat16:
            raise DFlashError(f"the rowlinear kernel runs bfloat16 weights (this target: {self.dtype}); use --dtype "
                              "bfloat16 or --kernel torch.")
        if not available():
            raise DFlashError(f"the rowlinear kernel is unavailable: {why_unavailable()}; use --kernel torch.")
        # Why huge pages: a step streams every weight (~270 MB in bf16 for SmolLM2-135M); on 4 KiB pages that is
        # ~66,000 page translations a step (kernels/hugepages.py). The tied embedding follows the head's Parameter.
        self.lm_head_weight.data = hugepages.place(self.lm_head_weight.data)
        for layer in self._layers:
            layer.place(hugepages.place)
            for name in ("wqkv", "wgu", "wo", "wdown"):
                setattr(layer, name, RowLinear.from_bf16(getattr(layer, name)))
        self.stack = None  # it held the old weights: build it again after the linears change (`use_layer_stack`)
        self.head = RowLinear.from_bf16(self.lm_head_weight)
        self.kernel, self.codes = "rowlinear", False
        hugepages.trim()  # the old storage, now unreferenced

    def linear_weights(self) -> list[torch.Tensor]:
        """The weights F.linear multiplies under `kernel == "torch"` (the exactness self-check probes them)."""
        ws = [w for layer in self._layers for w in (layer.wqkv, layer.wgu, layer.wo, layer.wdown)]
        return [w for w in ws if isinstance(w, torch.Tensor)] + [self.lm_head_weight]

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor | RowLinear | None = None) -> torch.Tensor:
        """As `HFTarget.logits`; on our kernels also a row subset `weight` (the drafter's reduced vocabulary), as a
        bf16 tensor or as rows of the head's codes (`proposers.draft_head`)."""
        if isinstance(weight, RowLinear):
            head = weight
        elif self.head is None or (weight is not None and (weight.dtype != torch.bfloat16 or weight.shape[1] % 32)):
            return super().logits(hidden, weight)
        else:
            head = self.head if weight is None else RowLinear.from_bf16(weight)
        logits = head(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:-1], -1)
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits


    # ---- RoPE: one table per layer type, computed once, indexed by position ----------------------------------
    def _rope_table(self, n: int) -> None:
        """cos/sin [>= n, hd] for positions 0..n-1. Why a table, grown in fixed chunks: a position's rotary values
        must have the same bits in every call, and a vectorised cos/sin gives an element different bits depending
        on where it sits in the tensor; so each position is computed once, always inside the same chunk."""
        x = torch.zeros(1, dtype=self.dtype, device=self.device)
        rot = self.decoder.rotary_emb
        per_type = "layer_type" in inspect.signature(rot.forward).parameters  # Gemma 3: one base per layer type
        while self._rope_len < n:
            pos = torch.arange(self._rope_len, self._rope_len + ROPE_CHUNK, device=self.device)[None]
            for t in {layer.attn_type for layer in self._layers}:
                cos, sin = rot(x, pos, t) if per_type else rot(x, pos)
                old = self._rope.get(t)
                self._rope[t] = (cos[0], sin[0]) if old is None else (torch.cat([old[0], cos[0]]),
                                                                       torch.cat([old[1], sin[0]]))
            self._rope_len += ROPE_CHUNK

    # ---- the forward -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def features(self, ids: torch.Tensor) -> SequenceFeatures:
        """ids: [B, S] (right-padded is fine: attention is causal) -> the training taps and final normed states.
        Where our linears run on a CPU without bf16 units, through our own forward: the features decoding hands the
        drafter, and faster there than HF's bf16 modules (training steps 1.7-2.9x shorter,
        bench/results/train-cpu-fp32/). Else HF's forward. Why not on CPUs with bf16 units: there HF's modules run
        oneDNN's bf16 GEMM, and ours have not been measured against it at training's widths."""
        if self.kernel == "torch" or measurements.cpu_has_bf16_units():  # our linears are what make it faster
            return super().features(ids)
        return self.own_features(ids)

    @torch.no_grad()
    def own_features(self, ids: torch.Tensor) -> SequenceFeatures:
        """`features` through our own forward (one fresh cache, positions 0..S-1), wherever it runs."""
        self.require_taps()
        B, S = ids.shape
        positions = torch.arange(S, device=ids.device).expand(B, S)
        final, taps = self.forward(ids, positions, self.new_cache(B, S), kv_len=S)
        return SequenceFeatures(taps, final)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: PositionCache, kv_len: int | None = None,
                taps: bool = True, slots: torch.Tensor | None = None, visible: torch.Tensor | None = None):
        """Same contract as `HFTarget.forward` (see `TargetModel.forward`)."""
        slots = positions if slots is None else slots
        kv_len = int(slots.max()) + 1 if kv_len is None else kv_len
        if kv_len > cache.max_len:
            raise DFlashError(f"position {kv_len - 1} exceeds the cache ({cache.max_len}); allocate a longer cache.")
        if cache.max_len > self._rope_len:  # positions never exceed the cache: no host sync on them
            self._rope_table(cache.max_len)
        splits = self._splits(positions, slots, kv_len, visible, cache.max_len)
        x = self.embed(ids)  # [B, Q, H]
        if self.stack is not None:  # every layer in one C++ call (kernels/layers.cpp); one layer type, no window
            sp = splits["full_attention"]
            cos, sin = (c[positions] for c in self._rope["full_attention"])  # [B, Q, hd]
            x, feats = self.stack.forward(x, cos, sin, cache.keys, cache.values, slots, sp.head_vis, sp.tail_slot,
                                          list(self.tap_ids) if taps else [])
            return x, (feats if taps and self.tap_ids else None)  # normed in the stack (layers.cpp `set_final_norm`)
        tapped = {}
        want = set(self.tap_ids) if taps else set()
        rope = {t: tuple(c[positions][:, :, None] for c in cs) for t, cs in self._rope.items()}  # [B, Q, 1, hd]
        for i, layer in enumerate(self._layers):
            cos, sin = rope[layer.attn_type]
            a = self._attention(layer, i, layer.ln_in(x), cos, sin, cache, slots, kv_len, splits[layer.attn_type])
            if layer.ln_pre_ff is not None:
                x = x + layer.ln_post_attn(a)
                x = x + layer.ln_post_ff(layer.mlp(layer.ln_pre_ff(x)))
            else:
                x = x + a
                x = x + layer.mlp(layer.ln_post_attn(x))
            if i in want:
                tapped[i] = x
        feats = torch.cat([tapped[i] for i in self.tap_ids], dim=-1) if want else None
        return self.norm(x), feats

    def _splits(self, positions, slots, kv_len, visible, max_len: int) -> dict[str, _Split]:
        """Where each query's keys are read from, per layer type (see `_Split`)."""
        B, Q = positions.shape
        dev = positions.device
        types = {layer.attn_type for layer in self._layers}
        if self.fused_attention and types == {"full_attention"}:  # one C++ call, the same lists (kernels/keylists.cpp)
            head, tail = key_lists(positions, slots, kv_len, visible, self.tail_depth, self.tail_depth + 1)
            return {"full_attention": _Split(head, tail, self.dtype, self.num_kv_heads, max_len)}
        slot_pos = torch.arange(kv_len, device=dev).expand(B, kv_len).clone()
        slot_pos.scatter_(1, slots, positions)  # the position of the token each slot holds
        vis = (slot_pos[:, None, :] <= positions[:, :, None]) if visible is None else visible[:, 0]  # [B, Q, S]
        split = (positions - self.tail_depth).clamp(min=0)  # [B, Q]
        rel = slot_pos[:, None, :] - split[:, :, None]  # [B, Q, S] offset of a key's position in the query's tail
        out = {}
        for t in types:
            v = vis
            if t == "sliding_attention":  # the window counts positions, not slots
                v = vis & (slot_pos[:, None, :] > positions[:, :, None] - self.sliding_window)
            out[t] = _Split.build(v, rel, self.dtype, self.num_kv_heads, max_len, self.tail_depth + 1)
        return out

    def _attention(self, layer: _Layer, i: int, h: torch.Tensor, cos, sin, cache: PositionCache,
                   slots: torch.Tensor, kv_len: int, sp: "_Split") -> torch.Tensor:
        """h [B, Q, H] normed -> attention output after o_proj [B, Q, H]; writes this layer's K/V at `slots`."""
        B, Q, _ = h.shape
        hd, kvh = self.head_dim, self.num_kv_heads
        g = self.num_heads // kvh
        q, k, v = _rows(h, layer.wqkv).split(layer.split, dim=-1)
        q, k, v = q.view(B, Q, -1, hd), k.view(B, Q, kvh, hd), v.view(B, Q, kvh, hd)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # The value rows carry a trailing 1 (see new_cache): e.[V | 1] yields the softmax numerator AND denominator.
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        cache.write(i, k.transpose(1, 2), v.transpose(1, 2), slots)
        if self.fused_attention:  # one row-invariant C++ call (kernels/attention.cpp) for everything below
            return _rows(attend(q, cache.keys[i], cache.values[i], sp.head_vis, sp.tail_slot, layer.scaling), layer.wo)
        keys, values = cache.keys[i][:, :, :kv_len], cache.values[i][:, :, :kv_len]  # [B, kvh, S, hd (+1)]
        f = sp.head.dtype  # fp32 scores for 16-bit weights (HF eager's recipe), the model's dtype otherwise
        # Grouped-query heads as rows: query head j*g + r uses kv head j (HF's repeat_kv order), so the g heads of
        # a kv head and their Q queries form one [g*Q, hd] matrix per kv head, no K/V copies.
        q = q.view(B, Q, kvh, g, hd).permute(0, 2, 3, 1, 4)  # [B, kvh, g, Q, hd]
        # Head: the keys before each query's split, read in place (slot == position there in every kind of step).
        sh = torch.matmul(q.reshape(B, kvh, g * Q, hd), keys.transpose(-1, -2)).to(f)  # [B, kvh, g*Q, S]
        sh = sh.view(B, kvh, g, Q, kv_len).transpose(2, 3) * layer.scaling + sp.head  # [B, kvh, Q, g, S]
        # Tail: the keys from the split to the query itself, gathered in POSITION order (a tree keeps ancestors at
        # other slots than one-token decoding does; gathered, both see the same L keys in the same order). Products
        # and sums run elementwise in fp32 over a fixed L: batched matmuls are not batch-count invariant (measured:
        # MKL groups fp32 matrices differently, bf16 ones differ with strided operands) and bf16 ones are slow.
        kt = cache.keys[i].view(-1, hd).index_select(0, sp.tail_rows).view(B, kvh, Q, 1, -1, hd)
        vt = cache.values[i].view(-1, hd + 1).index_select(0, sp.tail_rows).view(B, kvh, Q, 1, -1, hd + 1)
        qt = q.transpose(2, 3)[..., None, :].to(f)  # [B, kvh, Q, g, 1, hd]
        st = (qt * kt.to(f)).sum(-1) * layer.scaling + sp.tail  # [B, kvh, Q, g, L]
        # Why no torch.softmax: its row sum is vectorised, so a key's lane (its slot mod the vector width) sets the
        # summation order (measured: 1-ulp denominators, flipped bf16 weights). exp is elementwise and the max
        # exact; the head's sums run inside a matmul (e.[V | 1]) whose k-loop sees the same keys in the same order
        # in every kind of step (trailing hidden slots add exact zeros), the tail's over a fixed L.
        m = torch.maximum(sh.amax(dim=-1), st.amax(dim=-1))[..., None]  # [B, kvh, Q, g, 1]
        eh = torch.exp(sh - m).to(values.dtype).transpose(2, 3).reshape(B, kvh, g * Q, kv_len)
        nd = torch.matmul(eh, values).view(B, kvh, g, Q, hd + 1).transpose(2, 3).to(f)  # [B, kvh, Q, g, hd + 1]
        nd = nd + (torch.exp(st - m)[..., None] * vt.to(f)).sum(-2)
        o = (nd[..., :hd] / nd[..., hd:]).to(values.dtype)  # [B, kvh, Q, g, hd]
        o = o.permute(0, 2, 1, 3, 4).reshape(B, Q, self.num_heads * hd)
        return _rows(o, layer.wo)

    def new_cache(self, batch: int, max_len: int) -> PositionCache:
        """Value rows are hd + 1 wide: the extra column holds 1.0 (written with each token's V)."""
        return PositionCache(self.num_layers, batch, self.num_kv_heads, max_len, self.head_dim, self.dtype,
                             self.device, value_dim=self.head_dim + 1)

    @torch.no_grad()
    def reference_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The plain causal forward of THIS engine (what an audit compares decoding with), not HF's."""
        B, S = ids.shape
        pos = torch.arange(S, device=self.device).expand(B, S)
        hidden, _ = self.forward(ids.to(self.device), pos, self.new_cache(B, S), kv_len=S, taps=False)
        return self.logits(hidden)
