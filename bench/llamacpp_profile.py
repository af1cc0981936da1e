"""Where llama.cpp's DFlash spends a cycle on this CPU: its draft step against its verify and its plain AR step.

    .venv/bin/python bench/llamacpp_profile.py [--prompts 4] [--max-new-tokens 64] [--out bench/results/llamacpp-profile]

For each configuration (draft vocabulary: full / 16384 / 4096 rows of the head; drafts per cycle: 15 / 3) it runs
llama.cpp's own `llama-speculative-simple` with our bundled drafter exported to GGUF, on the Q4_1 target, and reads
its statistics: the draft step's wall time per call (`dur(g)` / calls), the target's time per verify cycle (its
"prompt eval" time minus the prompt's own encoding, over the cycles), tau; and `llama-completion`'s ms per AR
token on the same prompts. A smaller head shows what the LM head and the full-vocabulary sampling cost of a draft.
Needs scripts/llamacpp-build.sh --tools-only. Run it on a quiet machine (timings).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dflashkit.bench.datasets import load_dataset  # noqa: E402
from dflashkit.bench.llamacpp import llamacpp_bin  # noqa: E402
from dflashkit.gguf_export import export_gguf  # noqa: E402
from dflashkit.loader import default_gguf, encode_chat, load_default_drafter, load_target  # noqa: E402

WORK = ROOT / ".llamacpp" / "work"
CONFIGS = [("full", 0, 15), ("v16384", 16384, 15), ("v4096", 4096, 15), ("full", 0, 3), ("v4096", 4096, 3)]


def run(cmd: list) -> str:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed: {r.stderr[-1500:]}")
    return r.stdout + r.stderr


def number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    if m is None:
        raise RuntimeError(f"no match for {pattern!r} in llama.cpp's output")
    return float(m.group(1))


def profile_spec(target: Path, drafter: Path, prompt: Path, n: int, drafts: int, threads: int) -> dict:
    out = run([llamacpp_bin("llama-speculative-simple"), "-m", target, "-md", drafter, "-f", prompt, "-n", n,
               "--spec-type", "draft-dflash", "--spec-draft-n-max", drafts, "--spec-draft-p-min", 0,
               "-t", threads, "-td", threads, "-c", 4096, "--temp", 0, "--seed", 0,
               "-lv", 4])  # verbosity 4 = trace: its speculative statistics, without the per-candidate debug lines
    calls = number(r"#calls\(b,g,a\) =\s+\d+\s+(\d+)", out)
    draft_ms = number(r"dur\(b,g,a\) = [\d.]+, ([\d.]+),", out)
    encode_s = number(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", out)
    target_eval_ms = number(r"prompt eval time =\s+([\d.]+) ms", out)  # the prompt AND every verify batch
    decoded = number(r"decoded\s+(\d+) tokens", out)
    decode_s = number(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds", out)
    return {"cycles": calls, "draft_ms_per_cycle": draft_ms / calls,
            "verify_ms_per_cycle": (target_eval_ms - 1000 * encode_s) / calls,
            "tau": decoded / calls, "tokens_per_s": decoded / decode_s}


def ar_ms_per_token(target: Path, prompt: Path, n: int, threads: int) -> float:
    out = run([llamacpp_bin("llama-completion"), "-m", target, "-f", prompt, "-n", n, "-no-cnv",
               "--no-display-prompt", "-t", threads, "-c", 4096, "--temp", 0, "--seed", 0])
    return number(r"\beval time =\s+[\d.]+ ms /\s+\d+ runs\s+\(\s*([\d.]+) ms per token", out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench/results/llamacpp-profile"))
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    target, tok = load_target(dtype="float32")
    drafter, _ = load_default_drafter(target, tok)
    tgt = default_gguf()
    files = {"full": export_gguf(drafter, tgt, WORK / "profile-full.gguf")}
    for name, vocab, _ in CONFIGS:
        if vocab and name not in files:
            files[name] = export_gguf(drafter, tgt, WORK / f"profile-{name}.gguf", head=target.lm_head_weight,
                                      draft_vocab=vocab)
    half = args.prompts // 2
    convs = load_dataset("humaneval", limit=half) + load_dataset("mt-bench", limit=args.prompts - half)
    prompts = []
    for i, c in enumerate(convs):
        p = WORK / f"profile-prompt-{i}.txt"
        p.write_text(tok.decode(encode_chat(tok, c[0])))
        prompts.append(p)
    ar = [ar_ms_per_token(tgt, p, args.max_new_tokens, args.threads) for p in prompts]
    rows = []
    for name, vocab, drafts in CONFIGS:
        runs = [profile_spec(tgt, files[name], p, args.max_new_tokens, drafts, args.threads) for p in prompts]
        row = {"draft_vocab": name, "drafts_per_cycle": drafts}
        for k in ("draft_ms_per_cycle", "verify_ms_per_cycle", "tau", "tokens_per_s"):
            row[k] = round(statistics.median(r[k] for r in runs), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    ar_ms = round(statistics.median(ar), 3)
    result = {"target": tgt.name, "threads": args.threads, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "ar_ms_per_token": ar_ms, "ar_tokens_per_s": round(1000 / ar_ms, 2),
              "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# llama.cpp DFlash cycle profile ({tgt.name}, {args.threads} threads, medians over {args.prompts} "
             f"prompts x {args.max_new_tokens} tokens)", "",
             f"llama.cpp AR: {ar_ms:.1f} ms per token ({1000 / ar_ms:.1f} tok/s).", "",
             "| draft vocabulary | drafts per cycle | draft ms / cycle | verify ms / cycle | tau | tok/s | vs AR |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['draft_vocab']} | {r['drafts_per_cycle']} | {r['draft_ms_per_cycle']:.1f} | "
                     f"{r['verify_ms_per_cycle']:.1f} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s'] * ar_ms / 1000:.2f}x |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
