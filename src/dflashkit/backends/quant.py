"""The 4-bit target (`--quant int4`): the lean forward with the GGUF's own Q4_1 / Q8_0 codes, not re-quantised.

A GGUF target (the default SmolLM2 is Q4_1 with a Q8_0 embedding/head) is loaded by transformers as dequantised
weights; here the same file's codes replace the lean layers' linears and the head with `RowLinear`s (our
row-invariant kernel dequantises 32-weight blocks on the fly). It is a different target from the bf16 one (w = d*q + m
in fp32, not rounded to bf16), with its own AR baseline; verified logits equal one-token logits bit for bit as in
bf16, because every kernel is row-invariant.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from ..errors import DFlashError
from ..kernels import RowLinear, available, why_unavailable

log = logging.getLogger(__name__)

GGML_KINDS = {"Q4_1": "q4_1", "Q8_0": "q8_0"}
PROJ = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
        "down": "ffn_down"}


def _rope_rows(n: int, heads: int) -> torch.Tensor:
    """The HF row order of a q/k weight stored by llama.cpp's converter, which interleaves each head's two rotary
    halves (`permute` in convert_hf_to_gguf.py): GGUF row g holds HF row perm[g]."""
    perm = torch.arange(n).view(heads, 2, n // heads // 2).transpose(1, 2).reshape(n)
    return torch.argsort(perm)


def _close(lin: RowLinear, w: torch.Tensor) -> bool:
    """Do the codes dequantise to the weights transformers loaded from the same file (up to w's dtype rounding)?"""
    return torch.allclose(lin.dequantize(), w.float(), rtol=2 ** -7, atol=1e-6)


def attach_gguf_codes(target, gguf_path: str | Path, int8_acts: bool = False) -> None:
    """Replace `target`'s (a LeanTarget loaded from `gguf_path`) linears and head with the file's own codes;
    int8_acts: apply them to 8-bit activations with integer dot products (`--quant int4-a8`, kernels/qlinear.cpp)."""
    import gguf

    if not available():
        raise DFlashError(f"--quant int4 needs our row-invariant kernel, unavailable here: {why_unavailable()}.")
    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}

    def codes(name: str, hf_weight: torch.Tensor, heads: int | None = None) -> RowLinear:
        t = tensors.get(name)
        if t is None or t.tensor_type.name not in GGML_KINDS:
            kind = None if t is None else t.tensor_type.name
            raise DFlashError(f"--quant int4 needs Q4_1 / Q8_0 tensors; {gguf_path} has {name} as {kind}. Use a "
                              "Q4_1 GGUF (llama.cpp: llama-quantize MODEL.gguf OUT.gguf Q4_1) or drop --quant.")
        n, k = hf_weight.shape
        lin = RowLinear.from_ggml(GGML_KINDS[t.tensor_type.name], torch.from_numpy(np.array(t.data)), n, k)
        if heads and not _close(lin, hf_weight):  # Llama q/k rows are stored rotary-interleaved: undo it
            lin = lin.select_rows(_rope_rows(n, heads))
        # Why check every tensor: a wrong row order or block layout would not fail, it would decode garbage.
        if not _close(lin, hf_weight):
            raise DFlashError(f"{name} in {gguf_path} does not dequantise to the weights loaded from it; the file's "
                              "layout is not one this loader knows. Drop --quant.")
        return lin.with_int8_acts() if int8_acts else lin

    nh, nkv = target.num_heads, target.num_kv_heads
    for i, (layer, hf) in enumerate(zip(target._layers, target.layers)):
        a, m = hf.self_attn, hf.mlp
        get = (lambda p, w, heads=None: codes(f"blk.{i}.{PROJ[p]}.weight", w, heads))
        layer.wqkv = RowLinear.cat([get("q", a.q_proj.weight, nh), get("k", a.k_proj.weight, nkv),
                                    get("v", a.v_proj.weight)])
        layer.wo = get("o", a.o_proj.weight)
        layer.wgu = RowLinear.cat([get("gate", m.gate_proj.weight), get("up", m.up_proj.weight)])
        layer.wdown = get("down", m.down_proj.weight)
    target.stack = None  # a layer stack holds the old weights: build it again after this (`use_layer_stack`)
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    target.head = codes(head, target.lm_head_weight)
    target.kernel = "int4-a8" if int8_acts else "int4"
    log.info("int4 target: %d layers of %s codes from %s, head %s", len(target._layers),
             tensors["blk.0.attn_q.weight"].tensor_type.name, Path(gguf_path).name, tensors[head].tensor_type.name)
