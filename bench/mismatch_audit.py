"""Audit of the greedy outputs where DFlash parts from AR in half precision (`mismatches_vs_ar` of a bench run).

    .venv/bin/python bench/mismatch_audit.py DIR [--method dflash-b16] [--noise-prompts 24] [--apply]

DIR is a `dflashkit bench` output directory (results.json + outputs.json.gz, bfloat16, T=0). Two questions:

1. How large is a rounding tie, measured rather than assumed? A DFlash step verifies a block of B tokens in one
   target forward; AR decodes one token per forward. In bf16 the two round differently, and so do the K/V they
   leave in the cache. For `--noise-prompts` AR outputs of the run, the target is run over the same tokens both
   ways: one token per forward, and blocks of B tokens that advance by 1-4 positions at a time (the computation
   a verify step does at tau ~2, rejected rows overwritten by the next block). At every generated position the
   gap between the one-token path's top-2 logits is recomputed from the block path's logits; the distribution
   of |gap_one - gap_block| and the argmax flips between the paths are the size of a rounding tie here.
2. Is each mismatch a rounding tie? For every differing output the harness's gap (top-2 gap of the target on
   the AR prefix, `details` in results.json) is set against that distribution, and every mismatch outside the
   2-ulp rule is decoded again in float64, AR and DFlash, by the same engine: equal float64 outputs mean the
   half-precision difference comes from rounding, not from the algorithm.
A mismatch is a near-tie when its gap is within 2 ulps of the top logit or within the largest gap change the
measurement saw (`dflashkit bench` applies the same rule, measuring the noise on fewer prompts inline).
Writes DIR/mismatch_audit.json and DIR/mismatch_audit.md; `--apply` also rewrites mismatches_vs_ar in
DIR/results.json and results.md with this classification (for runs made before the bench measured it).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from dflashkit import DecodeConfig, DFlashEngine
from dflashkit.bench import calibrate_noise, is_near_tie, load_dataset, noise_summary, write_markdown
from dflashkit.loader import encode_chat, load_default_drafter, load_target


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--method", default=None, help="the DFlash row to audit (default: the first dflash-b* row)")
    ap.add_argument("--noise-prompts", type=int, default=24, help="AR outputs per dataset for the noise measure")
    ap.add_argument("--apply", action="store_true",
                    help="rewrite mismatches_vs_ar in results.json/.md with this audit's measured near-tie bound "
                         "(what `dflashkit bench` does itself since it measures the bound inline)")
    args = ap.parse_args()
    out = Path(args.dir)
    report = json.loads((out / "results.json").read_text())
    outputs = json.loads(gzip.open(out / "outputs.json.gz", "rt").read())
    dtype = report["machine"]["dtype"]
    target, tok = load_target(dtype=dtype)
    audit: dict = {"source": str(out), "dtype": dtype, "datasets": {}}
    noise_all: list[dict] = []
    t64 = None
    for dname, rows in report["results"].items():
        method = args.method or next(m for m in rows if m.startswith("dflash-b") and "@" not in m)
        block = int(method.rsplit("-b", 1)[1])
        items = load_dataset(dname) if dname in ("humaneval", "mt-bench", "mt-bench-t1", "sharegpt-heldout", "math") else None
        if items is None:
            continue
        items = items[: len(outputs[dname]["ar"])]
        summary, noise = calibrate_noise(target, tok, items, outputs[dname]["ar"], block, args.noise_prompts)
        noise_all += noise
        mm = rows[method]["mismatches_vs_ar"]
        bound = summary["max"]
        cases = []
        for d in mm["details"]:
            case = dict(d)
            case["within_2ulp"] = "gap" in d and d["gap"] <= d["threshold"]
            case["noise_bound"] = bound
            case["near_tie"] = "gap" in d and is_near_tie(d["gap"], d["threshold"], bound)
            if not case["within_2ulp"]:
                if t64 is None:
                    t64, _ = load_target(dtype="float64")
                    d64, _ = load_default_drafter(t64, tok)
                    e64 = DFlashEngine(t64, d64, tokenizer=tok, config=DecodeConfig())
                item = items[d["item"]]
                history, off_item = [], sum(len(x) for x in items[: d["item"]])
                for t in range(d["turn"]):  # earlier turns are equal: rebuild the AR history
                    history += [{"role": "user", "content": item[t]},
                                {"role": "assistant", "content": tok.decode(outputs[dname]["ar"][off_item + t],
                                                                            skip_special_tokens=True)}]
                prompt = encode_chat(tok, history + [{"role": "user", "content": item[d["turn"]]}])
                n = max(len(outputs[dname]["ar"][off_item + d["turn"]]), len(outputs[dname][method][off_item + d["turn"]]))
                ar64 = e64.generate([prompt], max_new_tokens=n, block_size=1)[0].tokens
                df64 = e64.generate([prompt], max_new_tokens=n, block_size=block)[0].tokens
                case["float64_equal"] = ar64 == df64
                case["float64_ar_equals_bf16_ar_until_divergence"] = ar64[: d.get("index", 0)] == \
                    outputs[dname]["ar"][off_item + d["turn"]][: d.get("index", 0)]
            if "gap" in d:
                case["noise_share_at_or_above_gap"] = round(sum(r["noise"] >= d["gap"] for r in noise) / max(len(noise), 1), 5)
            cases.append(case)
        audit["datasets"][dname] = {
            "method": method, "mismatches": mm["count"], "near_ties_2ulp": sum(c["within_2ulp"] for c in cases),
            "near_ties": sum(c["near_tie"] for c in cases), "cases": cases,
            "noise": summary}
        if args.apply:
            rows["ar"]["rounding_noise"] = audit["datasets"][dname]["noise"]
            keep = ("item", "turn", "index", "gap", "threshold", "noise_bound", "near_tie", "stop_only")
            rows[method]["mismatches_vs_ar"] = {
                "count": mm["count"], "near_ties": audit["datasets"][dname]["near_ties"],
                "near_ties_2ulp": audit["datasets"][dname]["near_ties_2ulp"],
                "details": [{k: c[k] for k in keep if k in c} for c in cases],
                "classified_by": "bench/mismatch_audit.py --apply"}
    audit["noise_all"] = noise_summary(noise_all)
    (out / "mismatch_audit.json").write_text(json.dumps(audit, indent=2) + "\n")
    if args.apply:
        (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
        write_markdown(report, out, "\nMismatches classified by `bench/mismatch_audit.py --apply` (see mismatch_audit.md).\n")
    md = [f"# Mismatch audit of `{out}` ({dtype})", "",
          "Rounding noise: |top-2 gap, one token per forward - the same gap, blocks per forward| over the AR outputs.", "",
          "| dataset | method | mismatches | within 2 ulps | within measured noise | outside both | outside 2 ulps, "
          "equal in float64 | noise positions | argmax flips | largest gap that flipped | noise p99 | noise max |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for dname, r in audit["datasets"].items():
        out2 = [c for c in r["cases"] if not c["within_2ulp"]]
        n = r["noise"]
        md.append(f"| {dname} | {r['method']} | {r['mismatches']} | {r['near_ties_2ulp']} | {r['near_ties']} | "
                  f"{r['mismatches'] - r['near_ties']} | {sum(bool(c.get('float64_equal')) for c in out2)} of "
                  f"{len(out2)} | {n['positions']} | {n['flips']} | {n['max_gap_flipped']} | {n['p99']} | {n['max']} |")
    md += ["", "Mismatches outside the 2-ulp rule:", "", "| dataset | item | turn | index | gap | 2-ulp threshold | "
           "measured noise bound | share of positions with noise >= gap | float64 AR == DFlash |",
           "|---|---|---|---|---|---|---|---|---|"]
    for dname, r in audit["datasets"].items():
        for c in r["cases"]:
            if not c["within_2ulp"]:
                md.append(f"| {dname} | {c['item']} | {c['turn']} | {c.get('index', 'stop')} | {c.get('gap', '-')} | "
                          f"{c.get('threshold', '-')} | {c['noise_bound']} | {c.get('noise_share_at_or_above_gap', '-')} | "
                          f"{c.get('float64_equal')} |")
    (out / "mismatch_audit.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
