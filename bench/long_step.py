"""Target steps at long context: chunked prefill and 1- / 4-token steps of the default target after C tokens.

    .venv/bin/python bench/long_step.py --out bench/results/long-step/after [--contexts 1024,4096] [--repeats 5]

The default target on its default kernels, bf16: the context prefilled in chunks of 512 (as the engine prefills a
long prompt), then a step of w = 1 and 4 new tokens (forward + the LM head over them), medians of `--repeats`
means of 3 calls. At long context the attention, not the weights, sets the step's cost: this is where it shows.
Writes long_step.json, long_step.md and long_step.png into --out.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from dflashkit.measurements import cpu_name, median_ms


def measure(t, ctx: int, repeats: int) -> dict:
    cache = t.new_cache(1, ctx + 8)
    ids = torch.randint(4, t.vocab_size, (1, ctx + 8), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    for c0 in range(0, ctx, 512):
        c1 = min(c0 + 512, ctx)
        t.forward(ids[:, c0:c1], torch.arange(c0, c1)[None], cache, kv_len=c1, taps=False)
    res = {"prefill_s": round(time.perf_counter() - t0, 2)}
    for w in (1, 4):
        pos = torch.arange(ctx, ctx + w)[None]

        def step():
            return t.logits(t.forward(ids[:, ctx:ctx + w], pos, cache, kv_len=ctx + w, taps=False)[0])
        res[f"step{w}_ms"] = round(median_ms(step, repeats), 2)
    return res


def report(res: dict) -> str:
    mt = res["meta"]
    lines = [f"# Target steps at long context ({mt['date']}, {mt['cpu']}, {mt['threads']} threads)", "",
             f"`{mt['command']}`. Engine {mt['engine']}, bf16, prefill in chunks of 512.", "",
             "| context | prefill, s | 1-token step, ms | 4-token step, ms |", "|---|---|---|---|"]
    for ctx, r in res["contexts"].items():
        lines.append(f"| {ctx} | {r['prefill_s']} | {r['step1_ms']} | {r['step4_ms']} |")
    return "\n".join(lines) + "\n"


def plot(res: dict):
    import matplotlib.pyplot as plt

    ctxs = list(res["contexts"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for j, key in enumerate(("step1_ms", "step4_ms")):
        ax.bar([i + 0.4 * j for i in range(len(ctxs))], [res["contexts"][c][key] for c in ctxs], 0.4, label=key)
    ax.set_xticks([i + 0.2 for i in range(len(ctxs))], [f"{c} tokens" for c in ctxs])
    ax.set_ylabel("ms per step")
    ax.legend()
    ax.set_title("target step at long context")
    return fig


def main() -> int:
    from dflashkit.loader import load_target
    from dflashkit.bench.report import write_result

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/long-step")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    t, _ = load_target(None, dtype="bfloat16")
    with torch.inference_mode():
        ctxs = {c: measure(t, int(c), args.repeats) for c in args.contexts.split(",")}
    res = {"meta": {"command": "bench/long_step.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
                    "cpu": cpu_name(), "threads": torch.get_num_threads(), "engine": t.engine_name},
           "contexts": ctxs}
    write_result(args.out, "long_step", res, report(res), plot)
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
