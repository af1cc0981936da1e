"""When to run the drafter while it does not pay (`Probes`), and when not even to look (`Looks`).

- `Probes`: what drafting has been worth per live row (EMA of the chosen cut's gain and width), and back-off probes
  of a drafter that stopped paying, so the policy can find out that it pays again.
- `Looks`: a look (lookup + cut) costs host time; where recent looks were worth less than they cost, the next 1, 2,
  4, then PLAIN_MAX steps are plain AR steps without looking (exact either way: a plain step is the AR step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..step_cost import batch_bucket

PROBE_MIN, PROBE_MAX = 4, 64  # steps between probes of a drafter that stopped paying (doubling back-off)
# ... and a probe's extra time (drafter, pending features, wider verify) at most this share of the plain time since
# the last, halved per unpaid probe at this batch size (at 3 %, cells where drafting never paid lost ~2.5 % to it).
PROBE_BUDGET = 0.01
# The engine's first probe, before anything is known of the drafter, may cost up to this many plain steps whatever
# the budget; a dearer one (a long prompt's features all pending: at ~8k tokens ~23 plain steps) waits for it.
FIRST_PROBE_STEPS = 4
# Plain steps between looks once looking stops paying: doubled per unpaid look, up to PLAIN_MAX (a copy is found at
# most 8 steps late; a look at batch 16, ~3 % of a step, then costs a ninth of that); LOOK_DECAY: the EMAs' weight.
# (A longer memory, 0.9, did not remove the slow runs on HumanEval at batch 4: bench/results/policy-looks-fix/.)
PLAIN_MAX, LOOK_DECAY = 8, 0.7


@dataclass
class Probes:
    """What drafting has been worth, per live row, in the steps that drafted (EMA): the expected accepted tokens of
    the chosen cut and its width. With the cost model they predict the rate of drafting at any batch size. The
    prior, before the drafter has run here: one accepted token per row from a 4-node cut (a modest drafter); where
    even that would not pay (a CPU whose wide passes are slow, a big batch) the drafter waits for a probe."""

    gain: float = 1.0
    width: float = 4.0
    drafted_once: bool = False
    skipped: int = 0  # steps since the drafter ran
    skipped_ms: float = 0.0  # ... their predicted plain ms each at its own batch size (not steps x today's)
    backoff: int = PROBE_MIN
    unpaid: dict[int, int] = field(default_factory=dict)  # per batch-size bucket: probes in a row that did not pay

    def due(self, rows: int, base: float, extra: float) -> bool:
        """A probe is due: after `backoff` skipped steps, once the plain steps since the last run cost enough that
        the probe's extra time fits PROBE_BUDGET of them. The engine's first probe may also spend up to
        FIRST_PROBE_STEPS plain steps (`base` each): nothing is known of the drafter yet. Why not whatever it costs:
        on a fresh engine whose first prompt is long, the probe ingests every prompt feature and drafts over them
        (an 8k-token prompt on the AVX2 path: 925 ms, ~23 plain steps, a fifth of a 128-token answer). Later probes
        wait for the budget alone: what drafting earns per row is known then and carries over to other batch sizes
        (measured: an unconditional first probe per batch size cost 5-10 % of a 32-token cell where drafting never
        paid)."""
        k = batch_bucket(rows)
        allowance = (self.skipped_ms + base) * PROBE_BUDGET / 2 ** self.unpaid.get(k, 0)
        if not self.drafted_once:
            allowance = max(allowance, FIRST_PROBE_STEPS * base)
        return self.skipped + 1 >= self.backoff and allowance >= extra

    def skip(self, plain_ms: float) -> None:
        """A step without the drafter."""
        self.skipped += 1
        self.skipped_ms += plain_ms

    def learn(self, gain: float, width: int, paid: bool, rows: int) -> None:
        """A drafted step's best cut (expected accepted per live row, width) and whether it beat not drafting."""
        keep = 0.7 if self.drafted_once else 0.0  # the first measurement replaces the prior
        self.gain = keep * self.gain + (1 - keep) * gain
        self.width = keep * self.width + (1 - keep) * width
        self.drafted_once = True
        self.skipped, self.skipped_ms = 0, 0.0
        self.backoff = PROBE_MIN if paid else min(2 * self.backoff, PROBE_MAX)
        k = batch_bucket(rows)
        self.unpaid[k] = 0 if paid else min(self.unpaid.get(k, 0) + 1, 6)


@dataclass
class Looks:
    """What a look is worth (ms its cut saves against AR) and costs (host ms), per looked step (EMA). The value
    starts high, so the first steps look."""

    value: float = math.inf
    ms: float = 0.0
    plain_left: int = 0  # plain steps still to take
    plain_span: int = 1  # the next run's length

    def plain(self) -> bool:
        """This step is a plain step of a run (and counts it)."""
        if self.plain_left > 0:
            self.plain_left -= 1
            return True
        return False

    def learn(self, value: float, spent: float) -> None:
        """A look without the drafter: value < cost starts a run of `plain_span` plain steps (doubling)."""
        first = math.isinf(self.value)
        self.value = value if first else LOOK_DECAY * self.value + (1 - LOOK_DECAY) * value
        self.ms = spent if first else LOOK_DECAY * self.ms + (1 - LOOK_DECAY) * spent
        if self.value < self.ms:
            self.plain_left, self.plain_span = self.plain_span, min(2 * self.plain_span, PLAIN_MAX)
        else:
            self.plain_span = 1
