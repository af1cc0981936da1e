"""The Z Lab checkpoint format: round trip, a published-layout directory, corrupt files, mismatches."""

import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import make_drafter, make_target
from dflashkit import DecodeConfig, DFlashConfig, DFlashDrafter, DFlashEngine, DFlashError, default_target_layer_ids
from dflashkit.checkpoint import load_drafter, save_drafter


def test_default_layer_ids_match_published_drafts():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B/4B-b16
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]  # Qwen3.5-4B
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # Qwen3.6-27B
    assert default_target_layer_ids(30, 1) == [15]


def block_logits(t, dr):
    torch.manual_seed(0)
    S, Q = 10, dr.config.block_size
    feats = torch.randn(1, S, dr.config.num_taps * t.hidden_size, dtype=t.dtype)
    kv = dr.context_kv(dr.fuse(feats), torch.arange(S)[None])
    mask = torch.cat([(torch.arange(S) < 8).expand(1, 1, Q, S), torch.ones(1, 1, Q, Q, dtype=torch.bool)], -1)
    h = dr(t.embed(torch.tensor([[5] + [dr.config.mask_token_id] * (Q - 1)])), 8 + torch.arange(Q)[None], kv, mask)
    return t.logits(h)


def test_save_load_identical_logits(tmp_path):
    t = make_target("llama")
    dr = make_drafter(t)
    save_drafter(dr, tmp_path / "d")
    files = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert files == ["config.json", "model.safetensors"]
    back = load_drafter(tmp_path / "d", dtype=torch.float64)
    assert torch.equal(block_logits(t, dr), block_logits(t, back))
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["target_layer_ids"] == [1, 3]


# The published Qwen3-8B-DFlash-b16 config.json, key for key, with the dimensions shrunk to a tiny target.
PUBLISHED = {
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16,
    "bos_token_id": 151643, "dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 3]},
    "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 8, "hidden_act": "silu", "hidden_size": 32,
    "initializer_range": 0.02, "intermediate_size": 48, "layer_types": ["full_attention", "full_attention"],
    "max_position_embeddings": 40960, "max_window_layers": 5, "model_type": "qwen3", "num_attention_heads": 4,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "num_target_layers": 6, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "transformers_version": "4.57.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 96,
}


@pytest.mark.parametrize("block_inside", [False, True])
def test_published_layout_loads_unchanged(tmp_path, block_inside):
    t = make_target("qwen3")
    cfg = json.loads(json.dumps(PUBLISHED))
    if block_inside:  # Qwen3.5+ drafts keep block_size inside dflash_config
        cfg["dflash_config"]["block_size"] = cfg.pop("block_size")
    ref = make_drafter(t, block_size=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in ref.state_dict().items()}, tmp_path / "model.safetensors")
    dr = load_drafter(tmp_path, dtype=torch.float64)
    assert dr.config.block_size == 16 and dr.config.target_layer_ids == [1, 3] and dr.config.mask_token_id == 3
    eng = DFlashEngine(t, dr, eos_token_ids=[], config=DecodeConfig())
    ar = eng.generate([[5, 6, 7]], max_new_tokens=20, block_size=1)
    assert eng.generate([[5, 6, 7]], max_new_tokens=20)[0].tokens == ar[0].tokens


def test_corrupt_and_missing_files(tmp_path):
    t = make_target("llama")
    d = save_drafter(make_drafter(t), tmp_path / "d")
    with pytest.raises(DFlashError, match="not a directory"):
        load_drafter(tmp_path / "nope")
    raw = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DFlashError, match="corrupt"):
        load_drafter(d)
    (d / "model.safetensors").write_bytes(raw)
    (d / "config.json").write_text("{not json")
    with pytest.raises(DFlashError, match="not valid JSON"):
        load_drafter(d)
    (d / "config.json").unlink()
    with pytest.raises(DFlashError, match="no config.json"):
        load_drafter(d)
    save_drafter(make_drafter(t), d)
    from safetensors.torch import load_file
    state = load_file(d / "model.safetensors")
    del state["layers.1.mlp.up_proj.weight"]
    save_file(state, d / "model.safetensors")
    with pytest.raises(DFlashError, match="missing .*up_proj"):
        load_drafter(d)


def test_config_errors():
    base = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=48, vocab_size=96, num_target_layers=6, mask_token_id=3)
    with pytest.raises(DFlashError, match="target_layer_ids"):
        DFlashConfig(**base, target_layer_ids=[1, 6])
    with pytest.raises(DFlashError, match="mask_token_id"):
        DFlashConfig(**{**base, "mask_token_id": 96})
    with pytest.raises(DFlashError, match="block_size"):
        DFlashConfig(**base, block_size=0)
    with pytest.raises(DFlashError, match="num_target_layers"):
        DFlashConfig.from_hf_dict({k: v for k, v in PUBLISHED.items() if k != "num_target_layers"})


def test_drafter_target_mismatch_errors():
    t = make_target("llama")
    other = make_target("qwen3")
    dr = make_drafter(t)
    wide = DFlashDrafter(dr.config.replace(hidden_size=64, head_dim=16)).double()
    with pytest.raises(DFlashError, match="hidden_size"):
        DFlashEngine(t, wide)
    with pytest.raises(DFlashError, match="vocab"):
        DFlashEngine(t, DFlashDrafter(dr.config.replace(vocab_size=97)).double())
    with pytest.raises(DFlashError, match="layers"):
        DFlashEngine(t, DFlashDrafter(dr.config.replace(num_target_layers=8)).double())
    with pytest.raises(DFlashError, match="tapped layer ids"):
        other.set_taps([0, 6])
