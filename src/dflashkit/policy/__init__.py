"""The step policy: how much to draft and verify each step, so that speculation never costs a user time.

Every verified token costs time (on 2 CPU cores a pass of 16 tokens can cost 6x a pass of one), and the drafter's
forward costs time too. A draft is worth verifying only where its expected accepted tokens buy back its cost, and
that depends on the machine, the batch size, the context length and how well the drafter is doing right now.

- `step.py`: the seam. The batch calls `plan(StepView) -> Plan`, `cut(plan, tree) -> TreeCut`, `observe(plan,
  StepOutcome)` and nothing else; `FixedPolicy` (`--policy fixed`) drafts and verifies the configured shape.
- `CostModel` (`step_cost.py`): ms of a target pass by the tokens it verifies (all rows, padded width) and the
  context length, plus the drafter's by its rows, context and pending features. Calibrated once per machine and
  model, then corrected online from every measured step.
- `acceptance.py`: the expected acceptance of each node, calibrated from what verification observed, times each
  row's own observed / predicted ratio.
- `cut.py`: keep the nodes worth more than a threshold chosen to maximise committed tokens per millisecond of the
  whole batch. Keeping only the anchor is a plain AR step, always among the choices: by its own model the policy
  never picks a step slower than AR.
- `probes.py`: run the drafter only where it has been paying at this batch size, with back-off probes; where recent
  looks (lookup + cut, host time) found nothing worth their cost, take runs of plain steps without looking.
- `adaptive.py`: `AdaptivePolicy` (the default) puts them together.
Exact by construction: a policy only chooses which nodes are verified, from the drafter, the lookup and the past
(never from this step's target choices); verification and commit are unchanged (`tree.py`).
"""

from .acceptance import Acceptance, RowHistory
from .adaptive import AdaptivePolicy
from .cut import ANCHOR, MARGIN, CutChoice, best_cut
from .step import FixedPolicy, Plan, PolicyStats, StepOutcome, StepView, TreeCut

__all__ = ["ANCHOR", "MARGIN", "Acceptance", "AdaptivePolicy", "CutChoice", "FixedPolicy", "Plan", "PolicyStats",
           "RowHistory", "StepOutcome", "StepView", "TreeCut", "best_cut"]
