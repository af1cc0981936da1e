"""Steps with the kernels' weights on 4 KiB pages vs transparent huge pages (kernels/hugepages.py), A/B in one
process.

    .venv/bin/python bench/hugepages.py --out bench/results/hugepages-amd [--aa]

Two engines (the default target and the bundled drafter) are loaded, the first with `hugepages` off, the second on;
then in each round every step runs on each, the engines' order alternating round by round: one-token and
small-verify target steps (1 row, after a 176-token prompt) and the drafter's drafting steps at blocks 2, 4 and 16.
--block 1 (the default): every step follows a step of the other engine, so both engines' weights and page tables
compete for the caches (this favours huge pages more than one engine would see); --block 30: 30 steps in a row per
engine, as a lone engine decodes. --aa loads both on huge pages (the A/A control: ratios within its spread are
noise). Writes hugepages.json, .md and .png into --out.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from dflashkit.kernels import hugepages
from dflashkit.measurements import cpu_name

from step_ab import ab_parser, engine_steps, plot_ratios, step_label  # noqa: E402  (bench/ is not a package)


def arm_steps(on: bool, ctx: int) -> tuple[dict, str]:
    """One engine's steps, loaded with `hugepages` on or off, each run once (weights packed lazily are packed now,
    under this arm's setting); and the target's engine name."""
    hugepages.set_enabled(on)
    fns, target = engine_steps(ctx)
    return fns, target.engine_name


def main() -> int:
    from dflashkit.bench.report import write_result

    ap = ab_parser(__doc__, "both engines on huge pages (the A/A control)")
    ap.add_argument("--block", type=int, default=1,
                    help="steps in a row on one engine (> 5: its first 5 not counted): 1 interleaves the engines "
                         "step by step (their page tables compete too); 30 runs each like a lone engine")
    args = ap.parse_args()
    if not hugepages.enabled():
        raise SystemExit("transparent huge pages are off here (or DFLASHKIT_HUGE_PAGES=0): nothing to compare")
    with torch.inference_mode():
        fns = {}
        for arm, on in (("4k", args.aa), ("huge", True)):
            steps, engine = arm_steps(on, args.context)
            fns.update({(arm, k): fn for k, fn in steps.items()})
        keys = list(steps)
        runs: dict = {k: [] for k in fns}
        for i in range(args.rounds + 10):
            for key in keys:
                for arm in (("4k", "huge") if i % 2 else ("huge", "4k")):
                    for j in range(args.block):
                        t0 = time.perf_counter()
                        fns[arm, key]()
                        if i >= 10 and (args.block == 1 or j >= 5):  # warm-up rounds; a block's first steps
                            runs[arm, key].append((time.perf_counter() - t0) * 1e3)
    res = {"ms": {key: {arm: round(statistics.median(runs[arm, key]), 3) for arm in ("4k", "huge")} for key in keys},
           "meta": {"command": "bench/hugepages.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
                    "cpu": cpu_name(), "threads": torch.get_num_threads(), "rounds": args.rounds, "aa": args.aa,
                    "block": args.block,
                    "context": args.context, "engine": engine}}
    for v in res["ms"].values():
        v["ratio"] = round(v["huge"] / v["4k"], 3)
    write_result(args.out, "hugepages", res, report(res), plot)
    print(report(res))
    return 0


def report(res: dict) -> str:
    mt = res["meta"]
    arms = "both on huge pages (A/A control)" if mt["aa"] else "4 KiB pages vs huge pages"
    lines = [f"# Weights on 4 KiB vs transparent huge pages ({mt['date']}, {mt['cpu']}, {mt['threads']} threads)", "",
             f"`{mt['command']}`: {arms}; medians of {mt['rounds']} rounds, "
             + ("every step after a step of the other engine" if mt.get("block", 1) == 1 else
                f"{mt['block']} steps in a row per engine (the first 5 not counted)")
             + f", 1 row, {mt['context']}-token context; target {mt['engine']}.", "",
             "| step | 4 KiB pages, ms | huge pages, ms | ratio |", "|---|---|---|---|"]
    for key, v in res["ms"].items():
        what = step_label(key)
        lines.append(f"| {what} | {v['4k']:.2f} | {v['huge']:.2f} | {v['ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(res: dict):
    return plot_ratios(res["ms"], "huge pages / 4 KiB pages (step time)", (0.8, 1.1))


if __name__ == "__main__":
    raise SystemExit(main())
