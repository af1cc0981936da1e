"""Batch invariance: does a token get the same logits, bit for bit, decoded alone or verified in a block / tree?

If it does, greedy speculative output equals the engine's own greedy output by construction, in any dtype. That is
a property of the kernels a backend's forward runs on a given CPU and torch build, so it is measured, not assumed:
`check(target)` decodes a few random tokens of two ragged rows one at a time (the AR path), then verifies the same
tokens as one block and as the true path hidden inside a draft tree (ancestors at scattered slots, decoy siblings),
and compares every logit bitwise. The answer is cached per machine, torch build, model and dtype (a ~1-3 s probe).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .kernel_plan import plan_of
from .measurements import engine_identity, lookup, machine_key, store

log = logging.getLogger(__name__)


@dataclass
class Invariance:
    block: bool  # a chain block's logits == one-token decoding's
    tree: bool  # a tree path's logits (scattered slots, decoys) == one-token decoding's
    max_diff: float  # the largest |difference| seen (0.0 when invariant)
    cause: str = ""  # what was found not row-invariant, when known (`linear_row_change`)

    @property
    def exact(self) -> bool:
        return self.block and self.tree

    def label(self) -> str:
        if self.exact:
            return "bitwise (batch-invariant kernels: verified logits equal one-token logits)"
        why = f"; {self.cause}" if self.cause else ""
        return f"near-tie rule (kernels are not batch-invariant here, max logit difference {self.max_diff:.3g}{why})"


# Row counts probed: every verify width up to a 16-token block plus one, wider trees and batches, a prefill.
ROW_COUNTS = (*range(2, 18), 24, 32, 48, 64, 128, 256)


def linear_row_change(weights: list[torch.Tensor], rows: tuple[int, ...] = ROW_COUNTS, seed: int = 0) -> str | None:
    """Does torch's `F.linear` give a row other bits when other rows share the call? It depends on the CPU and the
    library: on an AVX512-BF16 EPYC, oneDNN's one-row kernel and its many-row kernels sum in different orders (the
    576x1536 down projection of SmolLM2 differs from 2-10 rows on; a 128x32 weight only in some rows of a few
    hundred); on the AVX2 hosts before it never did. Returns "torch's F.linear ..." naming the first weight shape
    [N, K] and row count where a row differs from the same row computed alone, or None.
    Why activations over a wide range of magnitudes: a different summation order changes the rounding of only a
    few rows of ordinary data, so a probe with them can miss a kernel that does change."""
    gen, seen, n = torch.Generator().manual_seed(seed), set(), max(rows)
    for w in weights:
        if tuple(w.shape) in seen:
            continue
        seen.add(tuple(w.shape))
        x = torch.randn(n, w.shape[1], generator=gen) * torch.exp2(torch.randint(-8, 9, (n, w.shape[1]), generator=gen))
        x = x.to(device=w.device, dtype=w.dtype)
        alone = torch.cat([F.linear(x[i:i + 1], w) for i in range(n)])
        for m in rows:
            if not torch.equal(F.linear(x[:m], w), alone[:m]):
                return (f"torch's F.linear gives a row other bits with {m} rows in the call ({w.shape[0]}x{w.shape[1]} "
                        "weight); --kernel rowlinear is row-invariant")
    return None


def mode(target) -> str:
    """The rule greedy equality with AR rests on for this target, as measured by `check`."""
    inv = getattr(target, "batch_invariant", None)
    return "bitwise" if inv else "near-tie rule" if inv is False else "not measured"


def _decode_alone(target, ids: list[int], n: int) -> torch.Tensor:
    """The AR path for one row: prefill ids[:-n], then one token per forward. Returns logits [n, V]."""
    dev = target.device
    P = len(ids) - n
    cache = target.new_cache(1, len(ids))
    target.forward(torch.tensor([ids[:P]], device=dev), torch.arange(P, device=dev)[None], cache, kv_len=P,
                   taps=False)
    out = []
    for p in range(P, len(ids)):
        h, _ = target.forward(torch.tensor([[ids[p]]], device=dev), torch.tensor([[p]], device=dev), cache,
                              kv_len=p + 1, taps=False)
        out.append(target.logits(h)[0])
    return torch.cat(out)


def _prefill(target, rows: list[list[int]], P: list[int], max_len: int):
    dev = target.device
    cache = target.new_cache(len(rows), max_len)
    ids = torch.zeros((len(rows), max(P)), dtype=torch.long, device=dev)
    for r, (x, p) in enumerate(zip(rows, P)):
        ids[r, :p] = torch.tensor(x[:p], device=dev)
    pos = torch.arange(max(P), device=dev).expand(len(rows), -1)
    target.forward(ids, pos, cache, kv_len=max(P), taps=False)
    return cache


def _tree_layout(n: int, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """Slots of a tree block of 2n nodes: the true path's n nodes at increasing scattered slots, decoys elsewhere.
    Returns (slot index of each path node, parent slot index of each decoy, -1 = the committed prefix)."""
    order = torch.randperm(2 * n, generator=gen)[:n].sort().values.tolist()
    decoys = [s for s in range(2 * n) if s not in order]
    parents = [max([o for o in order if o < s], default=-1) for s in decoys]  # a decoy hangs off a path node
    return order, parents


def _verify(target, rows, P, n, vocab, gen, tree: bool) -> torch.Tensor:
    """Verify the last n tokens of each row in one forward (block or tree). Returns the path's logits [R, n, V]."""
    dev = target.device
    R, W = len(rows), 2 * n if tree else n
    cache = _prefill(target, rows, P, max(P) + W)
    path, parents = _tree_layout(n, gen) if tree else (list(range(n)), [])
    ids = torch.randint(4, vocab, (R, W), generator=gen).to(dev)
    depth = torch.zeros((R, W), dtype=torch.long)
    anc = torch.zeros((W, W), dtype=torch.bool)  # anc[i, j]: node j is visible to node i (ancestor or itself)
    for d, s in enumerate(path):
        ids[:, s] = torch.tensor([x[p + d] for x, p in zip(rows, P)], device=dev)
        depth[:, s] = d
        anc[s, path[:d + 1]] = True
    for s, par in zip([x for x in range(W) if x not in path], parents):
        pd = path.index(par) if par >= 0 else -1
        depth[:, s] = pd + 1
        anc[s, path[:pd + 1]] = True
        anc[s, s] = True
    start = torch.tensor(P, device=dev)[:, None]
    kv_len = max(P) + W
    slots = start + torch.arange(W, device=dev)
    visible = torch.zeros((R, 1, W, kv_len), dtype=torch.bool, device=dev)
    for r, p in enumerate(P):
        visible[r, 0, :, :p] = True
        visible[r, 0, :, p:p + W] = anc.to(dev)
    h, _ = target.forward(ids, start + depth.to(dev), cache, kv_len=kv_len, taps=False, slots=slots,
                          visible=visible)
    return target.logits(h[:, path])


@torch.no_grad()
def measure(target, n: int = 8, prompt: int = 29, seed: int = 0) -> Invariance:
    """Two ragged rows (prompt and prompt - 5 tokens), n tokens each: one-token logits vs block and tree."""
    gen = torch.Generator().manual_seed(seed)
    vocab = min(target.vocab_size, 30000)
    P = [prompt, prompt - 5]
    rows = [torch.randint(4, vocab, (p + n,), generator=gen).tolist() for p in P]
    alone = torch.stack([_decode_alone(target, x, n) for x in rows])  # [R, n, V]
    diffs = {}
    for kind in ("block", "tree"):
        got = _verify(target, rows, P, n, vocab, gen, tree=kind == "tree")
        diffs[kind] = (got.float() - alone.float()).abs().max().item()
    return Invariance(block=diffs["block"] == 0, tree=diffs["tree"] == 0, max_diff=max(diffs.values()))


def check(target, identity: str, cache_file: str | os.PathLike | None = None) -> Invariance:
    """`measure`, cached in `cache_file` (JSON) under the machine/torch/model/dtype key; sets
    `target.batch_invariant`. `identity` names the weights (e.g. the model directory and its config digest)."""
    # the kernels too (their sources, not only their name): they set the bits
    key = machine_key(identity, target.architecture, target.dtype, target.device, engine_identity(target))
    stored = lookup(cache_file, key)
    if stored is not None:
        inv = Invariance(**stored)
    else:
        inv = measure(target)
        if not inv.exact and not plan_of(target).ours and hasattr(target, "linear_weights"):
            inv.cause = linear_row_change(target.linear_weights()) or ""
        store(cache_file, key, asdict(inv))
    target.batch_invariant, target.invariance_cause = inv.exact, inv.cause
    (log.info if inv.exact else log.warning)("greedy exactness on this machine: %s", inv.label())
    return inv
