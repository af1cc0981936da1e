"""`dflashkit export`: a drafter in the layouts serving engines load.

- `zlab`: Z Lab's published layout (config.json + model.safetensors, no embedding / LM head, full vocabulary).
  SGLang (`--speculative-algorithm DFLASH`) and vLLM (`--speculative-config '{"method": "dflash", ...}'`) load it.
- `speculators`: vLLM's speculators layout (`speculators_model_type: "dflash"`, `speculators_config` with a
  greedy proposal of `block_size - 1` tokens and the verifier, `transformer_layer_config`,
  `aux_hidden_state_layer_ids` = target_layer_ids + 1 without the verifier's last layer, `mask_token_id`).

Why the key checks: vLLM loads a drafter with a missing tensor without a word (it stays randomly
initialised) and acceptance silently collapses. Every export checks the required config keys and tensor
names before writing and refuses with the missing list.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint import CODEBOOKS, CONFIG, WEIGHTS, atomic_write
from .config import DFLASH2_FIELDS
from .drafter import DFlashDrafter
from .errors import DFlashError

ZLAB_REQUIRED_CONFIG = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size",
                        "num_target_layers", "block_size", "dflash_config")
SPECULATORS_REQUIRED_CONFIG = ("speculators_model_type", "architectures", "speculators_config",
                               "transformer_layer_config", "draft_vocab_size", "block_size",
                               "aux_hidden_state_layer_ids", "mask_token_id")


def required_tensors(num_layers: int, arch: str = "dflash") -> set[str]:
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    if arch == "dflash2":
        names |= {f"candidate_selector.{n}.weight"
                  for n in ("predecessor_codebook", "successor_codebook", "hidden_projection")}
    for i in range(num_layers):
        p = f"layers.{i}."
        if arch == "dflash2":
            names |= {p + f"{c}_conv.{n}" for c in ("attention", "mlp")
                      for n in ("base_kernel", "kernel_projection.weight")}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                  p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"}
        names |= {p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
    return names


def check_export(config: dict, tensors: dict[str, torch.Tensor], required_config, num_layers: int,
                 arch: str = "dflash") -> None:
    missing = [k for k in required_config if k not in config]
    missing += sorted(required_tensors(num_layers, arch) - set(tensors))
    if missing:
        raise DFlashError(f"refusing to export: missing {missing}. A serving engine would load the drafter with these "
                          "silently absent (random weights, collapsed acceptance).")
    if config.get("dflash_config", {}).get("mask_token_id", config.get("mask_token_id")) is None:
        raise DFlashError("refusing to export: no mask_token_id.")


def _state(drafter: DFlashDrafter, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items() if k != "d2t"}
    return {k: v.to(dtype) if dtype is not None else v for k, v in state.items()}


def _write(out: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / WEIGHTS, lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    atomic_write(out / CONFIG, lambda p: Path(p).write_text(json.dumps(config, indent=2) + "\n"))
    return out


def export_zlab(drafter: DFlashDrafter, out: str | Path, dtype: torch.dtype | None = torch.bfloat16) -> Path:
    """Full-vocabulary Z Lab layout (a reduced draft vocabulary is dropped: the layout has no place for it)."""
    cfg = drafter.config.replace(draft_vocab_size=None).to_hf_dict()
    tensors = _state(drafter, dtype)
    cfg["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    check_export(cfg, tensors, ZLAB_REQUIRED_CONFIG, drafter.config.num_hidden_layers, drafter.config.arch)
    return _write(Path(out), cfg, tensors)


def export_speculators(drafter: DFlashDrafter, target, target_name: str, out: str | Path,
                       dtype: torch.dtype | None = torch.bfloat16) -> Path:
    """vLLM speculators layout (as speculators 0.9.0 saves it): the draft body only; the embedding, LM head
    and verifier norm are reloaded from the verifier named in `speculators_config.verifier`."""
    c = drafter.config
    v2 = c.arch == "dflash2"
    if c.is_causal:  # speculators' full-attention layers are always bidirectional inside the block
        raise DFlashError("this drafter's layers are all causal (is_causal: true), which the speculators layout "
                          "cannot express; export it with --format zlab.")
    zl = c.replace(draft_vocab_size=None).to_hf_dict()
    layer = {k: v for k, v in zl.items() if k not in ("architectures", "auto_map", "block_size", "dflash_config",
                                                      "num_target_layers")}
    # Why +1 and no last layer: Z Lab taps hidden_states[id + 1] (index 0 = embeddings); speculators counts
    # that index directly and always adds the verifier's last layer itself.
    aux = [i + 1 for i in c.target_layer_ids if i + 1 != target.num_layers]
    if len(aux) != len(c.target_layer_ids):
        raise DFlashError("the drafter taps the target's last layer, which the speculators layout cannot express; "
                          "export it with --format zlab.")
    tensors = _state(drafter, dtype)
    arch = [target.architecture]
    cfg = {
        "architectures": ["DFlash2DraftModel" if v2 else "DFlashSpeculator"],
        "speculators_model_type": c.arch,
        "speculators_version": "0.9.0",
        "draft_vocab_size": c.vocab_size,
        "block_size": c.block_size,
        "aux_hidden_state_layer_ids": aux,
        "mask_token_id": c.mask_token_id,
        "target_hidden_size": None,
        "sample_from_anchor": False,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": c.arch,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target_name, "architectures": arch},
        },
        "torch_dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."),
    }
    # speculators' sliding layers: bidirectional inside the block when sliding_window_non_causal (is_causal false)
    cfg["sliding_window_non_causal"] = c.is_causal is False or ("sliding_attention" not in c.layer_types and v2)
    if v2:
        cfg.update({f: getattr(c, f) for f in DFLASH2_FIELDS})
    check_export(cfg, tensors, SPECULATORS_REQUIRED_CONFIG, c.num_hidden_layers, c.arch)
    # speculators' codebooks are bare parameters (`load_drafter` reads either name, as Z Lab's key mapping does)
    return _write(Path(out), cfg, {k.removesuffix(".weight") if k.removesuffix(".weight") in CODEBOOKS else k: v
                                   for k, v in tensors.items()})
