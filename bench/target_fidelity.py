"""How far each way of computing the default target strays from the same weights computed in float32.

The default SmolLM2 is a Q4_1 GGUF: transformers loads its weights, and every engine target computes the same weights
with another arithmetic: `--quant none` (bf16 activations and weights, the codes read as their exact bf16 values),
`--quant int4` (the codes' own values against bf16 activations, fp32 sums; the default on AVX512-BF16 CPUs) and
`--quant int4-a8` (the codes as they are, activations rounded to int8 per 32-block, as llama.cpp computes them).
The reference is the HF model in float32 on those weights. On human-written text (the prompts of three sets, chat
template applied, never the targets' own outputs, which would favour one of them), per next-token position:
  KL(reference || target), whether the target's top-1 token is the reference's, and the text's NLL under each;
  the KL and top-1 also with the target's logits kept in fp32 (its head's own sums, before the bf16 rounding that
  `logits` applies as the HF bf16 model does).
Why the positions of the prompts' shared prefix (the chat template's system turn) count once per set: they are the
same context in every prompt, so counted per prompt they weigh 40x and one near-tie there decides the table (a
2^-18 change of every layer's scales moved the mean KL 0.0011 <-> 0.0033 on 20 prompts counted that way; counted
once, 0.00110-0.00114). The median KL is given beside the mean: a few near-tie positions dominate a mean.

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
TARGETS = {"bf16": {"dtype": "bfloat16", "quant": "none"}, "int4": {"dtype": "bfloat16", "quant": "int4"},
           "int4-a8": {"dtype": "bfloat16", "quant": "int4-a8"}}  # auto (the default) is int4 on AVX512-BF16, else bf16


def log_probs(target, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[T - 1, V] fp32 log-probabilities of the next token after each position but the last: from `logits` as it
    returns them, and from the head's fp32 sums (a kernel head's `out_fp32`; else the same as the first)."""
    x = torch.tensor([ids])
    cache = target.new_cache(1, len(ids))
    h, _ = target.forward(x, torch.arange(len(ids))[None], cache, kv_len=len(ids), taps=False)
    head = getattr(target, "head", None)
    lp = torch.log_softmax(target.logits(h)[0, :-1].float(), dim=-1)
    return lp, lp if head is None else torch.log_softmax(head(h[0, :-1], out_fp32=True).float(), dim=-1)


def shared_prefix(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt shares (the chat template's system turn)."""
    n = min(map(len, prompts))
    return next((j for j in range(n) if len({p[j] for p in prompts}) > 1), n)


def compare(ref: torch.Tensor, got: torch.Tensor, got32: torch.Tensor, ids: list[int], skip: int) -> dict:
    """Over next-token positions from `skip` on: KL(ref || got) per position, top-1 agreement, NLL of the text's next
    tokens (ref and got); KL and top-1 of got32 (fp32 logits)."""
    ref, got, got32 = ref[skip:], got[skip:], got32[skip:]
    nxt = torch.tensor(ids[1:])[skip:, None]
    kl = (ref.exp() * (ref - got)).sum(-1)
    top1 = ref.argmax(-1)
    return {"positions": len(nxt), "kls": kl, "top1_same": int((top1 == got.argmax(-1)).sum()),
            "kl32": float((ref.exp() * (ref - got32)).sum()), "top1_same32": int((top1 == got32.argmax(-1)).sum()),
            "nll": float(-got.gather(1, nxt).sum()), "nll_ref": float(-ref.gather(1, nxt).sum())}


def summary(parts: list[dict]) -> dict:
    """One set's table row from its prompts' `compare` results."""
    n = sum(p["positions"] for p in parts)
    kls = torch.cat([p["kls"] for p in parts])
    total = lambda k: sum(p[k] for p in parts)  # noqa: E731
    return {"positions": n, "mean_kl": float(kls.mean()), "median_kl": float(kls.median()), "max_kl": float(kls.max()),
            "top1_agreement": total("top1_same") / n, "mean_kl_fp32_logits": total("kl32") / n,
            "top1_agreement_fp32_logits": total("top1_same32") / n, "nll": total("nll") / n,
            "nll_reference": total("nll_ref") / n}


def main() -> int:
    from dflashkit.bench.report import write_result

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=40, help="prompts per set")
    ap.add_argument("--max-tokens", type=int, default=512, help="a prompt's tokens past this are cut")
    ap.add_argument("--out", default="bench/results/target-fidelity")
    args = ap.parse_args()
    ref_t, tok = load_target(dtype="float32", backend="hf")
    targets = {name: load_target(**kw)[0] for name, kw in TARGETS.items()}
    table = {}
    with torch.inference_mode():
        for d in DATASETS:
            prompts = [encode_chat(tok, turns[0])[: args.max_tokens] for turns in load_dataset(d, args.limit)]
            common = shared_prefix(prompts)
            parts = {name: [] for name in targets}
            for i, ids in enumerate(tqdm(prompts, desc=d, unit="prompt")):
                ref, _ = log_probs(ref_t, ids)
                skip = 0 if i == 0 else common  # the shared prefix's positions count once (the first prompt's)
                for name, t in targets.items():
                    parts[name].append(compare(ref, *log_probs(t, ids), ids, skip))
            table[d] = {name: summary(p) for name, p in parts.items()}
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
             "The positions of the prompts' shared prefix (the chat template's system turn) count once per set. "
             "Logits as `logits` returns them (bf16, as the HF bf16 model's), and kept in fp32 (the head's sums).", "",
             "| set | target | positions | mean KL (nats) | median KL | max KL | top-1 agreement | mean KL, fp32 "
             "logits | top-1, fp32 logits | NLL (nats/token) | NLL, float32 reference |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for d, per in res["table"].items():
        for name, r in per.items():
            lines.append(f"| {d} | {name} | {r['positions']} | {r['mean_kl']:.5f} | {r['median_kl']:.5f} | "
                         f"{r['max_kl']:.3f} | {r['top1_agreement']:.2%} | {r['mean_kl_fp32_logits']:.5f} | "
                         f"{r['top1_agreement_fp32_logits']:.2%} | {r['nll']:.4f} | {r['nll_reference']:.4f} |")
    return "\n".join(lines) + "\n"


def plot(res: dict):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    sets = list(res["table"])
    names = list(next(iter(res["table"].values())))
    for i, name in enumerate(names):
        width = 0.8 / len(names)
        xs = [j + width * i for j in range(len(sets))]
        axes[0].bar(xs, [res["table"][d][name]["median_kl"] for d in sets], width=width, label=name)
        axes[1].bar(xs, [1 - res["table"][d][name]["top1_agreement"] for d in sets], width=width, label=name)
    for ax, title in zip(axes, ["median KL(float32 || target), nats", "top-1 differs from float32 (share)"]):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sets))], sets)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    raise SystemExit(main())
