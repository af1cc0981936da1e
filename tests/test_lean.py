"""The lean backend: the same model as transformers computes, and batch-invariant in bfloat16 (so greedy speculative
output equals the engine's own AR output bit for bit, chain and tree alike)."""

import json

import pytest
import torch

from conftest import assert_invariant_unless_torch_linear_is_not, make_drafter, make_target
from dflashkit import DecodeConfig, DFlashEngine, DFlashError
from dflashkit.backends.lean import TAIL_DEPTH, LeanTarget
from dflashkit.invariance import check, measure
from dflashkit.loader import make_target as backend_for
from dflashkit.lookup import LookupParams
from test_engine import PROMPTS, reference_runs, with_oracle
from test_tree import with_lookup_oracle


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_lean_logits_equal_transformers(arch, dtype, tol):
    """Prefill over whole sequences and a verify block over a cache: HF's logits within `tol`."""
    hf, lean = make_target(arch, dtype), make_target(arch, dtype, backend="lean")
    ids = torch.randint(4, 96, (2, 70))
    ref = hf.reference_logits(ids)
    assert (lean.reference_logits(ids) - ref).abs().max() <= tol
    assert torch.equal(lean.embed(ids), hf.embed(ids))  # F.embedding for a plain table, the module where it scales
    cache = lean.new_cache(2, 80)
    lean.forward(ids[:, :60], torch.arange(60).expand(2, 60), cache, kv_len=60)
    h, feats = lean.forward(ids[:, 60:], torch.arange(60, 70).expand(2, 10), cache, kv_len=70)
    assert (lean.logits(h) - ref[:, 60:]).abs().max() <= tol
    assert feats is None  # no taps were set


def test_taps_match_transformers_hidden_states(arch):
    hf, lean = make_target(arch), make_target(arch, backend="lean")
    hf.set_taps([1, 3])
    lean.set_taps([1, 3])
    ids = torch.randint(4, 96, (1, 12))
    _, feats = lean.forward(ids, torch.arange(12)[None], lean.new_cache(1, 12), kv_len=12)
    assert (feats - hf.taps(ids)).abs().max() <= 1e-10


@pytest.mark.parametrize("n,prompt,seed", [(4, 9, 0), (8, 29, 1), (16, 40, 2), (12, 77, 3), (16, 150, 4)])
def test_bf16_logits_are_bitwise_equal_in_blocks_trees_and_ragged_batches(arch, n, prompt, seed):
    """The property exactness rests on: every logit of a token decoded alone (one-token steps, batch 1) equals, bit
    for bit, the same token's logits verified in a block or as a path hidden in a tree (ancestors at scattered slots,
    decoy siblings), in a ragged batch of 2. Prompts span the head/tail split (TAIL_DEPTH) of the attention."""
    t = make_target(arch, torch.bfloat16, backend="lean")
    assert_invariant_unless_torch_linear_is_not(t, measure(t, n=n, prompt=prompt, seed=seed))


def test_the_self_check_names_a_torch_linear_that_changes_with_the_row_count(tmp_path, monkeypatch):
    """Where torch's F.linear gives a row other bits in a bigger call (oneDNN on an AVX512-BF16 CPU), the self-check's
    label says which weight, from how many rows, and names the remedy."""
    import dflashkit.invariance as invariance

    real = invariance.F.linear

    def wobbly(x, w):  # a GEMM that switches kernels from 5 rows on
        y = real(x, w)
        return y + 1e-2 if x.shape[0] >= 5 else y

    monkeypatch.setattr(invariance.F, "linear", wobbly)
    t = make_target("llama", torch.bfloat16, backend="lean")
    assert "with 5 rows in the call (64x32 weight)" in invariance.linear_row_change(t.linear_weights())
    monkeypatch.setattr(invariance, "measure", lambda target: invariance.Invariance(False, False, 0.03))
    inv = check(t, "tiny-llama-wobbly", tmp_path / "inv.json")
    assert not t.batch_invariant and "--kernel rowlinear is row-invariant" in inv.label()
    assert json.loads((tmp_path / "inv.json").read_text())  # the cause is cached with the verdict


def test_the_self_check_catches_a_forward_that_is_not_batch_invariant(tmp_path):
    """A forward whose rounding depends on the block width (as many fused kernels' do) is reported, not trusted."""
    t = make_target("llama", torch.bfloat16, backend="lean")

    class Wobbly(LeanTarget):
        def forward(self, ids, positions, cache, **kw):
            h, f = super().forward(ids, positions, cache, **kw)
            return h + 1e-2 * (ids.shape[1] > 1), f

    wobbly = Wobbly(make_target("llama", torch.bfloat16).model)
    inv = check(wobbly, "tiny-llama", tmp_path / "inv.json")
    assert not inv.exact and not wobbly.batch_invariant and "near-tie" in inv.label()
    assert check(t, "tiny-llama-ok", tmp_path / "inv.json").exact and t.batch_invariant
    # cached per machine/model/dtype: a second check reads the file (no forward runs)
    table = json.loads((tmp_path / "inv.json").read_text())
    assert len(table) == 2
    t.forward = None  # would raise if called
    assert check(t, "tiny-llama-ok", tmp_path / "inv.json").exact


@pytest.mark.parametrize("config", [
    DecodeConfig(),  # the plain chain
    DecodeConfig(tree=12, lookup=LookupParams(max_tokens=6)),  # a drafter tree + a lookup branch
    DecodeConfig(tree=20, tree_min_prob=0.01, lookup=LookupParams(max_tokens=16, tokens_per_n=4, skip_drafter_n=3)),
])
def test_bf16_speculative_greedy_output_is_bitwise_ar(arch, config):
    """In bfloat16 (no near-tie allowance): chain and trees, batch and single, drafts often accepted (oracles)."""
    t = make_target(arch, torch.bfloat16, backend="lean")
    dr = make_drafter(t, block_size=8)
    eng = DFlashEngine(t, dr, eos_token_ids=[], config=config)
    ar, ref = reference_runs(eng, PROMPTS, 48)
    with_oracle(eng, ref, keep=0.8, seed=5)
    if config.lookup.max_tokens:
        with_lookup_oracle(eng, ref, keep=0.6)
    batch = eng.generate(PROMPTS, max_new_tokens=48)
    assert [g.tokens for g in batch] == [g.tokens for g in ar]
    assert eng.generate(PROMPTS[3:4], max_new_tokens=48)[0].tokens == ar[3].tokens
    assert sum(g.stats.tau for g in batch) / len(batch) > 1.8  # the oracles' drafts really were accepted


def test_backend_choice_and_errors():
    hf = make_target("llama")
    assert isinstance(backend_for(hf.model, "auto"), LeanTarget)
    assert type(backend_for(hf.model, "hf")).__name__ == "HFTarget"
    with pytest.raises(DFlashError, match="choose one of"):
        backend_for(hf.model, "fast")
    assert TAIL_DEPTH >= 32  # deeper than the deepest default tree (block 16 + lookup 16): exact by construction


def test_lean_rejects_an_architecture_it_does_not_implement():
    from transformers import AutoModelForCausalLM, Qwen2Config  # q/k/v biases: not implemented by the lean forward

    model = AutoModelForCausalLM.from_config(Qwen2Config(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=50))
    with pytest.raises(DFlashError, match="--backend hf"):
        LeanTarget(model)
    assert type(backend_for(model, "auto")).__name__ == "HFTarget"  # auto falls back


def test_lean_handles_sliding_layers_and_refuses_what_it_does_not_implement():
    from transformers import AutoModelForCausalLM, Gemma2Config, Qwen3Config

    from dflashkit import Target

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, use_sliding_window=True, sliding_window=6, max_window_layers=2)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").double()
    assert "sliding_attention" in cfg.layer_types
    ids = torch.randint(4, 96, (2, 30))
    ref = Target(model).reference_logits(ids)
    assert (LeanTarget(model).reference_logits(ids) - ref).abs().max() <= 1e-10
    gemma2 = AutoModelForCausalLM.from_config(Gemma2Config(vocab_size=96, hidden_size=32, intermediate_size=64,
                                                           num_hidden_layers=2, num_attention_heads=4,
                                                           num_key_value_heads=2, head_dim=8))
    with pytest.raises(DFlashError, match="--backend hf"):
        LeanTarget(gemma2)  # not a supported architecture (and it soft-caps attention logits)
