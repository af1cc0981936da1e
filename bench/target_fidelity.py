"""How far each way of computing the default target strays from the same weights computed in float32.

The default SmolLM2 is a Q4_1 GGUF: transformers loads its weights, and every engine target computes the same weights
with another arithmetic: the default (bf16 activations and weights, the codes read as their exact bf16 values),
`--quant int4` (the codes' own values against bf16 activations, fp32 sums) and `--quant int4-a8` (the codes as they
are, activations rounded to int8 per 32-block, as llama.cpp computes them).
The reference is the HF model in float32 on those weights. On human-written text (the prompts of three sets, chat
template applied, never the targets' own outputs, which would favour one of them), per next-token position:
  KL(reference || target), whether the target's top-1 token is the reference's, and the text's NLL under each.

    .venv/bin/python bench/target_fidelity.py --limit 40 --out bench/results/target-fidelity

Writes fidelity.json, fidelity.md and fidelity.png.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from tqdm import tqdm

from dflashkit.bench.datasets import load_dataset
from dflashkit.loader import encode_chat, load_target
from dflashkit.measurements import cpu_name

DATASETS = ["sharegpt-heldout", "humaneval", "mt-bench-t1"]
TARGETS = {"bf16 (default)": {"dtype": "bfloat16"}, "int4": {"dtype": "bfloat16", "quant": "int4"},
           "int4-a8": {"dtype": "bfloat16", "quant": "int4-a8"}}


def log_probs(target, ids: list[int]) -> torch.Tensor:
    """[T - 1, V] fp32 log-probabilities of the next token after each position but the last."""
    x = torch.tensor([ids])
    cache = target.new_cache(1, len(ids))
    h, _ = target.forward(x, torch.arange(len(ids))[None], cache, kv_len=len(ids), taps=False)
    return torch.log_softmax(target.logits(h)[0, :-1].float(), dim=-1)


def compare(ref: torch.Tensor, got: torch.Tensor, ids: list[int]) -> dict:
    """Sums over positions: KL(ref || got), top-1 agreement, NLL of the text's next tokens (ref and got)."""
    nxt = torch.tensor(ids[1:])[:, None]
    kl = (ref.exp() * (ref - got)).sum(-1)
    return {"positions": len(ids) - 1, "kl": float(kl.sum()), "kl_max": float(kl.max()),
            "top1_same": int((ref.argmax(-1) == got.argmax(-1)).sum()),
            "nll": float(-got.gather(1, nxt).sum()), "nll_ref": float(-ref.gather(1, nxt).sum())}


def main() -> int:
    from dflashkit.bench.report import write_result

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=40, help="prompts per set")
    ap.add_argument("--max-tokens", type=int, default=512, help="a prompt's tokens past this are cut")
    ap.add_argument("--out", default="bench/results/target-fidelity")
    args = ap.parse_args()
    ref_t, tok = load_target(dtype="float32", backend="hf")
    targets = {name: load_target(**kw)[0] for name, kw in TARGETS.items()}
    sums = {d: {name: {} for name in targets} for d in DATASETS}
    with torch.inference_mode():
        for d in DATASETS:
            for turns in tqdm(load_dataset(d, args.limit), desc=d, unit="prompt"):
                ids = encode_chat(tok, turns[0])[: args.max_tokens]
                ref = log_probs(ref_t, ids)
                for name, t in targets.items():
                    for k, v in compare(ref, log_probs(t, ids), ids).items():
                        acc = sums[d][name]
                        acc[k] = max(acc.get(k, 0.0), v) if k == "kl_max" else acc.get(k, 0) + v
    table = {d: {name: {"positions": s["positions"], "mean_kl": s["kl"] / s["positions"], "max_kl": s["kl_max"],
                        "top1_agreement": s["top1_same"] / s["positions"], "nll": s["nll"] / s["positions"],
                        "nll_reference": s["nll_ref"] / s["positions"]} for name, s in per.items()}
             for d, per in sums.items()}
    meta = {"command": "bench/target_fidelity.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
            "cpu": cpu_name(), "threads": torch.get_num_threads(), "limit": args.limit,
            "engines": {name: t.engine_name for name, t in targets.items()}}
    res = {"meta": meta, "table": table}
    write_result(args.out, "fidelity", res, report(res), plot)
    print(report(res))
    return 0


def report(res: dict) -> str:
    mt = res["meta"]
    lines = [f"# Each engine target against the same weights in float32 ({mt['date']}, {mt['cpu']})", "",
             f"`{mt['command']}`. Reference: the HF model in float32 on the GGUF's weights; human-written prompts "
             f"({mt['limit']} per set, chat template applied), every next-token position. Engines: "
             + "; ".join(f"{k}: {v}" for k, v in mt["engines"].items()) + ".", "",
             "| set | target | positions | mean KL (nats) | max KL | top-1 agreement | NLL (nats/token) | NLL, "
             "float32 reference |", "|---|---|---|---|---|---|---|---|"]
    for d, per in res["table"].items():
        for name, r in per.items():
            lines.append(f"| {d} | {name} | {r['positions']} | {r['mean_kl']:.5f} | {r['max_kl']:.3f} | "
                         f"{r['top1_agreement']:.2%} | {r['nll']:.4f} | {r['nll_reference']:.4f} |")
    return "\n".join(lines) + "\n"


def plot(res: dict):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    sets = list(res["table"])
    names = list(next(iter(res["table"].values())))
    for i, name in enumerate(names):
        width = 0.8 / len(names)
        xs = [j + width * i for j in range(len(sets))]
        axes[0].bar(xs, [res["table"][d][name]["mean_kl"] for d in sets], width=width, label=name)
        axes[1].bar(xs, [1 - res["table"][d][name]["top1_agreement"] for d in sets], width=width, label=name)
    for ax, title in zip(axes, ["mean KL(float32 || target), nats", "top-1 differs from float32 (share)"]):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sets))], sets)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    raise SystemExit(main())
