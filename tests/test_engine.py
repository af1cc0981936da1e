"""Lossless greedy decoding: speculative output == autoregressive output, token for token (float64)."""

import random

import pytest
import torch

from conftest import make_drafter, make_target, skip_random_drafts_on_lean
from dflashkit import DecodeConfig, DFlashEngine, DFlashError
from dflashkit.cache import PositionCache

PLAIN = DecodeConfig()  # the plain DFlash block: the drafter's argmax chain, no lookup

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14] * 10, [4, 40, 41, 42, 43, 44, 45]]


def with_oracle(engine, reference, keep=0.75, seed=0):
    """Replace half-random drafts by the true continuation (prob `keep` per slot) so that blocks are
    partly accepted; the real drafter still runs (and writes its cache) underneath. The draws are seeded per
    (sequence, position), so they do not depend on the order of the batch's rows."""

    class Oracle(engine.drafter_factory):
        def draft(self, state, view, k=1, probs=False, block=None):
            d, logp = super().draft(state, view, k, probs, block)
            for r, (s, st) in enumerate(zip(view.seqs, view.start.tolist())):
                full = reference[s.index]
                rng = random.Random(f"{seed}-{s.index}-{st}")
                for j in range(1, d.shape[1] + 1):
                    if st + j < len(full) and rng.random() < keep:
                        # the truth at rank 0 (k = 1) or at one of the top 3 ranks (a tree must find it off the argmax)
                        put_at_rank(d[r, j - 1], full[st + j], rng.randrange(min(k, 3)))
            return d, logp

    engine.set_proposers(drafter=Oracle)
    return engine


def put_at_rank(row: torch.Tensor, tok: int, rank: int) -> None:
    """row: [k] distinct tokens, best first. Put `tok` at `rank`, keeping the others distinct and in order."""
    rest = [x for x in row.tolist() if x != tok]
    row.copy_(torch.tensor((rest[:rank] + [tok] + rest[rank:])[: row.numel()]))


def reference_runs(engine, prompts, n):
    ar = engine.generate(prompts, max_new_tokens=n, block_size=1)
    return ar, {i: list(p) + g.tokens for i, (p, g) in enumerate(zip(prompts, ar))}


def test_block_size_one_equals_transformers_generate(arch, backend):
    t = make_target(arch, backend=backend)
    eng = DFlashEngine(t, eos_token_ids=[], config=PLAIN)
    for p, g in zip(PROMPTS, eng.generate(PROMPTS, max_new_tokens=24)):
        ids = torch.tensor([p])
        hf = t.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert g.tokens == hf[0, len(p):].tolist()


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
@pytest.mark.parametrize("oracle", [False, True])
def test_greedy_lossless_batch_and_single(arch, block_size, oracle, backend):
    skip_random_drafts_on_lean(backend, oracle)
    t = make_target(arch, backend=backend)
    eng = DFlashEngine(t, make_drafter(t, block_size=block_size), eos_token_ids=[], config=PLAIN)
    ar, ref = reference_runs(eng, PROMPTS, 40)
    if oracle:
        with_oracle(eng, ref)
    batch = eng.generate(PROMPTS, max_new_tokens=40, block_size=block_size)
    assert [g.tokens for g in batch] == [g.tokens for g in ar]
    single = eng.generate(PROMPTS[2:3], max_new_tokens=40, block_size=block_size)
    assert single[0].tokens == ar[2].tokens
    if oracle and block_size > 2:
        assert max(max(g.stats.accepted) for g in batch) >= 2  # the acceptance path really ran
        assert sum(g.stats.tau for g in batch) / len(batch) > 1.5


@pytest.mark.parametrize("block_size", [4, 16])
def test_eos_and_max_new_tokens_inside_a_block(arch, block_size):
    t = make_target(arch)
    eng = DFlashEngine(t, make_drafter(t, block_size=block_size), eos_token_ids=[], config=PLAIN)
    ar, ref = reference_runs(eng, PROMPTS, 40)
    with_oracle(eng, ref, keep=1.0)  # perfect drafts: every stop falls inside a long accepted block
    # max_new_tokens not a multiple of anything: the stop lands mid-block
    for n in (1, 7, 23):
        out = eng.generate(PROMPTS, max_new_tokens=n, block_size=block_size)
        assert [g.tokens for g in out] == [g.tokens[:n] for g in ar]
        assert all(g.finish_reason == "length" for g in out)
    # EOS = the token the AR run emits at step 10 of prompt 0: cut right after its first occurrence
    eos = ar[0].tokens[10]
    eng.eos_token_ids = {eos}
    out = eng.generate(PROMPTS, max_new_tokens=40, block_size=block_size)
    for g, a in zip(out, ar):
        want = a.tokens[: a.tokens.index(eos) + 1] if eos in a.tokens else a.tokens
        assert g.tokens == want
        assert g.finish_reason == ("stop" if eos in a.tokens else "length")
    assert out[0].stats.accepted and max(out[0].stats.accepted) == block_size - 1


class CharTokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids)


def test_stop_string_inside_a_block():
    t = make_target("llama")
    eng = DFlashEngine(t, make_drafter(t, block_size=8), tokenizer=CharTokenizer(), eos_token_ids=[], config=PLAIN)
    ar, ref = reference_runs(eng, PROMPTS[:1], 40)
    with_oracle(eng, ref, keep=1.0)
    text = CharTokenizer().decode(ar[0].tokens)
    stop = text[13:16]
    first = text.index(stop)
    g = eng.generate(PROMPTS[:1], max_new_tokens=40, stop=[stop])[0]
    assert g.finish_reason == "stop"
    assert g.tokens == ar[0].tokens[: first + len(stop)]
    assert g.text == text[:first]


def test_caches_hold_exactly_the_committed_context(arch, backend):
    """After every step: target K/V slots [0, start) equal a fresh forward of the committed tokens, and
    at every draft call the draft cache slots [0, start) equal the drafter's K/V of fresh features."""
    t = make_target(arch, backend=backend)
    dr = make_drafter(t, block_size=4)
    eng = DFlashEngine(t, dr, eos_token_ids=[], config=PLAIN)
    ar, ref = reference_runs(eng, PROMPTS, 20)
    with_oracle(eng, ref, keep=0.7)

    checked, _ = check_caches_while_decoding(eng, t, dr, PROMPTS, 20)
    assert checked["draft"] > 10 and checked["target"] > 10


def check_caches_while_decoding(eng, t, dr, prompts, max_new):
    """Decode `prompts` with `eng` (whose drafter proposer may already be an oracle), checking after every step that target
    K/V slots [0, start) equal a fresh forward of the committed tokens, and at every draft call that draft cache
    slots [0, start) equal the drafter's K/V of fresh features. Returns (counts of checks, each step's outputs)."""
    def fresh(tokens):
        c = t.new_cache(1, len(tokens) + 1)
        pos = torch.arange(len(tokens))[None]
        _, feats = t.forward(torch.tensor([tokens]), pos, c)
        return c, dr.context_kv(dr.fuse(feats), pos)

    checked = {"draft": 0, "target": 0}

    class Checker(eng.drafter_factory):  # wraps the oracle, if any
        def draft(self, state, view, k=1, probs=False, block=None):
            d = super().draft(state, view, k, probs, block)
            dcache = state.cache
            for r, (s, st) in enumerate(zip(view.seqs, view.start.tolist())):
                committed = s.prompt + s.generated
                assert st == len(committed) - 1  # the anchor (last token) has no K/V yet
                _, kv = fresh(committed[:st])
                for layer, (k, v) in enumerate(kv):
                    torch.testing.assert_close(dcache.keys[layer][r, :, :st], k[0], rtol=1e-9, atol=1e-9)
                    torch.testing.assert_close(dcache.values[layer][r, :, :st], v[0], rtol=1e-9, atol=1e-9)
                checked["draft"] += 1
            return d

    eng.set_proposers(drafter=Checker)
    gen = eng.stream(prompts, max_new_tokens=max_new)
    steps = []
    for out in gen:
        steps.append(out)
        batch = stream_batch(gen)
        if batch is None:
            break
        tcache: PositionCache = batch.tcache
        for r, (s, st) in enumerate(zip(batch.seqs, batch.starts)):
            if s.finished:  # its row leaves the batch before the next step
                continue
            committed = s.prompt + s.generated
            assert st == len(committed) - 1
            c, _ = fresh(committed[:st])
            for layer in range(t.num_layers):
                torch.testing.assert_close(tcache.keys[layer][r, :, :st], c.keys[layer][0, :, :st], rtol=1e-9, atol=1e-9)
                torch.testing.assert_close(tcache.values[layer][r, :, :st], c.values[layer][0, :, :st], rtol=1e-9, atol=1e-9)
            checked["target"] += 1
    return checked, steps


def test_the_cache_store_keeps_each_rows_used_slots_through_joins_and_leaves():
    """PositionCache's row store: a select in any order (in place where it can be, gathered where a source was
    overwritten), joins of shorter prompt caches into free rows, and growth keep every row's slots 0..used-1."""
    torch.manual_seed(0)

    def filled(rows, max_len):
        c = PositionCache(2, rows, 2, max_len, 4, torch.float64, torch.device("cpu"), value_dim=5)
        for layer in c.keys + c.values:
            layer.normal_()
        return c

    def snapshot(c):  # per row: its (keys, values) of every layer
        return [([k[r].clone() for k in c.keys], [v[r].clone() for v in c.values]) for r in range(c.batch_size)]

    def check(c, want, used):  # used: one for all rows, or one per row
        assert c.batch_size == len(want)
        for r, (ks, vs) in enumerate(want):
            u = used[r] if isinstance(used, list) else used
            for layer, (k, v) in enumerate(zip(ks, vs)):
                assert torch.equal(c.keys[layer][r, :, :u], k[:, :u])
                assert torch.equal(c.values[layer][r, :, :u], v[:, :u])

    c = filled(5, 16)
    rows = snapshot(c)
    c.select(torch.tensor([0, 4, 2]), used=10)  # compaction: holes filled from the end, in place
    check(c, [rows[0], rows[4], rows[2]], 10)
    kept = snapshot(c)
    c.select(torch.tensor([1, 0, 2]), used=10)  # a swap: the second move's source was overwritten -> gathered
    check(c, [kept[1], kept[0], kept[2]], 10)
    kept = snapshot(c)
    new = filled(2, 7)  # two prompts' own caches (7 slots) join the free rows: no growth
    c.extend(new)
    assert c.capacity == 5
    check(c, kept + snapshot(new), 7)
    kept = snapshot(c)
    more = filled(3, 7)
    c.extend(more)  # full: the store grows, the rows already there keep every slot
    assert c.capacity >= 8 and c.keys[0].is_contiguous()
    check(c, kept + snapshot(more), [16] * 5 + [7] * 3)
    with pytest.raises(ValueError, match="cannot join"):
        c.extend(filled(1, 32))
    kept, cap = snapshot(c), c.capacity
    c.select(torch.tensor([0, 1]), used=16)
    c.grow(cap - 1)  # rows appended unwritten: the kept rows stay, the store grows, every slot finite
    assert c.batch_size == cap + 1 and c.capacity > cap
    for r, (ks, vs) in enumerate(kept[:2]):
        for i, (k, v) in enumerate(zip(ks, vs)):
            assert torch.equal(c.keys[i][r], k) and torch.equal(c.values[i][r], v)
    assert all(torch.isfinite(layer).all() for layer in c.keys + c.values)


def test_a_reserved_batch_store_takes_its_rows_without_growing():
    """A server's batch reserves --max-batch rows up front (`DecodeBatch.reserve`): rows joining later land in that
    store (no reallocation mid-load) and decode as they would alone."""
    t = make_target("llama", backend="lean")
    eng = DFlashEngine(t, make_drafter(t, block_size=4), eos_token_ids=[], config=PLAIN)
    alone = [eng.generate([p], max_new_tokens=10)[0].tokens for p in PROMPTS]
    batch = eng.new_batch(max_len=64)
    batch.reserve(len(PROMPTS))
    store = batch.tcache._kstore[0].data_ptr()
    got = {}

    def collect(outs):
        for o in outs:
            got.setdefault(o.index, []).extend(o.tokens)
    collect(batch.add([eng.sequence(i, p, max_new_tokens=10) for i, p in enumerate(PROMPTS[:2])]))
    collect(batch.step())
    collect(batch.add([eng.sequence(i, p, max_new_tokens=10) for i, p in enumerate(PROMPTS) if i >= 2]))
    while batch.alive:
        collect(batch.step())
    assert batch.tcache.capacity == len(PROMPTS) and batch.tcache._kstore[0].data_ptr() == store
    assert [got[i] for i in range(len(PROMPTS))] == alone


def test_prompts_are_prefilled_in_groups_of_similar_length():
    """A short prompt is not padded to a long one's length (prefill_groups), and the groups' rows decode exactly
    as each prompt alone (float64, the lean backend: row-invariant)."""
    from dflashkit.prefill import prefill_groups

    assert prefill_groups([240, 40, 230, 45, 5]) == [[0, 2], [3, 1], [4]]
    assert prefill_groups([10, 10, 10]) == [[0, 1, 2]]
    assert sorted(i for g in prefill_groups([7, 3, 90, 12, 12, 1]) for i in g) == list(range(6))
    t = make_target("llama", backend="lean")
    eng = DFlashEngine(t, make_drafter(t, block_size=4), eos_token_ids=[], config=PLAIN)
    prompts = [list(range(4, 64)), [5, 6], list(range(10, 66)), [7, 8, 9]]
    alone = [eng.generate([p], max_new_tokens=12)[0].tokens for p in prompts]
    assert [g.tokens for g in eng.generate(prompts, max_new_tokens=12)] == alone


def test_a_joining_prompt_stays_pending_until_the_drafter_runs(arch):
    """The drafter's state of joining rows is lazy: no cache and every prompt feature pending (a shorter prompt
    padded by repeating its last position) until the drafter first runs; rows joining a batch whose drafter already
    ran get their cache then. At every draft call the cache slots [0, start) equal the drafter's K/V of fresh
    features, for the first rows and the joining ones alike."""
    t = make_target(arch)
    dr = make_drafter(t, block_size=4)
    eng = DFlashEngine(t, dr, eos_token_ids=[], config=DecodeConfig(policy="fixed"))
    drafted = []

    class Checker(eng.drafter_factory):
        def draft(self, state, view, k=1, probs=False, block=None):
            for r, (s, st) in enumerate(zip(view.seqs, view.start.tolist())):
                committed = s.prompt + s.generated
                pos = torch.arange(st)[None]
                _, feats = t.forward(torch.tensor([committed[:st]]), pos, t.new_cache(1, st + 1), kv_len=st)
                for layer, (k_, v_) in enumerate(dr.context_kv(dr.fuse(feats), pos)):
                    torch.testing.assert_close(state.cache.keys[layer][r, :, :st], k_[0], rtol=1e-9, atol=1e-9)
                    torch.testing.assert_close(state.cache.values[layer][r, :, :st], v_[0], rtol=1e-9, atol=1e-9)
            drafted.append(len(view.seqs))
            return super().draft(state, view, k, probs, block)

    eng.set_proposers(drafter=Checker)
    batch = eng.new_batch(max_len=96)
    (a, b), L = PROMPTS[2:4], max(len(PROMPTS[2]), len(PROMPTS[3]))
    batch.add([eng.sequence(0, a, max_new_tokens=12), eng.sequence(1, b, max_new_tokens=12),
               eng.sequence(3, PROMPTS[1], max_new_tokens=2)])
    st = batch.dstate
    assert st.cache is None and st.lo == [0, 0, 0] and st.pending(max(batch.starts)) == 3 * L
    _, feats = t.forward(torch.tensor([b]), torch.arange(len(b))[None], t.new_cache(1, len(b)), kv_len=len(b))
    torch.testing.assert_close(st.feats.keys[0][1, 0, :len(b)], feats[0], rtol=1e-9, atol=1e-9)  # by position
    batch.step()
    assert st.cache is not None and st.cache.batch_size == 3 and drafted == [3]
    while len(batch.seqs) == 3:  # the short row finishes and leaves: its row of the store keeps stale K/V
        batch.step()
    # joins a batch whose drafter has a cache: into the left row, unwritten (`PositionCache.grow`); the checker
    # sees its slots [0, start) rewritten at its first draft
    batch.add([eng.sequence(2, PROMPTS[0], max_new_tokens=12)])
    assert batch.dstate.cache.batch_size == 3 and batch.dstate.cache.capacity == 3
    n = len(drafted)
    while batch.alive:
        batch.step()
    assert drafted[n] == 3 and len(drafted) > n + 1


def stream_batch(gen):
    """The DecodeBatch of a suspended `stream` generator (through torch's inference_mode generator wrapper)."""
    while gen is not None and gen.gi_frame is not None:
        f = gen.gi_frame.f_locals
        if "batch" in f:
            return f["batch"]
        gen = f.get("gen")
    return None


def test_reduced_draft_vocabulary_stays_exact():
    t = make_target("qwen3")
    dr = make_drafter(t, block_size=4, draft_vocab_size=40)
    dr.d2t.copy_(torch.arange(40) * 2 - torch.arange(40))  # draft id i -> target id 2i
    eng = DFlashEngine(t, dr, eos_token_ids=[], config=PLAIN)
    ar = eng.generate(PROMPTS, max_new_tokens=30, block_size=1)
    sp = eng.generate(PROMPTS, max_new_tokens=30)
    assert [g.tokens for g in sp] == [g.tokens for g in ar]


def test_bad_inputs_raise_clear_errors():
    t = make_target("llama")
    eng = DFlashEngine(t, make_drafter(t), eos_token_ids=[], config=PLAIN)
    with pytest.raises(DFlashError, match="block size"):
        eng.generate(PROMPTS, block_size=0)
    with pytest.raises(DFlashError, match="context"):
        eng.generate([[5] * 500], max_new_tokens=100)
    with pytest.raises(DFlashError, match="empty"):
        eng.generate([[]])
    with pytest.raises(DFlashError, match="needs a drafter"):
        DFlashEngine(t, None, config=DecodeConfig(block_size=4))


def test_rows_finishing_at_different_times_in_a_big_batch():
    """8 rows with different max_new_tokens: each finished row leaves the batch before the next step (its hole
    filled by the last row), the others' outputs unchanged."""
    t = make_target("qwen3")
    eng = DFlashEngine(t, make_drafter(t, block_size=4), eos_token_ids=[], config=PLAIN)
    prompts = PROMPTS * 2
    limits = [3, 30, 5, 30, 30, 8, 30, 30]
    ar, ref = reference_runs(eng, prompts, 30)
    with_oracle(eng, ref, keep=0.8)
    out = eng.generate(prompts, max_new_tokens=limits)
    assert [g.tokens for g in out] == [a.tokens[:n] for a, n in zip(ar, limits)]


def test_sequences_join_and_leave_a_running_batch(arch, backend):
    """Continuous batching: rows added between steps, and a cancelled row, leave every other row's output
    exactly what it is alone (float64, greedy, drafts partly accepted)."""
    t = make_target(arch, backend=backend)
    eng = DFlashEngine(t, make_drafter(t, block_size=4), eos_token_ids=[], config=PLAIN)
    ar, ref = reference_runs(eng, PROMPTS, 24)
    with_oracle(eng, ref, keep=0.7)
    batch = eng.new_batch(max_len=96)
    got = {i: [] for i in range(4)}

    def collect(outs):
        for o in outs:
            got[o.index].extend(o.tokens)

    collect(batch.add([eng.sequence(0, PROMPTS[0], max_new_tokens=24)]))
    for _ in range(3):
        collect(batch.step())
    collect(batch.add([eng.sequence(1, PROMPTS[1], max_new_tokens=24), eng.sequence(2, PROMPTS[2], max_new_tokens=24)]))
    collect(batch.step())
    collect(batch.add([eng.sequence(3, PROMPTS[3], max_new_tokens=24)]))
    collect(batch.step())
    batch.cancel(1)
    cut = len(got[1])
    while batch.alive:
        collect(batch.step())
    assert got[0] == ar[0].tokens and got[2] == ar[2].tokens and got[3] == ar[3].tokens
    assert got[1] == ar[1].tokens[:cut] and 0 < cut < 24
    assert all(s.finish_reason in ("length", "cancelled") for s in batch.seqs) or not batch.seqs


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_cache_moves_accepted_slots_as_the_torch_definition(dtype, monkeypatch):
    """PositionCache.move (an accepted tree branch to slot == position): the C++ copy on a CPU equals the torch
    definition (every read before any write), for overlapping moves, ragged rows and a row with nothing to move; the
    rows and slots not named are untouched."""
    from dflashkit import kernels

    if kernels.load() is None:
        pytest.skip(kernels.why_unavailable())
    torch.manual_seed(1)
    c = PositionCache(3, 4, 2, 12, 8, dtype, torch.device("cpu"), value_dim=9)
    for layer in c.keys + c.values:
        layer.copy_(torch.randn(layer.shape))
    before = [t.clone() for t in c.keys + c.values]
    src, dst = [[5, 7, 3], [], [9, 4]], [[3, 4, 5], [], [4, 5]]  # row 0: slot 3 is read before it is written
    want = [t.clone() for t in before]
    for t in want:  # the definition: all of a row's reads, then its writes
        for r, (s_, d_) in enumerate(zip(src, dst)):
            if s_:
                t[r, :, d_] = t[r, :, s_].clone()
    c.move(src, dst)
    assert all(torch.equal(a, b) for a, b in zip(c.keys + c.values, want))
    for layer, t in zip(c.keys + c.values, before):  # the torch path (another device's) gives the same
        layer.copy_(t)
    monkeypatch.setattr(kernels, "on_cpu", lambda *ts: None)
    c.move(src, dst)
    assert all(torch.equal(a, b) for a, b in zip(c.keys + c.values, want))


def test_a_row_ending_mid_block_does_not_push_the_batch_past_its_cache():
    """A row whose budget ends inside an accepted block: its start must stop at its budget (before the fix it
    advanced by the whole block; while finished rows rode along until a quarter of the batch was done, the next
    verify's slots ran past the cache, sized by prompt + max_new_tokens + tree width: 'exceeds the cache')."""
    t = make_target("llama")
    eng = DFlashEngine(t, make_drafter(t, block_size=8), eos_token_ids=[], config=PLAIN)
    prompts = [list(range(4, 44))] + [[5 + i, 6, 7, 8, 9] for i in range(4)]
    budgets = [3, 30, 30, 30, 30]
    ar, ref = reference_runs(eng, prompts, 30)
    with_oracle(eng, ref, keep=1.0)
    got = eng.generate(prompts, max_new_tokens=budgets)
    assert [g.tokens for g in got] == [g.tokens[:n] for g, n in zip(ar, budgets)]
