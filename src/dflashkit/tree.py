"""The draft tree: the DFlash chain plus a lookup branch, verified in ONE target pass.

Nodes of one row, in this order (node index = offset of its cache slot from the row's `start`):
  0            the anchor (the last committed token), depth 0, at position start;
  1 .. m       the DFlash chain d_1..d_m, node j at depth j (slot == position, as in a plain block);
  m+1 .. m+k   the lookup branch l_1..l_k, branch node j at depth j, position start + j, but slot
               start + m + j: two nodes at the same depth cannot share a slot.
The branch hangs off the chain where they part: if l_1..l_c equal d_1..d_c, those branch nodes are
dead duplicates and l_{c+1} is a child of chain node c (of the anchor if c = 0). Dead and padding
nodes are never accepted.

Verification walks the tree from the anchor following the TARGET's choice at each node (argmax at
T=0, one sample at T>0): move to the child carrying that token, else stop; the choice at the last node
is the bonus. Every committed token is then the target's own choice given exactly the committed prefix,
so output is exact at any temperature. Why duplicates must die: two sibling nodes with the same token
would carry two independent target samples of the same distribution, and keeping the luckier one would
bias sampling.

After acceptance, the path's K/V (and the drafter's context features) are moved to slot == position,
the invariant `cache.py` relies on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [b, W] node tokens (node 0 = anchor)
    parent: torch.Tensor  # [b, W] parent node index (node 0 is its own parent)
    depth: torch.Tensor  # [b, W] depth = position offset from start
    alive: torch.Tensor  # [b, W] bool: may be accepted (False for duplicates and padding)
    max_depth: int

    @property
    def width(self) -> int:
        return self.tokens.shape[1]


def build(anchor: torch.Tensor, chain: torch.Tensor | None, branch: torch.Tensor, branch_len: torch.Tensor) -> DraftTree:
    """anchor: [b]; chain: [b, m] DFlash proposals (None or m = 0: no drafter this step);
    branch: [b, k] lookup proposals, right-padded; branch_len: [b] valid branch tokens per row."""
    b, k = branch.shape
    dev = anchor.device
    m = 0 if chain is None else chain.shape[1]
    j_m = torch.arange(1, m + 1, device=dev)
    j_k = torch.arange(1, k + 1, device=dev)
    # c: how many leading branch tokens equal the chain's (the shared prefix).
    if m and k:
        L = min(m, k)
        c = (branch[:, :L] == chain[:, :L]).to(torch.int32).cumprod(1).sum(1)  # [b]
    else:
        c = torch.zeros(b, dtype=torch.long, device=dev)
    c = c.long()
    tokens = torch.cat([anchor[:, None], chain if m else branch[:, :0], branch], dim=1)
    chain_parent = (j_m - 1).expand(b, m)
    # branch node j: parent = chain node c if j == c + 1, else branch node j - 1 (slot m + j - 1).
    first = j_k[None] == (c[:, None] + 1)
    branch_parent = torch.where(first, c[:, None].expand(b, k), m + j_k[None] - 1)
    parent = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=dev), chain_parent, branch_parent], dim=1)
    depth = torch.cat([torch.arange(m + 1, device=dev).expand(b, m + 1), j_k.expand(b, k)], dim=1)
    branch_alive = (j_k[None] > c[:, None]) & (j_k[None] <= branch_len[:, None])
    alive = torch.cat([torch.ones(b, m + 1, dtype=torch.bool, device=dev), branch_alive], dim=1)
    return DraftTree(tokens, parent, depth, alive, max(m, k))


def ancestors(tree: DraftTree) -> torch.Tensor:
    """[b, W, W] bool: anc[r, q, s] iff node s is node q or one of its ancestors."""
    b, W = tree.tokens.shape
    anc = torch.zeros(b, W, W, dtype=torch.bool, device=tree.tokens.device)
    node = torch.arange(W, device=tree.tokens.device).expand(b, W).contiguous()
    for _ in range(tree.max_depth + 1):
        anc.scatter_(2, node[:, :, None], True)
        node = tree.parent.gather(1, node)
    return anc


def verify_mask(tree: DraftTree, start: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[b, 1, W, kv_len] bool for the target's verify pass: committed slots (< start) plus the node's own
    ancestors, found at slots start + node index. Everything else (rejected drafts of earlier steps,
    other branches) stays invisible."""
    b, W = tree.tokens.shape
    slots = torch.arange(kv_len, device=start.device)
    mask = (slots[None, :] < start[:, None])[:, None, :].expand(b, W, kv_len).clone()
    idx = (start[:, None] + torch.arange(W, device=start.device))[:, None, :].expand(b, W, W)
    mask.scatter_(2, idx, ancestors(tree))
    return mask[:, None]


def accept(tree: DraftTree, choices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """choices: [b, W] the target's token for the position after each node.

    Returns (accepted depth a [b], path [b, D+1] node index at each depth 0..D, D = max_depth). Entries of
    `path` beyond a repeat the accepted node. The committed tokens are choices.gather(1, path)[:, :a+1]."""
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
