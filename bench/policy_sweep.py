"""Throughput vs batch size of plain AR, the fixed tree + lookup and the adaptive policy, INTERLEAVED.

    .venv/bin/python bench/policy_sweep.py --prompts 16 --max-new-tokens 32 --out bench/results/policy-batch

Why interleaved: on a shared 2-core host the same command ran 40 % slower five minutes later (AR at batch 1:
63 s, then 90 s, in one `dflashkit bench` run), which swamps a 5 % question. Here every chunk of prompts is
decoded by all three methods in lockstep (one step of each in turn; who goes first and who follows whom balanced
over chunks: `turn_order`), so drift hits them alike; back-to-back chunks were not enough (`run_lockstep`). Why
decode throughput
(generated tokens after the first / time after the prefill): the prefill is the same work for every method and on
a CPU without bf16 units it dominates (4 HumanEval prompts: ~13 s of prefill, ~2 s of decoding 32 tokens) and
varies by +-1 s, which would hide the decoding entirely; the total with prefill is kept in the JSON. Reported per
batch size: decode tokens/s per method, tau, what the policy chose, and the median over chunks of
adaptive / max(ar, fixed) besides the ratio of totals. The datasets are HumanEval and MT-Bench first turns.
Writes policy_sweep.json, .md and .png (throughput and the policy's chosen draft size vs batch size).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from dflashkit import DecodeConfig, DFlashEngine
from dflashkit.bench import turn_order
from dflashkit.bench.runner import run_lockstep as lockstep
from dflashkit.bench.datasets import load_dataset
from dflashkit.loader import encode_chat, load_models

METHODS = {"ar": DecodeConfig.autoregressive(), "fixed": DecodeConfig.recommended(policy="fixed"),
           "adaptive": DecodeConfig.recommended()}
# `--aa`: plain AR a second time in the same lockstep, so that ar-again / ar shows the host's noise per cell
CONTROL = {"ar-again": DecodeConfig.autoregressive()}


def run_lockstep(engine, prompts, names: list[str], max_new: int) -> dict:
    """The methods `names` (in that turn order) decode `prompts` in lockstep (`runner.run_lockstep`)."""
    return lockstep({m: engine.stream(prompts, max_new_tokens=max_new, config={**METHODS, **CONTROL}[m])
                     for m in names})


def sweep(engine, prompts, sizes, max_new, desc, base: int, min_chunks: int, aa: bool = False) -> dict:
    """base: prompts per batch size; big batches take more (`min_chunks` chunks of n) so no cell is one chunk."""
    out = {}
    for n in sizes:
        use = prompts[:max(base, n * min_chunks)]
        chunks = [use[i:i + n] for i in range(0, len(use), n)]
        methods = list(METHODS) + (list(CONTROL) if aa else [])
        tot = {m: [0, 0.0, 0.0, []] for m in methods}
        ratios, control = [], []
        pol = engine.policy(engine.resolve(METHODS["adaptive"]))
        before = dict(vars(pol.stats))
        for k, chunk in enumerate(tqdm(chunks, desc=f"{desc} batch {n}", unit="chunk")):
            names = turn_order(methods, k)  # who goes first and who follows whom, balanced
            rate = {}
            for m, r in run_lockstep(engine, chunk, names, max_new).items():
                tot[m][0] += r.tokens
                tot[m][1] += r.decode_s
                tot[m][2] += r.total_s
                tot[m][3] += r.accepted
                rate[m] = r.tokens_per_s
            ratios.append(rate["adaptive"] / max(rate["ar"], rate["fixed"]))
            if aa:
                control.append(rate["ar-again"] / rate["ar"])
        after = vars(pol.stats)
        steps = max(after["steps"] - before["steps"], 1)
        rows = max(after["rows"] - before["rows"], 1)
        out[str(n)] = {m: {"tokens_per_s": round(t[0] / t[1], 3), "with_prefill_s": round(t[2], 2),
                           "tau": round(sum(a + 1 for a in t[3]) / max(len(t[3]), 1), 3)} for m, t in tot.items()}
        best = max(out[str(n)]["ar"]["tokens_per_s"], out[str(n)]["fixed"]["tokens_per_s"])
        out[str(n)]["adaptive_vs_best"] = round(out[str(n)]["adaptive"]["tokens_per_s"] / best, 4)
        out[str(n)]["adaptive_vs_best_median_chunk"] = round(statistics.median(ratios), 4)
        out[str(n)]["adaptive_vs_best_chunks"] = [round(r, 4) for r in ratios]
        if aa:
            out[str(n)]["aa_median_chunk"] = round(statistics.median(control), 4)
            out[str(n)]["aa_chunks"] = [round(r, 4) for r in control]
        out[str(n)]["policy"] = {"drafter_fraction": round((after["drafter_steps"] - before["drafter_steps"]) / steps,
                                                           4),
                                 "drafter_steps": after["drafter_steps"] - before["drafter_steps"],
                                 "probes": after.get("probe_steps", 0) - before.get("probe_steps", 0),
                                 "plain_fraction": round((after["plain_steps"] - before["plain_steps"]) / steps, 4),
                                 "nodes_per_row": round((after["nodes"] - before["nodes"]) / rows, 3),
                                 "mean_width": round((after["width"] - before["width"]) / steps, 3)}
        print(json.dumps({desc: {n: out[str(n)]}}), flush=True)
    return out


def report(meta: dict, res: dict, out: Path) -> str:
    md = [f"# Step policy vs batch size (`{meta['command']}`)", "",
          f"{meta['prompts']} prompts per dataset (batch n: at least n x {meta.get('min_chunks', 1)}), "
          f"{meta['max_new_tokens']} new tokens, greedy, {meta['dtype']}, "
          f"{meta['threads']} threads, backend {meta['backend']} (exactness: {meta['exactness']}). Each chunk of "
          "prompts is decoded by all three methods in lockstep (one step of each in turn); tokens/s = decode throughput "
          "(generated tokens after the first / time after the prefill). "
          "fixed = the tree + lookup every step (`--policy fixed`), adaptive = the default (`--policy adaptive`).",
          ""]
    for d, rows in res.items():
        sizes = sorted(int(n) for n in rows)
        md += [f"## {d}", "", f"Run: `{meta.get('runs', {}).get(d, meta['command'])}`", "",
               "| batch | ar tok/s | fixed tok/s (tau) | adaptive tok/s (tau) | adaptive / max(ar, fixed)"
               " | median over chunks | A/A: AR again / AR, median | drafter ran (steps; probes)"
               " | draft nodes / row / step |",
               "|---|---|---|---|---|---|---|---|---|"]
        for n in sizes:
            r = rows[str(n)]
            md.append(f"| {n} | {r['ar']['tokens_per_s']:.1f} | {r['fixed']['tokens_per_s']:.1f} "
                      f"({r['fixed']['tau']:.2f}) | {r['adaptive']['tokens_per_s']:.1f} ({r['adaptive']['tau']:.2f}) "
                      f"| **{r['adaptive_vs_best']:.3f}** | {r['adaptive_vs_best_median_chunk']:.3f} | "
                      f"{r.get('aa_median_chunk', float('nan')):.3f} | "
                      f"{100 * r['policy']['drafter_fraction']:.1f} % ({r['policy'].get('drafter_steps', '?')}; "
                      f"{r['policy'].get('probes', '?')}) | {r['policy']['nodes_per_row']:.2f} |")
        md.append("")
    (out / "policy_sweep.md").write_text("\n".join(md) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4))
    for d, rows in res.items():
        sizes = sorted(int(n) for n in rows)
        for m in METHODS:
            a0.plot(sizes, [rows[str(n)][m]["tokens_per_s"] for n in sizes], marker="o", label=f"{d} {m}")
        a1.plot(sizes, [rows[str(n)]["policy"]["nodes_per_row"] for n in sizes], marker="o",
                label=f"{d}: draft nodes / row")
        a1.plot(sizes, [rows[str(n)]["adaptive"]["tau"] - 1 for n in sizes], marker="x", linestyle="--",
                label=f"{d}: accepted / step (tau - 1)")
    for a, yl in ((a0, "decode tokens/s"), (a1, "per row per step")):
        a.set_xscale("log", base=2)
        a.set_xlabel("batch size")
        a.set_ylabel(yl)
        a.legend(fontsize=7)
    a0.set_title("throughput")
    a1.set_title("adaptive: chosen draft size and acceptance")
    fig.tight_layout()
    fig.savefig(out / "policy_sweep.png", dpi=120)
    plt.close(fig)
    return "\n".join(md)


def looks_of(pol) -> dict:
    """The policy's estimate of a look's value and host ms (EMAs) and its plain-run length; the names of the
    policy before the policy seam (e4f65e5) are read too, so that a before/after comparison reports both."""
    looks = getattr(pol, "looks", None)
    if looks is not None and not callable(looks):
        return {"value_ms": looks.value, "host_ms": looks.ms, "plain_span": looks.plain_span}
    return {"value_ms": pol.look_value, "host_ms": pol.look_ms, "plain_span": pol.plain_span}


def main() -> int:
    import torch

    from dflashkit.invariance import mode

    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, action="append", default=None)
    ap.add_argument("--min-chunks", type=int, default=1,
                    help="at least this many chunks per batch size: batch n decodes max(prompts, n x this) prompts "
                         "(one chunk of 16 at batch 16 is one sample of a host whose speed swings 20-30 %%)")
    ap.add_argument("--datasets", default="humaneval,mt-bench-t1",
                    help="comma list; results for other datasets already in --out are kept (one run per table)")
    ap.add_argument("--out", default="bench/results/policy-batch")
    ap.add_argument("--aa", action="store_true", help="also plain AR a second time in each lockstep (A/A control)")
    ap.add_argument("--cost", default=None,
                    help="a step cost model (JSON: the `cost_model` of an earlier policy_sweep.json, or a cost.json "
                         "entry) instead of the cached one: two versions of the code compared on one model")
    ap.add_argument("--looks", action="store_true",
                    help="also report what the policy learned of its looks (their value and host ms; plain runs)")
    args = ap.parse_args()
    sizes = args.batch_size or [1, 2, 4, 8, 16]
    target, tok, drafter, _ = load_models()
    engine = DFlashEngine(target, drafter, tokenizer=tok)
    if args.cost:
        from dflashkit.step_cost import CostModel

        saved = json.loads(Path(args.cost).read_text())
        saved = saved["meta"]["cost_model"] if "meta" in saved else saved
        engine.cost = CostModel(**{k: v for k, v in saved.items() if k in CostModel.__dataclass_fields__})
    need = max([args.prompts] + [n * args.min_chunks for n in sizes])
    sets = {d: [encode_chat(tok, it[0]) for it in load_dataset(d, need)] for d in args.datasets.split(",")}
    for m in METHODS.values():  # warm-up (and the cost model's calibration, if not cached)
        engine.generate([next(iter(sets.values()))[0]], max_new_tokens=4, config=m)
    res = {d: sweep(engine, p, sizes, args.max_new_tokens, d, args.prompts, args.min_chunks, args.aa)
           for d, p in sets.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["bench/policy_sweep.py"] + sys.argv[1:])
    runs = {d: command for d in res}
    if (out / "policy_sweep.json").exists():  # keep the tables of datasets this run did not redo
        saved = json.loads((out / "policy_sweep.json").read_text())
        old = saved["meta"].get("runs") or {d: saved["meta"]["command"] for d in saved["results"]}
        runs = {**{d: c for d, c in old.items() if d not in res}, **runs}
        res = {**{d: r for d, r in saved["results"].items() if d not in res}, **res}
    meta = {"command": command, "runs": runs, "prompts": args.prompts, "min_chunks": args.min_chunks,
            "max_new_tokens": args.max_new_tokens, "dtype": str(target.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "exactness": mode(target),
            "backend": getattr(target, "engine_name", type(target).__name__),
            "calibration": engine.policy(engine.resolve(METHODS["adaptive"])).acc.report(),
            "cost_model": vars(engine.policy(engine.resolve(METHODS["adaptive"])).cost), "cost_from": args.cost}
    if args.looks:
        meta["looks"] = looks_of(engine.policy(engine.resolve(METHODS["adaptive"])))
    (out / "policy_sweep.json").write_text(json.dumps({"meta": meta, "results": res}, indent=2) + "\n")
    print(report(meta, res, out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
