"""Load benchmark of `dflashkit serve` over loopback: throughput and per-user speed vs concurrency.

    .venv/bin/python bench/serve_load.py [--requests 16] [--max-tokens 64] [--out bench/results/serve-load]

Modes (`--modes`, comma list): `ar` and `dflash-b8` (`dflashkit serve` in its own process, block size 1 / 8 with
the bundled drafter, no tree or lookup), `default` (`dflashkit serve` as shipped: the tree + lookup under the
adaptive step policy), `default-fixed` (the same with `--policy fixed`), `vllm` and `vllm-dflash-b8` (`vllm serve` from .venv-vllm, plain / with the bundled drafter
as `--speculative-config method=dflash`; built by scripts/vllm-env.sh, skipped with a message when absent).
Every engine gets the same CPU threads (torch's count here; vLLM bound to cores 0..n-1). `--requests` chat
requests (MT-Bench first turns, T=0) are sent by the `openai` client at concurrency 1, 2, 4, 8, 16. Reported:
aggregate completion tokens/s, median per-user tokens/s (completion tokens / request latency), median latency,
tau from the server's own statistics (vLLM: its /metrics acceptance counters). All servers are started first and
each concurrency level is run by every mode back to back (`bench.turn_order`: who goes first rotates and the cycle's
direction flips, so each mode follows each other equally often; `--chunk N`: in chunks of N requests, each chunk by
every mode in turn, so that modes compared are seconds apart, not minutes) (drift on a shared host hits all
modes alike). `--one-server`: `ar` is not a server of its own but the `default` server's requests sent with
`speculate: false` (its AR batch: the same weights in the same process), which takes the process-to-process spread
out of the default / AR ratio; with it, `ar-again` sends the same AR requests once more in every cell (an A/A
control: what the same work measures twice here, the floor under any ratio in the table). Writes serve_load.json,
serve_load.md and serve_load.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import socket
import subprocess
import urllib.request
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_process(cmd: list[str], env: dict, log: Path, base: str, name: str):
    """Start a server process, wait for /health (start-up can take minutes on 2 cores), stop it afterwards."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}); see {log}")
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(base + "/health", timeout=5).status == 200:
                    break
            if time.time() - t0 > 600:
                raise RuntimeError(f"{name} did not start in 10 minutes; see {log}")
            time.sleep(2)
        yield
    finally:
        proc.terminate()
        proc.wait(60)


PLAIN = ["--lookup", "0", "--tree", "0", "--draft-vocab", "0"]  # the plain AR / DFlash rows, as committed
DFLASHKIT_MODES = {"default": [], "default-fixed": ["--policy", "fixed"]}  # anything else: ar / dflash-bN


@contextlib.contextmanager
def dflashkit_server(mode: str, dtype: str, threads: int, log: Path):
    """`dflashkit serve` in its own process, like `vllm serve`: the load generator never shares its interpreter."""
    import os

    port = free_port()
    flags = DFLASHKIT_MODES.get(mode)
    if flags is None:
        flags = ["--block-size", str(int(mode.rsplit("-b", 1)[1]) if "-b" in mode else 1)] + PLAIN
    cmd = [str(Path(sys.executable).parent / "dflashkit"), "serve", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--max-batch", "16", "--max-len", "1024", "--model-name", "smollm2"] + flags
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    base = f"http://127.0.0.1:{port}"
    with server_process(cmd, env, log, base, "dflashkit serve"):
        yield base, None


def policy_counters(base: str) -> tuple[float, float, float]:
    """(steps, drafter steps, verified draft nodes) of the adaptive policy from `dflashkit serve`'s /metrics."""
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()

    def total(name):
        return sum(float(m) for m in re.findall(rf"^dflashkit_{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))
    return total("policy_steps_total"), total("policy_drafter_steps_total"), total("policy_verified_draft_nodes_total")


def vllm_counters(base: str) -> tuple[float, float]:
    """(drafts, accepted tokens) from vLLM's Prometheus /metrics."""
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()

    def total(name):
        return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))
    return total("vllm:spec_decode_num_drafts_total"), total("vllm:spec_decode_num_accepted_tokens_total")


@contextlib.contextmanager
def vllm_server(py: str, target_dir: str, drafter_dir: str | None, block: int, dtype: str, threads: int, log: Path):
    from dflashkit.bench import vllm_env

    port = free_port()
    cmd = [str(Path(py).parent / "vllm"), "serve", target_dir, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--max-model-len", "2048", "--served-model-name", "smollm2", "--max-num-seqs", "16"]
    if drafter_dir:
        cmd += ["--speculative-config", json.dumps({"method": "dflash", "model": drafter_dir,
                                                     "num_speculative_tokens": block - 1})]
    env = vllm_env(py, threads)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server keeps its engine in its own process
    base = f"http://127.0.0.1:{port}"
    with server_process(cmd, env, log, base, "vllm serve"):
        yield base, (lambda: vllm_counters(base)) if drafter_dir else None


def start_server(mode: str, args, threads: int, out: Path):
    """The server context of one mode, or a string saying why it is skipped."""
    from dflashkit.bench import vllm_python
    from dflashkit.loader import BUNDLED_DRAFTER, resolve_target_dir

    if not mode.startswith("vllm"):
        return dflashkit_server(mode, args.dtype, threads, out / f"{mode}.log")
    py = vllm_python()
    if py is None:
        return "no vLLM virtualenv: run scripts/vllm-env.sh"
    block = int(mode.rsplit("-b", 1)[1]) if "-b" in mode else 1
    return vllm_server(py, str(resolve_target_dir(None)), str(BUNDLED_DRAFTER) if block > 1 else None,
                       block, args.dtype, threads, out / f"{mode}.log")


def ask(client, prompt: str, max_tokens: int, speculate: bool = True):
    """(completion tokens, latency s, the server's dflash statistics or None) of one chat request."""
    t0 = time.perf_counter()
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=max_tokens, temperature=0,
                                       extra_body=None if speculate else {"speculate": False})
    return r.usage.completion_tokens, time.perf_counter() - t0, (r.model_extra or {}).get("dflash")


def load_round(mode: str, server, prompts: list[str], conc: int, max_tokens: int) -> dict:
    """Every prompt sent at `conc` concurrent clients to one server: throughput, per-user speed, tau, policy."""
    base, counters, client, speculate = server
    c0 = counters() if counters else None
    p0 = policy_counters(base) if mode == "default" else None
    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as ex:
        res = list(ex.map(lambda p: ask(client, p, max_tokens, speculate), prompts))
    wall = time.perf_counter() - t0
    toks = sum(r[0] for r in res)
    if counters:  # vLLM: tau = 1 + accepted / drafts over this round
        c1 = counters()
        tau = 1 + (c1[1] - c0[1]) / max(c1[0] - c0[0], 1)
    elif res[0][2]:
        passes = sum(r[2]["target_passes"] for r in res)
        tau = sum(r[2]["tau"] * r[2]["target_passes"] for r in res) / passes if passes else 1.0
    else:
        tau = 1.0
    row = {"mode": mode, "concurrency": conc, "requests": len(res), "completion_tokens": toks,
           "wall_s": round(wall, 3), "per_user": [r[0] / r[1] for r in res], "latency": [r[1] for r in res],
           "throughput_tok_s": round(toks / wall, 2),
           "per_user_tok_s_median": round(statistics.median(r[0] / r[1] for r in res), 2),
           "latency_s_median": round(statistics.median(r[1] for r in res), 3), "tau": round(tau, 3)}
    if p0:  # what the adaptive policy chose over this round
        p1 = policy_counters(base)
        steps = max(p1[0] - p0[0], 1)
        row["drafter_fraction"] = round((p1[1] - p0[1]) / steps, 3)
        row["draft_nodes_per_step"] = round((p1[2] - p0[2]) / steps, 2)
    return row


def merge_rounds(rows: list[dict], names: list[str]) -> list[dict]:
    """One row per (mode, concurrency) over all rounds: throughput = all tokens / all wall time, medians over all
    requests, tau averaged over rounds; `rounds_throughput` keeps each round's figure."""
    out = []
    for mode in names:
        for conc in sorted({r["concurrency"] for r in rows}):
            rr = [r for r in rows if r["mode"] == mode and r["concurrency"] == conc]
            m = {"mode": mode, "concurrency": conc, "requests": sum(r["requests"] for r in rr),
                 "completion_tokens": sum(r["completion_tokens"] for r in rr),
                 "throughput_tok_s": round(sum(r["completion_tokens"] for r in rr) / sum(r["wall_s"] for r in rr), 2),
                 "per_user_tok_s_median": round(statistics.median([u for r in rr for u in r["per_user"]]), 2),
                 "latency_s_median": round(statistics.median([u for r in rr for u in r["latency"]]), 3),
                 "tau": round(statistics.fmean(r["tau"] for r in rr), 3),
                 "rounds_throughput": [r["throughput_tok_s"] for r in rr]}
            if "drafter_fraction" in rr[0]:
                m["drafter_fraction"] = round(statistics.fmean(r["drafter_fraction"] for r in rr), 3)
                m["draft_nodes_per_step"] = round(statistics.fmean(r["draft_nodes_per_step"] for r in rr), 2)
            out.append(m)
    return out


class _Up:
    """A started server as a context: entering waits for /health and warms it up; -> (base, counters, client,
    speculate=True)."""

    def __init__(self, server, prompt: str, max_tokens: int):
        self.server, self.prompt, self.max_tokens = server, prompt, max_tokens

    def __enter__(self):
        from openai import OpenAI

        base, counters = self.server.__enter__()
        client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
        ask(client, self.prompt, self.max_tokens)  # warm-up
        return base, counters, client, True

    def __exit__(self, *exc):
        return self.server.__exit__(*exc)


def start_all(order: list[str], args, threads: int, out: Path, prompts: list[str], skipped: dict) -> dict:
    """The servers of `order` (not yet started: `_Up` contexts), skipping (with a message) the ones unavailable."""
    servers = {}
    for mode in order:
        server = start_server(mode, args, threads, out)
        if isinstance(server, str):
            skipped[mode] = server
            print(f"skipping {mode}: {server}", flush=True)
            continue
        servers[mode] = _Up(server, prompts[0], args.max_tokens)
    return servers


def main() -> int:
    from dflashkit.bench import turn_order
    from dflashkit.data import mtbench_questions

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--modes", default="ar,dflash-b8,vllm,vllm-dflash-b8")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every (concurrency, mode) cell, interleaved")
    ap.add_argument("--restart", action="store_true", help="fresh servers every round, started in a rotating order")
    ap.add_argument("--one-server", action="store_true",
                    help="ar = the default server's requests with speculate: false (one process for both)")
    ap.add_argument("--chunk", type=int, default=0,
                    help="run each concurrency's requests in chunks of max(CHUNK, concurrency), each chunk by every "
                         "mode in turn (0: all requests as one chunk)")
    ap.add_argument("--out", default="bench/results/serve-load")
    ap.add_argument("--report-only", action="store_true", help="rewrite serve_load.md/.png from serve_load.json")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        saved = json.loads((out / "serve_load.json").read_text())
        print(report(saved["meta"], saved["rows"], out))
        return 0
    prompts = [q["turns"][0] for q in mtbench_questions()][: args.requests]
    threads = torch.get_num_threads()
    rows, skipped = [], {}
    modes = args.modes.split(",")
    shared = args.one_server and "ar" in modes and "default" in modes
    k = 0
    # Every server is started first and stays up (an idle one polls its queue every 50 ms); then each concurrency
    # level is run by every mode back to back, in a rotating order. Why: on a shared 2-core host the same work ran
    # 40 % slower minutes apart, so modes run one after another (minutes each) would compare different machines;
    # interleaved, drift hits them alike. --restart: fresh servers every round, started in a rotating order (two
    # identical AR servers side by side differed by 1-19 %, consistently: a process's own luck, which rounds within
    # one set of processes cannot average out).
    for r in range(args.rounds if args.restart else 1):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        servers = start_all([m for m in order if not (shared and m in ("ar", "ar-again"))], args, threads, out,
                            prompts, skipped)
        with contextlib.ExitStack() as stack:
            for mode in order:
                if mode in servers:
                    servers[mode] = stack.enter_context(servers[mode])
            if shared and "default" in servers:  # its AR warm-up: the AR batch's first request
                servers["ar"] = servers["default"][:3] + (False,)
                if "ar-again" in modes:
                    servers["ar-again"] = servers["ar"]
                ask(servers["ar"][2], prompts[0], args.max_tokens, False)
            names = [m for m in modes if m in servers]
            for _ in range(1 if args.restart else args.rounds):
                for conc in (1, 2, 4, 8, 16):
                    size = max(args.chunk, conc) if args.chunk else len(prompts)
                    for i in range(0, len(prompts), size):  # each chunk run by every mode in turn
                        for mode in turn_order(names, k):
                            rows.append(load_round(mode, servers[mode], prompts[i:i + size], conc, args.max_tokens))
                            print({a: b for a, b in rows[-1].items() if a not in ("per_user", "latency")},
                                  flush=True)
                        k += 1
    names = [m for m in modes if m not in skipped]
    rows = merge_rounds(rows, names)
    meta = {"command": " ".join(sys.argv), "threads": threads, "dtype": args.dtype, "requests": len(prompts),
            "max_tokens": args.max_tokens, "prompts": "MT-Bench first turns", "skipped": skipped,
            "rounds": args.rounds, "restart": args.restart, "one_server": shared,
            "order": "interleaved: all servers up, each concurrency run by every mode back to back (turn_order: "
                     "rotating, the cycle's direction flipping)"
                     + (f"; in chunks of max({args.chunk}, concurrency) requests, each chunk by every mode in turn"
                        if args.chunk else "")
                     + ("; fresh servers every round, started in a rotating order" if args.restart else "")
                     + ("; ar = the default server's requests with speculate: false (one process)" if shared else "")}
    (out / "serve_load.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(report(meta, rows, out))
    return 0


def report(meta: dict, rows: list[dict], out: Path) -> str:
    """serve_load.md (one wide table: every mode side by side per concurrency, then the long table) + .png."""
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    cell = {(r["mode"], r["concurrency"]): r for r in rows}
    concs = sorted({r["concurrency"] for r in rows})
    md = [f"# Serving load (`{meta['command']}`)", "",
          f"{meta.get('requests', 16)} chat requests (MT-Bench first turns), max_tokens {meta['max_tokens']}, T=0, "
          f"{meta['dtype']}, {meta['threads']} CPU threads for every engine (vLLM bound to cores "
          f"0-{meta['threads'] - 1}), loopback, openai client."
          + (" Order: " + meta["order"] + "." if "order" in meta else "")
          + (f" Rounds: {meta['rounds']} per cell (throughput = all tokens / all time)." if "rounds" in meta else ""),
          "",
          "Side by side: aggregate throughput tok/s / median per-user tok/s (tau for the DFlash modes).", "",
          "| concurrency | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for c in concs:
        cells = []
        for m in modes:
            r = cell.get((m, c))
            cells.append("-" if r is None else f"{r['throughput_tok_s']:.0f} / {r['per_user_tok_s_median']:.1f}"
                         + (f" (tau {r['tau']:.2f})" if r["tau"] > 1 else ""))
        md.append(f"| {c} | " + " | ".join(cells) + " |")
    md += ["", "| mode | concurrency | throughput tok/s | per-user tok/s (median) | latency s (median) | tau |",
           "|---|---|---|---|---|---|"]
    md += [f"| {r['mode']} | {r['concurrency']} | {r['throughput_tok_s']} | {r['per_user_tok_s_median']} | "
           f"{r['latency_s_median']} | {r['tau']} |" for r in rows]
    pol = [r for r in rows if "drafter_fraction" in r]
    if pol:
        md += ["", "What the adaptive policy (`default`) chose per step, by concurrency:", "",
               "| concurrency | drafter ran | draft nodes verified per step (all rows) |", "|---|---|---|"]
        md += [f"| {r['concurrency']} | {100 * r['drafter_fraction']:.0f} % | {r['draft_nodes_per_step']} |"
               for r in pol]
    fixed = {r["concurrency"]: r for r in rows if r["mode"] == "default-fixed"}
    ar = {r["concurrency"]: r for r in rows if r["mode"] == "ar"}
    ada = [r for r in rows if r["mode"] == "default" and r["concurrency"] in fixed and r["concurrency"] in ar]
    if ada:  # the acceptance rule of the adaptive policy: >= 0.95 x the better of AR and the fixed tree
        # Each round's (or chunk's) modes ran back to back, so its ratio compares one stretch of the host; the
        # median of those ratios is robust to a round that a slow minute of the host hit in one mode only.
        md += ["", "| concurrency | default / max(ar, default-fixed): median of the rounds' ratios | per round (chunk) | "
               "pooled (all tokens / all time) |", "|---|---|---|---|"]
        for r in ada:
            a, f = ar[r["concurrency"]], fixed[r["concurrency"]]
            best = max(a["throughput_tok_s"], f["throughput_tok_s"])
            rounds = [d / max(x, y) for d, x, y in zip(r["rounds_throughput"], a["rounds_throughput"],
                                                       f["rounds_throughput"])]
            md.append(f"| {r['concurrency']} | **{statistics.median(rounds):.3f}** | "
                      f"{' / '.join(f'{x:.3f}' for x in rounds)} | {r['throughput_tok_s'] / best:.3f} |")
    again = {r["concurrency"]: r for r in rows if r["mode"] == "ar-again"}
    if again and ar:  # the A/A control: the same AR requests measured twice in each cell
        md += ["", "The same AR requests measured twice (A/A control: what identical work reads in each cell):", "",
               "| concurrency | ar-again / ar: median of the rounds' ratios | per round | pooled |", "|---|---|---|---|"]
        for c, r in again.items():
            rounds = [x / y for x, y in zip(r["rounds_throughput"], ar[c]["rounds_throughput"])]
            md.append(f"| {c} | {statistics.median(rounds):.3f} | {' / '.join(f'{x:.3f}' for x in rounds)} | "
                      f"{r['throughput_tok_s'] / ar[c]['throughput_tok_s']:.3f} |")
    md += [f"\nskipped `{m}`: {why}" for m, why in meta.get("skipped", {}).items()]
    (out / "serve_load.md").write_text("\n".join(md) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode in modes:
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
    plt.close(fig)
    return "\n".join(md)


if __name__ == "__main__":
    sys.exit(main())
