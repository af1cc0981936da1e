"""`dflashkit export --format gguf`: a drafter as the GGUF file llama.cpp's DFlash runs (architecture `dflash`).

The file holds the draft body only (fc, hidden_norm, the layers, the final norm): llama.cpp draws the embedding
and the LM head from the target it is paired with, unless a reduced draft vocabulary is written, in which case
the file carries `d2t` (draft row -> target token id, I64) and those rows of the target's head as `output`.
Its tokenizer is the target GGUF's own (llama.cpp pairs a drafter with a target only when their vocabularies
agree), plus `tokenizer.ggml.mask_token_id`.

What llama.cpp cannot run is refused before anything is written (no partial file): a tap on the target's last
layer, a vocabulary that differs from the target's, a missing or out-of-range mask token, a target GGUF whose
layer count or width does not match the drafter.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from .checkpoint import atomic_write
from .config import DFLASH2_FIELDS
from .drafter import DFlashDrafter
from .errors import DFlashError

log = logging.getLogger(__name__)

ARCH = "dflash"
# GGUF value types of the tensors by `--gguf-type`; 1-D tensors (norms) always stay F32, as llama.cpp's converter
# writes them. `file_type` is llama.cpp's LlamaFileType code for the file as a whole.
GGUF_TYPES = {"f32": ("F32", 0), "f16": ("F16", 1), "bf16": ("BF16", 32), "q8_0": ("Q8_0", 7)}

# Z Lab tensor names -> llama.cpp's (src/llama-arch.cpp); per-layer names get `blk.{i}.`.
TOP_NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
             "norm.weight": "output_norm.weight"}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


# DFlash2's parts (llama.cpp's src/models/dflash.cpp): the convolutions' base kernels have no `.weight` suffix there.
TOP_NAMES.update({"candidate_selector.predecessor_codebook.weight": "selector_predecessor.weight",
                  "candidate_selector.successor_codebook.weight": "selector_successor.weight",
                  "candidate_selector.hidden_projection.weight": "selector_hidden.weight"})
LAYER_NAMES.update({"attention_conv.base_kernel": "attn_conv_base",
                    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
                    "mlp_conv.base_kernel": "ffn_conv_base",
                    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight"})


def gguf_name(name: str) -> str:
    """Our (Z Lab) tensor name -> llama.cpp's."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".", 2)
    if parts[0] == "layers" and len(parts) == 3 and parts[2] in LAYER_NAMES:
        return f"blk.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    raise DFlashError(f"no llama.cpp name for drafter tensor {name!r}: llama.cpp's dflash architecture has no such "
                      "tensor, so this drafter cannot be exported to GGUF.")


class TargetGGUF:
    """What the export needs from the target's GGUF: its tokenizer fields, layer count, width and vocabulary."""

    def __init__(self, path: str | Path):
        from gguf import GGUFReader

        self.path = Path(path)
        with open(self.path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise DFlashError(f"{self.path} is not a GGUF file; give the target's .gguf (--target-gguf).")
        self.reader = GGUFReader(str(self.path))
        arch = self.field("general.architecture")
        self.num_layers = int(self.field(f"{arch}.block_count"))
        self.hidden_size = int(self.field(f"{arch}.embedding_length"))
        self.vocab_size = len(self.reader.fields["tokenizer.ggml.tokens"].data)
        self.tokenizer_fields = [f for k, f in self.reader.fields.items() if k.startswith("tokenizer.")]

    def field(self, key: str):
        f = self.reader.fields.get(key)
        if f is None:
            raise DFlashError(f"{self.path} has no {key!r}; it is not a complete llama.cpp model GGUF.")
        return f.contents()


def check_fit(drafter: DFlashDrafter, target: TargetGGUF, draft_vocab: int) -> None:
    """Refuse, naming the remedy, what llama.cpp would not run (or would run wrongly)."""
    c = drafter.config
    if c.num_target_layers != target.num_layers or c.hidden_size != target.hidden_size:
        raise DFlashError(f"the drafter fits a target of {c.num_target_layers} layers x {c.hidden_size}, but "
                          f"{target.path.name} has {target.num_layers} x {target.hidden_size}; give the GGUF of the "
                          "target the drafter was trained for.")
    if c.vocab_size != target.vocab_size:
        raise DFlashError(f"the drafter's vocabulary ({c.vocab_size}) differs from {target.path.name}'s "
                          f"({target.vocab_size} tokens); llama.cpp pairs only drafters and targets with one "
                          "vocabulary. Give the matching target GGUF.")
    # Why +1 and the last-layer refusal: llama.cpp taps the INPUT of layer id + 1 (= our hidden state after layer
    # id); the last layer's output is nobody's input there ("layer input tensor is null" at run time).
    last = [i for i in c.target_layer_ids if i + 1 >= target.num_layers]
    if last:
        raise DFlashError(f"the drafter taps target layer(s) {last}, the last layer; llama.cpp taps layer inputs "
                          "and cannot give the last layer's output. Retrain with taps below the last layer "
                          "(dflashkit's default taps never include it).")
    if c.mask_token_id is None or not 0 <= c.mask_token_id < c.vocab_size:
        raise DFlashError(f"the drafter's mask_token_id ({c.mask_token_id}) is missing or outside the vocabulary; "
                          "llama.cpp builds the block from it. Set it in the drafter's config.json to the id it "
                          "was trained with.")
    if draft_vocab and drafter.d2t is None:
        ranking = drafter.token_ranking
        if ranking is None or len(ranking) < draft_vocab:
            have = 0 if ranking is None else len(ranking)
            raise DFlashError(f"--draft-vocab {draft_vocab} needs the drafter's token ranking of at least that "
                              f"many ids (it has {have}); use --draft-vocab 0 (full vocabulary).")


def draft_rows(drafter: DFlashDrafter, draft_vocab: int) -> torch.Tensor | None:
    """[n] target ids of the draft vocabulary written as `d2t` (sorted), or None for the full vocabulary."""
    if drafter.d2t is not None:  # trained with its own reduced vocabulary
        return drafter.draft_to_target_ids().cpu()
    if not draft_vocab:
        return None
    return torch.tensor(sorted(drafter.token_ranking[:draft_vocab]), dtype=torch.long)


def _array(t: torch.Tensor, kind: str):
    """A tensor as (numpy array, raw GGML type or None) in `kind`; 1-D tensors stay F32."""
    from gguf import GGMLQuantizationType, quants

    a = t.detach().float().cpu().contiguous().numpy()
    if a.ndim <= 1 or kind == "F32":
        return a.astype(np.float32), None
    if kind == "F16":
        return a.astype(np.float16), None
    qtype = GGMLQuantizationType[kind]  # BF16 / Q8_0: gguf's reference quantizer, stored as raw bytes
    return quants.quantize(a, qtype), qtype


def export_gguf(drafter: DFlashDrafter, target_gguf: str | Path, out: str | Path, head: torch.Tensor | None = None,
                draft_vocab: int = 0, gguf_type: str = "f16", name: str = "dflashkit drafter") -> Path:
    """Write `drafter` as a llama.cpp DFlash GGUF at `out` for the target whose GGUF is `target_gguf`.
    head: [V, H] the target's LM head (needed only for a reduced draft vocabulary: its rows become `output`)."""
    from gguf import GGUFValueType, GGUFWriter

    if gguf_type not in GGUF_TYPES:
        raise DFlashError(f"--gguf-type must be one of {sorted(GGUF_TYPES)} (got {gguf_type!r}).")
    if drafter.config.windowed:  # never drop the window silently
        raise DFlashError("the GGUF export does not write sliding-window or causal draft layers yet; export this "
                          "drafter with --format zlab.")
    target = TargetGGUF(target_gguf)
    check_fit(drafter, target, draft_vocab)
    c, (kind, file_type) = drafter.config, GGUF_TYPES[gguf_type]
    rows = draft_rows(drafter, draft_vocab)
    if rows is not None and head is None:
        raise DFlashError("a reduced draft vocabulary needs the target's LM head (load the target).")
    tensors = {gguf_name(k): v for k, v in drafter.state_dict().items() if k != "d2t"}
    if rows is not None:
        tensors["output.weight"] = head[rows.to(head.device)]  # [n, H] the draft vocabulary's head rows
    out = Path(out)

    def write(tmp: str) -> None:
        w = GGUFWriter(tmp, ARCH)  # writes general.architecture itself
        w.add_string("general.type", "model")
        w.add_string("general.name", name)
        for key, value in (("block_count", c.num_hidden_layers), ("context_length", c.max_position_embeddings),
                           ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                           ("attention.head_count", c.num_attention_heads),
                           ("attention.head_count_kv", c.num_key_value_heads),
                           ("attention.key_length", c.head_dim), ("attention.value_length", c.head_dim),
                           ("block_size", c.block_size)):
            w.add_uint32(f"{ARCH}.{key}", int(value))
        # RoPE: llama.cpp's dflash graph rotates NeoX style (halves), as our drafter does; only the base is stored.
        if c.arch == "dflash2":  # llama.cpp's dflash architecture runs DFlash2 when these keys are present
            for key in DFLASH2_FIELDS:
                w.add_uint32(f"{ARCH}.{key}", int(getattr(c, key)))
        w.add_float32(f"{ARCH}.rope.freq_base", float(c.rope_theta))
        w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", float(c.rms_norm_eps))
        w.add_uint32("general.file_type", file_type)
        w.add_key_value(f"{ARCH}.target_layers", [i + 1 for i in c.target_layer_ids], GGUFValueType.ARRAY,
                        GGUFValueType.INT32)  # layer-input indices: our tap after layer i = input of layer i + 1
        w.add_uint32("general.quantization_version", 2)
        for f in target.tokenizer_fields:
            _copy_field(w, f)
        w.add_uint32("tokenizer.ggml.mask_token_id", int(c.mask_token_id))
        for gname, t in tensors.items():
            # DFlash2's base kernels stay F32 whatever the type, as llama.cpp's converter writes them
            arr, raw = _array(t, "F32" if gname.endswith("_conv_base") else kind)
            w.add_tensor(gname, arr, raw_dtype=raw)
        if rows is not None:
            w.add_tensor("d2t", rows.numpy().astype(np.int64))  # absolute target ids (llama.cpp asserts I64)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    logging.getLogger("gguf").setLevel(logging.WARNING)  # its writer announces every file at INFO
    atomic_write(out, write)
    log.info("wrote %s (%s, %d tensors, %s)", out, gguf_type, len(tensors) + (rows is not None),
             f"draft vocabulary {len(rows)}" if rows is not None else "full vocabulary")
    return out


def _copy_field(w, f) -> None:
    """Copy one GGUF key (a reader field) into writer `w`, keeping its value type."""
    from gguf import GGUFValueType

    kind = f.types[0]
    value = f.contents()
    if kind == GGUFValueType.ARRAY:
        w.add_key_value(f.name, value, kind, f.types[-1])
    else:
        w.add_key_value(f.name, value, kind)


def convert_target(target_dir: Path, out: Path, llamacpp_src: Path, outtype: str = "bf16") -> Path:
    """An HF target as a GGUF, made by llama.cpp's own converter (the engine's tool decides its tokenizer and
    tensor layout; ours would only be a second opinion)."""
    script = Path(llamacpp_src) / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise DFlashError(f"{script} not found: converting an HF target to GGUF uses llama.cpp's converter; run "
                          "scripts/llamacpp-build.sh (it puts the source in .llamacpp/src) or pass --llamacpp-src.")
    env = {**os.environ, "PYTHONPATH": str(Path(llamacpp_src) / "gguf-py")}
    cmd = [sys.executable, str(script), str(target_dir), "--outfile", str(out), "--outtype", outtype]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise DFlashError(f"llama.cpp's converter failed on {target_dir}: {r.stderr.strip().splitlines()[-1:]}")
    return out


def compare_gguf(ours: str | Path, reference: str | Path, skip=("general.name", "general.size_label")) -> dict:
    """Key by key and tensor by tensor, what `reference` (e.g. llama.cpp's converter output) holds and `ours`
    lacks or holds differently (value, type, shape, bytes). Keys only `ours` has are listed, not counted."""
    from gguf import GGUFReader

    a, b = GGUFReader(str(ours)), GGUFReader(str(reference))
    keys = [k for k in b.fields if not k.startswith("GGUF.") and k not in skip]
    diff_keys = [k for k in keys if k not in a.fields or a.fields[k].types != b.fields[k].types
                 or a.fields[k].contents() != b.fields[k].contents()]
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    diff_tensors = [n for n, t in tb.items() if n not in ta or ta[n].tensor_type != t.tensor_type
                    or list(ta[n].shape) != list(t.shape) or not np.array_equal(ta[n].data, t.data)]
    return {"keys_compared": len(keys), "keys_differing": diff_keys,
            "extra_keys": sorted(k for k in a.fields if k not in b.fields and not k.startswith("GGUF.")),
            "tensors_compared": len(tb), "tensors_differing": diff_tensors, "extra_tensors": sorted(set(ta) - set(tb)),
            "identical": not diff_keys and not diff_tensors}
