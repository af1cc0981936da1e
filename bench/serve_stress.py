"""Stress `dflashkit serve`: 64 concurrent streaming clients with mixed sampling settings, plus poison requests.

Starts `dflashkit serve` (the default system, bf16) in its own process, then fires `--streams` streaming chat
requests at once through the `openai` client, each with its own temperature / top_p / top_k / seed / n / logprobs
/ stop, and `--poison` requests with out-of-range fields among them. Counts: streams that ended with a
finish_reason (completed), lost streams (no finish), 5xx answers, and the poison requests' statuses (all must be
4xx). Writes serve_stress.json, serve_stress.md and serve_stress.png (latency per stream) into --out.

    .venv/bin/python bench/serve_stress.py --out bench/results/serve-stress
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = ["Write a Python function that reverses a string.", "Name three planets.", "What is 7 * 8?",
           "Write a haiku about autumn.", "Explain what a list comprehension is.", "Say hello in French.",
           "Give two uses of a hammer.", "What does HTTP stand for?"]
POISON = [{"seed": 2 ** 64}, {"top_k": 2 ** 63}, {"temperature": -1}, {"top_p": 0}, {"n": 10 ** 6},
          {"stop": ["x"] * 100}, {"max_tokens": 10 ** 9}, {"tools": [{"type": "function"}]}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settings(rng: random.Random) -> dict:
    kw = {"temperature": rng.choice([0, 0, 0.5, 1.0, 1.5]), "max_tokens": rng.choice([16, 32, 48])}
    if rng.random() < 0.3:
        kw["top_p"] = rng.choice([0.5, 0.9, 1e-300])
    if rng.random() < 0.3:
        kw["top_k"] = rng.choice([1, 5, 50, 2 ** 31 - 1])
    if rng.random() < 0.5:
        kw["seed"] = rng.randrange(-(2 ** 63), 2 ** 64)
    if rng.random() < 0.2:
        kw["n"] = 2
    if rng.random() < 0.2:
        kw["logprobs"], kw["top_logprobs"] = True, rng.randrange(0, 5)
    if rng.random() < 0.2:
        kw["stop"] = [rng.choice(["\n\n", ".", "def"])]
    return kw


def stream(client, i: int, kw: dict) -> dict:
    from openai import APIStatusError

    t0 = time.time()
    finished, chunks = set(), 0
    kw = dict(kw)
    extra = {"top_k": kw.pop("top_k")} if "top_k" in kw else None  # not an OpenAI field: the client sends it as is
    try:
        for c in client.chat.completions.create(model="smollm2-135m-instruct-dflash", stream=True,
                                                messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                                extra_body=extra, **kw):
            chunks += 1
            for ch in c.choices:
                if ch.finish_reason:
                    finished.add(ch.index)
        status = 200
    except APIStatusError as e:
        status = e.status_code
    except Exception as e:  # a broken stream counts as lost
        return {"i": i, "status": None, "error": repr(e), "lost": True, "s": round(time.time() - t0, 3),
                "settings": kw}
    return {"i": i, "status": status, "chunks": chunks, "lost": status == 200 and len(finished) < kw.get("n", 1),
            "s": round(time.time() - t0, 3), "settings": kw}


def poison(url: str, kw: dict) -> int:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **kw}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"content-type": "application/json"})
    try:
        return urllib.request.urlopen(req, timeout=300).status
    except urllib.error.HTTPError as e:
        return e.code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--out", default="bench/results/serve-stress")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from openai import OpenAI

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    exe = Path(sys.executable).parent / "dflashkit"
    cmd = [str(exe), "serve", "--port", str(port), "--max-batch", str(args.max_batch), "--max-queue", "256"]
    log = open(out / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"the server did not start; see {out / 'server.log'}")
                time.sleep(0.5)
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)
        rng = random.Random(args.seed)
        jobs = [settings(rng) for _ in range(args.streams)]
        t0 = time.time()
        with ThreadPoolExecutor(args.streams + len(POISON)) as ex:
            futs = [ex.submit(stream, client, i, kw) for i, kw in enumerate(jobs)]
            time.sleep(1.0)  # the poison arrives while the streams are decoding
            bad = [ex.submit(poison, url, kw) for kw in POISON]
            rows = [f.result() for f in futs]
            poison_status = [f.result() for f in bad]
        wall = time.time() - t0
        health = json.loads(urllib.request.urlopen(url + "/health").read())
    finally:
        proc.terminate()
        code = proc.wait(120)
    summary = {"command": "python bench/serve_stress.py " + " ".join(sys.argv[1:]), "server": " ".join(cmd[1:]),
               "streams": len(rows), "completed": sum(r["status"] == 200 and not r["lost"] for r in rows),
               "lost": sum(bool(r["lost"]) for r in rows), "5xx": sum((r["status"] or 0) >= 500 for r in rows),
               "other_status": sorted({r["status"] for r in rows if r["status"] not in (200, None)}),
               "poison": [{"fields": list(kw), "status": s} for kw, s in zip(POISON, poison_status)],
               "wall_s": round(wall, 1), "max_stream_s": max(r["s"] for r in rows),
               "health_after": health, "server_exit_code": code}
    (out / "serve_stress.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=2) + "\n")
    md = [f"# serve stress: {summary['streams']} concurrent streams + {len(POISON)} poison requests", "",
          f"`{summary['command']}` against `dflashkit {summary['server']}`", "",
          "| streams | completed | lost | 5xx | poison statuses | wall s | slowest stream s | server exit |",
          "|---|---|---|---|---|---|---|---|",
          f"| {summary['streams']} | {summary['completed']} | {summary['lost']} | {summary['5xx']} | "
          f"{sorted(set(poison_status))} | {summary['wall_s']} | {summary['max_stream_s']} | {code} |"]
    (out / "serve_stress.md").write_text("\n".join(md) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(range(len(rows)), [r["s"] for r in rows])
    ax.set_xlabel("stream")
    ax.set_ylabel("seconds to the last chunk")
    ax.set_title(f"{summary['completed']}/{summary['streams']} completed, {summary['lost']} lost, {summary['5xx']} 5xx")
    fig.tight_layout()
    fig.savefig(out / "serve_stress.png", dpi=120)
    print("\n".join(md))
    ok = summary["lost"] == 0 and summary["5xx"] == 0 and all(400 <= s < 500 for s in poison_status)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
