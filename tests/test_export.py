"""`dflashkit export`: Z Lab and speculators layouts, with the key checks that serving engines lack."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_drafter, make_target
from dflashkit import DFlashError
from dflashkit.checkpoint import load_drafter
from dflashkit.export import check_export, export_speculators, export_zlab, required_tensors, ZLAB_REQUIRED_CONFIG


def test_zlab_export_round_trips_and_drops_a_reduced_vocabulary(tmp_path):
    t = make_target("qwen3")
    dr = make_drafter(t, draft_vocab_size=40)
    export_zlab(dr, tmp_path / "z", dtype=None)
    cfg = json.loads((tmp_path / "z" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and "draft_vocab_size" not in cfg
    names = set(load_file(tmp_path / "z" / "model.safetensors"))
    assert names == required_tensors(2)  # no d2t, no embedding, no LM head
    back = load_drafter(tmp_path / "z", dtype=torch.float64)
    for k, v in back.state_dict().items():
        assert torch.equal(v, dr.state_dict()[k])


def test_speculators_export_layout(tmp_path):
    t = make_target("qwen3")
    dr = make_drafter(t, block_size=8)  # taps [1, 3] of 6 layers
    export_speculators(dr, t, "my-target", tmp_path / "s", dtype=None)
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["aux_hidden_state_layer_ids"] == [2, 4]
    assert cfg["speculators_config"]["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 7}]
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "my-target"
    assert cfg["mask_token_id"] == 3 and cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    assert set(load_file(tmp_path / "s" / "model.safetensors")) == required_tensors(2)
    last = make_drafter(t)
    last.config.target_layer_ids = [1, 5]  # the verifier's last layer: not expressible there
    with pytest.raises(DFlashError, match="last layer"):
        export_speculators(last, t, "x", tmp_path / "bad")


def test_export_refuses_missing_keys_and_tensors():
    t = make_target("llama")
    dr = make_drafter(t)
    cfg = dr.config.to_hf_dict()
    state = dict(dr.state_dict())
    check_export(cfg, state, ZLAB_REQUIRED_CONFIG, 2)
    del state["layers.1.self_attn.k_norm.weight"]
    with pytest.raises(DFlashError, match="k_norm"):
        check_export(cfg, state, ZLAB_REQUIRED_CONFIG, 2)
    del cfg["num_target_layers"]
    with pytest.raises(DFlashError, match="num_target_layers"):
        check_export(cfg, dict(dr.state_dict()), ZLAB_REQUIRED_CONFIG, 2)
