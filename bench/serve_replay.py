"""The server's continuous batching replayed in ONE process, every mode in lockstep: AR, the fixed tree, the default.

    .venv/bin/python bench/serve_replay.py --requests 16 --max-tokens 32 --rounds 3 --out bench/results/serve-replay

Why: `serve_load.py` runs each mode in its own server process, and two identical AR servers side by side differed
by 1-19 % per cell on this host (bench/results/serve-load-processes) - more than the 5 % in question. Here one
process drives a `DecodeBatch` per mode exactly as the server's engine loop does (`scheduler.py`: admit waiting
requests up to the concurrency, prefill them, one step for the batch), with `concurrency` closed-loop clients per
mode (a finished request is replaced by the next), and the modes take turns, one admit + step each, so the
host's drift hits them alike. Throughput = completion tokens / the mode's own time, prefill included (as the
server's). No HTTP, no tokenizer round trips: those are the same for every mode.
Writes serve_replay.json, .md and .png.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

from dflashkit import DecodeConfig, DFlashEngine
from dflashkit.bench import turn_order
from dflashkit.bench.datasets import load_dataset
from dflashkit.loader import encode_chat, load_models

# ar-again: the same AR requests replayed once more in the same turns (an A/A control: the ratio identical work
# reads here, the floor under any ratio in the table)
MODES = {"ar": DecodeConfig.autoregressive(), "default-fixed": DecodeConfig.recommended(policy="fixed"),
         "default": DecodeConfig.recommended(), "ar-again": DecodeConfig.autoregressive()}
MAX_LEN = 1024  # as serve_load's servers (--max-len 1024)


class Replay:
    """One mode's server: a queue of requests, `concurrency` of them in flight."""

    def __init__(self, engine, config, prompts, concurrency: int, max_tokens: int):
        self.config = engine.resolve(config)
        self.batch = engine.new_batch(MAX_LEN, self.config)
        self.batch.reserve(concurrency)  # as the server's batch reserves --max-batch rows (`Scheduler`)
        self.queue = [engine.sequence(i, p, max_new_tokens=max_tokens, config=self.config)
                      for i, p in enumerate(prompts)]
        self.concurrency, self.seconds, self.admit_s, self.done = concurrency, 0.0, 0.0, []
        stats = getattr(self.batch.policy, "stats", None)  # the adaptive policy's counts (kept per engine)
        self.before = copy.copy(stats) if stats is not None else None

    def turn(self) -> bool:
        """Admit, then one step (the engine loop's iteration); False when every request is done."""
        t0 = time.perf_counter()
        live = sum(not s.finished for s in self.batch.seqs)
        new = []
        while self.queue and live + len(new) < self.concurrency:
            new.append(self.queue.pop(0))
        if new:
            self.batch.add(new)
            self.done += new
            self.admit_s += time.perf_counter() - t0
        if self.batch.alive:
            self.batch.step()
        self.seconds += time.perf_counter() - t0
        return bool(self.queue) or self.batch.alive


def run(engine, prompts, concurrency: int, max_tokens: int, k: int) -> dict:
    names = turn_order(list(MODES), k)  # who goes first and who follows whom, balanced over rounds
    reps = {m: Replay(engine, MODES[m], prompts, concurrency, max_tokens) for m in names}
    going = set(names)
    while going:
        for m in names:
            if m in going and not reps[m].turn():
                going.discard(m)
    out = {}
    for m, r in reps.items():
        toks = sum(len(s.generated) for s in r.done)
        acc = [a for s in r.done for a in s.stats.accepted]
        out[m] = {"tokens": toks, "seconds": round(r.seconds, 3), "throughput_tok_s": round(toks / r.seconds, 2),
                  "tau": round(sum(a + 1 for a in acc) / max(len(acc), 1), 3), "admit_s": round(r.admit_s, 3)}
        if r.before is not None:
            out[m]["policy"] = r.batch.policy.stats.since(r.before).summary()
    out["default_vs_best"] = round(out["default"]["throughput_tok_s"]
                                   / max(out["ar"]["throughput_tok_s"], out["default-fixed"]["throughput_tok_s"]), 4)
    out["ar_again_vs_ar"] = round(out["ar-again"]["throughput_tok_s"] / out["ar"]["throughput_tok_s"], 4)
    return out


def median_cell(rounds: list[dict]) -> dict:
    """One cell over its rounds: each mode's median throughput and tau, the median of the per-round ratios (each
    round's modes ran in lockstep, so its ratio is the fair one), and the rounds themselves."""
    if len(rounds) == 1:
        return rounds[0]
    cell = {m: {k: statistics.median(r[m][k] for r in rounds) for k in ("throughput_tok_s", "tau")} for m in MODES}
    cell["default_vs_best"] = statistics.median(r["default_vs_best"] for r in rounds)
    cell["ar_again_vs_ar"] = statistics.median(r["ar_again_vs_ar"] for r in rounds)
    cell["rounds"] = rounds
    return cell


def report(meta: dict, res: dict, out: Path) -> str:
    md = [f"# Continuous batching replayed in one process (`{meta['command']}`)", "",
          f"{meta['requests']} MT-Bench first turns, {meta['max_tokens']} tokens each, greedy, {meta['dtype']}, "
          f"{meta['threads']} threads, backend {meta['backend']}; `concurrency` closed-loop clients per mode; the "
          "modes take turns (one admit + step each). Throughput = completion tokens / the mode's own time "
          f"(prefill included). {meta.get('rounds', 1)} round(s) per cell: medians (the ratio: of the per-round "
          "ratios).", "",
          "| concurrency | ar tok/s | default-fixed tok/s (tau) | default tok/s (tau) | default / max(ar, fixed) "
          "| per round | A/A: ar-again / ar (per round) |",
          "|---|---|---|---|---|---|---|"]
    for c, r in res.items():
        md.append(f"| {c} | {r['ar']['throughput_tok_s']:.1f} | {r['default-fixed']['throughput_tok_s']:.1f} "
                  f"({r['default-fixed']['tau']:.2f}) | {r['default']['throughput_tok_s']:.1f} "
                  f"({r['default']['tau']:.2f}) | **{r['default_vs_best']:.3f}** | "
                  + " / ".join(f"{x['default_vs_best']:.3f}" for x in r.get("rounds", [r])) + " | "
                  + f"{r['ar_again_vs_ar']:.3f} ("
                  + " / ".join(f"{x['ar_again_vs_ar']:.3f}" for x in r.get("rounds", [r])) + ") |")
    (out / "serve_replay.md").write_text("\n".join(md) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    cs = [int(c) for c in res]
    for m in [m for m in MODES if m != "ar-again"]:
        ax.plot(cs, [res[str(c)][m]["throughput_tok_s"] for c in cs], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("throughput tok/s (prefill included)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "serve_replay.png", dpi=120)
    plt.close(fig)
    return "\n".join(md)


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, action="append", default=None)
    ap.add_argument("--rounds", type=int, default=1, help="repeat every cell (rounds interleaved across cells); "
                    "the table quotes medians: one cell's prefill is a few big calls, which vary +-10 %% here")
    ap.add_argument("--out", default="bench/results/serve-replay")
    args = ap.parse_args()
    target, tok, drafter, _ = load_models()
    engine = DFlashEngine(target, drafter, tokenizer=tok)
    prompts = [encode_chat(tok, it[0]) for it in load_dataset("mt-bench-t1", args.requests)]
    for m in MODES.values():  # warm-up (and the cost model's calibration, if not cached)
        engine.generate(prompts[:1], max_new_tokens=4, config=m)
    cs = args.concurrency or [1, 2, 4, 8, 16]
    rounds = {str(c): [] for c in cs}
    cells = [(r, c) for r in range(args.rounds) for c in cs]
    for k, (r, c) in enumerate(tqdm(cells, desc="round x concurrency")):
        rounds[str(c)].append(run(engine, prompts, c, args.max_tokens, k))
        print(json.dumps({"round": r, c: rounds[str(c)][-1]}), flush=True)
    res = {c: median_cell(rs) for c, rs in rounds.items()}
    meta = {"command": " ".join(["bench/serve_replay.py"] + sys.argv[1:]), "requests": args.requests,
            "rounds": args.rounds,
            "max_tokens": args.max_tokens, "dtype": str(target.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "backend": getattr(target, "engine_name", type(target).__name__)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_replay.json").write_text(json.dumps({"meta": meta, "results": res}, indent=2) + "\n")
    print(report(meta, res, out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
