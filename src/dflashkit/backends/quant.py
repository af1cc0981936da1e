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


# The GGUF's tensors as raw block bytes, in a folder of the converted target's directory: not beside its weights,
# where engines that load every *.safetensors file (vLLM) would take them for the model's.
CODES_FILE = "dflashkit-codes/gguf-tensors.safetensors"


def gguf_tensors(gguf_path: str | Path, cache_dir: Path | None = None) -> dict[str, tuple[str, torch.Tensor]]:
    """name -> (GGML type name, the tensor's raw bytes as uint8 [rows, bytes per row]). Why a cache: gguf's reader
    parses every metadata field first (the 49,152-token vocabulary: ~5 s here) although only the tensors are
    needed; the first call writes them to `cache_dir`/CODES_FILE (atomically), later calls map that file."""
    import json
    import os
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import save_file

    cached = cache_dir / CODES_FILE if cache_dir is not None else None
    if cached is not None and cached.is_file():
        with safe_open(str(cached), "pt") as f:
            kinds = json.loads(f.metadata()["kinds"])
            return {name: (kinds[name], f.get_tensor(name)) for name in f.keys()}
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    out = {t.name: (t.tensor_type.name, torch.from_numpy(np.array(t.data)).view(torch.uint8)
                    .reshape(int(t.shape[-1]) if len(t.shape) > 1 else 1, -1)) for t in reader.tensors}
    if cached is not None:
        tmp = None
        try:
            cached.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cached.parent, prefix=f".{cached.name}.")
            os.close(fd)
            save_file({k: v.contiguous() for k, (_, v) in out.items()}, tmp,
                      metadata={"kinds": json.dumps({k: kind for k, (kind, _) in out.items()})})
            os.chmod(tmp, 0o644)  # as the converted weights beside it (mkstemp makes it private)
            os.replace(tmp, cached)
        except OSError as e:  # a read-only cache: the next load parses the file again
            log.info("could not cache the GGUF's codes in %s: %s", cache_dir, e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
    return out


class NotTheSameBits(DFlashError):
    """The codes do not decode to the loaded bf16 weights bit for bit (`attach_gguf_codes(same_bits=True)`)."""


def attach_gguf_codes(target, gguf_path: str | Path, int8_acts: bool = False, same_bits: bool = False,
                      cache_dir: Path | None = None) -> None:
    """Replace `target`'s (a LeanTarget loaded from `gguf_path`) linears and head with the file's own codes;
    int8_acts: apply them to 8-bit activations with integer dot products (`--quant int4-a8`, kernels/qlinear.cpp).
    same_bits: only if every tensor's codes decode, as rowlinear's AVX512-BF16 path decodes them (`as_bf16`), to
    exactly the bf16 weights loaded (then the target is the same bf16 model, reading a third of the bytes; else
    `NotTheSameBits` is raised and the target is left as it was). cache_dir: where `gguf_tensors` keeps the
    tensors."""
    if not available():
        raise DFlashError(f"--quant int4 needs our row-invariant kernel, unavailable here: {why_unavailable()}.")
    tensors = gguf_tensors(gguf_path, cache_dir)

    def codes(name: str, hf_weight: torch.Tensor, heads: int | None = None) -> RowLinear:
        kind, raw = tensors.get(name, (None, None))
        if kind not in GGML_KINDS:
            if same_bits:
                raise NotTheSameBits(f"{name} is {kind}, not Q4_1 / Q8_0")
            raise DFlashError(f"--quant int4 needs Q4_1 / Q8_0 tensors; {gguf_path} has {name} as {kind}. Use a "
                              "Q4_1 GGUF (llama.cpp: llama-quantize MODEL.gguf OUT.gguf Q4_1) or drop --quant.")
        n, k = hf_weight.shape
        lin = RowLinear.from_ggml(GGML_KINDS[kind], raw, n, k)
        if heads and not _close(lin, hf_weight):  # Llama q/k rows are stored rotary-interleaved: undo it
            lin = lin.select_rows(_rope_rows(n, heads))
        if same_bits:
            if not torch.equal(lin.as_bf16().view(torch.int16), hf_weight.detach().view(torch.int16)):
                raise NotTheSameBits(f"{name} does not decode to the loaded bf16 weights bit for bit")
        # Why check every tensor: a wrong row order or block layout would not fail, it would decode garbage.
        elif not _close(lin, hf_weight):
            raise DFlashError(f"{name} in {gguf_path} does not dequantise to the weights loaded from it; the file's "
                              "layout is not one this loader knows. Drop --quant.")
        if same_bits:
            return lin
        # --quant int4: the codes' own values (plinear on AVX512-BF16 CPUs), not the bf16 model's rounded weights
        return lin.with_int8_acts() if int8_acts else lin.with_exact_codes()

    nh, nkv = target.num_heads, target.num_kv_heads
    new = []  # every layer's linears first: a tensor that fails leaves the target untouched
    for i, hf in enumerate(target.layers):
        a, m = hf.self_attn, hf.mlp
        get = (lambda p, w, heads=None: codes(f"blk.{i}.{PROJ[p]}.weight", w, heads))
        new.append({"wqkv": RowLinear.cat([get("q", a.q_proj.weight, nh), get("k", a.k_proj.weight, nkv),
                                           get("v", a.v_proj.weight)]),
                    "wo": get("o", a.o_proj.weight),
                    "wgu": RowLinear.cat([get("gate", m.gate_proj.weight), get("up", m.up_proj.weight)]),
                    "wdown": get("down", m.down_proj.weight)})
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    target.head = codes(head, target.lm_head_weight)
    for layer, lins in zip(target._layers, new):
        for name, lin in lins.items():
            setattr(layer, name, lin)
    target.stack = None  # a layer stack holds the old weights: build it again after this (`use_layer_stack`)
    # same bits: the bf16 model on rowlinear, its weights read as codes (the `KernelPlan` says "+codes")
    target.kernel = "rowlinear" if same_bits else ("int4-a8" if int8_acts else "int4")
    target.codes = same_bits
    log.info("%s: %d layers of %s codes from %s, head %s", "bf16 weights as their GGUF codes" if same_bits else
             "int4 target", len(target._layers), tensors["blk.0.attn_q.weight"][0], Path(gguf_path).name,
             tensors[head][0])
