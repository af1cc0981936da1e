"""The corpus lookup (`corpus.py`): its matches against their definition, its file, how the lookup branch and the
policy use it, and lossless decoding with it."""

import random
from collections import Counter

import numpy as np
import pytest

from conftest import make_drafter, make_target
from dflashkit import DecodeConfig, DFlashEngine, DFlashError, SamplingParams
from dflashkit.checkpoint import CORPUS, load_drafter, save_drafter
from dflashkit.corpus import MAX_N, Corpus, CorpusMatch
from dflashkit.lookup import LookupParams
from dflashkit.policy.acceptance import Acceptance, lookup_prior
from dflashkit.proposers import LookupProposer
from test_engine import PROMPTS, reference_runs


@pytest.fixture(params=["python", "cpp"])
def impl(request, monkeypatch):
    """`Corpus.match` in Python or in one C++ call (kernels/corpusmatch.cpp): both are tested."""
    from dflashkit import kernels

    if request.param == "python":
        monkeypatch.setattr(kernels, "on_cpu", lambda *a: None)
    elif not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.why_unavailable()}")
    return request.param


def plain_match(answers: list[list[int]], ids: list[int], max_tokens: int, min_n: int = 1):
    """The definition, written plainly: the longest suffix of ids (at most MAX_N) that ends somewhere inside an
    answer; then, token by token, the next token most of its occurrences share (a tie to the smallest id, an
    answer's end counting as -1), keeping only the occurrences that agree; no match where nothing is copied."""
    for n in range(min(MAX_N, len(ids)), 0, -1):
        conts = [a[e + 1:e + 1 + max_tokens] for a in answers for e in range(n - 1, len(a))
                 if a[e - n + 1:e + 1] == ids[-n:]]
        if conts:
            break
    else:
        return [], 0, 0
    if n < min_n:
        return [], 0, 0
    out, support = [], 0
    for j in range(max_tokens):
        col = [c[j] if j < len(c) else -1 for c in conts]
        counts = Counter(col)
        best = min(counts, key=lambda v: (-counts[v], v))
        if best == -1:
            break
        support = counts[best] if j == 0 else support
        out.append(best)
        conts = [c for c, v in zip(conts, col) if v == best]
    return (out, n, support) if out else ([], 0, 0)


def test_a_match_is_the_longest_suffix_and_the_continuation_most_occurrences_share(impl):
    c = Corpus.from_answers([[1, 2, 3, 4], [9, 2, 3, 5, 6], [2, 3, 5, 7], [8, 8]])
    m = c.match([0, 2, 3], max_tokens=3)
    assert (m.tokens, m.n, m.support) == ([5, 6], 2, 2)  # [2, 3] -> 5 twice, 4 once; then 6 and 7: a tie to 6
    assert c.match([7, 1, 2, 3], 3).tokens == [4]  # [1, 2, 3]: the longest suffix wins; the answer ends after 4
    assert c.match([4, 4], 3).n == 0  # 4 ends an answer only: nothing follows
    assert c.match([0, 8], 3, min_n=2).n == 0 and c.match([8, 8], 3).tokens == []
    assert c.match([3, 99], 3).n == 0  # an id the corpus never holds


def test_matches_agree_with_the_definition_on_random_corpora(impl):
    rng = random.Random(0)
    for _ in range(1500):
        v = rng.randint(2, 7)
        answers = [[rng.randrange(v) for _ in range(rng.randint(1, 15))] for _ in range(rng.randint(1, 4))]
        c = Corpus.from_answers(answers)
        ids = [rng.randrange(v) for _ in range(rng.randint(1, 12))]
        k, min_n = rng.randint(1, 6), rng.randint(1, 3)
        m = c.match(ids, k, min_n)
        assert (m.tokens, m.n, m.support) == plain_match(answers, ids, k, min_n), (answers, ids, k, min_n)


def test_the_cpp_match_equals_the_python_one_on_the_bundled_corpus(monkeypatch):
    """Queries from the bundled corpus' own answers (long matches, ranges past SAMPLED occurrences: the evenly spaced
    sample) and perturbed ones: kernels/corpusmatch.cpp answers exactly as corpus.py's Python."""
    from dflashkit import kernels
    from dflashkit.loader import BUNDLED_DRAFTER

    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.why_unavailable()}")
    c = Corpus.load(BUNDLED_DRAFTER / CORPUS).prepare()
    answers, rng = c.answers(), np.random.default_rng(0)
    queries = []
    for i in rng.integers(0, len(answers), 400):
        a = answers[i]
        if len(a) > 3:
            q = a[:int(rng.integers(2, len(a)))].copy()
            if rng.random() < 0.4:  # a token the corpus did not see there: a shorter match
                q[-int(rng.integers(1, min(len(q), 6)))] = rng.integers(0, 49152)
            queries.append(q)
    fast = [c.match(q, 16, 1) for q in queries]
    monkeypatch.setattr(kernels, "on_cpu", lambda *a: None)
    slow = [c.match(q, 16, 1) for q in queries]
    assert fast == slow
    assert sum(m.occurrences == 64 for m in fast) > 20 and sum(m.n == MAX_N for m in fast) > 20  # both cases ran


def test_ids_past_16_bits_and_the_file_round_trip(tmp_path, impl):
    answers = [[70_000, 5, 100_000, 7], [5, 100_000, 8]]
    c = Corpus.from_answers(answers)
    assert c.bits == 32 and c.match([1, 5, 100_000], 2).tokens == [7]  # a tie between 7 and 8: the smaller
    c.save(tmp_path / "c.npz")
    assert [a.tolist() for a in Corpus.load(tmp_path / "c.npz").answers()] == answers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]  # written atomically, no temporary left
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(DFlashError, match="corpus"):
        Corpus.load(tmp_path / "bad.npz")
    with pytest.raises(DFlashError):
        Corpus(np.array([[1, 2]]))
    with pytest.raises(DFlashError):
        LookupParams(max_tokens=4, corpus_n=-1)


class Row:
    """What `LookupProposer.propose` reads of a sequence."""

    def __init__(self, tokens):
        self.tokens, self.finished = np.asarray(tokens), False

    def history(self):
        return self.tokens

    def suffixes(self, max_n):
        return None


def test_the_branch_copies_from_the_corpus_only_where_the_rows_own_match_is_short():
    corpus = Corpus.from_answers([[1, 2, 3, 4, 5, 6]])
    params = LookupParams(max_tokens=3, skip_drafter_n=2, corpus_n=2)
    rows = [Row([9, 2, 3]), Row([2, 3, 9, 2, 3]), Row([9, 8])]
    p = LookupProposer(params, corpus).propose(rows)
    # row 0: no match of its own -> the corpus; row 1: its own [2, 3] match; row 2: nothing anywhere
    assert p.tokens == [[4, 5, 6], [9, 2, 3], []] and p.corpus == [True, False, False]
    assert [p.key(r) for r in range(3)] == ["corpus-2-one", 2, 0]  # one occurrence of [2, 3] in the corpus
    assert not p.skips_drafter  # a corpus match never skips the drafter, however long
    off = LookupProposer(LookupParams(max_tokens=3, corpus_n=0), corpus).propose(rows)
    assert off.tokens[0] == [] and off.corpus == [False] * 3
    acc = Acceptance()
    assert acc.lookup_rate("corpus-2-one") < acc.lookup_rate(2)  # a corpus match is trusted less a priori
    acc.observe_lookup("corpus-2-one", [4, 5, 6], [4, 5, 7])
    assert acc.lookup_tried == {"corpus-2-one": 3} and acc.lookup_right == {"corpus-2-one": 2}


def test_a_copy_is_keyed_by_how_far_the_corpus_agrees_on_it(impl):
    """`CorpusMatch.agreement`: the share of the occurrences read that continue with the proposal's first token;
    the policy's prior trusts an agreed copy more than a long match, and a disputed one less."""
    def corpus(after: list[int]):  # one answer [2, 3, t] per t
        return Corpus.from_answers([[2, 3, t] for t in after])
    got = {name: corpus(after).match([9, 2, 3], 1, 2) for name, after in
           (("one", [4]), ("hi", [4] * 10), ("mid", [4] * 6 + [5] * 4), ("lo", [4] * 2 + [5] + [6] + [7]))}
    assert {name: (m.agreement, m.tokens, m.support, m.occurrences) for name, m in got.items()} == {
        "one": ("one", [4], 1, 1), "hi": ("hi", [4], 10, 10), "mid": ("mid", [4], 6, 10), "lo": ("lo", [4], 2, 5)}
    big = corpus([4] * 100 + [5] * 11)  # more occurrences than are read: the share of the SAMPLED read
    m = big.match([9, 2, 3], 1, 2)
    assert m.occurrences == 64 and m.tokens == [4] and m.agreement == "hi"
    rates = {k: lookup_prior(k) for k in ("corpus-2-lo", "corpus-2-mid", "corpus-2-hi", "corpus-8-hi", "corpus-8-one")}
    assert rates["corpus-2-lo"] < rates["corpus-2-mid"] < rates["corpus-2-hi"] < rates["corpus-8-hi"] <= 0.9
    assert rates["corpus-8-one"] < rates["corpus-8-hi"]


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_greedy_stays_exact_and_the_corpus_is_accepted(arch, policy, tmp_path):
    """The corpus holds this target's answers to these prompts (as if it had answered them before): its copies are
    accepted and the output is still AR's, in a batch and alone; a corpus of noise changes nothing either. The
    corpus also travels with a drafter directory (`corpus.npz`)."""
    t = make_target(arch)
    dr = make_drafter(t, block_size=4)
    ar, ref = reference_runs(DFlashEngine(t, dr, eos_token_ids=[]), PROMPTS, 30)
    config = DecodeConfig(lookup=LookupParams(max_tokens=6, corpus_n=2), policy=policy)
    dr_dir = tmp_path / "drafter"
    save_drafter(dr, dr_dir)
    Corpus.from_answers([g.tokens for g in ar]).save(dr_dir / CORPUS)
    loaded = load_drafter(dr_dir, dtype=next(dr.parameters()).dtype)
    rng = np.random.default_rng(0)
    noise = Corpus.from_answers([rng.integers(0, t.vocab_size, 40) for _ in range(20)])
    taus = {}
    for name, eng in (("own", DFlashEngine(t, loaded, eos_token_ids=[], config=config)),
                      ("noise", DFlashEngine(t, dr, eos_token_ids=[], config=config, corpus=noise)),
                      ("off", DFlashEngine(t, dr, eos_token_ids=[], config=config.replace(
                          lookup=LookupParams(max_tokens=6))))):
        batch = eng.generate(PROMPTS, max_new_tokens=30)
        assert [g.tokens for g in batch] == [g.tokens for g in ar], name
        assert eng.generate(PROMPTS[1:2], max_new_tokens=30)[0].tokens == ar[1].tokens, name
        taus[name] = sum(g.stats.tau for g in batch) / len(batch)
    assert taus["own"] > taus["off"] + (0.5 if policy == "fixed" else 0.1), taus  # adaptive: pays for less


def test_seeded_sampling_with_the_corpus_returns_seeded_plain_decodings_tokens():
    """The corpus proposes fixed tokens like any lookup: a seeded row still commits exactly the tokens plain
    decoding with the same seed commits (the distribution test is in test_sampling)."""
    t = make_target("llama")
    dr = make_drafter(t, block_size=4)
    params = SamplingParams(temperature=0.8, seed=11)
    plain = DFlashEngine(t, dr, eos_token_ids=[])
    ar = plain.generate(PROMPTS, sampling=params, max_new_tokens=30, config=DecodeConfig.autoregressive())
    eng = DFlashEngine(t, dr, eos_token_ids=[], corpus=Corpus.from_answers([g.tokens for g in ar]),
                       config=DecodeConfig(lookup=LookupParams(max_tokens=6, corpus_n=2)))
    out = eng.generate(PROMPTS, sampling=params, max_new_tokens=30)
    assert [g.tokens for g in out] == [g.tokens for g in ar]
    assert max(a for g in out for a in g.stats.accepted) >= 3


def test_the_engine_builds_the_index_at_start_only_when_its_config_asks_the_corpus():
    t = make_target("llama")
    dr = make_drafter(t, block_size=4)
    on, off = Corpus.from_answers([[1, 2, 3, 4]]), Corpus.from_answers([[1, 2, 3, 4]])
    DFlashEngine(t, dr, corpus=on, config=DecodeConfig(lookup=LookupParams(max_tokens=4, corpus_n=2)))
    DFlashEngine(t, dr, corpus=off, config=DecodeConfig(lookup=LookupParams(max_tokens=4)))
    assert on.order is not None and off.order is None  # `off` still indexes itself on a first match
    assert off.match([9, 2, 3], 2, 2).tokens == [4]


def test_the_script_writes_a_drafters_corpus_from_data_shards(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from dflashkit.data import TokenShard

    data, drafter = tmp_path / "data", tmp_path / "drafter"
    data.mkdir()
    drafter.mkdir()
    # two examples: prompt [7, 7] then answer [1, 2, 3, 5]; prompt [8] then answer [2, 3, 5, 6]
    TokenShard.from_examples([([7, 7, 1, 2, 3, 5], 2, "a"), ([8, 2, 3, 5, 6], 1, "b")]).save(data / "train-00000.npz")
    script = Path(__file__).resolve().parents[1] / "scripts" / "lookup_corpus.py"
    out = subprocess.run([sys.executable, str(script), str(data), str(drafter)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    corpus = Corpus.load(drafter / CORPUS)
    assert [a.tolist() for a in corpus.answers()] == [[1, 2, 3, 5], [2, 3, 5, 6]]  # the answers, prompts left out
    assert corpus.match([4, 2, 3], 4, 2) == CorpusMatch([5], 2, 2, 2)  # then an answer's end ties with 6: it stops
