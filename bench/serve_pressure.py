"""Long prompts arriving at a busy `dflashkit serve`: does /health answer, do running streams keep flowing, and
what does chunked prefill cost in throughput?

    .venv/bin/python bench/serve_pressure.py --out bench/results/serve-pressure [--chunks 0,64,256]
        [--requests 2] [--rounds 2] [--before-src DIR]

Each setting is a `dflashkit serve` process of its own (bf16, the default system, `--max-batch 8 --max-len 2048`,
`--prefill-chunk N`). Eight closed-loop streaming clients (the `openai` client, T=0, max_tokens 48) send
`--requests` requests each, each with probability `--long-share` (0.6) a ~1,400-token prompt (HumanEval problems
concatenated into one module to complete), else an MT-Bench first turn; the request sequence is drawn from a
seeded generator per (client, round), so every setting of a round does the same work. A prober GETs /health
every 0.1 s until the last request ends (a 10 s timeout counts as 10 s). `--before-src DIR`: one more setting, `before`, served from another checkout's
`src/` (the code before the kernels released the GIL and prompts were chunked).

Reported per setting: /health latency p50 / p95 / max; the streams' inter-token latency (the gap between
consecutive content events of one stream, its first token excluded) p50 / p99 / max; TTFT p50 / p95; the
server's output tokens/s (completion tokens / the time until the last request ended) and its ratio to
`--prefill-chunk 0` in the same round. Settings run in turn, the order rotated per round (`bench.turn_order`), so drift hits them alike.
Writes serve_pressure.json, serve_pressure.md and serve_pressure.png into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from serve_load import free_port, server_process

from dflashkit.bench import turn_order
from dflashkit.bench.datasets import HUMANEVAL_WRAPPER, load_dataset
from dflashkit.measurements import cpu_flags

CLIENTS, MAX_TOKENS, LONG_TOKENS = 8, 48, 1400


def long_prompts(tok, n: int = 12) -> list[str]:
    """n prompts of ~LONG_TOKENS tokens: consecutive HumanEval problems as one module whose last function is asked."""
    from dflashkit import data
    from dflashkit.loader import encode_chat

    probs = [p["prompt"].strip() for p in data.humaneval_prompts()]
    out, i = [], 0
    while len(out) < n:
        parts = []
        while len(encode_chat(tok, HUMANEVAL_WRAPPER.format("\n\n\n".join(parts)))) < LONG_TOKENS:
            parts.append(probs[i % len(probs)])
            i += 1
        out.append(HUMANEVAL_WRAPPER.format("\n\n\n".join(parts)))
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def drive(base: str, prompts: dict, requests: int, seed: int, long_share: float) -> dict:
    """8 closed-loop streaming clients of `requests` requests each and the /health prober: the raw timings."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=1800)
    gaps, ttft, health, tokens, done = [], [], [], [0], [0]
    lock = threading.Lock()
    finished = threading.Event()

    def user(i: int) -> None:
        rng = random.Random(f"{seed}-{i}")
        for _ in range(requests):
            p = rng.choice(prompts["long"] if rng.random() < long_share else prompts["short"])
            t0, last, first, mine, n = time.perf_counter(), None, None, [], 0
            for ev in client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": p}],
                                                     max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}):
                now = time.perf_counter()
                if ev.usage is not None:
                    n = ev.usage.completion_tokens
                if not ev.choices or not ev.choices[0].delta.content:
                    continue
                if last is None:
                    first = now - t0
                else:
                    mine.append(now - last)
                last = now
            with lock:
                gaps.extend(mine)
                ttft.extend([first] if first is not None else [])
                tokens[0] += n
                done[0] += 1

    def prober() -> None:
        while not finished.is_set():
            t0 = time.perf_counter()
            try:
                urllib.request.urlopen(base + "/health", timeout=10).read()
                health.append(time.perf_counter() - t0)
            except OSError:
                health.append(10.0)
            time.sleep(max(0.0, 0.1 - (time.perf_counter() - t0)))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS + 1) as ex:
        probe = ex.submit(prober)
        try:
            for f in [ex.submit(user, i) for i in range(CLIENTS)]:
                f.result()
            wall = time.perf_counter() - t0
        finally:  # a failing client must not leave the prober running (the pool would wait for it forever)
            finished.set()
        probe.result()
    return {"gaps": gaps, "ttft": ttft, "health": health, "tokens": tokens[0], "requests": done[0], "wall": wall}


def summary(runs: list[dict]) -> dict:
    cat = {k: [x for r in runs for x in r[k]] for k in ("gaps", "ttft", "health")}
    toks, wall = sum(r["tokens"] for r in runs), sum(r["wall"] for r in runs)
    return {"health_p50_s": pct(cat["health"], 0.5), "health_p95_s": pct(cat["health"], 0.95),
            "health_max_s": max(cat["health"]), "health_probes": len(cat["health"]),
            "itl_p50_ms": 1000 * pct(cat["gaps"], 0.5), "itl_p99_ms": 1000 * pct(cat["gaps"], 0.99),
            "itl_max_ms": 1000 * max(cat["gaps"]), "ttft_p50_s": pct(cat["ttft"], 0.5),
            "ttft_p95_s": pct(cat["ttft"], 0.95), "requests": sum(r["requests"] for r in runs),
            "tokens_per_s": toks / wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/serve-pressure")
    ap.add_argument("--chunks", default="0,64,256", help="--prefill-chunk values to compare (0 = whole prompts)")
    ap.add_argument("--before-src", default=None, help="another checkout's src/ to serve as the setting `before`")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--long-share", type=float, default=0.6)
    args = ap.parse_args()
    from dflashkit.loader import load_tokenizer, resolve_target_dir

    tok = load_tokenizer(resolve_target_dir())
    prompts = {"long": long_prompts(tok), "short": [t[0] for t in load_dataset("mt-bench-t1")]}
    settings = [f"chunk-{c}" for c in args.chunks.split(",")] + (["before"] if args.before_src else [])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw: dict[str, list[dict]] = {s: [] for s in settings}
    ratios: dict[str, list[float]] = {s: [] for s in settings}
    for rnd in range(args.rounds):
        per_round = {}
        for name in turn_order(settings, rnd):
            port = free_port()
            env = dict(os.environ)
            cmd = [sys.executable, "-m", "dflashkit.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                   "--max-batch", str(CLIENTS), "--max-len", "2048", "--model-name", "smollm2"]
            if name == "before":  # its own cache: its kernels' sources differ (one build directory per cache)
                env["PYTHONPATH"] = str(Path(args.before_src).resolve())
                env["DFLASHKIT_CACHE"] = str(Path(tempfile.gettempdir()) / "dflashkit-before-cache")
            else:
                cmd += ["--prefill-chunk", name.split("-")[1]]
            base = f"http://127.0.0.1:{port}"
            log = Path(tempfile.gettempdir()) / f"serve-pressure-{name}.log"  # host paths inside: not a result
            with server_process(cmd, env, log, base, name):
                r = drive(base, prompts, args.requests, rnd, args.long_share)
            raw[name].append(r)
            per_round[name] = r["tokens"] / r["wall"]
            print(f"round {rnd} {name}: {summary([r])}", flush=True)
        for name in settings:
            ratios[name].append(per_round[name] / per_round["chunk-0"] if "chunk-0" in per_round else float("nan"))
    table = {s: {**summary(raw[s]), "tokens_per_s_vs_chunk0": statistics.median(ratios[s]),
                 "ratio_rounds": ratios[s]} for s in settings}
    meta = {"command": "bench/serve_pressure.py " + " ".join(sys.argv[1:]), "clients": CLIENTS,
            "max_tokens": MAX_TOKENS, "long_prompt_tokens": [len(tok(p)["input_ids"]) for p in prompts["long"]],
            "long_share": args.long_share, "requests_per_client": args.requests, "rounds": args.rounds,
            "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name()}
    (out / "serve_pressure.json").write_text(json.dumps({"meta": meta, "settings": table}, indent=1))
    write_md(out / "serve_pressure.md", meta, table)
    plot(out / "serve_pressure.png", table)
    return 0


def cpu_name() -> str:
    flags = cpu_flags()
    isa = "AVX512-BF16" if "avx512_bf16" in flags else "AVX2" if "avx2" in flags else "?"
    return f"{os.cpu_count()} vCPUs, {isa}"


def write_md(path: Path, meta: dict, table: dict) -> None:
    lines = [f"# Serving under long prompts: /health, inter-token latency, throughput ({meta['date']}, {meta['cpu']})",
             "", f"`{meta['command']}`: {meta['clients']} closed-loop streaming clients, {meta['long_share']:.0%} of "
             f"requests a ~{LONG_TOKENS}-token prompt, {meta['max_tokens']} new tokens, {meta['requests_per_client']} "
             f"requests per client, {meta['rounds']} rounds per setting.", "",
             "| setting | /health p50 / p95 / max (s) | inter-token p50 / p99 / max (ms) | TTFT p50 / p95 (s) | "
             "requests | tokens/s | vs chunk-0 (median of rounds) |", "|---|---|---|---|---|---|---|"]
    for s, r in table.items():
        lines.append(f"| {s} | {r['health_p50_s']:.3f} / {r['health_p95_s']:.3f} / {r['health_max_s']:.3f} | "
                     f"{r['itl_p50_ms']:.0f} / {r['itl_p99_ms']:.0f} / {r['itl_max_ms']:.0f} | "
                     f"{r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} | {r['requests']} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s_vs_chunk0']:.3f} ({', '.join(f'{x:.3f}' for x in r['ratio_rounds'])}) |")
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, table: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    fig, ax = plt.subplots(1, 3, figsize=(13, 4))
    ax[0].bar(names, [table[n]["health_p95_s"] for n in names], label="p95")
    ax[0].plot(names, [table[n]["health_max_s"] for n in names], "kx", label="max")
    ax[0].set_ylabel("/health latency (s)")
    ax[0].set_yscale("log")
    ax[0].legend()
    ax[1].bar(names, [table[n]["itl_p99_ms"] for n in names], label="p99")
    ax[1].plot(names, [table[n]["itl_p50_ms"] for n in names], "kx", label="p50")
    ax[1].set_ylabel("streams' inter-token latency (ms)")
    ax[1].legend()
    ax[2].bar(names, [table[n]["tokens_per_s"] for n in names])
    ax[2].set_ylabel("server output tokens/s")
    for a in ax:
        a.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
