"""Load benchmark of `dflashkit serve` over loopback: throughput and per-user speed vs concurrency.

    .venv/bin/python bench/serve_load.py [--requests 16] [--max-tokens 64] [--out bench/results/serve-load]

For autoregressive serving (block size 1) and DFlash serving (block size 8, the bundled drafter), the server
runs in-process on a free port; `--requests` chat requests (MT-Bench first turns, T=0) are sent by the
`openai` client at concurrency 1, 2, 4, 8, 16. Reported: aggregate completion tokens/s, median per-user
tokens/s (completion tokens / request latency), median latency, tau from the server's own statistics.
Writes serve_load.json, serve_load.md and serve_load.png.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch


def main() -> int:
    import uvicorn
    from openai import OpenAI

    from dflashkit import DFlashEngine
    from dflashkit.data import mtbench_questions
    from dflashkit.loader import load_default_drafter, load_target
    from dflashkit.server import build_app

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="bench/results/serve-load")
    args = ap.parse_args()
    prompts = [q["turns"][0] for q in mtbench_questions()][: args.requests]
    target, tok = load_target(dtype=args.dtype)
    drafter, _ = load_default_drafter(target, tok)
    rows = []
    for mode, block in (("ar", 1), ("dflash-b8", 8)):
        engine = DFlashEngine(target, drafter, tokenizer=tok, block_size=block)
        app = build_app(engine, tok, "smollm2", block_size=block, max_batch=16, max_queue=64, max_len=1024)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        th = threading.Thread(target=srv.run, daemon=True)
        th.start()
        while not srv.started:
            time.sleep(0.05)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)

        def ask(p):
            t0 = time.perf_counter()
            r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": p}],
                                               max_tokens=args.max_tokens, temperature=0)
            return r.usage.completion_tokens, time.perf_counter() - t0, r.model_extra["dflash"]

        ask(prompts[0])  # warm-up
        for conc in (1, 2, 4, 8, 16):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(conc) as ex:
                res = list(ex.map(ask, prompts))
            wall = time.perf_counter() - t0
            toks = sum(r[0] for r in res)
            passes = sum(r[2]["target_passes"] for r in res)
            acc = sum(r[2]["tau"] * r[2]["target_passes"] for r in res)
            rows.append({"mode": mode, "concurrency": conc, "requests": len(res), "completion_tokens": toks,
                         "throughput_tok_s": round(toks / wall, 2),
                         "per_user_tok_s_median": round(statistics.median(r[0] / r[1] for r in res), 2),
                         "latency_s_median": round(statistics.median(r[1] for r in res), 3),
                         "tau": round(acc / passes, 3) if passes else 1.0})
            print(rows[-1], flush=True)
        srv.should_exit = True
        th.join(30)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(sys.argv), "threads": torch.get_num_threads(), "dtype": args.dtype,
            "max_tokens": args.max_tokens, "prompts": "MT-Bench first turns"}
    (out / "serve_load.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    md = [f"# Serving load (`{meta['command']}`)", "",
          f"{len(prompts)} chat requests (MT-Bench first turns), max_tokens {args.max_tokens}, T=0, {args.dtype}, "
          f"{meta['threads']} CPU threads, loopback, openai client.", "",
          "| mode | concurrency | throughput tok/s | per-user tok/s (median) | latency s (median) | tau |",
          "|---|---|---|---|---|---|"]
    md += [f"| {r['mode']} | {r['concurrency']} | {r['throughput_tok_s']} | {r['per_user_tok_s_median']} | "
           f"{r['latency_s_median']} | {r['tau']} |" for r in rows]
    (out / "serve_load.md").write_text("\n".join(md) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode in ("ar", "dflash-b8"):
        rr = [r for r in rows if r["mode"] == mode]
        axes[0].plot([r["concurrency"] for r in rr], [r["throughput_tok_s"] for r in rr], marker="o", label=mode)
        axes[1].plot([r["concurrency"] for r in rr], [r["per_user_tok_s_median"] for r in rr], marker="o", label=mode)
    for ax, title in zip(axes, ("throughput (tok/s)", "per-user tok/s (median)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "serve_load.png", dpi=120)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
