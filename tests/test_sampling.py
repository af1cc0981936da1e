"""Speculative sampling keeps the target's distribution exactly.

The marginal of each of the first 4 emitted tokens under speculative sampling (block 4, with drafts that
are often accepted) is compared with the EXACT marginal, computed by enumerating every prefix of the
tiny target (vocab 12). One chi-square test per (setting, position, backend): 5 settings (two plain blocks, a lookup
branch, a corpus lookup, a drafter tree) x 4 positions x 2 target backends = 40 tests at alpha = 1e-3 each, so the
file raises a false alarm with probability <= 4 %.
"""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, LlamaConfig

from dflashkit import DecodeConfig, DFlashEngine, SamplingParams, Target
from dflashkit.backends.lean import LeanTarget
from dflashkit.sampling import Sampler

from conftest import make_drafter

V, N_SAMPLES, N_TOKENS, ALPHA = 12, 20_000, 4, 1e-3
PROMPT = [1, 5, 7]


def small_target(backend: str = "hf"):
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    # tail_depth 4 >= the deepest node of these trees (block 4, lookup 3): bit-identical, and cheap at batch 2000
    return LeanTarget(model.double(), tail_depth=4) if backend == "lean" else Target(model.double())


def exact_marginals(t: Target, params: SamplingParams):
    """[N_TOKENS, V] exact marginal distribution of each emitted token, by enumeration of prefixes."""
    sampler = Sampler([params], t.device)
    marg = []
    prefixes, weights = [[]], torch.ones(1, dtype=torch.float64)
    for _ in range(N_TOKENS):
        ids = torch.tensor([PROMPT + p for p in prefixes])
        with torch.no_grad():
            logits = t.reference_logits(ids)[:, -1:]
        probs = torch.cat([sampler.probs(logits[i:i + 1])[0, 0][None] for i in range(len(prefixes))]).double()
        joint = weights[:, None] * probs  # [n_prefixes, V]
        marg.append(joint.sum(0))
        prefixes = [p + [v] for p in prefixes for v in range(V)]
        weights = joint.reshape(-1)
    return torch.stack(marg).numpy()


def greedy_oracle(engine, t: Target):
    """Drafts = the target's argmax chain from the committed text: often accepted when the target is peaked,
    rejected otherwise, so every acceptance length occurs. Asked for k tokens per slot (a drafter tree), it
    gives the target's k best at each slot of that chain, with their log-probs: the tree then branches where a
    sample often leaves the argmax."""

    class Oracle(engine.drafter_factory):
        def draft(self, state, view, k=1, probs=False, block=None):
            seqs = view.seqs
            drafts = torch.zeros((len(seqs), (block or self.block_size) - 1, k), dtype=torch.long)
            logp = torch.zeros(drafts.shape)
            texts = [s.prompt + s.generated for s in seqs]
            for n in set(map(len, texts)):  # rows are ragged: one batch per committed length
                rows = [i for i, x in enumerate(texts) if len(x) == n]
                ctx = torch.tensor([texts[i] for i in rows])
                for j in range(drafts.shape[1]):
                    lp, top = t.reference_logits(ctx)[:, -1].float().log_softmax(-1).topk(k, dim=-1)
                    drafts[rows, j], logp[rows, j] = top, lp
                    ctx = torch.cat([ctx, top[:, :1]], dim=1)
            return drafts, logp

    engine.set_proposers(drafter=Oracle)


def assert_sampling_matches_target(eng: DFlashEngine, t: Target, params: SamplingParams, seed: int) -> None:
    """Draw N_SAMPLES continuations of N_TOKENS with `eng`; check that both acceptance and rejection occurred and
    that each emitted position's marginal passes the chi-square test against the exact one."""
    torch.manual_seed(seed)
    counts = np.zeros((N_TOKENS, V))
    accepted = []
    with torch.inference_mode():
        for _ in range(N_SAMPLES // 2000):
            for g in eng.generate([PROMPT] * 2000, sampling=params, max_new_tokens=N_TOKENS):
                for j, tok in enumerate(g.tokens):
                    counts[j, tok] += 1
                accepted += g.stats.accepted
    assert max(accepted) >= 2 and min(accepted) == 0  # both acceptance and rejection paths ran
    exact = exact_marginals(t, params)
    for j in range(N_TOKENS):
        expected = exact[j] * N_SAMPLES
        assert counts[j][expected == 0].sum() == 0, "emitted a token the target cannot emit"
        keep = expected >= 5  # merge sparse cells into one bin for a valid chi-square
        obs = np.append(counts[j][keep], counts[j][~keep].sum())
        exp = np.append(expected[keep], expected[~keep].sum())
        obs, exp = obs[exp > 0], exp[exp > 0]
        p = chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
        assert p > ALPHA, f"token {j}: chi-square p={p:.2e}\nobs={obs}\nexp={exp}"


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8)])
def test_speculative_sampling_matches_target_distribution(params, backend):
    t = small_target(backend)
    eng = DFlashEngine(t, make_drafter(t, block_size=4, mask_token_id=3), eos_token_ids=[], config=DecodeConfig())
    greedy_oracle(eng, t)
    assert_sampling_matches_target(eng, t, params, seed=1234)


def test_speculative_sampling_with_the_dflash2_selector_matches_target_distribution():
    """A DFlash2 drafter's chain (the selector's greedy path, whatever the temperature: drafts are any function of
    the drafter's state, and each committed token is the target's own draw with its position's uniform) keeps the
    target's distribution."""
    t = small_target("lean")
    eng = DFlashEngine(t, make_drafter(t, block_size=4, mask_token_id=3, arch="dflash2"), eos_token_ids=[],
                       config=DecodeConfig())
    assert_sampling_matches_target(eng, t, SamplingParams(temperature=1.0), seed=2468)


def test_top_k_top_p_filtering():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    s = Sampler([SamplingParams(temperature=1.0, top_p=0.7)], torch.device("cpu"))
    torch.testing.assert_close(s.probs(logits)[0, 0], torch.tensor([0.625, 0.375, 0, 0]))
    s = Sampler([SamplingParams(temperature=1.0, top_k=3, top_p=0.99)], torch.device("cpu"))
    torch.testing.assert_close(s.probs(logits)[0, 0], torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)


def test_seeded_rows_are_reproducible_in_any_batch():
    t = small_target()
    eng = DFlashEngine(t, eos_token_ids=[], config=DecodeConfig())
    a = eng.generate([PROMPT], sampling=SamplingParams(temperature=1.0, seed=7), max_new_tokens=12)[0].tokens
    mixed = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=7)]
    b = eng.generate([PROMPT, PROMPT], sampling=mixed, max_new_tokens=12)[1].tokens
    assert a == b


def seeded_configs():
    from dflashkit.lookup import LookupParams

    return {"block": DecodeConfig(), "tree": DecodeConfig(tree=6),
            "tree+lookup": DecodeConfig(tree=6, lookup=LookupParams(max_tokens=3))}


@pytest.mark.parametrize("name", list(seeded_configs()))
def test_seeded_speculative_sampling_returns_what_seeded_plain_decoding_returns(name):
    """A seeded row commits plain decoding's tokens with the same seed, token for token, whatever is drafted (an
    oracle that is often right and sometimes wrong, a tree, a lookup branch), alone or beside other rows of other
    lengths and seeds; and the same again on a second run."""
    t = small_target("lean")
    eng = DFlashEngine(t, make_drafter(t, block_size=4, mask_token_id=3), eos_token_ids=[],
                       config=seeded_configs()[name])
    greedy_oracle(eng, t)
    if name == "tree+lookup":
        use_lookup_oracle(eng, t, 3)
    for params in (SamplingParams(temperature=0.7, seed=1234), SamplingParams(temperature=1.0, top_p=0.9, seed=-5)):
        ar = eng.generate([PROMPT], sampling=params, max_new_tokens=40, config=DecodeConfig.autoregressive())[0]
        alone = eng.generate([PROMPT], sampling=params, max_new_tokens=40)[0]
        again = eng.generate([PROMPT], sampling=params, max_new_tokens=40)[0]
        others = [SamplingParams(temperature=1.0), params, SamplingParams(temperature=0.9, seed=5), SamplingParams()]
        mixed = eng.generate([[2, 4], PROMPT, PROMPT + [6, 1, 8], PROMPT], sampling=others,
                             max_new_tokens=[9, 40, 30, 17])
        assert alone.tokens == ar.tokens == again.tokens == mixed[1].tokens
        assert max(alone.stats.accepted) >= 2 and min(alone.stats.accepted) < 3  # drafts both kept and refused
    # the seed is what decides: another seed draws another text
    other = eng.generate([PROMPT], sampling=SamplingParams(temperature=0.7, seed=1235), max_new_tokens=40)[0]
    assert other.tokens != ar.tokens


def test_position_uniforms_are_independent_and_uniform():
    """u(seed, position) is what every sampled token rests on: uniform on [0, 1), no relation between neighbouring
    positions or neighbouring seeds (a chi-square on 20 bins and the lag-1 correlations)."""
    from dflashkit.sampling import seed_key, uniforms

    keys = np.array([seed_key(s) for s in range(200)], dtype=np.uint64)
    u = uniforms(keys, np.arange(500, dtype=np.int64)[None].repeat(200, 0))  # [seeds, positions]
    assert u.min() >= 0 and u.max() < 1
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    assert chisquare(counts).pvalue > ALPHA
    assert abs(np.corrcoef(u[:, 1:].ravel(), u[:, :-1].ravel())[0, 1]) < 0.02  # 99,800 pairs: sd ~0.003
    assert abs(np.corrcoef(u[1:].ravel(), u[:-1].ravel())[0, 1]) < 0.02


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                dict(temperature=float("nan"))])
def test_bad_sampling_parameters(kw):
    from dflashkit import DFlashError
    with pytest.raises(DFlashError):
        SamplingParams(**kw)


def lookup_oracle(t: Target, k: int):
    """Lookup proposals that disagree with the greedy drafts in different places: by the committed length mod 3,
    the target's argmax chain (a dead duplicate of the drafts), or its chain with the 2nd-ranked token at
    slot 1 or slot 2 (a live branch off the anchor or off draft 1)."""
    memo = {}

    def fake(tokens):
        key = tuple(tokens)
        if key not in memo:
            memo[key] = chain(key)
        return memo[key], 1

    def chain(tokens):
        ctx = torch.tensor([list(tokens)])
        out = []
        for j in range(k):
            ranked = t.reference_logits(ctx)[0, -1].argsort(descending=True)
            nxt = ranked[1] if j + 1 == (len(tokens) - 1) % 3 else ranked[0]
            out.append(int(nxt))
            ctx = torch.cat([ctx, nxt.view(1, 1)], dim=1)
        return out
    return fake


def use_lookup_oracle(eng: DFlashEngine, t: Target, k: int) -> None:
    fake = lookup_oracle(t, k)

    class Oracle(eng.lookup_factory):
        def suggest(self, tokens, index=None):
            return fake(tokens)

    eng.set_proposers(lookup=Oracle)


def test_speculative_sampling_with_a_lookup_branch_matches_target_distribution(backend):
    from dflashkit.lookup import LookupParams

    t = small_target(backend)
    eng = DFlashEngine(t, make_drafter(t, block_size=4, mask_token_id=3), eos_token_ids=[],
                       config=DecodeConfig(lookup=LookupParams(max_tokens=3)))
    greedy_oracle(eng, t)
    use_lookup_oracle(eng, t, 3)
    assert_sampling_matches_target(eng, t, SamplingParams(temperature=1.0), seed=4321)


def test_speculative_sampling_with_the_corpus_lookup_matches_target_distribution(backend):
    """The corpus branch copies from 300 of the target's own samples (so its copies are often right, and wrong
    where a sample leaves the likeliest continuation): the marginals stay the target's."""
    from dflashkit.corpus import Corpus
    from dflashkit.lookup import LookupParams

    t = small_target(backend)
    plain = DFlashEngine(t, eos_token_ids=[], config=DecodeConfig.autoregressive())
    torch.manual_seed(99)
    answers = [g.tokens for g in plain.generate([PROMPT] * 300, sampling=SamplingParams(temperature=1.0),
                                                 max_new_tokens=8)]
    eng = DFlashEngine(t, make_drafter(t, block_size=4, mask_token_id=3), eos_token_ids=[],
                       config=DecodeConfig(lookup=LookupParams(max_tokens=3, corpus_n=1)),
                       corpus=Corpus.from_answers(answers))
    assert_sampling_matches_target(eng, t, SamplingParams(temperature=1.0), seed=4322)


def test_speculative_sampling_with_a_drafter_tree_matches_target_distribution(backend):
    """A tree of the target's 2nd/3rd choices beside its argmax chain: a sample that leaves the argmax is often
    still accepted, down a side branch."""
    t = small_target(backend)
    eng = DFlashEngine(t, make_drafter(t, block_size=4, mask_token_id=3), eos_token_ids=[],
                       config=DecodeConfig(tree=6))
    greedy_oracle(eng, t)
    assert_sampling_matches_target(eng, t, SamplingParams(temperature=1.0), seed=2468)


def test_speculative_sampling_with_the_adaptive_policy_matches_target_distribution(backend):
    """The adaptive policy cuts the tree + lookup branch where the cost model says (here: inside it, differently
    from step to step as its calibration learns); the cut depends on the drafter and the past only."""
    from dflashkit.lookup import LookupParams
    from dflashkit.step_cost import DRAFT_GRID, VERIFY_GRID, CostModel

    t = small_target(backend)
    cost = CostModel([100.0 + 0.01 * n for n in VERIFY_GRID], 0.0, [5.0] * len(DRAFT_GRID), learn=False)
    eng = DFlashEngine(t, make_drafter(t, block_size=4, mask_token_id=3), eos_token_ids=[], cost=cost,
                       config=DecodeConfig(tree=6, lookup=LookupParams(max_tokens=3), policy="adaptive"))
    # the fixed model's "ms" are not wall ms: a look's real host time (thousands of rows here) must not be weighed
    # against them (`probes.Looks`; its own tests are in test_policy.py): a clock that stands still
    eng.policy(eng.resolve(eng.config)).clock = lambda: 0.0
    greedy_oracle(eng, t)
    use_lookup_oracle(eng, t, 3)
    assert_sampling_matches_target(eng, t, SamplingParams(temperature=1.0), seed=1357)
    st = eng.policy_stats()["b4-tree6-lookup3"]
    assert 1.5 < st["mean_width"] < 1 + 6 + 3 - 0.5, st  # cut inside the tree, not all or nothing


def test_speculative_sampling_with_plain_steps_between_looks_matches_target_distribution():
    """Looks priced far above their worth: runs of plain steps between looks (`probes.Looks`) mix with
    drafted and lookup steps; the distribution is still the target's."""
    from dflashkit.lookup import LookupParams
    from dflashkit.step_cost import DRAFT_GRID, VERIFY_GRID, CostModel

    t = small_target("lean")
    cost = CostModel([100.0 + 0.01 * n for n in VERIFY_GRID], 0.0, [5.0] * len(DRAFT_GRID), learn=False)
    eng = DFlashEngine(t, make_drafter(t, block_size=4, mask_token_id=3), eos_token_ids=[], cost=cost,
                       config=DecodeConfig(tree=6, lookup=LookupParams(max_tokens=3), policy="adaptive"))
    pol = eng.policy(eng.resolve(eng.config))
    pol.looks.value, pol.looks.ms = 0.0, 1e9
    greedy_oracle(eng, t)
    use_lookup_oracle(eng, t, 3)
    assert_sampling_matches_target(eng, t, SamplingParams(temperature=1.0), seed=97531)
    st = eng.policy_stats()["b4-tree6-lookup3"]
    assert st["plain_steps"] > 0 and st["plain_steps"] < st["steps"], st
