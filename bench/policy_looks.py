"""bench/policy_sweep.py, recording every look of the adaptive policy: (the value of its cut in ms, its host ms).

    .venv/bin/python bench/policy_looks.py OUT.json [policy_sweep.py arguments]

Works on the policy before the policy seam (e4f65e5, `AdaptivePolicy._learn_look`) and after it (`Looks.learn`),
so that a before/after comparison shows whether a look is valued or timed differently. The value is computed as the
policy computes it; nothing the policy decides changes.
"""

from __future__ import annotations

import atexit
import json
import runpy
import sys
import time

RECORD: list[tuple[float, float]] = []  # per look: (value ms, host ms)


def record_after_the_seam() -> bool:
    try:
        from dflashkit.policy.probes import Looks
    except ImportError:
        return False
    learn = Looks.learn

    def recorded(self, value: float, spent: float) -> None:
        RECORD.append((round(value, 4), round(spent, 4)))
        learn(self, value, spent)

    Looks.learn = recorded
    return True


def record_before_the_seam() -> None:
    import dflashkit.policy as policy

    learn = policy.AdaptivePolicy._learn_look

    def recorded(self, batch, cut: tuple, live: int) -> None:
        spent = 1000 * (time.perf_counter() - self._t_look)
        base = self._cost_of(batch)(1)
        value = max((live + cut[2]) * base / max(live, 1) - (live + cut[2]) / max(cut[3], 1e-9), 0.0)
        RECORD.append((round(value, 4), round(spent, 4)))
        learn(self, batch, cut, live)

    policy.AdaptivePolicy._learn_look = recorded


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    out = sys.argv.pop(1)
    if not record_after_the_seam():
        record_before_the_seam()
    atexit.register(lambda: open(out, "w").write(json.dumps(RECORD) + "\n"))
    sys.argv[0] = "bench/policy_sweep.py"
    runpy.run_path("bench/policy_sweep.py", run_name="__main__")


if __name__ == "__main__":
    main()
