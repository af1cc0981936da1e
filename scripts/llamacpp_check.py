"""Prove `dflashkit export --format gguf` in llama.cpp itself (its own binaries, its own output).

    scripts/llamacpp-build.sh --tools-only          # once: .llamacpp/src + .llamacpp/bin
    .venv/bin/python scripts/llamacpp_check.py [--prompts 20] [--max-new-tokens 64] \
        [--out bench/results/llamacpp-check]

Checks, for the bundled drafter and the default target (SmolLM2-135M-Instruct):
1. writer == converter: our GGUF writer against llama.cpp's `convert_hf_to_gguf.py` run on our Z Lab export, for
   f32 and f16: every key the converter writes (the name aside) and every tensor (type, shape, bytes).
2. identity: on each prompt (half HumanEval, half MT-Bench first turns; our chat-templated token ids), greedy
   llama-server with our drafter (`--spec-type draft-dflash`, block 16: 15 drafts, no probability cut) against
   greedy llama-server without speculation, token for token, on an f32 target (llama.cpp's converter on the
   dequantized model) and on the Q4_1 GGUF itself.
3. acceptance: llama.cpp's verify cycles (its log's "accepted a/15" lines) against ours (the chain, f32, same
   prompt ids, same drafter): tau and per-position acceptance over each output's first N tokens.
Writes results.json and results.md under --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dflashkit import DecodeConfig, DFlashEngine  # noqa: E402
from dflashkit.bench.datasets import load_dataset  # noqa: E402
from dflashkit.checkpoint import load_drafter  # noqa: E402
from dflashkit.export import export_zlab  # noqa: E402
from dflashkit.gguf_export import compare_gguf, convert_target, export_gguf  # noqa: E402
from dflashkit.loader import default_gguf, encode_chat, load_default_drafter, load_target, resolve_target_dir  # noqa
from dflashkit.bench.llamacpp import LlamaServerMethod, llamacpp_bin  # noqa: E402
from dflashkit.stats import acceptance, tau  # noqa: E402

LLAMACPP = ROOT / ".llamacpp"
BIN, SRC, WORK = LLAMACPP / "bin", LLAMACPP / "src", LLAMACPP / "work"
BLOCK = 16


def run(cmd: list, timeout: int = 600) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({r.returncode}): {r.stderr[-2000:]}")
    return r


def writer_vs_converter(drafter, target_dir: Path) -> dict:
    """Our direct GGUF against llama.cpp's converter on our Z Lab export, per tensor type."""
    zlab = export_zlab(drafter, WORK / "zlab-f32", dtype=torch.float32)
    out = {}
    for kind in ("f32", "f16"):
        conv = WORK / f"converter-{kind}.gguf"
        run([sys.executable, SRC / "convert_hf_to_gguf.py", zlab, "--target-model-dir", target_dir,
             "--outfile", conv, "--outtype", kind])
        ours = export_gguf(drafter, default_gguf(), WORK / f"ours-{kind}.gguf", gguf_type=kind)
        out[kind] = compare_gguf(ours, conv)
    return out


def first_n(accepted: list[int], n: int) -> list[int]:
    """The cycles that produced an output's first n tokens (the first token comes from the prompt pass); the
    last cycle clipped to what was still needed."""
    out, have = [], 1
    for a in accepted:
        if have >= n:
            break
        a = min(a, n - have - 1)
        out.append(a)
        have += a + 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--targets", default="f32,q4_1", help="comma list of f32 (converted), q4_1 (the GGUF itself)")
    ap.add_argument("--only", default=None, help="comma list of prompt indices to run (default: all)")
    ap.add_argument("--skip-writer-check", action="store_true", help="skip the writer == converter comparison")
    ap.add_argument("--drafter", default=None, help="a drafter directory (v1 or DFlash2; default: the bundled one)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/llamacpp-check"))
    args = ap.parse_args()
    llamacpp_bin("llama-server")  # Skip names the remedy when it was not built
    WORK.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    n = args.max_new_tokens
    target, tok = load_target(dtype="float32")
    if args.drafter:
        drafter = load_drafter(args.drafter, dtype=target.dtype, num_target_layers=target.num_layers)
    else:
        drafter, _ = load_default_drafter(target, tok)
    target_dir = resolve_target_dir()
    result = {"max_new_tokens": n, "block_size": BLOCK, "threads": args.threads, "drafter": args.drafter or "bundled",
              "arch": drafter.config.arch,
              "llama_server": _shown(llamacpp_bin("llama-server")),
              "writer_vs_converter": {} if args.skip_writer_check else writer_vs_converter(drafter, target_dir)}
    print(json.dumps(result["writer_vs_converter"], indent=1))

    f32 = WORK / "target-f32.gguf"
    if not f32.is_file():
        convert_target(target_dir, f32, SRC, outtype="f32")
    targets = {k: v for k, v in {"f32": f32, "q4_1": default_gguf()}.items() if k in args.targets.split(",")}
    # f32 drafter: its acceptance is compared with ours in float32 (identity does not depend on it)
    dgguf = export_gguf(drafter, default_gguf(), WORK / "drafter-f32.gguf", gguf_type="f32")

    half = args.prompts // 2
    convs = load_dataset("humaneval", limit=half) + load_dataset("mt-bench", limit=args.prompts - half)
    ids = [encode_chat(tok, c[0]) for c in convs]
    keep = [int(i) for i in args.only.split(",")] if args.only else list(range(len(ids)))
    ids = [ids[i] for i in keep]
    ours = DFlashEngine(target, drafter, tokenizer=tok, config=DecodeConfig()).generate(ids, max_new_tokens=n)
    rows = []
    for kind, tpath in targets.items():
        ar = LlamaServerMethod(str(tpath), f"check-ar-{kind}", args.threads)
        spec = LlamaServerMethod(str(tpath), f"check-dflash-{kind}", args.threads, str(dgguf), block_size=BLOCK)
        try:
            for i, p in enumerate(ids):
                a, d = ar.run([p], n)[0], spec.run([p], n)[0]
                row = {"target": kind, "prompt": keep[i], "prompt_tokens": len(p), "new_tokens": len(a.tokens),
                       "identical": a.tokens == d.tokens, "first_difference": _first_diff(a.tokens, d.tokens),
                       "llamacpp_accepted": d.accepted, "text": tok.decode(d.tokens)[:120]}
                if not row["identical"]:
                    row["top2_gap_at_difference"] = _gap(target, p, a.tokens, row["first_difference"])
                if kind == "f32":
                    row["ours_accepted"] = ours[i].stats.accepted
                    row["ours_same_tokens_as_llamacpp"] = ours[i].tokens[:len(a.tokens)] == a.tokens
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if not k.endswith("accepted")}), flush=True)
        finally:
            ar.close()
            spec.close()
    result["rows"] = rows
    result["summary"] = summarize(rows, n)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "results.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def _shown(path: Path) -> str:
    """A path as results may name it: relative to the repository, never a host path."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return f"$DFLASHKIT_LLAMACPP_BIN/{path.name}"


def _gap(target, prompt: list[int], tokens: list[int], at: int) -> float:
    """The top-2 logit gap of the AR token at position `at` (our float32 reference forward): how near a tie the
    token llama.cpp's batched verification chose differently was."""
    logits = target.reference_logits(torch.tensor([prompt + tokens[:at + 1]]))[0, len(prompt) + at - 1].double()
    top = logits.topk(2).values
    return round(float(top[0] - top[1]), 5)


def _first_diff(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists part (None when equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summarize(rows: list[dict], n: int) -> dict:
    s = {}
    for kind in sorted({r["target"] for r in rows}):
        rs = [r for r in rows if r["target"] == kind]
        ll = [a for r in rs for a in first_n(r["llamacpp_accepted"], n)]
        gaps = [r["top2_gap_at_difference"] for r in rs if not r["identical"]]
        s[kind] = {"identical": f"{sum(r['identical'] for r in rs)}/{len(rs)}", "gaps_where_different": gaps,
                   "tau_llamacpp": round(tau(ll), 3),
                   "acceptance_llamacpp": [round(x, 3) for x in acceptance(ll, BLOCK)]}
        if "ours_accepted" in rs[0]:
            ours = [a for r in rs for a in first_n(r["ours_accepted"], n)]
            s[kind].update(ours_tokens_equal_llamacpp=f"{sum(r['ours_same_tokens_as_llamacpp'] for r in rs)}/{len(rs)}",
                           tau_ours=round(tau(ours), 3), acceptance_ours=[round(x, 3) for x in acceptance(ours, BLOCK)],
                           tau_ratio=round(tau(ll) / tau(ours), 4))
    return s


def markdown(result: dict) -> str:
    lines = ["# llama.cpp runs dflashkit's GGUF drafter", "",
             f"Drafter: {result.get('drafter', 'bundled')} ({result.get('arch', 'dflash')}), SmolLM2-135M-Instruct, "
             f"greedy, {result['max_new_tokens']} tokens, block "
             f"{result['block_size']}, {result['threads']} threads, llama-server `{result['llama_server']}`. Produced "
             "by `scripts/llamacpp_check.py`.", "",
             "| check | result |", "|---|---|"]
    for kind, c in result["writer_vs_converter"].items():
        lines.append(f"| our writer == llama.cpp's converter ({kind}) | {'yes' if c['identical'] else 'NO'}: "
                     f"{c['keys_compared']} keys, {c['tensors_compared']} tensors compared; differing "
                     f"{c['keys_differing'] + c['tensors_differing'] or 'none'} |")
    for kind, s in result["summary"].items():
        why = (f"; where not, the first differing token was a near-tie: top-2 logit gaps {s['gaps_where_different']}"
               " (llama.cpp's batched f32 matmul rounds differently from its one-token path)"
               if s["gaps_where_different"] else "")
        lines.append(f"| llama.cpp + drafter == llama.cpp AR, {kind} target | {s['identical']} prompts{why} |")
        extra = (f"; ours {s['tau_ours']:.3f} (ratio {s['tau_ratio']:.3f}; our greedy text == llama.cpp's on "
                 f"{s['ours_tokens_equal_llamacpp']} prompts)") if "tau_ours" in s else ""
        lines.append(f"| tau, {kind} target | llama.cpp {s['tau_llamacpp']:.3f}{extra} |")
    lines += ["", "Per-position acceptance (share of cycles accepting >= j drafts):", "",
              "| target | who | " + " | ".join(str(j) for j in range(1, BLOCK)) + " |",
              "|---|---|" + "---|" * (BLOCK - 1)]
    for kind, s in result["summary"].items():
        for who in ("llamacpp", "ours"):
            if f"acceptance_{who}" in s:
                lines.append(f"| {kind} | {who} | " + " | ".join(f"{x:.2f}" for x in s[f"acceptance_{who}"]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
