"""Audit of the greedy outputs where DFlash parts from AR in half precision (`mismatches_vs_ar` of a bench run).

    .venv/bin/python bench/mismatch_audit.py DIR [--method dflash-b16] [--noise-prompts 24]

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
Writes DIR/mismatch_audit.json and DIR/mismatch_audit.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from dflashkit import DFlashEngine
from dflashkit.bench import load_dataset
from dflashkit.loader import encode_chat, load_default_drafter, load_target


@torch.no_grad()
def gap_noise(target, prompt: list[int], tokens: list[int], block: int, rng: random.Random) -> list[dict]:
    """Per generated position: the one-token path's top-2 tokens, its gap, the block path's gap for the same two
    tokens, and whether the block path's argmax differs. prompt + tokens is an AR greedy sequence."""
    P, n = len(prompt), len(tokens)
    seq = torch.tensor([prompt + tokens])
    max_len = P + n + block + 1
    rows_one, rows_blk = [], {}
    for path in ("one", "block"):
        cache = target.new_cache(1, max_len)
        h, _ = target.forward(seq[:, :P], torch.arange(P)[None], cache, kv_len=P, taps=False)
        first = target.logits(h[:, -1:]).float()[0, 0]  # predicts tokens[0]; the same prefill on both paths
        if path == "one":
            rows_one.append(first)
            for i in range(n - 1):  # feed tokens[i] at position P + i -> predicts tokens[i + 1]
                h, _ = target.forward(seq[:, P + i:P + i + 1], torch.tensor([[P + i]]), cache, kv_len=P + i + 1,
                                      taps=False)
                rows_one.append(target.logits(h).float()[0, 0])
        else:
            rows_blk[0] = first
            p = P  # position of the block's first token (the anchor, as in a verify step)
            while p - P < n - 1:
                ids = seq[:, p:p + block]
                q = ids.shape[1]
                h, _ = target.forward(ids, torch.arange(p, p + q)[None], cache, kv_len=p + q, taps=False)
                logits = target.logits(h).float()[0]
                step = min(rng.randint(1, 4), q)  # rows kept = accepted + bonus; the rest is overwritten later
                for j in range(step):
                    rows_blk.setdefault(p - P + j + 1, logits[j])
                p += step
    out = []
    for i in range(n):
        a, b = rows_one[i], rows_blk[i]
        t1, t2 = a.topk(2).indices.tolist()
        ga, gb = float(a[t1] - a[t2]), float(b[t1] - b[t2])
        out.append({"gap_one": ga, "gap_block": gb, "noise": abs(ga - gb), "flip": int(b.argmax()) != t1})
    return out


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--method", default=None, help="the DFlash row to audit (default: the first dflash-b* row)")
    ap.add_argument("--noise-prompts", type=int, default=24, help="AR outputs per dataset for the noise measure")
    args = ap.parse_args()
    out = Path(args.dir)
    report = json.loads((out / "results.json").read_text())
    outputs = json.loads(gzip.open(out / "outputs.json.gz", "rt").read())
    dtype = report["machine"]["dtype"]
    target, tok = load_target(dtype=dtype)
    drafter, _ = load_default_drafter(target, tok)
    rng = random.Random(0)
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
        firsts, off = [], 0  # (prompt ids, AR tokens) of each item's first turn
        for item in items:
            firsts.append((encode_chat(tok, item[0]), outputs[dname]["ar"][off]))
            off += len(item)
        noise: list[dict] = []
        for prompt, toks in tqdm(firsts[: args.noise_prompts], desc=f"{dname}: rounding noise", unit="prompt"):
            if len(toks) > 1:
                noise += gap_noise(target, prompt, toks, block, rng)
        noise_all += noise
        mm = rows[method]["mismatches_vs_ar"]
        cases = []
        for d in mm["details"]:
            case = dict(d)
            if not d.get("near_tie"):
                if t64 is None:
                    t64, _ = load_target(dtype="float64")
                    d64, _ = load_default_drafter(t64, tok)
                    e64 = DFlashEngine(t64, d64, tokenizer=tok)
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
            "method": method, "mismatches": mm["count"], "near_ties_2ulp": mm["near_ties"], "cases": cases,
            "noise": {"positions": len(noise), "flips": sum(r["flip"] for r in noise),
                      "max": round(max((r["noise"] for r in noise), default=0.0), 5),
                      "p99": round(quantile([r["noise"] for r in noise], 0.99), 5) if noise else None,
                      "p999": round(quantile([r["noise"] for r in noise], 0.999), 5) if noise else None,
                      "max_gap_flipped": round(max((r["gap_one"] for r in noise if r["flip"]), default=0.0), 5)}}
    audit["noise_all"] = {"positions": len(noise_all), "flips": sum(r["flip"] for r in noise_all),
                          "max": round(max((r["noise"] for r in noise_all), default=0.0), 5),
                          "max_gap_flipped": round(max((r["gap_one"] for r in noise_all if r["flip"]), default=0.0), 5)}
    (out / "mismatch_audit.json").write_text(json.dumps(audit, indent=2) + "\n")
    md = [f"# Mismatch audit of `{out}` ({dtype})", "",
          "Rounding noise: |top-2 gap, one token per forward - the same gap, blocks per forward| over the AR outputs.", "",
          "| dataset | method | mismatches | near-ties (2 ulp) | outside | outside, equal in float64 | noise positions | argmax flips | max gap that flipped | noise p99 | noise max |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for dname, r in audit["datasets"].items():
        outside = [c for c in r["cases"] if not c.get("near_tie")]
        n = r["noise"]
        md.append(f"| {dname} | {r['method']} | {r['mismatches']} | {r['near_ties_2ulp']} | {len(outside)} | "
                  f"{sum(bool(c.get('float64_equal')) for c in outside)} | {n['positions']} | {n['flips']} | "
                  f"{n['max_gap_flipped']} | {n['p99']} | {n['max']} |")
    md += ["", "Mismatches outside the 2-ulp rule:", "", "| dataset | item | turn | index | gap | 2-ulp threshold | "
           "noise share >= gap | float64 AR == DFlash |", "|---|---|---|---|---|---|---|---|"]
    for dname, r in audit["datasets"].items():
        for c in r["cases"]:
            if not c.get("near_tie"):
                md.append(f"| {dname} | {c['item']} | {c['turn']} | {c.get('index', 'stop')} | {c.get('gap', '-')} | "
                          f"{c.get('threshold', '-')} | {c.get('noise_share_at_or_above_gap', '-')} | "
                          f"{c.get('float64_equal')} |")
    (out / "mismatch_audit.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
