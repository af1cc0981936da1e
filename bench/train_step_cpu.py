"""What one training step of the bundled drafter costs on this CPU, by its arithmetic and where its target features
come from, arms by turns in one process.

    .venv/bin/python bench/train_step_cpu.py --out bench/results/NAME [--rounds 4] [--batch-size 2]
        [--num-anchors 8] [--max-len 128] [--arch dflash2]

The default target (bf16, the kernels `--quant auto` picks here) and the bundled drafter (fine-tuned into DFlash2
with --arch dflash2, as `scripts/dflash2_device_job.sh` does); the committed training data. Arms:
- "bf16 + HF": bf16 autocast, the target's features from HF's modules (the trainer's behaviour before `bf16: None`);
- "fp32 + HF": float32 products (autocast off), HF's features;
- "fp32 + ours": float32 products, the features from the target's own forward (`LeanTarget.own_features`, what
  `LeanTarget.features` reads on a CPU without bf16 units).
Each arm trains its own copy of the drafter (Muon + AdamW, the default recipe); in each round every arm runs one
step (features, forward, loss, backward, clip, optimizer), the order rotating round by round. The first round is a
warm-up and is not counted. Writes train_step_cpu.json, .md and .png into --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from dflashkit.backends.hf import HFTarget
from dflashkit.data import load_shards
from dflashkit.loader import load_target
from dflashkit.measurements import cpu_name
from dflashkit.optimizer import build_optimizer
from dflashkit.train import Batches, TrainConfig, build_drafter, train_step_loss

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"bf16 + HF": (True, "hf"), "fp32 + HF": (False, "hf"), "fp32 + ours": (False, "ours")}


def one_step(drafter, opt, target, batches, cfg: TrainConfig, k: int) -> tuple[float, float]:
    """(seconds, loss) of training step k."""
    ids, lm = batches.get(k, cfg.batch_size)
    t0 = time.perf_counter()
    ctx = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16)  # noqa: E731
    loss, _ = train_step_loss(drafter, target, ids, lm, cfg, torch.Generator().manual_seed(k), ctx)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, float(loss.detach())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--num-anchors", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--arch", default="dflash2", choices=("dflash", "dflash2"))
    args = ap.parse_args()
    torch.manual_seed(0)
    target, tok = load_target(None, dtype="bfloat16")
    base = dict(out_dir="-", data_dir=str(ROOT / "data/smollm2-135m-instruct"), arch=args.arch,
                init_from=str(ROOT / "src/dflashkit/drafters/smollm2-135m-instruct"), batch_size=args.batch_size,
                num_anchors=args.num_anchors, max_len=args.max_len, lr=2e-4,
                selector_rank=64 if args.arch == "dflash2" else None)
    first = build_drafter(TrainConfig(**base), target, tok).float()
    target.set_taps(first.config.target_layer_ids)
    batches = Batches(load_shards(Path(base["data_dir"]), "train"), args.max_len, 0)
    arms = {}
    for name, (bf16, feats) in ARMS.items():
        cfg = TrainConfig(**base, bf16=bf16)
        drafter = copy.deepcopy(first).train()
        arms[name] = (cfg, feats, drafter, build_optimizer(drafter, cfg))
    times = {name: [] for name in ARMS}
    losses = {name: [] for name in ARMS}
    names = list(ARMS)
    for r in range(args.rounds + 1):
        for name in names[r % len(names):] + names[:r % len(names)]:
            cfg, feats, drafter, opt = arms[name]
            # each arm's feature source, whatever `LeanTarget.features` would choose on this CPU
            target.features = (HFTarget.features.__get__(target) if feats == "hf" else target.own_features)
            dt, loss = one_step(drafter, opt, target, batches, cfg, r)
            target.__dict__.pop("features", None)
            if r:
                times[name].append(dt)
                losses[name].append(loss)
    report = {"cpu": cpu_name(), "kernels": target.engine_name, "args": vars(args) | {"out": None},
              "arms": {n: {"step_s": [round(t, 3) for t in times[n]], "median_s": round(statistics.median(times[n]), 3),
                           "losses": [round(v, 5) for v in losses[n]]} for n in ARMS}}
    ref = report["arms"]["bf16 + HF"]["median_s"]
    for n in ARMS:
        report["arms"][n]["x_bf16_hf"] = round(report["arms"][n]["median_s"] / ref, 3)
    write(Path(args.out), report)


def write(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_step_cpu.json").write_text(json.dumps(report, indent=2) + "\n")
    rows = [f"| {n} | {a['median_s']:.2f} | {a['x_bf16_hf']:.3f} | {', '.join(f'{v:.3f}' for v in a['losses'])} |"
            for n, a in report["arms"].items()]
    (out / "train_step_cpu.md").write_text(
        f"# One training step by turns ({report['cpu']})\n\nkernels: {report['kernels']}; args: {report['args']}\n\n"
        "| arm | median s / step | x bf16 + HF | losses by round |\n|---|---|---|---|\n" + "\n".join(rows) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = list(report["arms"])
    ax.bar(names, [report["arms"][n]["median_s"] for n in names], color=["#999", "#69c", "#36a"])
    ax.set_ylabel("seconds per training step (median)")
    ax.set_title(report["cpu"][:60], fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "train_step_cpu.png", dpi=120)


if __name__ == "__main__":
    main()
