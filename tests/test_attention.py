"""The fused attention kernel (kernels/attention.cpp): the softmax attention it states, and a query's output bits
independent of what else shares the call. The kernel lays its work out in four ways (a unit per query head; on AVX-512,
a unit per query and kv head for short lists; units that load a kv head's keys once for several queries and heads;
those units split over the threads by phase), chosen by list length, batch rows, threads and CPU: the bits must not
depend on which one ran."""

import pytest
import torch

from dflashkit.kernels import attend, available, why_unavailable

pytestmark = pytest.mark.skipif(not available(), reason=f"kernels unavailable: {why_unavailable()}")

TAIL_DEPTH = 4


def _case(B: int, Q: int, nh: int, kvh: int, hd: int, S: int, L: int = 5, seed: int = 0):
    """Inputs as the lean target builds them for Q new tokens after S - Q committed ones: each query's head part is
    the slots before its position - TAIL_DEPTH, its tail the next L positions (some left out); odd batch rows have
    holes in their head part (a tree's rejected slots)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Q, nh, hd, generator=g).bfloat16()
    k = torch.randn(B, kvh, S + 8, hd, generator=g).bfloat16()
    v = torch.randn(B, kvh, S + 8, hd + 1, generator=g).bfloat16()  # the cache's value rows carry one extra column
    head = torch.zeros(B, Q, S, dtype=torch.bool)
    tail = torch.full((B, Q, L), -1, dtype=torch.long)
    for b in range(B):
        holes = torch.randperm(S, generator=g)[: S // 7]
        for j in range(Q):
            split = max(S - Q + j - TAIL_DEPTH, 0)
            head[b, j, :split] = True
            if b % 2:
                head[b, j, holes] = False
            for t in range(L):
                if split + t <= S - Q + j and (t + j) % 3:
                    tail[b, j, t] = split + t
    return q, k, v, head, tail, hd**-0.5


def _reference(q, k, v, head, tail, scale):
    """float64 softmax attention over each query's visible slots (its head part and its tail)."""
    B, Q, nh, hd = q.shape
    kvh, T = k.shape[1], k.shape[2]
    vis = torch.zeros(B, Q, T, dtype=torch.bool)
    vis[..., : head.shape[2]] = head
    bb, qq, jj = torch.nonzero(tail >= 0, as_tuple=True)
    vis[bb, qq, tail[bb, qq, jj]] = True
    kk = k.double().repeat_interleave(nh // kvh, dim=1)  # [B, nh, T, hd]
    vv = v[..., :hd].double().repeat_interleave(nh // kvh, dim=1)
    s = torch.einsum("bqhd,bhtd->bqht", q.double(), kk) * scale
    s = s.masked_fill(~vis[:, :, None, :], float("-inf"))
    return torch.einsum("bqht,bhtd->bqhd", torch.softmax(s, dim=-1), vv).reshape(B, Q, nh * hd)


@pytest.mark.parametrize("B,Q,nh,kvh,hd,S", [(1, 1, 9, 3, 64, 300), (1, 4, 9, 3, 64, 2500), (2, 3, 9, 3, 64, 3500),
                                             (1, 1, 4, 2, 128, 3200), (3, 9, 6, 2, 16, 2100), (1, 9, 8, 4, 256, 2200)])
def test_attend_computes_softmax_attention(B, Q, nh, kvh, hd, S):
    args = _case(B, Q, nh, kvh, hd, S)
    torch.testing.assert_close(attend(*args).double(), _reference(*args), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("B,Q,nh,kvh,hd,S", [(1, 4, 9, 3, 64, 176), (2, 3, 9, 3, 64, 3500), (3, 9, 6, 2, 16, 2100)])
def test_attend_is_float64_attention_rounded_to_bf16_but_for_near_ties(B, Q, nh, kvh, hd, S):
    """Tighter than the tolerance above: the kernel's own exp (`exp8`, within an fp32 ulp of the true one) and its
    fp32 sums leave almost every output equal to the float64 result rounded to bf16, the rest one bf16 ulp away."""
    args = _case(B, Q, nh, kvh, hd, S)
    got = attend(*args).view(torch.int16).int()
    want = _reference(*args).bfloat16().view(torch.int16).int()
    assert (got == want).float().mean().item() >= 0.99
    assert (got - want).abs().max().item() <= 1


@pytest.mark.parametrize("S,hd", [(1700, 64), (2300, 64), (3300, 64), (3300, 128), (3100, 24), (2600, 256)])
def test_a_querys_bits_do_not_depend_on_what_shares_the_call(S, hd):
    q, k, v, head, tail, scale = _case(2, 9, 6, 2, hd, S, seed=S)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in sorted({1, 2, threads}):
            torch.set_num_threads(n)
            outs.append(attend(q, k, v, head, tail, scale))  # 2 rows x 9 queries: units shared by query blocks
            for b in range(2):
                row = attend(q[b:b + 1], k[b:b + 1], v[b:b + 1], head[b:b + 1], tail[b:b + 1], scale)
                assert torch.equal(row.view(torch.int16), outs[0][b:b + 1].view(torch.int16))
                for j in (0, 4, 8):  # one query alone: few units (per head, or phased over the threads)
                    one = attend(q[b:b + 1, j:j + 1], k[b:b + 1], v[b:b + 1], head[b:b + 1, j:j + 1],
                                 tail[b:b + 1, j:j + 1], scale)
                    assert torch.equal(one.view(torch.int16), outs[0][b:b + 1, j:j + 1].view(torch.int16))
        for o in outs[1:]:
            assert torch.equal(o.view(torch.int16), outs[0].view(torch.int16))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("B,Q,nh,kvh,hd,S", [(1, 1, 9, 3, 64, 176), (1, 4, 9, 3, 64, 181), (3, 2, 9, 3, 64, 300),
                                             (1, 16, 9, 3, 64, 190), (2, 3, 8, 2, 64, 77), (1, 5, 7, 1, 64, 45),
                                             (1, 1, 10, 2, 128, 203), (2, 9, 8, 2, 128, 150), (1, 2, 4, 4, 128, 6),
                                             (1, 1, 32, 8, 128, 1000), (2, 1, 12, 12, 64, 13)])
def test_the_grouped_layout_gives_the_split_layouts_bits(B, Q, nh, kvh, hd, S):
    """Short lists run one unit per (query, kv head) whose query heads share each widened key and value row: on
    AVX-512 two keys a 16-lane register and eight keys' sums a tree, on AVX2 (or `set_isa("avx2")`) four keys' 8-lane
    chains side by side and their sums a tree; `set_attention_layout("split")` keeps the per-(query, head) layout.
    All must give the same bits: kv groups of 1-12 heads (chains 1-4 at a time on 16 lanes, 1-3 on 8, a unit split
    over the threads when there are few), lists not a multiple of 4 or 8 keys, holes and tails, one thread or two."""
    from dflashkit.kernels import set_attention_layout, set_isa

    args = _case(B, Q, nh, kvh, hd, S, seed=S + Q)
    threads = torch.get_num_threads()
    try:
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            grouped = attend(*args)
            for force in (lambda: set_attention_layout("split"), lambda: set_isa("avx2")):
                force()
                split = attend(*args)
                set_attention_layout("auto"), set_isa("auto")
                assert torch.equal(grouped.view(torch.int16), split.view(torch.int16))
    finally:
        set_attention_layout("auto"), set_isa("auto")
        torch.set_num_threads(threads)


def _tree_visible(B: int, ctx: int, n: int, g: torch.Generator):
    """A random draft tree of n nodes after ctx committed tokens per batch row, as a verify step lays it out:
    positions ctx + depth, slots ctx.. in node order, each node seeing the committed keys, its ancestors and itself."""
    positions = torch.empty(B, n, dtype=torch.long)
    visible = torch.zeros(B, 1, n, ctx + n, dtype=torch.bool)
    visible[..., :ctx] = True
    for b in range(B):
        parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        for i in range(n):
            j, depth = i, 0
            while j >= 0:
                visible[b, 0, i, ctx + j] = True
                j, depth = parent[j], depth + (parent[j] >= 0)
            positions[b, i] = ctx + depth
    return positions, (ctx + torch.arange(n)).expand(B, n).contiguous(), visible


@pytest.mark.parametrize("layout", ["block", "ragged rows", "tree", "shallow tail"])
def test_key_lists_in_cpp_equal_the_torch_build(layout):
    """backends/lean.py `_splits` builds each query's key lists from torch ops, or with our kernels in one C++ call
    (keylists.cpp): both must give the same head part and tail, for verify blocks, batch rows at different lengths
    (stale slots past a row's end), draft trees (a visible mask) and a tail shorter than the tree is deep."""
    from conftest import make_target

    t = make_target("llama", torch.bfloat16, backend="lean")
    g = torch.Generator().manual_seed(7)
    visible = None
    if layout == "block":
        positions = torch.arange(40, 46)[None]
        slots, kv_len = positions, 46
    elif layout == "ragged rows":
        positions = torch.stack([torch.arange(50, 54), torch.arange(20, 24)])
        slots, kv_len = positions, 54
    else:
        positions, slots, visible = _tree_visible(2, 30, 14, g)
        kv_len = 44
    if layout == "shallow tail":
        t.tail_depth = 2
    built = {}
    for fused in (False, True):
        t.fused_attention = fused
        sp = t._splits(positions, slots, kv_len, visible, 64)["full_attention"]
        built[fused] = (sp.head_vis, sp.tail_slot)
    assert torch.equal(built[True][0], built[False][0])
    assert torch.equal(built[True][1], built[False][1])
    assert built[True][1].ge(0).any() and built[True][0].any()  # both parts hold keys
