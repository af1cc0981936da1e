"""The seam between the batch and its step policy: what the policy sees, what it decides, what it learns from.

A step calls the policy three times (`batch.DecodeBatch.step`):
  plan(view: StepView) -> Plan        before any drafting: look at all? run the drafter? how much of the lookup?
  cut(plan, tree) -> TreeCut | None   a drafted step's tree: the nodes worth verifying (None: all of them)
  observe(plan, outcome: StepOutcome) after the commit: what was accepted and how long the step took
The policy only chooses which nodes are verified, from the drafter, the lookup and the past (never from this step's
target choices); verification and commit are the batch's (`tree.py`), so output is exact whatever it chooses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from ..lookup import LookupProposal


@dataclass
class StepView:
    """What the policy sees of the batch before a step."""

    live: list[bool]  # per row: still decoding (finished rows ride along until compaction)
    keys: list[int]  # per row: its sequence's key (`SeqState.key`), stable while the row moves: per-row state
    ctx: int  # max(start): the longest context a row's verify pass attends to
    pending: int  # drafter features the next drafting pass would ingest, over all rows
    drafter: bool  # a drafter can run this step
    propose_lookup: Callable[[], LookupProposal]  # the lookup's proposal: host work, asked only by a policy that looks
    _lookup: LookupProposal | None = field(default=None, repr=False)

    @property
    def rows(self) -> int:
        return len(self.live)

    def lookup(self) -> LookupProposal:
        """This step's lookup proposal (computed on the first call)."""
        if self._lookup is None:
            self._lookup = self.propose_lookup()
        return self._lookup


@dataclass
class Plan:
    """One step's choice. The batch reads `look`, `draft`, `scores`, `lookup_keep` and `block`; `record` is the
    policy's own (what it predicted, for `observe`)."""

    look: bool  # False: a plain AR step decided without looking: no lookup, no drafter, the anchors alone
    draft: bool  # run the drafter (then `cut` prunes the tree)
    scores: bool = False  # the drafter returns its nodes' path log-probabilities (`DraftTree.logp`): `cut` reads them
    lookup_keep: list[int] | None = None  # per row: lookup tokens to verify (None: all it proposed)
    block: int | None = None  # the drafting pass's block, 2 .. the configured (None: the configured block)
    record: Any = None


@dataclass
class TreeCut:
    """The nodes of a drafted tree to verify (`tree.prune`)."""

    keep: torch.Tensor  # [b, W] bool, prefix-closed, the anchor kept
    width: int  # the widest row's kept nodes
    depth: int  # the deepest kept node


@dataclass
class StepOutcome:
    """What verification decided, on the host (`DecodeBatch._commit`'s one sync)."""

    tokens: list[list[int]]  # per row [span]: the target's choices along the accepted path; the first a + 1 commit
    accepted: list[int]  # per row: a, the accepted depth
    path: list[list[int]]  # per row [span]: the node at each depth (past a it repeats the end)
    live: list[bool]  # per row: was decoding during the step (the others are not observed)
    ms: float  # the step's wall time


@dataclass
class PolicyStats:
    """What the policy chose, summed over steps (the server's /metrics, the bench report)."""

    steps: int = 0
    drafter_steps: int = 0  # steps that ran the drafter
    probe_steps: int = 0  # ... of which probes: run on the budget (`probes.Probes`), not because drafting paid
    plain_steps: int = 0  # steps taken as plain AR steps without looking (`probes.Looks`)
    rows: int = 0  # live rows summed over steps
    nodes: int = 0  # draft nodes verified (live rows, the anchor not counted)
    width: int = 0  # verify pass widths summed over steps
    committed: int = 0

    def since(self, before: "PolicyStats | None") -> "PolicyStats":
        """The counts added after `before` (a copy taken earlier)."""
        if before is None:
            return self
        return PolicyStats(**{k: v - getattr(before, k) for k, v in asdict(self).items()})

    def summary(self) -> dict:
        s = max(self.steps, 1)
        return {**asdict(self), "drafter_fraction": round(self.drafter_steps / s, 4),
                "plain_fraction": round(self.plain_steps / s, 4),
                "nodes_per_row": round(self.nodes / max(self.rows, 1), 3), "mean_width": round(self.width / s, 3)}


class FixedPolicy:
    """Every step drafts and verifies the configured shape (`--policy fixed`)."""

    def plan(self, view: StepView) -> Plan:
        return Plan(look=True, draft=view.drafter and not view.lookup().skips_drafter)

    def cut(self, plan: Plan, tree) -> TreeCut | None:
        return None

    def observe(self, plan: Plan, outcome: StepOutcome) -> None:
        pass
