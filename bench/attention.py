"""The fused attention kernel alone (`dflashkit.kernels.attend`), per layer, at the shapes the engine calls it with.

    .venv/bin/python bench/attention.py --out bench/results/attention-gqa/after-1 [--repeats 5]

SmolLM2's attention (9 query heads on 3 kv heads, head dim 64, value rows of 65 as the cache holds them), inputs
built as the lean target builds them: Q new tokens after S - Q committed ones, each query's head part the slots
before its position - 4 and its tail the next 5. Each shape times a pass over 30 layers' own caches (as a step
reads them: at long context they do not fit in the CPU's caches), reported per layer: the median of --repeats.
To compare two versions of the kernel, run this script under each (PYTHONPATH=OTHER/src) by turns.
Writes attention.json, attention.md and attention.png into --out.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from dflashkit.measurements import cpu_name, median_ms

# (context S, new tokens Q, batch rows B): decode and verify steps at short and long context, a batch, a prefill chunk
SHAPES = [(176, 1, 1), (176, 4, 1), (176, 1, 8), (176, 4, 8), (1024, 1, 1), (1024, 4, 1), (1024, 1, 8),
          (2048, 1, 1), (2048, 4, 1), (2048, 16, 1), (3072, 1, 1), (4096, 1, 1), (4096, 4, 1), (4096, 16, 1),
          (4096, 1, 8), (8192, 1, 1), (8192, 4, 1), (1536, 512, 1)]
TAIL_DEPTH, L = 4, 5


def inputs(B: int, Q: int, S: int, g: torch.Generator, nh: int = 9, kvh: int = 3, hd: int = 64):
    q = torch.randn(B, Q, nh, hd, generator=g).bfloat16()
    k = torch.randn(B, kvh, S + 16, hd, generator=g).bfloat16()
    v = torch.randn(B, kvh, S + 16, hd + 1, generator=g).bfloat16()
    pos = torch.arange(S - Q, S)  # the queries' positions; slot == position
    split = (pos - TAIL_DEPTH).clamp(min=0)
    head = (torch.arange(S)[None, :] < split[:, None]).expand(B, Q, S).contiguous()
    tail = split[:, None] + torch.arange(L)[None, :]
    tail = torch.where(tail <= pos[:, None], tail, -1).expand(B, Q, L).contiguous()
    return q, k, v, head, tail, hd**-0.5


def measure(S: int, Q: int, B: int, repeats: int) -> float:
    from dflashkit.kernels import attend

    g = torch.Generator().manual_seed(0)
    layers = [inputs(B, Q, S, g) for _ in range(30 if Q * B < 64 else 2)]
    return median_ms(lambda: [attend(*a) for a in layers], repeats) / len(layers)


def report(res: dict) -> str:
    mt = res["meta"]
    lines = [f"# The attention kernel per layer ({mt['date']}, {mt['cpu']}, {mt['threads']} threads)", "",
             f"`{mt['command']}`", "", "| context | new tokens | batch rows | ms per layer |", "|---|---|---|---|"]
    lines += [f"| {r['S']} | {r['Q']} | {r['B']} | {r['ms']:.4f} |" for r in res["shapes"]]
    return "\n".join(lines) + "\n"


def plot(res: dict):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    rows = res["shapes"]
    ax.bar(range(len(rows)), [r["ms"] for r in rows])
    ax.set_xticks(range(len(rows)), [f"{r['S']}/{r['Q']}/{r['B']}" for r in rows], rotation=60, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms per layer")
    ax.set_xlabel("context / new tokens / batch rows")
    return fig


def main() -> int:
    from dflashkit.bench.report import write_result

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/attention")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with torch.inference_mode():
        shapes = [{"S": S, "Q": Q, "B": B, "ms": round(measure(S, Q, B, args.repeats), 4)} for S, Q, B in SHAPES]
    res = {"meta": {"command": "bench/attention.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
                    "cpu": cpu_name(), "threads": torch.get_num_threads()}, "shapes": shapes}
    write_result(args.out, "attention", res, report(res), plot)
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
