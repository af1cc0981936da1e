"""The training objective: anchors, labels, the fast block mask vs a naive reference, train/serve parity."""

import math

import pytest
import torch

from conftest import make_drafter, make_target
from dflashkit.cache import PositionCache
from dflashkit.objective import (block_mask, build_blocks, decay_weights, decode_path_tau, dflash_loss, dpace_weights,
                                 sample_anchors, simulated_tau, teacher_rows, training_forward)


def reference_mask(anchors, valid, S, Bq):
    """The obvious O(n^2) loop: query (n, j) sees context t iff t < a_n, and block keys of its own block."""
    B, N = anchors.shape
    Q = N * Bq
    m = torch.zeros(B, 1, Q, S + Q, dtype=torch.bool)
    for b in range(B):
        for n in range(N):
            if not valid[b, n]:
                continue  # padding blocks see nothing
            for j in range(Bq):
                q = n * Bq + j
                for t in range(S):
                    m[b, 0, q, t] = t < anchors[b, n]
                for k in range(Bq):
                    m[b, 0, q, S + n * Bq + k] = True
    return m


def test_fast_mask_equals_reference_on_random_anchors():
    g = torch.Generator().manual_seed(0)
    for trial in range(5):
        S, Bq, N = 40, 4, 6
        lm = torch.rand(3, S, generator=g) > 0.3
        lm[2] = False
        lm[2, 30:33] = True  # few candidates -> padding blocks
        anchors, valid = sample_anchors(lm, N, g)
        assert not valid[2, 2:].any()
        assert torch.equal(block_mask(anchors, valid, S, Bq), reference_mask(anchors, valid, S, Bq))


def test_anchors_and_labels():
    g = torch.Generator().manual_seed(1)
    S, Bq = 30, 4
    ids = torch.arange(100, 100 + S)[None]
    lm = torch.zeros(1, S, dtype=torch.bool)
    lm[0, 10:] = True
    anchors, valid = sample_anchors(lm, 8, g)
    assert valid.all() and (anchors[valid] >= 10).all() and (anchors[valid] <= S - 2).all()
    assert torch.equal(anchors, anchors.sort(1).values) and len(set(anchors[0].tolist())) == 8
    bl = build_blocks(ids, lm, anchors, valid, Bq, mask_token_id=7, gamma=2.0)
    a = anchors[0, 0].item()
    assert bl.ids[0, :Bq].tolist() == [100 + a, 7, 7, 7]
    assert bl.positions[0, :Bq].tolist() == [a, a + 1, a + 2, a + 3]
    # same-position labels: slot j predicts the token AT anchor + j; slot 0 unsupervised
    w = decay_weights(Bq, 2.0)
    for j in range(1, Bq):
        if a + j < S:
            assert bl.labels[0, j] == 100 + a + j and torch.isclose(bl.weights[0, j], w[j])
    assert bl.weights[0, 0] == 0 and torch.isclose(w[1], torch.tensor(1.0)) and torch.isclose(w[3], torch.exp(torch.tensor(-1.0)))


WINDOWS = {"full": {}, "sliding-causal": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5),
           "sliding-bidirectional": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=3,
                                         is_causal=False)}


@pytest.mark.parametrize("window", list(WINDOWS))
def test_training_forward_equals_inference_forward(window):
    """Train/serve parity: the many-anchor training forward gives, for each anchor, the logits the
    incremental inference forward (cached context, engine-style mask) gives for that block; also with sliding-window
    draft layers (decoding drops the context keys outside the window, training masks them)."""
    t = make_target("llama")
    dr = make_drafter(t, block_size=4)
    dr.config = dr.config.replace(**WINDOWS[window])
    t.set_taps(dr.config.target_layer_ids)
    torch.manual_seed(0)
    S, Bq = 24, 4
    ids = torch.randint(4, 90, (1, S))
    lm = torch.ones(1, S, dtype=torch.bool)
    anchors, valid = sample_anchors(lm, 5, torch.Generator().manual_seed(3))
    taps = t.taps(ids)
    blocks = build_blocks(ids, lm, anchors, valid, Bq, dr.config.mask_token_id, 7.0)
    train_h = training_forward(dr, t.embed, taps, blocks)
    c = dr.config
    for n, a in enumerate(anchors[0].tolist()):
        cache = PositionCache(c.num_hidden_layers, 1, c.num_key_value_heads, 64, c.head_dim, t.dtype, torch.device("cpu"))
        pos = torch.arange(a)[None]
        for layer, (k, v) in enumerate(dr.context_kv(dr.fuse(taps[:, :a]), pos)):
            cache.write(layer, k, v, pos)
        kv = [(cache.keys[l][:, :, :a], cache.values[l][:, :, :a]) for l in range(c.num_hidden_layers)]
        block = torch.tensor([[ids[0, a].item()] + [c.mask_token_id] * (Bq - 1)])
        mask = torch.ones(1, 1, Bq, a + Bq, dtype=torch.bool)
        inf_h = dr(t.embed(block), a + torch.arange(Bq)[None], kv, mask)
        torch.testing.assert_close(train_h[:, n * Bq:(n + 1) * Bq], inf_h, rtol=1e-10, atol=1e-10)


def test_kl_loss_is_the_weighted_kl_to_the_targets_next_token_distribution():
    """loss "kl": at every supervised slot (position p), KL(target || drafter) with the target's distribution the full
    model gives for token p (its logits at p - 1), decay-weighted like the CE; zero when the drafter's rows are the
    target's own."""
    t = make_target("llama")
    dr = make_drafter(t, block_size=4)
    t.set_taps(dr.config.target_layer_ids)
    torch.manual_seed(1)
    S, Bq = 20, 4
    ids = torch.randint(4, 90, (2, S))
    lm = torch.arange(S)[None].expand(2, S) >= 5
    anchors, valid = sample_anchors(lm, 4, torch.Generator().manual_seed(2))
    feats = t.features(ids)
    blocks = build_blocks(ids, lm, anchors, valid, Bq, dr.config.mask_token_id, 7.0)
    hidden = training_forward(dr, t.embed, feats.taps, blocks)
    teacher = teacher_rows(feats.final, blocks)
    loss, _ = dflash_loss(hidden, blocks, t.lm_head_weight, Bq, teacher=teacher)
    full = t.model(input_ids=ids).logits.double()  # [2, S, V] the whole model's next-token logits
    num = den = 0.0
    for b in range(2):
        for q in range(blocks.ids.shape[1]):
            w = float(blocks.weights[b, q])
            if w == 0:
                continue
            p_log = full[b, blocks.positions[b, q] - 1].detach().log_softmax(-1)
            q_log = (hidden[b, q].detach().double() @ t.lm_head_weight.double().T).log_softmax(-1)
            num += w * float((p_log.exp() * (p_log - q_log)).sum())
            den += w
    assert den > 0 and abs(float(loss) - num / den) <= 1e-6 * max(1.0, num / den)
    same, _ = dflash_loss(teacher, blocks, t.lm_head_weight, Bq, teacher=teacher)
    assert abs(float(same)) <= 1e-6


def test_decode_path_tau_walks_the_anchors_decoding_visits():
    # The anchor right after a rejection is hard (run 1); decoding lands on it, then jumps over the easy
    # stretch in one pass: 7 tokens in 2 passes.
    runs = [1, 6, 6, 6, 6, 6, 1]
    assert decode_path_tau(runs) == (7, 2)
    # The uniform mean over anchors counts the easy stretch once per position: higher than 7 / 2.
    prefix = torch.tensor([[True] * (r - 1) + [False] * (6 - r) for r in runs])
    assert abs(simulated_tau(prefix) - sum(runs) / len(runs)) < 1e-6 and simulated_tau(prefix) > 7 / 2
    # A run past the end commits only what is left; an empty response needs no pass.
    assert decode_path_tau([5, 1, 1]) == (3, 1)
    assert decode_path_tau([]) == (0, 0)


def test_dpace_weights_are_the_expected_accepted_length_each_slot_still_holds():
    """dpace_weights against a naive double loop (speculators' definition), and in closed form at alpha 1 (every
    confidence 1: slot i weighs the number of supervised slots from i on); the D-PACE loss is the weighted mean CE
    with those weights, taken from the drafter's own probability of each label."""
    torch.manual_seed(3)
    conf = torch.rand(5, 6)
    held = torch.rand(5, 6) > 0.25
    held[:, 0] = False  # the anchor slot
    alpha = 0.3
    got = dpace_weights(conf, held, alpha)
    for m in range(5):
        smooth = [(1 - alpha) * float(conf[m, k]) + alpha if held[m, k] else 1.0 for k in range(6)]
        prefix = [math.prod(smooth[:j + 1]) for j in range(6)]
        for i in range(6):
            want = sum(prefix[j] for j in range(i, 6) if held[m, j]) if held[m, i] else 0.0
            assert abs(float(got[m, i]) - want) <= 1e-6, (m, i)
    ones = dpace_weights(conf, held, 1.0)
    assert torch.equal(ones, held.float().flip(-1).cumsum(-1).flip(-1) * held)
    t = make_target("llama")
    dr = make_drafter(t, block_size=4)
    t.set_taps(dr.config.target_layer_ids)
    S, Bq = 20, 4
    ids = torch.randint(4, 90, (2, S))
    lm = torch.arange(S)[None].expand(2, S) >= 5
    anchors, valid = sample_anchors(lm, 4, torch.Generator().manual_seed(2))
    blocks = build_blocks(ids, lm, anchors, valid, Bq, dr.config.mask_token_id, 7.0)
    hidden = training_forward(dr, t.embed, t.taps(ids), blocks)
    loss, _ = dflash_loss(hidden, blocks, t.lm_head_weight, Bq, dpace_alpha=alpha)
    logp = (hidden.detach().double() @ t.lm_head_weight.double().T).log_softmax(-1)  # [2, N*Bq, V]
    nll = -logp.gather(-1, blocks.labels[..., None])[..., 0]
    sup = blocks.weights > 0
    w = dpace_weights((-nll).exp().view(-1, Bq), sup.view(-1, Bq), alpha).view(sup.shape).double()
    want = float((w * nll).sum() / w.sum())
    assert w.sum() > 0 and abs(float(loss) - want) <= 1e-5 * max(1.0, want)
