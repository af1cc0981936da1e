"""The draft tree: what the drafter proposes plus a lookup branch, verified in ONE target pass.

Nodes of one row, in this order (node index = offset of its cache slot from the row's `start`):
  0            the anchor (the last committed token), depth 0, at position start;
  1 .. m       the drafter's nodes: either the DFlash chain d_1..d_m (node j at depth j, slot == position,
               as in a plain block) or a drafter TREE (`topk_tree`): the m most likely paths through the
               drafter's top-k tokens per block slot, parents before children;
  m+1 .. m+k   the lookup branch l_1..l_k, branch node j at depth j, position start + j, slot start + m + j.
A node's position is start + its depth, its slot start + its index: two nodes at one depth cannot share a
slot. The branch hangs off the drafter's nodes where they part: if l_1..l_c is a path of drafter nodes,
those branch nodes are dead duplicates and l_{c+1} is a child of that path's last node (of the anchor if
c = 0). Dead and padding nodes are never accepted.

Verification walks the tree from the anchor following the TARGET's choice at each node (argmax at
T=0, at T>0 a draw with the uniform of the node's position, `sampling.py`): move to the child carrying
that token, else stop; the choice at the last node is the bonus. Every committed token is then the target's
own choice given exactly the committed prefix, with the uniform plain decoding would use at that position,
so output is plain decoding's at any temperature, whatever the tree's shape, as long as siblings carry
distinct tokens. Why duplicates must die: two siblings with one token would both lie on the accepted path,
and the walk relies on one node per depth there.

Terms: the anchor is the last committed token (no target K/V yet); the target's choice at a node is its own
token for the next position (argmax at T=0, a sample at T>0); the accepted depth a counts drafted tokens on
the path; the bonus is the choice at the path's end (always emitted), so a step commits a + 1 tokens (`stats.py`).
With a chain and an argmax draft this is distributed as rejection sampling: d is kept w.p. p(d), and on a
mismatch the bonus is a draw from p with d removed.

After acceptance, the path's K/V (and the drafter's context features) are moved to slot == position,
the invariant `cache.py` relies on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from . import kernels


SOURCE_ANCHOR, SOURCE_DRAFTER, SOURCE_LOOKUP = 0, 1, 2  # `DraftTree.source`: what the stats count per source
# the C++ calls' "none" (no drafter nodes, all alive, no sources)
_NONE, _NONE_ALIVE, _NONE_SOURCE = (torch.empty(0, dtype=d) for d in (torch.long, torch.bool, torch.int8))


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [b, W] node tokens (node 0 = anchor)
    parent: torch.Tensor  # [b, W] parent node index (node 0 is its own parent)
    depth: torch.Tensor  # [b, W] depth = position offset from start
    alive: torch.Tensor  # [b, W] bool: may be accepted (False for duplicates and padding)
    max_depth: int
    source: torch.Tensor | None = None  # [b, W] int8 SOURCE_*: who proposed each node (None: not recorded)
    logp: torch.Tensor | None = None  # [b, W] float: a drafter node's path log-probability, -inf for the others
    #                                   (None: the drafter gave none, `DraftNodes.logp`)

    @property
    def width(self) -> int:
        return self.tokens.shape[1]


@dataclass
class DraftNodes:
    """The drafter's part of a tree; node i here is tree node i + 1 (tree node 0 is the anchor)."""

    tokens: torch.Tensor  # [b, m]
    parent: torch.Tensor  # [b, m] tree node index of the parent (0 = the anchor), parents before children
    depth: torch.Tensor  # [b, m] 1 + the parent's depth
    max_depth: int  # a bound known on the host (no sync): the deepest a node can be
    alive: torch.Tensor | None = None  # [b, m] bool, False = padding (never accepted); None = all alive
    logp: torch.Tensor | None = None  # [b, m] the drafter's log-probability of each node's path (when asked)


def chain_nodes(chain: torch.Tensor, logp: torch.Tensor | None = None) -> DraftNodes:
    """chain: [b, m] -> the chain as drafter nodes: node j has parent j - 1. logp: [b, m] each token's
    log-probability (optional): node j's path log-probability is their running sum."""
    b, m = chain.shape
    j = torch.arange(1, m + 1, device=chain.device).expand(b, m)
    return DraftNodes(chain, j - 1, j, m, logp=None if logp is None else logp.float().cumsum(1))


def topk_tree(tokens: torch.Tensor, logp: torch.Tensor, n: int, min_prob: float = 0.0,
              conditional: Callable[[int, torch.Tensor | None], torch.Tensor] | None = None) -> DraftNodes:
    """The n most likely drafter paths, as n' = min(n, D*K) drafter nodes.

    tokens, logp: [b, D, K] the drafter's K best tokens per block slot 1..D and their log-probabilities,
    best first. A DFlash block predicts every slot in one pass, so slot j's distribution does not depend on
    which tokens fill slots < j: a path's score is the sum of its tokens' log-probs. Per depth the K best
    paths are kept (a beam), then the n best of all kept paths become the tree (EAGLE-2's rule with
    DFlash's factorised scores). A child scores at most its parent (log-probs <= 0) and ties go to the
    shallower node, so the chosen set is prefix-closed: every chosen node's parent is chosen too.
    Children of one parent are distinct top-k tokens, so siblings never duplicate.

    min_prob > 0 also drops the paths the drafter gives less than that probability, and the tree's width
    becomes the largest number of nodes any row keeps (one host sync): on a CPU every verified token costs
    time, and a path this unlikely is not worth it. Rows with fewer nodes get dead padding.

    conditional(j, beam): where slot j's log-probabilities DO depend on the token before (DFlash2's selector):
    [b, K_beam, K] for each beam path ending in beam [b, K_beam] (j = 0: beam None, the anchor: [b, 1, K]); `logp`
    is then unused. Children are still scored at most their parent, so the tree stays prefix-closed."""
    b, D, K = tokens.shape
    fast = kernels.beam_tree(tokens, logp, n, min_prob) if conditional is None else None
    if fast is not None:  # the same rule in one C++ call (kernels/drafttree.cpp)
        tok, parent, depth, alive, score = fast
        return DraftNodes(tok, parent, depth, min(tok.shape[1], D), alive if min_prob > 0 else None, score)
    dev = tokens.device
    logp = logp.double()  # sums of many log-probs: keep the depth tie-break below exact
    score = logp[:, 0] if conditional is None else conditional(0, None)[:, 0].double()
    tok = tokens[:, 0]  # depth-1 beam: [b, K]
    scores, toks, parents = [score], [tok], [torch.full((b, K), -1, dtype=torch.long, device=dev)]
    for j in range(1, D):
        step = logp[:, j, None, :] if conditional is None else conditional(j, tok).double()
        cand = (score[:, :, None] + step).reshape(b, K * K)  # every beam path x slot j's top-K
        score, idx = cand.topk(K, dim=1)
        toks.append(tokens[:, j].gather(1, idx % K))
        parents.append((j - 1) * K + idx // K)  # flat index of the parent in the previous depth's beam
        scores.append(score)
    score = torch.cat(scores, 1)  # [b, D*K], flat index = depth-major, so parents come first
    depth = torch.arange(1, D + 1, device=dev).repeat_interleave(K)
    n = min(n, D * K)
    # Ties go to the shallower node (then the better rank): the prefix-closure above relies on it.
    top = (score - 1e-9 * depth).topk(n, dim=1).indices  # [b, n] flat indices
    alive = None
    if min_prob > 0:
        keep = score.gather(1, top) >= math.log(min_prob)  # prefix-closed too: a parent scores at least its child
        # Kept nodes first, each group in flat order (parents first), then cut to the widest row's kept count.
        key = (top + torch.where(keep, 0, D * K)).sort(dim=1).values
        n = int(keep.sum(1).max())  # the one extra host sync of a pruned tree
        key = key[:, :n]
        chosen, alive = key % (D * K), key < D * K
    else:
        chosen = top.sort(dim=1).values  # parents first
    new_index = torch.zeros(b, D * K + 1, dtype=torch.long, device=dev)  # flat index + 1 -> node index (0: anchor)
    new_index.scatter_(1, chosen + 1, torch.arange(1, n + 1, device=dev).expand(b, n))
    parent = new_index.gather(1, torch.cat(parents, 1).gather(1, chosen) + 1)
    return DraftNodes(torch.cat(toks, 1).gather(1, chosen), parent, depth.expand(b, D * K).gather(1, chosen), min(n, D),
                      alive, score.gather(1, chosen).float())


def build(anchor: torch.Tensor, draft: DraftNodes | None, branch: list[list[int]] | None = None) -> DraftTree:
    """anchor: [b]; draft: the drafter's nodes (`chain_nodes` or `topk_tree`; None: no drafter this step);
    branch: per row its lookup tokens, on the host (rows of any length; None: no lookup this step)."""
    b, dev = anchor.shape[0], anchor.device
    k = max(map(len, branch), default=0) if branch else 0
    mod = kernels.on_cpu(anchor)
    if mod is not None:  # the same rule in one C++ call (kernels/verifytree.cpp); empty tensors: no such nodes
        nodes = (_NONE,) * 3 if draft is None else (draft.tokens, draft.parent, draft.depth)
        alive = _NONE_ALIVE if draft is None or draft.alive is None else draft.alive
        dmax = 0 if draft is None else draft.max_depth
        tok, parent, depth, alive, source = mod.tree_build(anchor, *nodes, alive, dmax, branch or [])
        return DraftTree(tok, parent, depth, alive, max(dmax, k), source,
                         logp=None if draft is None else _tree_logp(draft, k))
    zero = torch.zeros(b, 1, dtype=torch.long, device=dev)
    if draft is None and k == 0:  # a plain step (most steps where speculation does not pay): the anchor alone
        return DraftTree(tokens=anchor[:, None], parent=zero, depth=zero,
                         alive=torch.ones(b, 1, dtype=torch.bool, device=dev), max_depth=0,
                         source=torch.full((b, 1), SOURCE_ANCHOR, dtype=torch.int8, device=dev))
    branch_len = torch.tensor([len(p) for p in branch] if branch else [0] * b, device=dev)
    branch = torch.tensor([p + [0] * (k - len(p)) for p in branch] if branch else [[]] * b, dtype=torch.long,
                          device=dev).reshape(b, k)  # [b, k] right-padded with 0
    draft = draft or DraftNodes(branch[:, :0], branch[:, :0], branch[:, :0], 0)
    d_tok, d_par, d_dep, dmax = draft.tokens, draft.parent, draft.depth, draft.max_depth
    m = d_tok.shape[1]
    parent = torch.cat([zero, d_par], 1)  # [b, 1+m]
    depth = torch.cat([zero, d_dep], 1)
    # c: the depth of the deepest drafter node whose path from the anchor spells l_1..l_c (the shared prefix).
    on = torch.zeros(b, 1 + m, dtype=torch.bool, device=dev)
    on[:, 0] = True
    if m and k:
        want = torch.cat([zero, branch], 1).gather(1, depth.clamp(max=k))  # l_d for a node at depth d
        match = (torch.cat([zero, d_tok], 1) == want) & (depth <= branch_len[:, None]) & (depth <= k)
        if draft.alive is not None:  # a branch must never hang off a dead node: it could not be accepted
            match[:, 1:] &= draft.alive
        match[:, 0] = True
        for _ in range(dmax):  # on the branch's path iff it and all its ancestors match
            on = match & on.gather(1, parent)
    c, attach = torch.where(on, depth, -1).max(dim=1)  # siblings are distinct: one node per depth at most
    j_k = torch.arange(1, k + 1, device=dev)
    # branch node j: parent = the attach node if j == c + 1, else branch node j - 1 (node index m + j - 1).
    first = j_k[None] == (c[:, None] + 1)
    branch_parent = torch.where(first, attach[:, None].expand(b, k), m + j_k[None] - 1)
    branch_alive = (j_k[None] > c[:, None]) & (j_k[None] <= branch_len[:, None])
    return DraftTree(tokens=torch.cat([anchor[:, None], d_tok, branch], 1),
                     parent=torch.cat([parent, branch_parent], 1),
                     depth=torch.cat([depth, j_k.expand(b, k)], 1),
                     alive=torch.cat([torch.ones(b, 1, dtype=torch.bool, device=dev),
                                      torch.ones_like(d_tok, dtype=torch.bool) if draft.alive is None else draft.alive,
                                      branch_alive], 1),
                     max_depth=max(dmax, k),
                     source=torch.cat([torch.full((b, 1), SOURCE_ANCHOR, dtype=torch.int8, device=dev),
                                       torch.full((b, m), SOURCE_DRAFTER, dtype=torch.int8, device=dev),
                                       torch.full((b, k), SOURCE_LOOKUP, dtype=torch.int8, device=dev)], 1),
                     logp=_tree_logp(draft, k))


def _tree_logp(draft: DraftNodes, k: int) -> torch.Tensor | None:
    """[b, 1 + m + k] the tree's `logp`: the drafter nodes' path log-probabilities, -inf for the anchor and branch."""
    if draft.logp is None:
        return None
    b, dev = draft.logp.shape[0], draft.logp.device
    return torch.cat([torch.full((b, 1), -math.inf, device=dev), draft.logp.float(),
                      torch.full((b, k), -math.inf, device=dev)], 1)


def prune(tree: DraftTree, keep: torch.Tensor, width: int, max_depth: int) -> DraftTree:
    """The tree cut to the nodes in keep [b, W] (prefix-closed, the anchor kept): each row's kept nodes first, in
    their order (parents before children stay so), then dead padding up to `width` (the widest row's kept count)
    and max_depth (the deepest kept node), both known on the host. Node indices change; slots follow them."""
    b, W = keep.shape
    dev = keep.device
    key = torch.arange(W, device=dev) + torch.where(keep, 0, W)  # kept first, each group in node order
    key = key.sort(dim=1).values[:, :width]
    chosen, alive = key % W, key < W
    new_index = torch.zeros(b, W, dtype=torch.long, device=dev)  # old node -> new node (dropped ones: 0)
    new_index.scatter_(1, chosen, torch.arange(width, device=dev).expand(b, width).contiguous())
    parent = new_index.gather(1, tree.parent.gather(1, chosen))
    depth = torch.where(alive, tree.depth.gather(1, chosen), 1)  # padding: any depth <= max_depth will do
    return DraftTree(tokens=tree.tokens.gather(1, chosen), parent=torch.where(alive, parent, 0), depth=depth,
                     alive=alive & tree.alive.gather(1, chosen), max_depth=max(max_depth, 1 if width > 1 else 0),
                     source=None if tree.source is None else tree.source.gather(1, chosen),
                     logp=None if tree.logp is None else tree.logp.gather(1, chosen))


def ancestors(tree: DraftTree) -> torch.Tensor:
    """[b, W, W] bool: anc[r, q, s] iff node s is node q or one of its ancestors."""
    b, W = tree.tokens.shape
    anc = torch.zeros(b, W, W, dtype=torch.bool, device=tree.tokens.device)
    node = torch.arange(W, device=tree.tokens.device).expand(b, W).contiguous()
    for _ in range(tree.max_depth + 1):
        anc.scatter_(2, node[:, :, None], True)
        node = tree.parent.gather(1, node)
    return anc


@dataclass
class VerifyInputs:
    """Where each node of a tree goes in the target's verify pass (`verify_inputs`)."""

    positions: torch.Tensor  # [b, W] start + depth: the node's position (RoPE)
    slots: torch.Tensor  # [b, W] start + node index: where its K/V is written
    visible: torch.Tensor  # [b, 1, W, kv_len] bool: the slots it sees (`verify_mask`)


def verify_inputs(tree: DraftTree, start: torch.Tensor, kv_len: int) -> VerifyInputs:
    """The verify pass's positions, slots and mask for rows whose anchors sit at `start` [b]: on the CPU in one C++
    call (kernels/verifytree.cpp, the same rules)."""
    mod = kernels.on_cpu(tree.parent, start)
    if mod is not None:
        return VerifyInputs(*mod.tree_inputs(tree.parent, tree.depth, start, kv_len, tree.max_depth))
    return VerifyInputs(start[:, None] + tree.depth, start[:, None] + torch.arange(tree.width, device=start.device),
                        verify_mask(tree, start, kv_len))


def verify_mask(tree: DraftTree, start: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[b, 1, W, kv_len] bool for the target's verify pass: committed slots (< start) plus the node's own
    ancestors, found at slots start + node index. Everything else (rejected drafts of earlier steps,
    other branches) stays invisible."""
    b, W = tree.tokens.shape
    slots = torch.arange(kv_len, device=start.device)
    if W == 1:  # the anchor alone: its own slot is start
        return (slots[None, :] <= start[:, None])[:, None, None, :]
    mask = (slots[None, :] < start[:, None])[:, None, :].expand(b, W, kv_len).clone()
    idx = (start[:, None] + torch.arange(W, device=start.device))[:, None, :].expand(b, W, W)
    mask.scatter_(2, idx, ancestors(tree))
    return mask[:, None]


def source_counts(tree: DraftTree, a: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """[b, 4] per row: draft nodes verified from the drafter, from the lookup, then those of each accepted (a [b],
    path [b, D+1] from `accept`). Verified = alive nodes (dead duplicates and padding are not drafts)."""
    b = tree.tokens.shape[0]
    if tree.source is None or tree.tokens.shape[1] == 1:
        return torch.zeros(b, 4, dtype=torch.long, device=tree.tokens.device)
    on = torch.arange(path.shape[1], device=a.device)[None] <= a[:, None]
    on[:, 0] = False  # the anchor is no draft
    src = tree.source.gather(1, path)
    return torch.stack([(tree.alive & (tree.source == SOURCE_DRAFTER)).sum(1),
                        (tree.alive & (tree.source == SOURCE_LOOKUP)).sum(1),
                        (on & (src == SOURCE_DRAFTER)).sum(1), (on & (src == SOURCE_LOOKUP)).sum(1)], 1)


def accept(tree: DraftTree, choices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """choices: [b, W] the target's token for the position after each node.

    Returns (accepted depth a [b], path [b, D+1] node index at each depth 0..D, D = max_depth). Entries of
    `path` beyond a repeat the accepted node. The committed tokens are choices.gather(1, path)[:, :a+1]."""
    if tree.tokens.shape[1] == 1:  # the anchor alone: nothing to accept but the target's own token
        zero = torch.zeros(choices.shape[0], dtype=torch.long, device=choices.device)
        return zero, zero[:, None]
    ok = tree.alive & (tree.tokens == choices.gather(1, tree.parent))
    ok[:, 0] = True
    on_path = ok.clone()
    for _ in range(tree.max_depth):  # a node is on the accepted path iff it and all its ancestors are ok
        on_path = ok & on_path.gather(1, tree.parent)
    # Siblings carry distinct tokens, so at most one node per depth is on the path: the deepest is its end.
    score = torch.where(on_path, tree.depth, -1)
    a, end = score.max(dim=1)
    D = tree.max_depth
    path = torch.empty(tree.tokens.shape[0], D + 1, dtype=torch.long, device=choices.device)
    node = end
    # Walk up from the end; depths above a repeat the end node.
    for d in range(D, -1, -1):
        above = d > a
        path[:, d] = torch.where(above, end, node)
        node = torch.where(above, node, tree.parent.gather(1, node[:, None])[:, 0])
    return a, path


@dataclass
class Accepted:
    """What verification accepted in each row (`accepted`): the path as a tensor, the rest on the host."""

    path: torch.Tensor  # [b, R] the node at each depth 0..R-1; past the accepted depth it repeats the end node
    tokens: list[list[int]]  # [b][R] the target's choice at each path node: the first a+1 are the step's tokens
    depth: list[int]  # [b] the accepted depth a (drafted tokens on the path)
    nodes: list[list[int]]  # [b][R] `path` on the host
    counts: list[list[int]]  # [b][4] `source_counts`: drafter / lookup nodes verified, then those accepted


def accepted(tree: DraftTree, choices: torch.Tensor, span: int) -> Accepted:
    """`accept` and `source_counts` for a path of `span` >= max_depth + 1 entries, read to the host: on the CPU in
    one C++ call (kernels/verifytree.cpp, the same rules), elsewhere by torch ops and one host read."""
    mod = kernels.on_cpu(tree.tokens, choices)
    if mod is not None:
        source = _NONE_SOURCE if tree.source is None else tree.source
        return Accepted(*mod.tree_accept(tree.tokens, tree.parent, tree.depth, tree.alive, source, choices,
                                         tree.max_depth, span))
    a, path = accept(tree, choices)
    b = path.shape[0]
    counts = source_counts(tree, a, path)
    path = torch.cat([path, path[:, -1:].expand(b, span - path.shape[1])], dim=1)  # [b, span]
    committed = choices.gather(1, path)
    host = torch.cat([committed, a[:, None], path, counts], dim=1).tolist()  # the one host read
    return Accepted(path, [r[:span] for r in host], [r[span] for r in host], [r[span + 1:2 * span + 1] for r in host],
                    [r[2 * span + 1:] for r in host])
