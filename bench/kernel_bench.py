"""Linear kernels and target steps on the real target, side by side in one run: torch's bf16 `F.linear`, our
row-invariant `rowlinear` kernel on the same bf16 weights, and on the GGUF's own Q4_1 codes (`--quant int4`);
then the whole target step (forward + LM head) of HF eager, lean, lean + rowlinear, + the fused attention
(kernels/attention.cpp), + the layer stack (all layers in one C++ call, kernels/layers.cpp; also with rowlinear's
AVX2 path forced, `@avx2`), and the int4 targets (fp32 products; 8-bit activations with integer dot products,
kernels/qlinear.cpp) at 1 / 4 / 16 / 32 tokens (one-token decoding and verify blocks).

    .venv/bin/python bench/kernel_bench.py --out bench/results/kernels

Medians of `--repeats` rounds, each round timing every variant back to back (drift on a shared host hits all
alike). Writes kernels.json, kernels.md and kernels.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dflashkit.kernels import RowLinear, isa, set_isa
from dflashkit.loader import apply_kernels, load_target, resolve_target_dir
from dflashkit.measurements import cpu_name

ROWS = [1, 4, 16, 32]
VARIANTS = ["hf", "lean", "lean+rowlinear", "lean+rowlinear+attend", "lean+rowlinear+attend+layers@avx2",
            "lean+rowlinear+attend+layers", "lean+int4+attend", "lean+int4+attend+layers", "lean+int4-a8+attend",
            "lean+int4-a8+attend+layers"]


@contextlib.contextmanager
def isa_of(name: str):
    """A variant named "...@avx2" runs rowlinear's 8-lane AVX2 path (on an AVX512-BF16 CPU the default is its
    16-lane bf16 dot products)."""
    if name.endswith("@avx2"):
        set_isa("avx2")
    try:
        yield
    finally:
        set_isa("auto")


def timed(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1000


def linear_table(targets: dict, repeats: int) -> dict:
    """ms per call of the layer-0 fused gate/up (the widest linear) and the LM head, per kernel and row count."""
    lean = targets["lean"]
    shapes = {"gate/up [3072 x 576]": {"torch": lean._layers[0].wgu,
                                       "rowlinear": targets["lean+rowlinear"]._layers[0].wgu,
                                       "rowlinear@avx2": targets["lean+rowlinear"]._layers[0].wgu,
                                       "int4": targets["lean+int4+attend"]._layers[0].wgu,
                                       "int4-a8": targets["lean+int4-a8+attend"]._layers[0].wgu},
              "head [49152 x 576]": {"torch": lean.lm_head_weight, "rowlinear": targets["lean+rowlinear"].head,
                                     "rowlinear@avx2": targets["lean+rowlinear"].head,
                                     "int4 (q8_0)": targets["lean+int4+attend"].head,
                                     "int4-a8 (q8_0)": targets["lean+int4-a8+attend"].head}}
    out = {}
    for shape, ws in shapes.items():
        for m in ROWS:
            x = torch.randn(m, 576).bfloat16()
            runs = {k: [] for k in ws}
            for _ in range(repeats):
                for k, w in ws.items():
                    f = (lambda w=w: w(x)) if isinstance(w, RowLinear) else (lambda w=w: F.linear(x, w))
                    with isa_of(k):
                        runs[k].append(timed(f, 5 if "head" in shape else 20))
            out[f"{shape} M={m}"] = {k: round(statistics.median(v), 3) for k, v in runs.items()}
    return out


def step_table(targets: dict, ids: list[int], repeats: int) -> dict:
    """ms of one target step (forward + head) with `m` new tokens after a prefilled prompt, per engine."""
    out = {}
    for m in tqdm(ROWS, desc="target steps", unit="width"):
        caches = {}
        for name, t in targets.items():  # prefill once per engine and width (not timed)
            c = t.new_cache(1, len(ids) + 64)
            with isa_of(name):
                t.forward(torch.tensor([ids]), torch.arange(len(ids))[None], c, kv_len=len(ids))
            caches[name] = c
        new = torch.tensor([ids[-m:]])
        pos = torch.arange(len(ids), len(ids) + m)[None]

        def step(t, c):
            h, _ = t.forward(new, pos, c)
            return t.logits(h)
        runs = {k: [] for k in targets}
        for _ in range(repeats):
            for name, t in targets.items():
                with isa_of(name):
                    runs[name].append(timed(lambda: step(t, caches[name]), 3))
        out[str(m)] = {k: round(statistics.median(v), 2) for k, v in runs.items()}
    return out


def main() -> int:
    from dflashkit.bench.datasets import load_dataset
    from dflashkit.loader import encode_chat

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench/results/kernels")
    args = ap.parse_args()
    targets = {}
    for name in VARIANTS:
        t, tok = load_target(None, dtype="bfloat16", backend="hf" if name == "hf" else "lean", kernel="torch")
        if "int4" in name:  # (apply_kernels also turns the fused attention on)
            apply_kernels(t, resolve_target_dir(None), "rowlinear", "int4-a8" if "a8" in name else "int4")
        elif "rowlinear" in name:
            t.use_rowlinear()
        if "attend" in name:
            t.use_fused_attention()
        # apply_kernels turns the layer stack on where it can (kernels/layers.cpp); "+layers" says where it runs
        t.stack = None
        if "+layers" in name:
            t.use_layer_stack()
        targets[name] = t
    ids = encode_chat(tok, load_dataset("humaneval", 1)[0][0])
    res = {"linears_ms": linear_table(targets, args.repeats), "target_step_ms": step_table(targets, ids, args.repeats)}
    meta = {"command": " ".join(["bench/kernel_bench.py"] + sys.argv[1:]), "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "prompt_tokens": len(ids),
            "repeats": args.repeats, "rowlinear_isa": isa(), "cpu": cpu_name()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps({"meta": meta, **res}, indent=2) + "\n")
    print(report(meta, res, out))
    return 0


def report(meta: dict, res: dict, out: Path) -> str:
    md = [f"# Linear kernels and target steps (`{meta['command']}`)", "",
          f"{meta['cpu']}, {meta['threads']} threads, torch CPU capability {meta['cpu_capability']}, rowlinear's "
          f"bf16 path: {meta['rowlinear_isa']} (`@avx2`: its 8-lane path forced), medians of {meta['repeats']} "
          "interleaved rounds. ms per call.", "", "## One linear", "",
          "| shape, rows | " + " | ".join(next(iter(res["linears_ms"].values()))) + " |",
          "|---" * (1 + len(next(iter(res["linears_ms"].values())))) + "|"]
    md += [f"| {k} | " + " | ".join(f"{v:.3f}" for v in row.values()) + " |" for k, row in res["linears_ms"].items()]
    engines = list(next(iter(res["target_step_ms"].values())))
    md += ["", f"## Target step: forward + LM head, {meta['prompt_tokens']}-token prompt in the cache", "",
           "| new tokens | " + " | ".join(engines) + " | " + " | ".join(f"hf / {e}" for e in engines[1:]) + " |",
           "|---" * (2 * len(engines)) + "|"]
    for m, row in res["target_step_ms"].items():
        md.append(f"| {m} | " + " | ".join(f"{row[e]:.1f}" for e in engines) + " | "
                  + " | ".join(f"{row['hf'] / row[e]:.2f}x" for e in engines[1:]) + " |")
    (out / "kernels.md").write_text("\n".join(md) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = [int(m) for m in res["target_step_ms"]]
    for e in engines:
        ax.plot(rows, [res["target_step_ms"][str(m)][e] for m in rows], marker="o", label=e)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in the step (1 = AR, 16 = a verify block)")
    ax.set_ylabel("ms per target step (forward + head)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "kernels.png", dpi=120)
    plt.close(fig)
    return "\n".join(md)


if __name__ == "__main__":
    raise SystemExit(main())
