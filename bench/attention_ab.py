"""Steps with `attend`'s grouped layout for short key lists vs its per-(query, head) split layout, A/B in one process.

    .venv/bin/python bench/attention_ab.py --out bench/results/attention-grouped [--aa] [--rounds 150]

The default engine (the default target, the bundled drafter) is loaded once; the layout is a process-wide switch
(`kernels.set_attention_layout`, the same bits either way), so each step runs under "split" and under "auto" (grouped)
back to back, the arms' order alternating round by round: one-row target steps of 1-16 new tokens
after a 176-token prompt (forward + LM head over every new token, as a verify computes it), the drafter's
drafting steps at blocks 2, 4 and 16, and target steps of 1 and 4 new tokens for each of --rows batch rows. Also
each arm's 4-token verify over its one-token step (issue 34's ratio).
--aa runs "auto" in both arms (the A/A control: ratios within its spread are noise). Writes attention_ab.json, .md
and .png into --out.
"""

from __future__ import annotations

import sys
import time

import torch

from dflashkit.kernels import set_attention_layout
from dflashkit.measurements import cpu_name

from roofline import target_steps  # noqa: E402  (bench/ is not a package)
from step_ab import ab_medians, ab_parser, engine_steps, plot_ratios, step_label  # noqa: E402


def main() -> int:
    from dflashkit.bench.report import write_result

    ap = ab_parser(__doc__, '"auto" in both arms (the A/A control)')
    ap.add_argument("--rows", default="4,8", help="batch rows whose 1- and 4-token steps are timed too ('': none)")
    args = ap.parse_args()
    arms = {"split": "auto" if args.aa else "split", "grouped": "auto"}
    fns, target = engine_steps(args.context)
    with torch.inference_mode():
        rows = [int(r) for r in args.rows.split(",") if r]
        fns.update({f"rows{k}": v[0] for k, v in target_steps(target, args.context, rows, [1, 4]).items()})

    def prepare(arm: str, key: str):
        set_attention_layout(arms[arm])
        return fns[key]

    with torch.inference_mode():
        try:
            ms = ab_medians(list(fns), args.rounds, prepare, arms=("split", "grouped"))
        finally:
            set_attention_layout("auto")
    res = {"ms": ms,
           "verify4_over_step1": {arm: round(ms["target_w4"][arm] / ms["target_w1"][arm], 3) for arm in arms},
           "meta": {"command": "bench/attention_ab.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
                    "cpu": cpu_name(), "threads": torch.get_num_threads(), "rounds": args.rounds, "aa": args.aa,
                    "context": args.context, "rows": args.rows, "engine": target.engine_name}}
    write_result(args.out, "attention_ab", res, report(res), plot)
    print(report(res))
    return 0


def report(res: dict) -> str:
    mt, v4 = res["meta"], res["verify4_over_step1"]
    arms = '"auto" in both arms (A/A control)' if mt["aa"] else "split layout vs grouped layout"
    lines = [f"# Short-list attention layouts in real steps ({mt['date']}, {mt['cpu']}, {mt['threads']} threads)", "",
             f"`{mt['command']}`: {arms}; medians of {mt['rounds']} rounds, the arms back to back step by step, 1 row"
             + (f" (and batch rows {mt['rows']} where named)" if mt.get("rows") else "") + ", "
             f"{mt['context']}-token context; target {mt['engine']}.", "",
             "| step | split, ms | grouped, ms | ratio |", "|---|---|---|---|"]
    for key, v in res["ms"].items():
        what = step_label(key)
        lines.append(f"| {what} | {v['split']:.2f} | {v['grouped']:.2f} | {v['ratio']:.3f} |")
    lines += ["", f"4-token verify / one-token step: split {v4['split']:.3f}x, grouped {v4['grouped']:.3f}x."]
    return "\n".join(lines) + "\n"


def plot(res: dict):
    return plot_ratios(res["ms"], "grouped / split layout (step time)", (0.7, 1.1))


if __name__ == "__main__":
    raise SystemExit(main())
