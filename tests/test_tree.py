"""Draft trees (DFlash chain + n-gram lookup branch): tree bookkeeping, lookup proposals, and lossless decoding."""

import math
import random

import numpy as np
import pytest
import torch

from conftest import make_drafter, make_target, skip_random_drafts_on_lean
from dflashkit import DecodeConfig, DFlashEngine, DFlashError
from dflashkit.lookup import LookupParams, SuffixIndex, propose
from dflashkit.tree import (DraftNodes, accept, accepted, ancestors, build, chain_nodes, prune, source_counts, topk_tree,
                            verify_inputs)
from test_engine import PROMPTS, check_caches_while_decoding, reference_runs, with_oracle


def t(rows):
    return torch.tensor(rows, dtype=torch.long)


def tree_impl(impl: str, monkeypatch) -> None:
    """The tree's steps as torch ops ("torch") or in one C++ call each ("cpp": topk_tree's beam in
    kernels/drafttree.cpp; build, verify_inputs and accepted in kernels/verifytree.cpp): both are tested."""
    from dflashkit import kernels

    if impl == "torch":
        monkeypatch.setattr(kernels, "beam_tree", lambda *a: None)
        monkeypatch.setattr(kernels, "on_cpu", lambda *a: None)
    elif not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.why_unavailable()}")


IMPLS = pytest.mark.parametrize("impl", ["torch", "cpp"])


def walk(tree, choices):
    """(a, path) as the engine gets them (`accepted`: C++ or torch, per `tree_impl`)."""
    got = accepted(tree, choices, tree.max_depth + 1)
    assert got.nodes == got.path.tolist() and got.tokens == choices.gather(1, got.path).tolist()
    return torch.tensor(got.depth), got.path


@IMPLS
def test_build_merges_a_shared_prefix_and_kills_duplicates(impl, monkeypatch):
    tree_impl(impl, monkeypatch)
    # row 0: branch parts from the chain after 2 shared tokens; row 1: no shared prefix; row 2: branch of 1 token
    chain = t([[10, 11, 12], [10, 11, 12], [10, 11, 12]])
    branch = [[10, 11, 20, 21], [30, 31, 32, 33], [40]]
    tree = build(t([1, 1, 1]), chain_nodes(chain), branch)
    assert tree.width == 8 and tree.max_depth == 4
    assert tree.parent.tolist()[0] == [0, 0, 1, 2, 3, 4, 2, 6]  # l3 hangs off chain node 2, l4 off l3
    assert tree.alive.tolist()[0] == [True] * 4 + [False, False, True, True]
    assert tree.parent.tolist()[1] == [0, 0, 1, 2, 0, 4, 5, 6]
    assert tree.alive.tolist()[2] == [True] * 4 + [True, False, False, False]
    assert tree.depth.tolist()[0] == [0, 1, 2, 3, 1, 2, 3, 4]
    anc = ancestors(tree)[0]
    assert anc[7].nonzero()[:, 0].tolist() == [0, 1, 2, 6, 7]  # l4: anchor, d1, d2, l3, itself
    assert anc[3].nonzero()[:, 0].tolist() == [0, 1, 2, 3]


@IMPLS
def test_accept_follows_the_target_choices_down_either_branch(impl, monkeypatch):
    tree_impl(impl, monkeypatch)
    chain = t([[10, 11, 12], [10, 11, 12], [10, 11, 12]])
    branch = [[10, 11, 20, 21], [30, 31, 32, 33], [30, 31, 32, 33]]
    tree = build(t([1, 1, 1]), chain_nodes(chain), branch)
    # choices[i] = the target's token after node i; 99 = disagrees with everything
    choices = t([
        [10, 11, 20, 99, 99, 99, 21, 7],   # d1, d2 (shared), then the branch: l3, l4, bonus 7
        [30, 99, 99, 99, 31, 32, 5, 99],   # the branch from the root: l1..l3, bonus 5
        [10, 11, 12, 8, 99, 99, 99, 99],   # the whole chain, bonus 8
    ])
    a, path = walk(tree, choices)
    assert a.tolist() == [4, 3, 3]
    assert path.tolist()[0] == [0, 1, 2, 6, 7]
    assert path.tolist()[1] == [0, 4, 5, 6, 6]
    committed = choices.gather(1, path)
    assert committed[0].tolist() == [10, 11, 20, 21, 7]
    assert committed[1, :4].tolist() == [30, 31, 32, 5]
    assert committed[2, :4].tolist() == [10, 11, 12, 8]


@IMPLS
def test_dead_nodes_are_never_accepted(impl, monkeypatch):
    tree_impl(impl, monkeypatch)
    # the branch duplicates the chain entirely, and row 1's branch is padding only
    tree = build(t([1, 1]), chain_nodes(t([[10, 11], [10, 11]])), [[10, 11], []])
    choices = t([[10, 11, 6, 10, 11], [0, 99, 99, 0, 0]])
    a, path = walk(tree, choices)
    assert a.tolist() == [2, 0]
    assert path.tolist()[0] == [0, 1, 2]


@IMPLS
def test_verify_inputs_show_committed_slots_and_ancestors_only(impl, monkeypatch):
    tree_impl(impl, monkeypatch)
    tree = build(t([1]), chain_nodes(t([[10, 11]])), [[20, 21]])
    where = verify_inputs(tree, t([3]), kv_len=9)
    assert where.positions.tolist() == [[3, 4, 5, 4, 5]] and where.slots.tolist() == [[3, 4, 5, 6, 7]]
    m = where.visible[0, 0].int()
    # slots 0-2 committed; tree nodes at slots 3.. (anchor, d1, d2, l1, l2); slot 8 is stale
    assert m.tolist() == [[1, 1, 1, 1, 0, 0, 0, 0, 0],
                          [1, 1, 1, 1, 1, 0, 0, 0, 0],
                          [1, 1, 1, 1, 1, 1, 0, 0, 0],
                          [1, 1, 1, 1, 0, 0, 1, 0, 0],
                          [1, 1, 1, 1, 0, 0, 1, 1, 0]]


def test_lookup_proposes_what_followed_the_longest_recent_match():
    p = LookupParams(max_tokens=3, max_n=3)
    assert propose([5, 6, 7, 8, 9, 1, 6, 7], p) == ([8, 9, 1], 2)  # suffix [6, 7] seen before
    assert propose([1, 2, 3, 1, 2, 4, 2], p) == ([4, 2], 1)  # the most recent match of [2] wins
    assert propose([1, 2, 3, 1, 2, 3, 9, 1, 2, 3], p) == ([9, 1, 2], 3)  # longest suffix first
    assert propose([1, 2, 3], p) == ([], 0)
    assert propose([4], p) == ([], 0)
    assert propose([1, 2, 3, 1, 2, 3], LookupParams(max_tokens=3, max_n=3, min_n=3)) == ([1, 2, 3], 3)


def test_lookup_agrees_with_the_definition_on_random_sequences():
    """The vectorised search against its definition, written plainly: for n from the longest down, the most recent
    earlier occurrence of the last n tokens; small vocabularies make many candidate ends and ties."""
    def plain(ids, p):
        for n in range(min(p.max_n, len(ids) - 1), p.min_n - 1, -1):
            for e in range(len(ids) - 2, n - 2, -1):
                if ids[e - n + 1:e + 1] == ids[len(ids) - n:]:
                    k = min(p.max_tokens, p.tokens_per_n * n) if p.tokens_per_n else p.max_tokens
                    return ids[e + 1:e + 1 + k], n
        return [], 0

    rng = random.Random(0)
    for _ in range(3000):
        ids = [rng.randrange(rng.randint(2, 9)) for _ in range(rng.randint(1, 40))]
        max_n = rng.randint(1, 5)
        p = LookupParams(max_tokens=rng.randint(1, 6), max_n=max_n, min_n=rng.randint(1, max_n),
                         tokens_per_n=rng.randint(0, 2))
        assert propose(ids, p) == plain(ids, p), (ids, p)
        # The per-sequence index, fed the same sequence as it grows by steps of 1-4 tokens, answers the same.
        index, grown = SuffixIndex(max_n), 1
        while grown <= len(ids):
            assert index.propose(np.asarray(ids[:grown]), p) == plain(ids[:grown], p), (ids[:grown], p)
            grown += rng.randint(1, 4)


def test_a_sequence_history_follows_its_commits():
    from dflashkit.batch import SeqState
    from dflashkit.stats import GenerationStats

    s = SeqState(0, list(range(5)), 200, GenerationStats(span=1))
    assert s.history().tolist() == list(range(5))
    for k in range(1, 60):  # grows past the buffer's first capacity
        s.generated.extend(range(100 + k, 100 + 2 * k))
        assert s.history().tolist() == s.prompt + s.generated
    index = s.suffixes(4)
    assert s.suffixes(4) is index
    del s.generated[3:]  # a stop string cut the tail
    assert s.history().tolist() == s.prompt + s.generated
    assert s.suffixes(4) is not index  # its n-grams ended at positions that no longer hold them


def test_bad_lookup_settings_raise_clear_errors():
    for kw in ({"max_tokens": -1}, {"max_tokens": 4, "min_n": 0}, {"max_tokens": 4, "min_n": 3, "max_n": 2},
               {"max_tokens": 4, "skip_drafter_n": -1}):
        with pytest.raises(DFlashError):
            LookupParams(**kw)


def with_lookup_oracle(eng, reference, keep=0.7, seed=0):
    """Lookup proposals: often the true continuation (so the branch wins), sometimes random; the real
    `propose` still runs so that its n (the skip rule) is real."""
    rng = random.Random(seed)

    class Oracle(eng.lookup_factory):
        def suggest(self, tokens, index=None):
            params = self.params
            prop, n = propose(tokens, params)
            for idx, full in reference.items():
                if full[: len(tokens)] == list(tokens):
                    tail = full[len(tokens): len(tokens) + params.max_tokens]
                    break
            else:
                return prop, n
            out = []
            for x in tail:
                out.append(x if rng.random() < keep else rng.randrange(4, 90))
            return out, max(n, 1)

    eng.set_proposers(lookup=Oracle)


@pytest.mark.parametrize("block_size,lookup,skip", [(1, 5, 0), (4, 6, 0), (8, 3, 0), (4, 6, 2)])
@pytest.mark.parametrize("oracle", [False, True])
def test_greedy_lossless_with_a_lookup_branch(arch, block_size, lookup, skip, oracle, monkeypatch, backend):
    skip_random_drafts_on_lean(backend, oracle)
    t_ = make_target(arch, backend=backend)
    dr = make_drafter(t_, block_size=max(block_size, 2))
    plain = DFlashEngine(t_, dr, eos_token_ids=[], config=DecodeConfig())
    ar, ref = reference_runs(plain, PROMPTS, 40)
    eng = DFlashEngine(t_, dr, eos_token_ids=[],
                       config=DecodeConfig(lookup=LookupParams(max_tokens=lookup, skip_drafter_n=skip)))
    if oracle:
        with_lookup_oracle(eng, ref)
        if block_size > 1:
            with_oracle(eng, ref, keep=0.5, seed=1)
    batch = eng.generate(PROMPTS, max_new_tokens=40, block_size=block_size)
    assert [g.tokens for g in batch] == [g.tokens for g in ar]
    single = eng.generate(PROMPTS[2:3], max_new_tokens=40, block_size=block_size)
    assert single[0].tokens == ar[2].tokens
    if oracle:
        assert max(max(g.stats.accepted) for g in batch) >= min(lookup, 3)
        assert sum(g.stats.tau for g in batch) / len(batch) > 1.5


def test_tree_steps_keep_both_caches_exact(arch, monkeypatch, backend):
    """After every tree step the target K/V of slots [0, start) equal a fresh forward of the committed tokens
    (an accepted branch was moved to slot == position), and at every draft call so do the drafter's."""
    t_ = make_target(arch, backend=backend)
    dr = make_drafter(t_, block_size=4)
    eng = DFlashEngine(t_, dr, eos_token_ids=[], config=DecodeConfig(lookup=LookupParams(max_tokens=5)))
    ar, ref = reference_runs(eng, PROMPTS, 24)
    with_lookup_oracle(eng, ref, keep=0.8)
    with_oracle(eng, ref, keep=0.4, seed=2)
    checked, steps = check_caches_while_decoding(eng, t_, dr, PROMPTS, 24)
    # steps that committed more than the chain (3 drafts + bonus) can give: an accepted branch was moved
    long_steps = sum(len(o.tokens) > 4 for out in steps for o in out)
    assert checked["draft"] > 10 and checked["target"] > 10 and long_steps > 0


# ---- drafter trees: the n most likely paths through the drafter's top-k per slot ---------------------------
def brute_force_best_paths(tokens, logp, n, min_logp=-math.inf):
    """All rank paths of every depth, scored by summed log-probs; of the n best (ties to the shallower), those
    scoring at least min_logp, as token tuples."""
    D, K = tokens.shape
    paths, frontier = [], [((), 0.0)]
    for j in range(D):
        frontier = [(p + (r,), s + float(logp[j, r])) for p, s in frontier for r in range(K)]
        paths += frontier
    paths.sort(key=lambda x: (-x[1], len(x[0])))
    return {tuple(int(tokens[j, r]) for j, r in enumerate(p)) for p, s in paths[:n] if s >= min_logp}


def node_paths(nodes, r, count):
    """Row r's first `count` drafter nodes as token tuples, each rebuilt through its parents (node 0 = the anchor);
    asserts that parents come before children, are alive, and that depths match the paths."""
    paths = set()
    for i in range(count):
        path, node = [], i + 1
        while node:
            assert nodes.parent[r, node - 1] < node
            assert nodes.alive is None or nodes.alive[r, node - 1]
            path.append(int(nodes.tokens[r, node - 1]))
            node = int(nodes.parent[r, node - 1])
        assert len(path) == nodes.depth[r, i]
        paths.add(tuple(reversed(path)))
    return paths




@pytest.mark.parametrize("impl", ["torch", "cpp"])
@pytest.mark.parametrize("seed", range(5))
def test_topk_tree_is_the_n_most_likely_paths(seed, impl, monkeypatch):
    tree_impl(impl, monkeypatch)
    g = torch.Generator().manual_seed(seed)
    b, D, K = 3, 4, 5
    logp, idx = torch.randn(b, D, 40, generator=g).mul(2).log_softmax(-1).topk(K, dim=-1)
    tokens = idx + 100
    for n in (1, 3, K):
        nodes = topk_tree(tokens, logp, n)
        tok, par, dep = nodes.tokens, nodes.parent, nodes.depth
        assert tok.shape == (b, n) and int(dep.max()) <= nodes.max_depth
        for r in range(b):
            assert node_paths(nodes, r, n) == brute_force_best_paths(tokens[r], logp[r], n)
            kids = {}
            for i in range(n):
                kids.setdefault(int(par[r, i]), []).append(int(tok[r, i]))
            assert all(len(v) == len(set(v)) for v in kids.values())  # siblings are distinct


@pytest.mark.parametrize("impl", ["torch", "cpp"])
@pytest.mark.parametrize("seed", range(3))
def test_a_pruned_tree_keeps_the_likely_paths_and_pads_the_rest(seed, impl, monkeypatch):
    tree_impl(impl, monkeypatch)
    g = torch.Generator().manual_seed(seed)
    b, D, K, n, p_min = 4, 4, 5, 5, 0.05
    logp, idx = torch.randn(b, D, 40, generator=g).mul(3).log_softmax(-1).topk(K, dim=-1)
    nodes = topk_tree(idx + 100, logp, n, min_prob=p_min)
    kept = nodes.alive.sum(1)
    assert nodes.tokens.shape[1] == int(kept.max()) <= n
    for r in range(b):
        assert nodes.alive[r, : int(kept[r])].all()  # kept nodes first, then padding
        # the n best paths, then those of probability >= p_min
        assert node_paths(nodes, r, int(kept[r])) == brute_force_best_paths(idx[r] + 100, logp[r], n, math.log(p_min))


@IMPLS
def test_a_lookup_branch_never_hangs_off_a_dead_node(impl, monkeypatch):
    tree_impl(impl, monkeypatch)
    # node 2 is padding (dead) but carries the branch's first token: the branch must start at the anchor
    draft = DraftNodes(t([[10, 11]]), t([[0, 0]]), t([[1, 1]]), 1, alive=torch.tensor([[True, False]]))
    tree = build(t([1]), draft, [[11, 12]])
    assert tree.parent.tolist()[0] == [0, 0, 0, 0, 3] and tree.alive.tolist()[0] == [True, True, False, True, True]
    a, path = walk(tree, t([[11, 99, 99, 12, 5]]))
    assert a.tolist() == [2] and path.tolist()[0] == [0, 3, 4]


@IMPLS
def test_a_lookup_branch_merges_into_a_drafter_tree_path(impl, monkeypatch):
    tree_impl(impl, monkeypatch)
    # drafter nodes: 1:[10] 2:[11] (siblings at depth 1), 3:[12] under 1, 4:[13] under 3, 5:[14] under 2
    draft = DraftNodes(t([[10, 11, 12, 13, 14]]), t([[0, 0, 1, 3, 2]]), t([[1, 1, 2, 3, 2]]), 3)
    tree = build(t([1]), draft, [[11, 14, 20]])  # l1, l2 = path 2 -> 5; l3 parts from it
    assert tree.parent.tolist()[0] == [0, 0, 0, 1, 3, 2, 5, 6, 5]
    assert tree.alive.tolist()[0] == [True] * 6 + [False, False, True]
    assert tree.depth.tolist()[0] == [0, 1, 1, 2, 3, 2, 1, 2, 3]
    choices = t([[11, 99, 14, 99, 99, 20, 99, 99, 7]])  # down node 2, node 5, then the branch's l3, bonus 7
    a, path = walk(tree, choices)
    assert a.tolist() == [3] and path.tolist()[0] == [0, 2, 5, 8]  # max depth 3: no repeats


def random_tree_inputs(g: random.Random, b: int):
    """A drafter's nodes (a chain, a top-k tree with or without a floor, or none), a lookup branch that often
    repeats a drafted path, and target choices that often agree with the nodes: every case of build and accept."""
    D, K = g.randint(1, 5), g.randint(1, 4)
    gen = torch.Generator().manual_seed(g.randint(0, 10**6))
    logp, idx = torch.randn(b, D, 6, generator=gen).mul(2).log_softmax(-1).topk(K, dim=-1)
    kind = g.choice(["none", "chain", "tree", "floor"])
    draft = {"none": None, "chain": chain_nodes(idx[:, :, 0] + 10, logp[:, :, 0]),
             "tree": topk_tree(idx + 10, logp, g.randint(1, D * K)),
             "floor": topk_tree(idx + 10, logp, g.randint(1, D * K), min_prob=0.1)}[kind]
    k = g.randint(0, 5)  # with no drafter and no branch: the plain step's anchor alone
    branch = torch.randint(10, 16, (b, k), generator=gen)
    if draft is not None and k:  # a branch that spells a drafted path for a while
        spell = min(k, draft.tokens.shape[1])
        branch[:, :spell] = torch.where(torch.rand(b, spell, generator=gen) < 0.7, draft.tokens[:, :spell],
                                        branch[:, :spell])
    length = torch.randint(0, k + 1, (b,), generator=gen).tolist()
    lists = None if k == 0 and g.random() < 0.5 else [row[:n] for row, n in zip(branch.tolist(), length)]
    return t([1] * b), draft, lists


@pytest.mark.parametrize("seed", range(40))
def test_the_cpp_tree_steps_equal_the_torch_ones(seed, monkeypatch):
    """build, prune + accepted, verify_inputs and the source counts in kernels/verifytree.cpp give tree.py's torch
    results exactly on random trees (every field, every row)."""
    from dflashkit import kernels

    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.why_unavailable()}")
    g = random.Random(seed)
    b = g.randint(1, 4)
    anchor, draft, branch = random_tree_inputs(g, b)
    fast = build(anchor, draft, branch)
    assert kernels.on_cpu(anchor) is not None
    with monkeypatch.context() as m:
        m.setattr(kernels, "on_cpu", lambda *a: None)
        slow = build(anchor, draft, branch)
    for f in ("tokens", "parent", "depth", "alive", "source", "logp"):
        x, y = getattr(fast, f), getattr(slow, f)
        assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y)), f
    assert fast.max_depth == slow.max_depth
    tree = fast
    if g.random() < 0.4 and tree.width > 1:  # a pruned tree: padding nodes, new indices
        keep = torch.rand(b, tree.width, generator=torch.Generator().manual_seed(seed)) < 0.6
        keep[:, 0] = True
        for _ in range(tree.max_depth):  # prefix-closed, as the policy's cuts are
            keep &= keep.gather(1, tree.parent)
        width = int(keep.sum(1).max())
        tree = prune(tree, keep, width, int(tree.depth[keep].max()))
    # choices: mostly each node's child token where there is one, so that paths are accepted to various depths
    choices = torch.randint(10, 16, (b, tree.width), generator=torch.Generator().manual_seed(seed + 1))
    for r in range(b):
        for i in range(1, tree.width):
            if g.random() < 0.7:
                choices[r, int(tree.parent[r, i])] = tree.tokens[r, i]
    start = torch.randint(0, 5, (b,), generator=torch.Generator().manual_seed(seed + 2))
    kv_len = int(start.max()) + tree.width + g.randint(0, 2)
    span = tree.max_depth + 1 + g.randint(0, 2)  # the batch's span may exceed this tree's depth: padded paths
    got, where = accepted(tree, choices, span), verify_inputs(tree, start, kv_len)
    a, path = accept(tree, choices)
    assert got.depth == a.tolist() and torch.equal(got.path[:, :path.shape[1]], path)
    assert got.counts == source_counts(tree, a, path).tolist()
    with monkeypatch.context() as m:
        m.setattr(kernels, "on_cpu", lambda *a: None)
        slow_where = verify_inputs(tree, start, kv_len)
        for f in ("positions", "slots", "visible"):
            assert torch.equal(getattr(where, f), getattr(slow_where, f)), f
        slow = accepted(tree, choices, span)
    for f in ("tokens", "depth", "nodes", "counts"):
        assert getattr(got, f) == getattr(slow, f), f
    assert torch.equal(got.path, slow.path) and got.nodes == got.path.tolist()


def test_the_cpp_feature_write_equals_the_torch_one(monkeypatch):
    """DraftState.append_path in one C++ call (kernels/rowcopy.cpp) writes what the gather + index_put writes."""
    from dflashkit import kernels
    from dflashkit.proposers import DraftState, feature_store

    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.why_unavailable()}")
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(3, 6, 40, generator=g).bfloat16()
    nodes = [[0, 2, 5, 5], [0, 1, 1, 1], [0, 3, 4, 2]]
    positions = [[7, 8, 9, 9], [3, 4, 4, 4], [0, 1, 2, 3]]
    stores = []
    for on in (True, False):
        with monkeypatch.context() as m:
            if not on:
                m.setattr(kernels, "on_cpu", lambda *a: None)
            state = DraftState(None, feature_store(3, 12, 40, torch.bfloat16, "cpu"), [0, 0, 0])
            state.append_path(feats, nodes, positions)
            stores.append(state.feats.keys[0].clone())
    assert torch.equal(stores[0], stores[1]) and torch.equal(stores[0][0, 0, 8], feats[0, 2])
    assert stores[0][1, 0, 5:].abs().sum() == 0  # nothing written past a row's positions


@pytest.mark.parametrize("block_size,n,lookup,p_min", [(4, 6, 0, 0), (8, 5, 4, 0), (16, 12, 0, 0), (4, 3, 5, 0),
                                                      (8, 10, 4, 0.02)])
@pytest.mark.parametrize("oracle", [False, True])
def test_greedy_lossless_with_a_drafter_tree(arch, block_size, n, lookup, p_min, oracle, monkeypatch, backend):
    skip_random_drafts_on_lean(backend, oracle)
    t_ = make_target(arch, backend=backend)
    dr = make_drafter(t_, block_size=block_size)
    plain = DFlashEngine(t_, dr, eos_token_ids=[], config=DecodeConfig())
    ar, ref = reference_runs(plain, PROMPTS, 40)
    eng = DFlashEngine(t_, dr, eos_token_ids=[],
                       config=DecodeConfig(lookup=LookupParams(max_tokens=lookup), tree=n, tree_min_prob=p_min))
    if oracle:
        with_oracle(eng, ref, keep=0.8, seed=3)
        if lookup:
            with_lookup_oracle(eng, ref, keep=0.5)
    batch = eng.generate(PROMPTS, max_new_tokens=40)
    assert [g.tokens for g in batch] == [g.tokens for g in ar]
    assert eng.generate(PROMPTS[1:2], max_new_tokens=40)[0].tokens == ar[1].tokens
    # the per-call override on an engine built without a tree
    assert plain.generate(PROMPTS[1:2], max_new_tokens=40, tree=n)[0].tokens == ar[1].tokens
    if oracle:  # truths off the argmax were found: more than the chain of argmaxes could commit
        assert sum(g.stats.tau for g in batch) / len(batch) > 1.8


def test_drafter_tree_steps_keep_both_caches_exact(arch, backend):
    t_ = make_target(arch, backend=backend)
    dr = make_drafter(t_, block_size=8)
    eng = DFlashEngine(t_, dr, eos_token_ids=[], config=DecodeConfig(tree=8))
    ar, ref = reference_runs(eng, PROMPTS, 24)
    with_oracle(eng, ref, keep=0.8, seed=4)
    checked, steps = check_caches_while_decoding(eng, t_, dr, PROMPTS, 24)
    assert checked["draft"] > 10 and checked["target"] > 10


def test_bad_tree_size_raises_a_clear_error():
    t_ = make_target("llama")
    for bad in (-1, 2.5, True):
        with pytest.raises(DFlashError, match="tree size"):
            DFlashEngine(t_, make_drafter(t_), config=DecodeConfig(tree=bad))
    for bad in (-0.1, 1.0):
        with pytest.raises(DFlashError, match="tree_min_prob"):
            DFlashEngine(t_, make_drafter(t_), config=DecodeConfig(tree=4, tree_min_prob=bad))


def test_draft_vocab_drafts_over_the_most_frequent_ids_and_stays_exact(tmp_path):
    from dflashkit.checkpoint import load_drafter, save_drafter, save_token_ranking

    t_ = make_target("llama")
    d = save_drafter(make_drafter(t_, block_size=4), tmp_path / "d")
    ranking = list(range(t_.vocab_size - 1, -1, -1))  # pretend the highest ids are the most frequent
    save_token_ranking(d, ranking, "test")
    dr = load_drafter(d, dtype=torch.float64)
    assert dr.token_ranking == ranking
    ar = DFlashEngine(t_, dr, eos_token_ids=[], config=DecodeConfig()).generate(PROMPTS, max_new_tokens=24, block_size=1)
    for tree in (0, 5):
        eng = DFlashEngine(t_, dr, eos_token_ids=[], config=DecodeConfig(tree=tree, draft_vocab=20))
        assert eng.drafter_proposer(eng.config).d2t.tolist() == sorted(ranking[:20])
        seen = []

        class Spy(eng.drafter_factory):
            def draft(self, *a, **kw):
                toks, logp = super().draft(*a, **kw)
                seen.append(toks)
                return toks, logp
        eng.set_proposers(drafter=Spy)
        assert [g.tokens for g in eng.generate(PROMPTS, max_new_tokens=24)] == [g.tokens for g in ar]
        assert seen and all(int(x.min()) >= t_.vocab_size - 20 for x in seen)  # proposals come from the 20 ids only


def test_draft_vocab_errors_name_the_remedy(tmp_path):
    from dflashkit.checkpoint import RANKING, load_drafter, save_drafter

    t_ = make_target("llama")
    with pytest.raises(DFlashError, match="token_ranking.json"):
        DFlashEngine(t_, make_drafter(t_), config=DecodeConfig(draft_vocab=8))  # no ranking
    with pytest.raises(DFlashError, match="own reduced draft vocabulary"):
        dr = make_drafter(t_, draft_vocab_size=16)
        dr.token_ranking = list(range(30))
        DFlashEngine(t_, dr, config=DecodeConfig(draft_vocab=8))
    dr = make_drafter(t_)
    dr.token_ranking = list(range(30))
    with pytest.raises(DFlashError, match="exceeds"):
        DFlashEngine(t_, dr, config=DecodeConfig(draft_vocab=31))
    with pytest.raises(DFlashError, match="draft_vocab must be"):
        DFlashEngine(t_, dr, config=DecodeConfig(draft_vocab=-2))
    d = save_drafter(make_drafter(t_), tmp_path / "d")
    (d / RANKING).write_text("{not json")
    with pytest.raises(DFlashError, match="corrupt"):
        load_drafter(d)
