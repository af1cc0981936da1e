"""DFlashConfig: the drafter's architecture plus its DFlash contract, and THE bridge to `config.json`.

The on-disk format is Z Lab's (dflash-spec §6.1): Qwen3 layer fields at the top level plus
`num_target_layers`, `block_size` (top level in Qwen3/LLaMA checkpoints, inside `dflash_config`
in Qwen3.5+; we read both and write both) and `dflash_config {mask_token_id, target_layer_ids}`.
A DFlash2 drafter (`arch = "dflash2"`, architecture `DFlash2DraftModel`) adds `conv_kernel_size`, `conv_group_size`,
`selector_rank` and `selector_top_k`, read from `dflash_config` or the top level as Z Lab's package reads them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .errors import DFlashError


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Z Lab's default taps: evenly from decoder layer 1 to layer N-3 (one tap per draft layer).

    Ids are 0-based decoder-layer indices; the tapped feature is the OUTPUT of that layer
    (HF `hidden_states[id + 1]`), see `backends.hf.HFTarget`.
    """
    n, k = num_target_layers, num_draft_layers
    if k == 1:
        return [n // 2]
    return [int(round(1 + i * (n - 4) / (k - 1))) for i in range(k)]


ARCHS = ("dflash", "dflash2")
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int  # draft layers L
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the TARGET's vocabulary (embedding and LM head are the target's)
    num_target_layers: int
    mask_token_id: int
    block_size: int = 16
    target_layer_ids: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    # Optional reduced draft vocabulary: draft logits over `draft_vocab_size` ids, mapped back to
    # target ids through the `d2t` tensor stored beside the weights. None = full vocabulary.
    draft_vocab_size: int | None = None
    # DFlash2 (`dflash2.py`): grouped dynamic causal convolutions in every layer and the candidate selector.
    arch: str = "dflash"  # "dflash" | "dflash2"
    conv_kernel_size: int = 2  # causal taps of each convolution (speculators' default)
    conv_group_size: int = 16  # hidden channels sharing one dynamic kernel value
    selector_rank: int = 256  # rank of the selector's predecessor / successor codebooks
    selector_top_k: int = 16  # the drafter's candidates per slot the selector walks
    # Sliding-window draft attention (Z Lab's `layer_types`, `sliding_window`, `is_causal`): in a "sliding_attention"
    # layer a block slot at position q sees keys at positions k with q - k < sliding_window, so the layer's cost stays
    # flat on long prompts. is_causal as Z Lab reads it: None = sliding layers causal inside the block (a slot sees
    # the slots at or before it) and full layers bidirectional; True / False = every layer causal / bidirectional
    # (speculators' `sliding_window_non_causal`: False).
    layer_types: list[str] = field(default_factory=list)  # per draft layer; [] = every layer "full_attention"
    sliding_window: int | None = None
    is_causal: bool | None = None

    def __post_init__(self) -> None:
        if not self.target_layer_ids:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.validate()

    def validate(self) -> None:
        if self.block_size < 1:
            raise DFlashError(f"block_size must be >= 1 (got {self.block_size}); use 1 for plain decoding.")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise DFlashError(
                f"target_layer_ids {bad} are outside the target's decoder layers 0..{self.num_target_layers - 1}; "
                "fix dflash_config.target_layer_ids (0-based decoder-layer ids) or num_target_layers."
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DFlashError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary (size {self.vocab_size}); "
                "use an id the target's embedding has, e.g. a reserved special token."
            )
        if self.arch not in ARCHS:
            raise DFlashError(f"drafter arch must be one of {', '.join(ARCHS)} (got {self.arch!r}).")
        if self.arch == "dflash2":
            if min(self.conv_kernel_size, self.conv_group_size, self.selector_rank, self.selector_top_k) < 1:
                raise DFlashError("conv_kernel_size, conv_group_size, selector_rank and selector_top_k must be >= 1.")
            if self.hidden_size % self.conv_group_size:
                raise DFlashError(f"hidden_size ({self.hidden_size}) must be a multiple of conv_group_size "
                                  f"({self.conv_group_size}); fix dflash_config.conv_group_size.")
            if self.selector_top_k > self.vocab_size:
                raise DFlashError(f"selector_top_k ({self.selector_top_k}) exceeds the vocabulary ({self.vocab_size}).")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - set(LAYER_TYPES):
                raise DFlashError(f"layer_types must name each of the {self.num_hidden_layers} draft layers, each one "
                                  f"of {', '.join(LAYER_TYPES)} (got {self.layer_types}).")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise DFlashError(f"sliding_window must be >= 1 (positions a slot sees back; got {self.sliding_window}), "
                              "or null: a sliding_attention layer without a window is only causal, as in Z Lab's.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DFlashError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})."
            )

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def attention_of(self, layer: int) -> tuple[int | None, bool]:
        """(window or None, causal inside the block) of draft layer `layer`, as Z Lab's attention reads its config."""
        sliding = bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"
        return (self.sliding_window if sliding else None), (sliding if self.is_causal is None else self.is_causal)

    @property
    def windowed(self) -> bool:
        """Some draft layer is not plain bidirectional full attention."""
        return any(self.attention_of(i) != (None, False) for i in range(self.num_hidden_layers))

    # ---- the checkpoint contract ---------------------------------------------------------------
    @classmethod
    def from_speculators(cls, d: dict, num_target_layers: int | None) -> "DFlashConfig":
        """vLLM speculators' `dflash` / `dflash2` layout (`speculators_model_type`): its draft layers' config is
        `transformer_layer_config`; it does not record the target's layer count, which the caller gives (the
        target's, when loading for one)."""
        kind = d.get("speculators_model_type")
        if kind not in ARCHS:
            raise DFlashError(f"speculators model type {kind!r} is not a DFlash drafter; dflashkit loads "
                              f"{', '.join(ARCHS)}.")
        if num_target_layers is None:
            raise DFlashError("a speculators-layout drafter does not record its target's layer count; load it with "
                              "its target (`--drafter DIR` does), or export it with `--format zlab`.")
        layers = dict(d.get("transformer_layer_config") or {})
        if d.get("sample_from_anchor"):
            raise DFlashError("this speculators drafter samples from the anchor slot (DSpark-style); dflashkit runs "
                              "DFlash drafters whose anchor is the last committed token.")
        if d.get("draft_vocab_size") not in (None, layers.get("vocab_size")):
            raise DFlashError("this speculators drafter has its own reduced-vocabulary LM head; dflashkit drafts "
                              "with the target's head. Train it with the full vocabulary.")
        # Why -1: speculators counts the target's hidden_states index (0 = embeddings); we count decoder layers.
        taps = [i - 1 for i in d.get("aux_hidden_state_layer_ids") or []]
        v2 = {k: d[k] for k in DFLASH2_FIELDS if k in d} if kind == "dflash2" else {}
        block = d.get("block_size", 8)
        dc = {"mask_token_id": d.get("mask_token_id"), "target_layer_ids": taps, "block_size": block, **v2}
        arch = ["DFlash2DraftModel"] if kind == "dflash2" else ["DFlashDraftModel"]
        # speculators' sliding layers are bidirectional inside the block unless sliding_window_non_causal is false
        sliding = "sliding_attention" in (layers.get("layer_types") or [])
        bidirectional = sliding and d.get("sliding_window_non_causal", kind == "dflash2")
        return cls.from_hf_dict({**layers, "architectures": arch, "num_target_layers": num_target_layers,
                                 "block_size": block, "dflash_config": dc, "draft_vocab_size": None,
                                 "is_causal": False if bidirectional else layers.get("is_causal")})

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DFlashConfig":
        dc = d.get("dflash_config") or {}
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if k not in d]
        if "mask_token_id" not in dc and "mask_token_id" not in d:
            missing.append("dflash_config.mask_token_id")
        num_target_layers = dc.get("num_target_layers", d.get("num_target_layers"))
        if num_target_layers is None:
            missing.append("num_target_layers")
        if missing:
            raise DFlashError(f"drafter config.json lacks {missing}; it is not a DFlash (Z Lab format) checkpoint.")
        rope_theta = d.get("rope_theta")
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling")
        if rope_theta is None:
            rope_theta = rope.get("rope_theta", 1_000_000.0)
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type")) or rope.get("rope_type", "default")
        if rope_type != "default":
            raise DFlashError(f"rope type {rope_type!r} is not supported by dflashkit yet; use a drafter with "
                              "default RoPE.")
        layer_types = list(d.get("layer_types") or [])
        if not layer_types and d.get("use_sliding_window"):  # transformers' Qwen3 rule when the list is absent
            first, n = d.get("max_window_layers", d["num_hidden_layers"]), d["num_hidden_layers"]
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        if dc.get("use_swa"):
            raise DFlashError("dflash_config.use_swa is not a field Z Lab's package reads; give layer_types and "
                              "sliding_window.")
        # Why the window only with use_sliding_window: transformers' Qwen3Config drops it otherwise, and Z Lab's
        # layers read the config through it (a sliding_attention layer without a window is then causal only).
        window = d.get("sliding_window") if "sliding_attention" in layer_types and d.get("use_sliding_window", True) \
            else None
        heads = d["num_attention_heads"]
        v2 = "DFlash2DraftModel" in (d.get("architectures") or []) or any(k in dc for k in DFLASH2_FIELDS)
        extra = {k: int(dc.get(k, d.get(k, getattr(cls, k)))) for k in DFLASH2_FIELDS} if v2 else {}
        return cls(
            **extra,
            arch="dflash2" if v2 else "dflash",
            hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            intermediate_size=d["intermediate_size"],
            vocab_size=d["vocab_size"],
            num_target_layers=num_target_layers,
            mask_token_id=dc.get("mask_token_id", d.get("mask_token_id")),
            block_size=dc.get("block_size", d.get("block_size", 16)),
            target_layer_ids=list(dc.get("target_layer_ids") or []),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=d.get("max_position_embeddings", 40960),
            attention_bias=d.get("attention_bias", False),
            draft_vocab_size=d.get("draft_vocab_size"),
            layer_types=layer_types if "sliding_attention" in layer_types else [],
            sliding_window=window,
            is_causal=d.get("is_causal"),
        )

    def to_hf_dict(self) -> dict:
        d = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "use_sliding_window": "sliding_attention" in self.layer_types,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types) or ["full_attention"] * self.num_hidden_layers,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "block_size": self.block_size,
            },
        }
        if self.draft_vocab_size is not None:
            d["draft_vocab_size"] = self.draft_vocab_size
        if self.is_causal is not None:
            d["is_causal"] = self.is_causal
        if self.arch == "dflash2":
            d["architectures"], d["auto_map"] = ["DFlash2DraftModel"], {"AutoModel": "dflash.DFlash2DraftModel"}
            d["dflash_config"].update({k: getattr(self, k) for k in DFLASH2_FIELDS})
        return d

    def replace(self, **changes) -> "DFlashConfig":
        return dataclasses.replace(self, **changes)
