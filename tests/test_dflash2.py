"""DFlash2 drafters: Z Lab's checkpoints load and propose what Z Lab's own `DFlash2DraftModel.propose` proposes, a v1
drafter converts without changing a draft, and greedy output with the selector's chain equals AR."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_drafter, make_target
from dflashkit import DecodeConfig, DFlashEngine, DFlashError
from dflashkit.checkpoint import load_drafter, save_drafter
from dflashkit.config import DFlashConfig
from dflashkit.drafter import dflash2_from
from test_engine import PROMPTS, reference_runs

V, H = 96, 32
FIELDS = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=16, selector_top_k=5)


def zlab_dflash2(tmp_path, seed: int = 0, window: dict | None = None):
    """A random DFlash2 drafter made and saved by Z Lab's own package (Qwen3 layers, 2 draft layers); window:
    `layer_types`, `sliding_window` and optionally `is_causal` (Z Lab's sliding-window draft attention)."""
    dflash = pytest.importorskip("dflash")
    from transformers import Qwen3Config

    window = dict(window or {})
    causal = window.pop("is_causal", None)
    cfg = Qwen3Config(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      intermediate_size=64, vocab_size=V, rms_norm_eps=1e-6, rope_theta=10000.0,
                      max_position_embeddings=512, architectures=["DFlash2DraftModel"], **window)
    if causal is not None:
        cfg.is_causal = causal
    cfg.num_target_layers, cfg.block_size = 6, 8
    cfg.dflash_config = {"mask_token_id": 3, "target_layer_ids": [1, 4], "block_size": 8, **FIELDS}
    model = dflash.DFlash2DraftModel(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # every tensor set here (some are left uninitialised)
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                    else 0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(tmp_path)
    return model


WINDOWS = {"full": None,
           "causal-only": dict(layer_types=["sliding_attention", "full_attention"]),  # no window: Qwen3Config drops it
           "sliding": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                           use_sliding_window=True),
           "sliding-bidirectional": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=5,
                                         use_sliding_window=True, is_causal=False)}


@pytest.mark.parametrize("window", list(WINDOWS))
def test_a_zlab_dflash2_checkpoint_loads_and_proposes_what_zlab_proposes(tmp_path, window):
    """float32, the same weights and inputs: the drafter's hidden states (<= 1e-5), the selector's path and each
    slot's top-k candidates equal Z Lab's `DFlash2DraftModel.propose`, over 20 random contexts; also with Z Lab's
    sliding-window draft layers (causal inside the block, its default, or bidirectional), contexts up to 24."""
    zl = zlab_dflash2(tmp_path, window=WINDOWS[window])
    ours = load_drafter(tmp_path, dtype=torch.float32)
    assert ours.config.windowed == (window != "full")
    assert ours.config.sliding_window == (WINDOWS[window] or {}).get("sliding_window")
    assert ours.config.arch == "dflash2" and ours.config.selector_top_k == 5 and ours.config.conv_group_size == 8
    head = torch.nn.Linear(H, V, bias=False)
    g = torch.Generator().manual_seed(1)
    head.weight.data = 0.5 * torch.randn(V, H, generator=g)
    for trial in range(20):
        S, B = 5 + trial, 8
        taps = torch.randn(1, S, 2 * H, generator=g)
        block = torch.full((1, B), 3, dtype=torch.long)
        block[0, 0] = int(torch.randint(4, V, (1,), generator=g))
        embeds = torch.randn(V, H, generator=g)[block]
        pos = torch.arange(S + B)[None]
        with torch.no_grad():
            ref_h = zl(target_hidden=taps, noise_embedding=embeds, position_ids=pos)[:, 1:]
            ref_path, ref_cand, _ = zl.propose(ref_h, block[:, 0], head, 0.0)
            ctx = ours.context_kv(ours.fuse(taps), pos[:, :S])
            h = ours(embeds, pos[:, S:], ctx, torch.ones(1, 1, B, S + B, dtype=torch.bool))[:, 1:]
            sel = ours.candidate_selector.select(h, head(h), block[:, 0])
        assert (h - ref_h).abs().max() <= 1e-5
        assert torch.equal(sel.path, ref_path)
        assert torch.equal(sel.candidates.sort(-1).values, ref_cand.sort(-1).values)


def test_zlab_codebooks_without_the_weight_suffix_load(tmp_path):
    zlab_dflash2(tmp_path)
    a = load_drafter(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    for name in ("predecessor_codebook", "successor_codebook"):  # the names Z Lab's key mapping reads
        state[f"candidate_selector.{name}"] = state.pop(f"candidate_selector.{name}.weight")
    save_file(state, tmp_path / "model.safetensors")
    b = load_drafter(tmp_path)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_dflash2_checkpoints_round_trip_and_refuse_what_is_missing(tmp_path):
    t = make_target("llama")
    dr = make_drafter(t, arch="dflash2")
    save_drafter(dr, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["selector_rank"] == 16
    back = load_drafter(tmp_path / "d", dtype=torch.float64)
    assert back.config == dr.config
    assert all(torch.equal(x, y) for x, y in zip(back.state_dict().values(), dr.state_dict().values()))
    state = load_file(tmp_path / "d" / "model.safetensors")
    del state["layers.0.mlp_conv.base_kernel"]
    save_file(state, tmp_path / "d" / "model.safetensors")
    with pytest.raises(DFlashError, match="missing .*mlp_conv.base_kernel"):
        load_drafter(tmp_path / "d")
    with pytest.raises(DFlashError, match="conv_group_size"):
        DFlashConfig.from_hf_dict({**cfg, "dflash_config": {**cfg["dflash_config"], "conv_group_size": 7}})


def test_a_dflash2_drafter_from_a_v1_drafter_drafts_exactly_the_same(arch):
    """Identity convolutions and a selector at the unary scores: every step's chain is the v1 drafter's (the
    engine's greedy runs give the same accepted lengths, not only the same tokens)."""
    t = make_target(arch)
    v1 = make_drafter(t, block_size=6)
    v2 = dflash2_from(v1, **FIELDS)
    config = DecodeConfig(block_size=6)
    runs = [DFlashEngine(t, d, eos_token_ids=[], config=config).generate(PROMPTS, max_new_tokens=24)
            for d in (v1, v2)]
    assert [g.tokens for g in runs[0]] == [g.tokens for g in runs[1]]
    assert [g.stats.accepted for g in runs[0]] == [g.stats.accepted for g in runs[1]]


def test_greedy_with_the_selector_chain_equals_ar(arch, backend):
    """A random DFlash2 drafter (its selector moves the chain away from the per-slot argmax): output equals AR,
    alone and batched, with the adaptive policy too."""
    t = make_target(arch, backend=backend)
    dr = make_drafter(t, block_size=6, arch="dflash2")
    eng = DFlashEngine(t, dr, eos_token_ids=[], config=DecodeConfig(block_size=6))
    ar, _ = reference_runs(eng, PROMPTS, 30)
    assert [g.tokens for g in eng.generate(PROMPTS, max_new_tokens=30)] == [g.tokens for g in ar]
    assert eng.generate(PROMPTS[2:3], max_new_tokens=30)[0].tokens == ar[2].tokens
    h = torch.randn(2, 5, t.hidden_size, dtype=t.dtype)
    logits = torch.randn(2, 5, t.vocab_size, dtype=t.dtype)
    assert not torch.equal(dr.candidate_selector.select(h, logits, torch.tensor([5, 6])).path, logits.argmax(-1))


def test_training_a_dflash2_drafter_from_a_v1_drafter_learns_the_selector(tmp_path):
    """`TrainConfig(arch="dflash2", init_from=V1)`: the v1 drafter becomes a DFlash2 drafter (as `dflash2_from`),
    trains with the unary + selector objective (its log shows both), and saves a DFlash2 checkpoint that decodes."""
    from test_train import recipe, tiny_setup
    from dflashkit.train import TrainConfig, train

    target_dir, data = tiny_setup(tmp_path)
    train(TrainConfig.from_file(recipe(tmp_path, target_dir, data, "v1", steps=3)))
    v1 = load_drafter(tmp_path / "v1" / "drafter")
    cfg = TrainConfig.from_file(recipe(tmp_path, target_dir, data, "v2", steps=6, arch="dflash2",
                                       init_from=str(tmp_path / "v1" / "drafter"), lr=3e-3, selector_rank=8))
    v2 = train(cfg)
    assert v2.config.arch == "dflash2" and v2.config.num_hidden_layers == v1.config.num_hidden_layers
    assert v2.config.selector_rank == 8
    log = [json.loads(x) for x in (tmp_path / "v2" / "train_log.jsonl").read_text().splitlines()]
    assert all("selector_loss" in r and 0 <= r["selector_acc"] <= 1 for r in log)
    assert log[-1]["selector_loss"] < log[0]["selector_loss"]
    moved = [n for n, p in v2.named_parameters() if "conv" in n or "selector" in n]
    assert moved and not torch.equal(v2.candidate_selector.predecessor_codebook.weight,
                                     torch.zeros_like(v2.candidate_selector.predecessor_codebook.weight))
    back = load_drafter(tmp_path / "v2" / "drafter")
    assert back.config.arch == "dflash2"
    # The CLI: `dflashkit train --config RECIPE --arch dflash2 --init-from V1` (the flags win over the recipe's
    # defaults), the selector alone
    from dflashkit.cli import main

    cli = recipe(tmp_path, target_dir, data, "v2cli", steps=2, train_only="selector", selector_rank=4)
    assert main(["train", "--config", str(cli), "--arch", "dflash2", "--init-from",
                 str(tmp_path / "v1" / "drafter")]) == 0
    made = load_drafter(tmp_path / "v2cli" / "drafter")
    assert made.config.arch == "dflash2" and made.config.selector_rank == 4
    assert torch.equal(made.layers[0].mlp.up_proj.weight, v1.layers[0].mlp.up_proj.weight)  # only the selector trained


def test_selector_lr_scale_moves_the_selector_alone_faster(tmp_path):
    """`selector_lr_scale`: the selector's parameters learn at lr x scale, the layers and convolutions at lr (scale 0:
    the selector stays at its converted values while everything else trains)."""
    from test_train import recipe, tiny_setup
    from dflashkit.train import TrainConfig, train

    target_dir, data = tiny_setup(tmp_path)
    train(TrainConfig.from_file(recipe(tmp_path, target_dir, data, "v1", steps=2)))
    start = load_drafter(tmp_path / "v1" / "drafter")
    runs = {}
    for scale in (0.0, 1.0):
        cfg = TrainConfig.from_file(recipe(tmp_path, target_dir, data, f"s{scale}", steps=2, arch="dflash2",
                                           init_from=str(tmp_path / "v1" / "drafter"), selector_rank=8,
                                           selector_lr_scale=scale))
        runs[scale] = train(cfg)
    frozen, moving = runs[0.0].candidate_selector, runs[1.0].candidate_selector
    assert torch.equal(frozen.predecessor_codebook.weight, torch.zeros_like(frozen.predecessor_codebook.weight))
    assert not torch.equal(moving.predecessor_codebook.weight, frozen.predecessor_codebook.weight)
    for run in runs.values():  # the layers and the convolutions train at lr either way
        assert not torch.equal(run.layers[0].mlp.up_proj.weight, start.layers[0].mlp.up_proj.weight)
        assert not torch.equal(run.layers[0].mlp_conv.kernel_projection.weight,
                               torch.zeros_like(run.layers[0].mlp_conv.kernel_projection.weight))


def test_selector_only_training_step_gives_the_full_steps_selector_gradient():
    """train_only="selector" runs the layers without a graph and one logits pass: the selector's gradient and the
    per-slot argmax counts equal the full step's (whose unary loss does not depend on the selector)."""
    from contextlib import nullcontext

    from dflashkit.train import TrainConfig, train_step_loss

    t = make_target("llama", dtype=torch.float32, backend="lean")
    dr = make_drafter(t, block_size=8, arch="dflash2").float()
    with torch.no_grad():  # a selector that scores pairs (not the unary init)
        dr.candidate_selector.predecessor_codebook.weight.normal_(0, 0.5)
    t.set_taps(dr.config.target_layer_ids)
    ids = torch.randint(4, V, (2, 40), generator=torch.Generator().manual_seed(0))
    lm = torch.zeros_like(ids, dtype=torch.bool)
    lm[:, 12:] = True
    out = {}
    for only in ("all", "selector"):
        cfg = TrainConfig(out_dir="-", data_dir="-", block_size=8, num_anchors=4, train_only=only)
        dr.zero_grad(set_to_none=True)
        loss, st = train_step_loss(dr, t, ids, lm, cfg, torch.Generator().manual_seed(1), nullcontext)
        loss.backward()
        out[only] = ([p.grad.clone() for p in dr.candidate_selector.parameters()], st)
    for a, b in zip(out["all"][0], out["selector"][0]):
        assert torch.allclose(a, b, atol=1e-6)
    full, fast = out["all"][1], out["selector"][1]
    assert torch.equal(full["correct"], fast["correct"]) and torch.equal(full["count"], fast["count"])
    assert float(full["selector_loss"]) == pytest.approx(float(fast["selector_loss"]), rel=1e-6)
    assert fast["count"].sum() > 0 and not any(p.grad is not None for p in dr.layers.parameters())


def test_a_dflash2_export_loads_in_zlabs_package_and_proposes_the_same(tmp_path):
    """`export_zlab` of our DFlash2 drafter: Z Lab's `DFlash2DraftModel.from_pretrained` loads it (all tensors
    present) and proposes our path. The speculators export writes speculators' `dflash2` layout (its loading by
    speculators itself: scripts/dflash2_check.py); the GGUF export writes llama.cpp's DFlash2 keys (tests/test_export.py)
    and refuses sliding-window layers rather than drop the window."""
    dflash = pytest.importorskip("dflash")
    from dflashkit.export import export_speculators, export_zlab
    from dflashkit.gguf_export import export_gguf

    t = make_target("qwen3", dtype=torch.float32)
    dr = make_drafter(t, block_size=8, arch="dflash2").float()
    export_zlab(dr, tmp_path / "z", dtype=None)
    zl = dflash.DFlash2DraftModel.from_pretrained(tmp_path / "z").float().eval()
    g = torch.Generator().manual_seed(4)
    taps, S = torch.randn(1, 9, 2 * t.hidden_size, generator=g), 9
    block = torch.tensor([[17] + [3] * 7])
    embeds, pos = t.embed(block).float(), torch.arange(S + 8)[None]
    head = torch.nn.Linear(t.hidden_size, t.vocab_size, bias=False)
    head.weight.data = t.lm_head_weight.float()
    with torch.no_grad():
        ref_h = zl(target_hidden=taps, noise_embedding=embeds, position_ids=pos)[:, 1:]
        ref_path = zl.propose(ref_h, block[:, 0], head, 0.0)[0]
        h = dr(embeds, pos[:, S:], dr.context_kv(dr.fuse(taps), pos[:, :S]),
               torch.ones(1, 1, 8, S + 8, dtype=torch.bool))[:, 1:]
    assert (h - ref_h).abs().max() <= 1e-5
    assert torch.equal(dr.candidate_selector.select(h, head(h), block[:, 0]).path, ref_path)
    export_speculators(dr, t, "tiny", tmp_path / "s", dtype=None)
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash2" and cfg["speculators_config"]["algorithm"] == "dflash2"
    assert all(cfg[k] == getattr(dr.config, k) for k in FIELDS) and cfg["draft_vocab_size"] == t.vocab_size
    written = load_file(tmp_path / "s" / "model.safetensors")
    ours = dr.state_dict()
    assert torch.equal(written["candidate_selector.predecessor_codebook"],
                       ours["candidate_selector.predecessor_codebook.weight"])
    assert "candidate_selector.successor_codebook" in written and "layers.0.mlp_conv.base_kernel" in written
    assert len(written) == len(ours)
    windowed = dr.config.replace(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    dr.config = windowed
    with pytest.raises(DFlashError, match="sliding-window"):
        export_gguf(dr, tmp_path / "none.gguf", tmp_path / "g.gguf")


@pytest.mark.parametrize("arch", ["dflash", "dflash2", "dflash2-sliding", "dflash-sliding-causal"])
def test_the_speculators_layout_loads_back_identical(tmp_path, arch):
    """`export_speculators` then `load_drafter`: the same config and every tensor equal, for v1 and DFlash2, with
    sliding-window layers bidirectional (speculators' dflash2 default) or causal inside the block. The layout does not
    record the target's layer count: without it the load names the remedy."""
    from dflashkit.export import export_speculators

    t = make_target("qwen3", dtype=torch.float32)
    dr = make_drafter(t, block_size=8, arch=arch.split("-")[0]).float()
    if "sliding" in arch:
        dr.config = dr.config.replace(layer_types=["sliding_attention", "full_attention"], sliding_window=5,
                                      is_causal=None if arch.endswith("causal") else False)
    export_speculators(dr, t, "tiny", tmp_path / "s", dtype=None)
    back = load_drafter(tmp_path / "s", num_target_layers=t.num_layers)
    assert back.config == dr.config
    theirs = back.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in dr.state_dict().items()) and len(theirs) == len(dr.state_dict())
    with pytest.raises(DFlashError, match="layer count"):
        load_drafter(tmp_path / "s")
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    for change, why in (({"sample_from_anchor": True}, "anchor"), ({"draft_vocab_size": 50}, "reduced-vocabulary"),
                        ({"speculators_model_type": "eagle3"}, "not a DFlash")):
        with pytest.raises(DFlashError, match=why):
            DFlashConfig.from_speculators({**cfg, **change}, t.num_layers)


def test_a_zlab_dflash2_checkpoint_for_smollm2_runs_from_the_cli_identical_to_ar(tmp_path, capsys):
    """The acceptance path: a DFlash2 drafter for the real SmolLM2 target, made and saved by Z Lab's own package
    (random, one layer), runs with `dflashkit generate --drafter DIR --compare` in bf16: identical to AR."""
    dflash = pytest.importorskip("dflash")
    from transformers import Qwen3Config

    from dflashkit.cli import main

    cfg = Qwen3Config(hidden_size=576, num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, intermediate_size=1536, vocab_size=49152, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=8192, architectures=["DFlash2DraftModel"])
    cfg.num_target_layers, cfg.block_size = 30, 8
    cfg.dflash_config = {"mask_token_id": 16, "target_layer_ids": [1, 14, 27], "block_size": 8, "selector_top_k": 8,
                         "selector_rank": 64, "conv_kernel_size": 2, "conv_group_size": 16}
    model = dflash.DFlash2DraftModel(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones(p.shape) if name.endswith("norm.weight") else 0.02 * torch.randn(p.shape, generator=g))
    model.save_pretrained(tmp_path / "z")
    assert main(["generate", "--drafter", str(tmp_path / "z"), "--prompt", "Name three colours.",
                 "--max-new-tokens", "24", "--dtype", "bfloat16", "--compare", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]
    assert stats["identical_to_ar"] and stats["new_tokens"] >= 1
    # `dflashkit export` writes it in speculators' layout and as llama.cpp's GGUF; the speculators directory runs
    # from the CLI too (its target's layer count comes from the target)
    assert main(["export", "--drafter", str(tmp_path / "z"), "--format", "speculators", "--out",
                 str(tmp_path / "s")]) == 0
    assert json.loads((tmp_path / "s" / "config.json").read_text())["speculators_model_type"] == "dflash2"
    assert main(["export", "--drafter", str(tmp_path / "z"), "--format", "gguf",
                 "--out", str(tmp_path / "d.gguf")]) == 0
    capsys.readouterr()
    assert main(["generate", "--drafter", str(tmp_path / "s"), "--prompt", "Name three colours.",
                 "--max-new-tokens", "24", "--dtype", "bfloat16", "--compare", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]["identical_to_ar"]


def test_a_selector_ranked_tree_is_exact_and_reduces_to_the_factorised_tree():
    """`topk_tree(conditional=...)`: with slot scores that ignore the parent it builds the factorised tree exactly;
    with the selector's (a DFlash2 drafter's `tree`), greedy output equals AR, with the fixed and adaptive policy."""
    from dflashkit.tree import topk_tree

    g = torch.Generator().manual_seed(2)
    toks = torch.randint(4, 90, (3, 5, 4), generator=g)
    logp = torch.rand(3, 5, 4, generator=g).log().sort(-1, descending=True).values
    plain = topk_tree(toks, logp, 9)
    cond = topk_tree(toks, torch.zeros_like(logp), 9,
                     conditional=lambda j, beam: logp[:, j, None, :].expand(3, 1 if beam is None else beam.shape[1], 4))
    for a, b in ((plain.tokens, cond.tokens), (plain.parent, cond.parent), (plain.depth, cond.depth)):
        assert torch.equal(a, b)
    t = make_target("qwen3")
    dr = make_drafter(t, block_size=6, arch="dflash2")
    for policy in ("fixed", "adaptive"):
        eng = DFlashEngine(t, dr, eos_token_ids=[], config=DecodeConfig(block_size=6, tree=8, policy=policy))
        ar, _ = reference_runs(eng, PROMPTS, 24)
        assert [x.tokens for x in eng.generate(PROMPTS, max_new_tokens=24)] == [x.tokens for x in ar]


def test_the_cost_model_prices_a_dflash2_drafter_on_its_own():
    """A DFlash2 drafter of v1's shape gets its own cached step costs (its convolutions and selector walk take time),
    the v1 drafter keeps its key."""
    from dflashkit.proposers import DrafterProposer
    from dflashkit.step_cost import cost_key

    t = make_target("llama")
    v1 = make_drafter(t)
    keys = [cost_key(t, DrafterProposer(d, t, 8)) for d in (v1, dflash2_from(v1, **FIELDS))]
    assert keys[0] != keys[1] and cost_key(t, DrafterProposer(v1, t, 8)) == keys[0]
