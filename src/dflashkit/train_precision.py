"""The trainer's arithmetic: bf16 autocast where the device has bf16 units, float32 elsewhere, and the frozen target's
embedding and head in the dtype the step's products need."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from .measurements import cpu_has_bf16_units

log = logging.getLogger("dflashkit.train")


def resolve_bf16(cfg, device: torch.device):
    """cfg (a TrainConfig) with `bf16` decided (None -> whether `device` has bf16 units); logs float32 when chosen."""
    if cfg.bf16 is not None:
        return cfg
    on = device.type != "cpu" or cpu_has_bf16_units()
    if not on:
        log.info("training in float32: this CPU has no bf16 units (set bf16 in the recipe to force either)")
    return dataclasses.replace(cfg, bf16=on)


@dataclass
class FrozenParts:
    """The frozen target's embedding and LM head as the step's products need them."""
    embed: object  # ids [B, T] -> [B, T, H]
    head: torch.Tensor  # [V, H]
    vocab: tuple | None  # None, or (d2t_head [Vd, H], t2d [V])


def frozen_parts(target, cfg, vocab, dtype: torch.dtype) -> FrozenParts:
    """Why a cast: without autocast (float32 training, `resolve_bf16`) a bf16 target's embedding rows and head would
    meet float32 activations in one product, which torch refuses. Autocast casts them itself."""
    head = target.lm_head_weight
    if cfg.bf16 or head.dtype == dtype:
        return FrozenParts(target.embed, head, vocab)
    return FrozenParts(lambda ids: target.embed(ids).to(dtype), head.to(dtype),
                       None if vocab is None else (vocab[0].to(dtype), vocab[1]))
