"""The drafter forward: cached context == uncached, attention pattern (context strictly before the anchor,
bidirectional inside the block)."""

import torch

from conftest import make_drafter, make_target
from dflashkit.cache import PositionCache


def setup(seed=0, S=12, Q=6):
    t = make_target("qwen3")
    dr = make_drafter(t, block_size=Q)
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(1, S, dr.config.num_taps * t.hidden_size, generator=g, dtype=torch.float64)
    block = torch.randn(1, Q, t.hidden_size, generator=g, dtype=torch.float64)
    return t, dr, feats, block


def run_uncached(dr, feats, block, anchor):
    S, Q = feats.shape[1], block.shape[1]
    kv = dr.context_kv(dr.fuse(feats), torch.arange(S)[None])
    mask = torch.cat([(torch.arange(S) < anchor).expand(1, 1, Q, S), torch.ones(1, 1, Q, Q, dtype=torch.bool)], -1)
    return dr(block, anchor + torch.arange(Q)[None], kv, mask)


def test_incremental_context_equals_uncached():
    t, dr, feats, block = setup()
    S, Q, anchor = feats.shape[1], block.shape[1], 9
    want = run_uncached(dr, feats, block, anchor)
    c = dr.config
    cache = PositionCache(c.num_hidden_layers, 1, c.num_key_value_heads, 64, c.head_dim, torch.float64, torch.device("cpu"))
    for lo, hi in [(0, 3), (3, 8), (8, S)]:  # ingest context in chunks, as decoding does
        pos = torch.arange(lo, hi)[None]
        for layer, (k, v) in enumerate(dr.context_kv(dr.fuse(feats[:, lo:hi]), pos)):
            cache.write(layer, k, v, pos)
    kv = [(cache.keys[l][:, :, :S], cache.values[l][:, :, :S]) for l in range(c.num_hidden_layers)]
    mask = torch.cat([(torch.arange(S) < anchor).expand(1, 1, Q, S), torch.ones(1, 1, Q, Q, dtype=torch.bool)], -1)
    got = dr(block, anchor + torch.arange(Q)[None], kv, mask)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_context_strictly_before_anchor_and_bidirectional_block():
    t, dr, feats, block = setup()
    anchor = 7
    base = run_uncached(dr, feats, block, anchor)
    f2 = feats.clone()
    f2[:, anchor:] += 1.0  # the anchor's own feature and later ones are invisible
    torch.testing.assert_close(run_uncached(dr, f2, block, anchor), base, rtol=0, atol=0)
    f3 = feats.clone()
    f3[:, anchor - 1] += 1.0  # the feature just before the anchor is visible
    assert not torch.allclose(run_uncached(dr, f3, block, anchor), base)
    b2 = block.clone()
    b2[:, 3] += 1.0  # a later block slot changes an earlier one: attention inside the block is bidirectional
    assert not torch.allclose(run_uncached(dr, feats, b2, anchor)[:, 1], base[:, 1])


def test_sliding_window_layers_see_what_zlabs_mask_allows():
    """Every layer "sliding_attention", window W, Z Lab's default is_causal: a slot at position q sees context and
    slots at positions q - W < k <= q. Context older than anchor - W + 1 is dropped when decoding (flat cost) and
    changes nothing; the first visible feature does; a later slot does not change an earlier one; and the decode
    path (keys dropped) equals the training path (keys masked, `tap_positions`)."""
    t, dr, feats, block = setup(S=16)
    W, anchor = 4, 12
    dr.config = dr.config.replace(layer_types=["sliding_attention"] * dr.config.num_hidden_layers, sliding_window=W)
    base = run_uncached(dr, feats, block, anchor)
    f2 = feats.clone()
    f2[:, :anchor - W + 1] += 1.0
    torch.testing.assert_close(run_uncached(dr, f2, block, anchor), base, rtol=0, atol=0)
    f3 = feats.clone()
    f3[:, anchor - W + 1] += 1.0
    assert not torch.allclose(run_uncached(dr, f3, block, anchor), base)
    b2 = block.clone()
    b2[:, 3] += 1.0  # causal inside the block: slots 0..2 do not see slot 3
    changed = run_uncached(dr, feats, b2, anchor)
    torch.testing.assert_close(changed[:, :3], base[:, :3], rtol=0, atol=0)
    assert not torch.allclose(changed[:, 3], base[:, 3])
    S, Q = anchor, block.shape[1]  # the training path: raw taps, every key kept and masked
    trained = dr(block, anchor + torch.arange(Q)[None], None, torch.ones(1, 1, Q, S + Q, dtype=torch.bool),
                 taps=feats[:, :S], tap_positions=torch.arange(S)[None])
    torch.testing.assert_close(trained, base, rtol=1e-12, atol=1e-12)
