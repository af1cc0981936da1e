"""Throughput against per-user interactivity, over concurrency, for every engine's real server (`dflashkit
bench-serve`): the Pareto curves the field reports (SPEED-Bench's throughput view), ours and the peers' on one chart.

A closed-loop client: at concurrency c, c users each send a streaming chat request, wait for its last token, and
send the next, until the cell's requests are done. Per request: TTFT (the first content chunk) and the user's decode
speed (tokens after the first / time after the first). Per cell: the system's output tokens/s (all tokens / the
cell's wall time). Cells run one at a time, the engines' turns interleaved per concurrency level
(`runner.turn_order`), so the host's drift hits them alike; `dflashkit-ar-again` repeats `dflashkit-ar` in every
level (A/A control: what the same work measures twice on this host).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .peers import Skip
from .runner import turn_order
from .servers import MODEL

log = logging.getLogger(__name__)

# engine -> (server, extra request fields); engines sharing a server share its process
ENGINES = {"dflashkit-ar": ("dflashkit", {"speculate": False}), "dflashkit": ("dflashkit", {}),
           "dflashkit-ar-again": ("dflashkit", {"speculate": False}),
           "llama-server": ("llama-server", {}), "llama-server-dflash": ("llama-server-dflash", {}),
           "vllm": ("vllm", {}), "vllm-dflash": ("vllm-dflash", {})}
MAX_CONCURRENCY = 64


@dataclass
class CurveConfig:
    engines: list[str]
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    requests_per_user: int = 2  # a cell sends max(min_requests, c x this) requests
    min_requests: int = 8
    max_tokens: int = 64
    peer_block: int = 4  # the peers' DFlash block (their drafts per step + 1)
    threads: int = 2
    max_len: int = 2048
    interactivity: list[float] = field(default_factory=lambda: [5.0, 10.0, 20.0, 40.0])
    out: str = "bench/results/serve-curve"
    command: str = ""


@dataclass
class RequestRecord:
    tokens: int  # completion tokens (the server's usage)
    ttft_s: float
    total_s: float

    @property
    def decode_tok_s(self) -> float:  # the user's interactivity: tokens after the first per second after it
        span = self.total_s - self.ttft_s
        return (self.tokens - 1) / span if self.tokens > 1 and span > 0 else 0.0


def ask(client, prompt: str, max_tokens: int, extra: dict) -> RequestRecord:
    t0 = time.perf_counter()
    first, tokens = None, 0
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=extra or None)
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    total = time.perf_counter() - t0
    return RequestRecord(tokens, total if first is None else first, total)


def run_cell(client, prompts: list[str], conc: int, cfg: CurveConfig, extra: dict) -> dict:
    """`conc` closed-loop users share the cell's prompts; the system's and every user's speed."""
    n = max(cfg.min_requests, conc * cfg.requests_per_user)
    todo = list(range(n))
    lock, records = threading.Lock(), []

    def user():
        while True:
            with lock:
                if not todo:
                    return
                k = todo.pop(0)
            rec = ask(client, prompts[k % len(prompts)], cfg.max_tokens, extra)
            with lock:
                records.append(rec)

    t0 = time.perf_counter()
    users = [threading.Thread(target=user) for _ in range(conc)]
    for u in users:
        u.start()
    for u in users:
        u.join()
    wall = time.perf_counter() - t0
    tokens = sum(r.tokens for r in records)
    per_user = sorted(r.decode_tok_s for r in records)
    ttft = sorted(r.ttft_s for r in records)
    return {"concurrency": conc, "requests": len(records), "tokens": tokens, "wall_s": round(wall, 3),
            "throughput_tok_s": round(tokens / wall, 2), "per_user_tok_s_median": round(statistics.median(per_user), 2),
            "ttft_s_median": round(statistics.median(ttft), 3),
            "ttft_s_p90": round(ttft[int(0.9 * (len(ttft) - 1))], 3), "records": [asdict(r) for r in records]}


def throughput_at(cells: list[dict], x: float) -> float | None:
    """The most output tokens/s among the cells whose median user decodes at >= x tokens/s (None: none does)."""
    ok = [c["throughput_tok_s"] for c in cells if c["per_user_tok_s_median"] >= x]
    return max(ok) if ok else None


def run_curve(cfg: CurveConfig, prompts: list[str], servers: dict) -> dict:
    """servers: {server name: Server or Skip} (cfg checked by `bench_serve`). Returns the report (cells per engine,
    skips, settings)."""
    import openai

    live = [e for e in cfg.engines if not isinstance(servers[ENGINES[e][0]], Skip)]
    skipped = {e: str(servers[ENGINES[e][0]]) for e in cfg.engines if e not in live}
    clients = {e: openai.OpenAI(base_url=servers[ENGINES[e][0]].base + "/v1", api_key="none", timeout=1800,
                                max_retries=0) for e in live}
    for e in live:  # warm-up: the first request of a process pays for lazy set-up
        ask(clients[e], "Hello", 4, ENGINES[e][1])
    cells: dict[str, list[dict]] = {e: [] for e in live}
    from tqdm import tqdm

    for k, conc in enumerate(tqdm(cfg.concurrency, desc="concurrency")):
        for e in turn_order(live, k):
            cells[e].append(run_cell(clients[e], prompts, conc, cfg, ENGINES[e][1]))
            log.info("%s c=%d: %.1f tok/s, %.1f tok/s per user", e, conc, cells[e][-1]["throughput_tok_s"],
                     cells[e][-1]["per_user_tok_s_median"])
    return {"cells": cells, "skipped": skipped, "settings": asdict(cfg),
            "throughput_at": {e: {str(x): throughput_at(cells[e], x) for x in cfg.interactivity} for e in live}}


def markdown(report: dict) -> str:
    cells, s = report["cells"], report["settings"]
    concs = s["concurrency"]
    lines = [f"`{s['command']}`", "",
             f"{s['max_tokens']} new tokens per request, greedy, closed loop; requests per cell: max("
             f"{s['min_requests']}, {s['requests_per_user']} x concurrency). Cell: output tokens/s of the whole "
             "system / median per-user decode tokens/s / median TTFT s.", "",
             "| engine | " + " | ".join(f"c={c}" for c in concs) + " |", "|---" * (len(concs) + 1) + "|"]
    for e, rows in cells.items():
        lines.append(f"| {e} | " + " | ".join(f"{r['throughput_tok_s']:.1f} / {r['per_user_tok_s_median']:.1f} / "
                                              f"{r['ttft_s_median']:.2f}" for r in rows) + " |")
    if "dflashkit-ar" in cells and "dflashkit-ar-again" in cells:
        aa = [b["throughput_tok_s"] / a["throughput_tok_s"] for a, b in zip(cells["dflashkit-ar"],
                                                                               cells["dflashkit-ar-again"])]
        lines += ["", "A/A control (dflashkit-ar-again / dflashkit-ar, output tokens/s, same requests): "
                  + ", ".join(f"c={c} {r:.3f}" for c, r in zip(concs, aa))]
    if "dflashkit" in cells and "dflashkit-ar" in cells:
        lines += ["", "dflashkit / dflashkit-ar (output tokens/s): " + ", ".join(
            f"c={c} {b['throughput_tok_s'] / a['throughput_tok_s']:.3f}"
            for c, a, b in zip(concs, cells["dflashkit-ar"], cells["dflashkit"]))]
    xs = s["interactivity"]
    lines += ["", "Output tokens/s at interactivity >= X tokens/s per user (the best cell that meets it):", "",
              "| engine | " + " | ".join(f">= {x:g}" for x in xs) + " |", "|---" * (len(xs) + 1) + "|"]
    for e, at in report["throughput_at"].items():
        lines.append(f"| {e} | " + " | ".join("-" if at[str(x)] is None else f"{at[str(x)]:.1f}" for x in xs) + " |")
    for e, why in report["skipped"].items():
        lines.append(f"\nskipped `{e}`: {why}")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for e, rows in report["cells"].items():
        xs, ys = [r["per_user_tok_s_median"] for r in rows], [r["throughput_tok_s"] for r in rows]
        ax.plot(xs, ys, marker="o", ls="--" if e.endswith("again") else "-", label=e)
        for r, x, y in zip(rows, xs, ys):
            ax.annotate(str(r["concurrency"]), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("tokens/s per user (median decode speed)")
    ax.set_ylabel("output tokens/s, whole system")
    ax.set_title("throughput vs interactivity (labels: concurrency)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def curve_prompts(n: int) -> list[str]:
    """Held-out ShareGPT first turns (never trained or tuned on) short enough that decoding, not prefill, is timed."""
    from .datasets import load_dataset

    return [it[0] for it in load_dataset("sharegpt-heldout") if len(it[0]) <= 1500][:n]


def bench_serve(cfg: CurveConfig, prompts: int = 64) -> dict:
    """Starts the engines' servers, runs the curve, writes serve_curve.json / .md and pareto.png under cfg.out."""
    import contextlib
    import json

    from .servers import start_servers

    unknown = [e for e in cfg.engines if e not in ENGINES]
    if unknown:
        raise ValueError(f"unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}")
    if not 1 <= cfg.max_tokens <= 1024 or not 2 <= cfg.peer_block <= 16 or not cfg.concurrency \
            or not all(1 <= c <= MAX_CONCURRENCY for c in cfg.concurrency):
        raise ValueError(f"--max-tokens 1..1024, --peer-block 2..16, --concurrency values 1..{MAX_CONCURRENCY}")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    for noisy in ("httpx", "httpx2", "openai"):  # one INFO line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    with contextlib.ExitStack() as stack:
        servers = start_servers({ENGINES[e][0] for e in cfg.engines}, out / "logs", cfg.threads, cfg.max_len,
                                cfg.peer_block, stack)
        report = run_curve(cfg, curve_prompts(prompts), servers)
        report["servers"] = {n: s.base for n, s in servers.items() if not isinstance(s, Skip)}
    (out / "serve_curve.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "serve_curve.md").write_text("# Throughput vs interactivity\n\n" + markdown(report))
    plot(report, out / "pareto.png")
    return report
