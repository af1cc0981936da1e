"""Does a change keep the adaptive policy's decisions? Its choices, step by step, on the real target, under fixed
cost models and a clock that advances a fixed amount per reading, so that two runs of the same code choose alike
(the real policy learns from wall time, which no two runs share; tokens alone cannot show a change of policy, since
output is exact whatever it verifies).

    .venv/bin/python bench/policy_trace.py --out bench/results/house-check/policy-trace-after.json
    .venv/bin/python bench/policy_trace.py --compare A.json B.json

Recorded per cost model, dataset and batch size: every sequence's tokens, accepted depth per step and verified /
accepted draft nodes per source, and the policy's counts (steps, drafter steps, probes, plain steps, nodes, summed
widths); at the end its calibration. Run with the code to compare on PYTHONPATH (a git worktree's src/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from dflashkit import DecodeConfig, DFlashEngine
from dflashkit.bench.datasets import load_dataset
from dflashkit.loader import encode_chat, load_models
from dflashkit.step_cost import DRAFT_GRID, VERIFY_GRID, CostModel

# Cost models (not learning) where drafting pays sometimes (mid) and rarely (steep: probes and plain steps).
MODELS = {"mid": ([10.0 + 0.5 * n for n in VERIFY_GRID], [3.0, 6.0, 20.0]),
          "steep": ([10.0 + 3.0 * n for n in VERIFY_GRID], [8.0, 20.0, 60.0])}
TICK_S = 0.0003  # what each clock reading advances: a look costs 0.3 ms of "host time"


def stepping_clock():
    t = [0.0]

    def clock() -> float:
        t[0] += TICK_S
        return t[0]
    return clock


def use_clock(policy, clock) -> None:
    """The policy reads `clock` for a look's host time (a policy module importing `time` reads its perf_counter)."""
    if hasattr(policy, "clock"):
        policy.clock = clock
    else:
        import dflashkit.policy as module

        module.time = SimpleNamespace(perf_counter=clock)


def trace(target, tok, drafter, prompts: dict, sizes: list[int], max_new: int) -> dict:
    out = {}
    for name, (verify, draft) in MODELS.items():
        cost = CostModel(verify, 0.0, draft, learn=False)
        assert len(draft) == len(DRAFT_GRID)
        engine = DFlashEngine(target, drafter, tokenizer=tok, cost=cost)
        config = DecodeConfig.recommended()
        policy = engine.policy(engine.resolve(config))
        use_clock(policy, stepping_clock())
        for dataset, ids in prompts.items():
            for n in sizes:
                rows = []
                for i in range(0, len(ids), n):
                    for g in engine.generate(ids[i:i + n], max_new_tokens=max_new, config=config):
                        d = g.stats.to_dict()
                        rows.append({"tokens": g.tokens, "accepted": list(g.stats.accepted),
                                     "draft_nodes": d["draft_nodes"]})
                out[f"{name}/{dataset}/b{n}"] = {"sequences": rows, "policy": dict(vars(policy.stats))}
        out[f"{name}/calibration"] = policy.acc.report()
    return out


def compare(a: dict, b: dict) -> list[str]:
    """The keys whose records differ (empty: the same choices)."""
    return sorted(k for k in (set(a) | set(b)) - {"command"} if a.get(k) != b.get(k))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="per dataset (HumanEval, MT-Bench first turns)")
    ap.add_argument("--sizes", default="1,4")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args()
    if args.compare:
        a, b = (json.loads(Path(p).read_text()) for p in args.compare)
        diff = compare(a, b)
        print(json.dumps({"records": len(set(a) | set(b)), "differing": diff}, indent=1))
        return 1 if diff else 0
    target, tok, drafter, _ = load_models()
    prompts = {d: [encode_chat(tok, it[0]) for it in load_dataset(d, args.prompts)]
               for d in ("humaneval", "mt-bench-t1")}
    res = trace(target, tok, drafter, prompts, [int(x) for x in args.sizes.split(",")], args.max_new_tokens)
    res["command"] = "bench/policy_trace.py " + " ".join(sys.argv[1:])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
