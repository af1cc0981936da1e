"""The step policy on long prompts: the default against plain decoding prompt by prompt, and every default step's
predicted against its measured time (is a long context priced right?).

    .venv/bin/python bench/long_policy.py --prompts bench/results/long-8k-xeon/prompts.jsonl --isa avx2 \
        --out bench/results/long-policy/after

One process, one engine whose step cost model is calibrated here (not read from the cache, so code under test
prices with its own calibration); the prompts in order, each decoded plainly (AR) and then by the default
(`DecodeConfig.recommended()`), greedy, bf16. `--isa avx2` runs the kernels' AVX2 path on any x86 host (what an
AVX2-only CPU runs, there with its own speed). Per default step: its width, whether the drafter ran (and as a
probe), the policy's predicted ms (its cost model at that moment, learned scales included) and the measured ms.
Run another version's code with PYTHONPATH set to its src/. Writes long_policy.json, .md and .png into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def decode(engine, ids: list[int], config, max_new: int) -> dict:
    t0 = time.perf_counter()
    g = engine.generate([ids], max_new_tokens=max_new, config=config)[0]
    d = g.stats.to_dict()
    return {"s": round(time.perf_counter() - t0, 2), "tokens": g.tokens, "new_tokens": d["new_tokens"],
            "tpot_ms": d["tpot_ms"], "ttft_ms": d["ttft_ms"], "tau": d["tau"]}


def traced(policy, steps: list) -> None:
    """Record each step the policy observes: what it chose, what its cost model predicted, what the step took."""
    observe = policy.observe

    def record(plan, outcome):
        rec, c = plan.record, policy.cost
        pred = c.pass_ms(rec.rows, rec.width, rec.ctx) + (c.draft(rec.rows, *rec.draft_in) if plan.draft else 0.0)
        steps.append({"ctx": rec.ctx, "width": rec.width, "drafter": bool(plan.draft), "probe": bool(rec.probe),
                      "predicted_ms": round(pred, 2), "ms": round(outcome.ms, 2), "accepted": outcome.accepted[0]})
        return observe(plan, outcome)
    policy.observe = record


def run(args) -> dict:
    from dflashkit import DecodeConfig, DFlashEngine
    from dflashkit.kernels import isa, set_isa
    from dflashkit.loader import encode_chat, load_models
    from dflashkit.measurements import cpu_name

    set_isa(args.isa)  # before loading: it changes the bits (each path is exact against its own AR)
    target, tok, drafter, _ = load_models()
    engine = DFlashEngine(target, drafter, tokenizer=tok, cost_file=None)
    default = DecodeConfig.recommended()
    policy = engine.policy(engine.resolve(default))
    rows, steps = [], []
    traced(policy, steps)  # AR runs without this policy: only the default's steps are recorded
    for i, line in enumerate(Path(args.prompts).read_text().splitlines()[:args.limit]):
        ids = encode_chat(tok, json.loads(line)["prompt"])
        ar = decode(engine, ids, DecodeConfig.autoregressive(), args.max_new_tokens)
        first = len(steps)
        dflash = decode(engine, ids, default, args.max_new_tokens)
        rows.append({"prompt": i, "prompt_tokens": len(ids), "ar": ar, "default": dflash, "steps": steps[first:],
                     "same_tokens": ar.pop("tokens") == dflash.pop("tokens")})
    c = policy.cost
    return {"meta": {"command": "bench/long_policy.py " + " ".join(sys.argv[1:]), "cpu": cpu_name(), "isa": isa(),
                     "engine": target.engine_name, "max_new_tokens": args.max_new_tokens,
                     "date": time.strftime("%Y-%m-%d")},
            "cost_model": {"verify_ms": c.verify_ms, "ctx_ms": c.ctx_ms, "draft_ms": c.draft_ms,
                           "draft_ctx_ms": c.draft_ctx_ms, "ingest_ms": c.ingest_ms, "scale": c.scale,
                           "wide": c.wide},
            "prompts": rows}


def summary(res: dict) -> dict:
    """Decode time over all prompts (new tokens x TPOT) for AR and the default, and the default's steps."""
    p = res["prompts"]
    ar = sum(r["ar"]["new_tokens"] * r["ar"]["tpot_ms"] for r in p)
    df = sum(r["default"]["new_tokens"] * r["default"]["tpot_ms"] for r in p)
    steps = [s for r in p for s in r["steps"]]
    probes = [s for s in steps if s["probe"]]
    return {"ar_s": ar / 1000, "default_s": df / 1000, "speedup": ar / df if df else 0.0, "steps": len(steps),
            "drafter_steps": sum(s["drafter"] for s in steps), "probe_ms": sum(s["ms"] for s in probes),
            "differing": sum(not r["same_tokens"] for r in p)}


def report(res: dict) -> str:
    m, s = res["meta"], summary(res)
    lines = [f"# The step policy on long prompts (`{m['command']}`)", "",
             f"{m['cpu']}, kernels `{m['isa']}` ({m['engine']}), {m['date']}; greedy, {m['max_new_tokens']} new "
             "tokens, AR then the default per prompt, one engine.", "",
             "| prompt | tokens | AR TPOT ms | default TPOT ms | default / AR | tau | steps | drafter steps | "
             "same output |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["prompts"]:
        a, d = r["ar"], r["default"]
        lines.append(f"| {r['prompt']} | {r['prompt_tokens']} | {a['tpot_ms']:.1f} | {d['tpot_ms']:.1f} | "
                     f"{a['tpot_ms'] / d['tpot_ms']:.2f}x | {d['tau']:.2f} | {len(r['steps'])} | "
                     f"{sum(x['drafter'] for x in r['steps'])} | {r['same_tokens']} |")
    lines += ["", f"All prompts: decoding {s['ar_s']:.2f} s (AR) vs {s['default_s']:.2f} s (default): "
              f"**{s['speedup']:.2f}x**; {s['drafter_steps']} of {s['steps']} steps ran the drafter "
              f"(probes: {s['probe_ms']:.0f} ms); {s['differing']} outputs differing from AR.", "",
              "Predicted vs measured ms of the default's steps, by width (median ratio measured / predicted):", "",
              "| width | steps | median measured ms | median predicted ms | measured / predicted |",
              "|---|---|---|---|---|"]
    by: dict = {}
    for r in res["prompts"]:
        for x in r["steps"]:
            by.setdefault(x["width"], []).append(x)
    for w in sorted(by):
        xs = by[w]
        med = sorted(x["ms"] for x in xs)[len(xs) // 2]
        pm = sorted(x["predicted_ms"] for x in xs)[len(xs) // 2]
        ratio = sorted(x["ms"] / x["predicted_ms"] for x in xs)[len(xs) // 2]
        lines.append(f"| {w} | {len(xs)} | {med:.1f} | {pm:.1f} | {ratio:.2f} |")
    return "\n".join(lines) + "\n"


def plot(res: dict):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    steps = [x for r in res["prompts"] for x in r["steps"]]
    sc = ax.scatter([x["predicted_ms"] for x in steps], [x["ms"] for x in steps], c=[x["width"] for x in steps],
                    cmap="viridis", s=14)
    hi = max([x["ms"] for x in steps] + [x["predicted_ms"] for x in steps] + [1.0])
    ax.plot([0, hi], [0, hi], "k--", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="predicted ms", ylabel="measured ms",
           title=f"default's steps on long prompts ({res['meta']['isa']})")
    fig.colorbar(sc, label="verify width")
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", required=True, help="JSONL, one {\"prompt\": ...} per line")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--isa", default="auto", choices=("auto", "avx512bf16", "avx2"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from dflashkit.bench.report import write_result

    res = run(args)
    write_result(args.out, "long_policy", res, report(res), plot)
    print(report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
