"""`dflashkit export`: Z Lab and speculators layouts, with the key checks that serving engines lack."""

import json

import numpy as np
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


# ---- llama.cpp GGUF ------------------------------------------------------------------------------------------
def _target_gguf(path, layers=6, hidden=32, vocab=96):
    """A stand-in target GGUF: the fields the drafter export reads (architecture, size, tokenizer)."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", layers)
    w.add_uint32("llama.embedding_length", hidden)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab)])
    w.add_array("tokenizer.ggml.token_type", [1] * vocab)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_gguf_export_writes_what_llamacpp_reads(tmp_path, arch):
    """The names, shapes and keys of llama.cpp's `dflash` architecture (src/llama-arch.cpp, src/models/dflash.cpp);
    a DFlash2 drafter adds the convolutions (`blk.N.attn_conv_base` ...), the selector and their four keys."""
    from gguf import GGUFReader

    from dflashkit.gguf_export import export_gguf, gguf_name

    t = make_target("qwen3", dtype=torch.float32)
    dr = make_drafter(t, arch=arch)  # taps [1, 3], mask id 3, block 8
    out = export_gguf(dr, _target_gguf(tmp_path / "t.gguf"), tmp_path / "d.gguf", gguf_type="f32")
    r = GGUFReader(str(out))
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["general.architecture"] == "dflash" and f["dflash.block_size"] == 8
    assert f["dflash.target_layers"] == [2, 4]  # layer INPUT indices: our tap after layer i is layer i+1's input
    assert f["tokenizer.ggml.mask_token_id"] == 3 and f["tokenizer.ggml.tokens"][5] == "t5"
    assert f["tokenizer.ggml.add_bos_token"] is False and f["dflash.attention.head_count_kv"] == 2
    assert f["dflash.block_count"] == 2 and f["dflash.attention.key_length"] == 8
    tensors = {x.name: x for x in r.tensors}
    state = dr.state_dict()
    assert set(tensors) == {gguf_name(k) for k in state}  # no embedding, no head: llama.cpp shares the target's
    for k, v in state.items():
        x = tensors[gguf_name(k)]
        assert list(x.shape) == list(reversed(v.shape))  # GGUF dims are innermost first
        assert np.array_equal(np.asarray(x.data).reshape(v.shape), v.numpy())
    if arch == "dflash2":
        c = dr.config
        assert [f[f"dflash.{k}"] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")] \
            == [c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k]
        # llama.cpp's create_tensor shapes (innermost first): codebooks {rank, n_vocab}, projection {n_embd, rank},
        # base kernels {n_embd, kernel, 2}
        assert list(tensors["selector_predecessor.weight"].shape) == [c.selector_rank, c.vocab_size]
        assert list(tensors["selector_hidden.weight"].shape) == [c.hidden_size, c.selector_rank]
        assert list(tensors["blk.1.ffn_conv_base"].shape) == [c.hidden_size, c.conv_kernel_size, 2]
        half = GGUFReader(str(export_gguf(dr, _target_gguf(tmp_path / "t.gguf"), tmp_path / "h.gguf")))
        kinds = {x.name: x.tensor_type.name for x in half.tensors}  # f16, but the base kernels F32 (the converter's)
        assert kinds["blk.0.attn_conv_base"] == "F32" and kinds["selector_successor.weight"] == "F16"


def test_gguf_export_reduced_vocabulary_ships_d2t_and_head_rows(tmp_path):
    from gguf import GGUFReader

    from dflashkit.gguf_export import export_gguf

    t = make_target("llama", dtype=torch.float32)
    dr = make_drafter(t)
    dr.token_ranking = list(range(95, -1, -1))  # most frequent first
    out = export_gguf(dr, _target_gguf(tmp_path / "t.gguf"), tmp_path / "d.gguf", head=t.lm_head_weight,
                      draft_vocab=20, gguf_type="f16")
    tensors = {x.name: x for x in GGUFReader(str(out)).tensors}
    d2t = np.asarray(tensors["d2t"].data)
    assert tensors["d2t"].tensor_type.name == "I64" and d2t.tolist() == list(range(76, 96))
    head = np.asarray(tensors["output.weight"].data).reshape(20, 32)
    assert tensors["output.weight"].tensor_type.name == "F16"
    assert np.allclose(head, t.lm_head_weight[76:96].numpy(), atol=1e-3)
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"  # norms stay f32


@pytest.mark.parametrize("case", ["last-layer tap", "vocab", "no mask", "layers", "ranking"])
def test_gguf_export_refuses_what_llamacpp_cannot_run(tmp_path, case):
    from dflashkit.gguf_export import export_gguf

    t = make_target("qwen3", dtype=torch.float32)
    dr = make_drafter(t)
    target = dict(layers=6, vocab=96)
    match, vocab = {"last-layer tap": "last layer", "vocab": "vocabulary", "no mask": "mask_token_id",
                    "layers": "layers", "ranking": "token ranking"}[case], 0
    if case == "last-layer tap":
        dr.config.target_layer_ids = [1, 5]
    elif case == "vocab":
        target["vocab"] = 100
    elif case == "no mask":
        dr.config.mask_token_id = None
    elif case == "layers":
        target["layers"] = 8
    else:
        vocab = 20  # the random drafter has no token ranking
    with pytest.raises(DFlashError, match=match):
        export_gguf(dr, _target_gguf(tmp_path / "t.gguf", **target), tmp_path / "d.gguf", head=t.lm_head_weight,
                    draft_vocab=vocab)
    assert not (tmp_path / "d.gguf").exists()
    with pytest.raises(DFlashError, match="not a GGUF"):
        export_gguf(dr, _not_gguf(tmp_path), tmp_path / "d.gguf")


def _not_gguf(tmp_path):
    p = tmp_path / "fake.gguf"
    p.write_text("not a gguf")
    return p
