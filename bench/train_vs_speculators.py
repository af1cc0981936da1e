"""Which objective trains the better drafter? Ours (CE to the target's answers; KL to the target's distribution)
against vLLM speculators' DFlash and DFlash2 trainers, at equal data, drafter size and time (issue 33 item 5).
With `--only ours-ce,ours-dpace,ours-muon,ours-muon-dpace`: speculators' DFlash recipe taken apart inside ours.

    .venv/bin/python bench/train_vs_speculators.py --speculators-python .venv-spec/bin/python --minutes 30 \
        --work runs/train-vs-speculators --out bench/results/train-vs-speculators

Equal for all four: the SmolLM2 target's own answers (data/smollm2-135m-instruct, the same batch at every step:
4 sequences of at most 320 tokens, drawn as our trainer draws them), 2 draft layers tapping the same target layers,
block 16, the same mask token, the full vocabulary (speculators' DFlash2 allows no other), 64 anchors a step, one
thread each, the same wall-clock budget (two runs side by side on a 2-core host). Each trainer keeps its own recipe
otherwise (ours: the options each run names, at lr 6e-4, cosine; speculators': Muon + AdamW 1e-3, linear, its
defaults per type), and sizes its schedule to the steps it can take in the budget (its step time measured first,
over 4 steps).
Then every drafter decodes prompts never trained on (`bench/drafter_tau.py`: held-out ShareGPT, HumanEval,
MT-Bench; the plain chain, greedy, bf16): tau and first-slot acceptance. Every phase resumes (rerun the command).
speculators' virtualenv: docs/training.md ("Our objective against speculators'").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflashkit.config import default_target_layer_ids
from dflashkit.data import load_shards
from dflashkit.loader import choose_mask_token_id, load_tokenizer, resolve_target_dir
from dflashkit.train import Batches

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "smollm2-135m-instruct"
BUNDLED = ROOT / "src" / "dflashkit" / "drafters" / "smollm2-135m-instruct"
BATCH, MAX_LEN, ANCHORS, LAYERS, BLOCK, SEED = 4, 320, 16, 2, 16, 0


@dataclass
class Run:
    name: str
    kind: str  # "ours" | "speculators"
    arch: str  # "dflash" | "dflash2"
    loss: str  # what it optimises, for the table (ours: the recipe's loss, weights, optimizer)
    label: str
    recipe: dict = field(default_factory=dict)  # ours: TrainConfig fields over the shared ones


# in the order they run, two at a time: the first four pair one of ours with one of speculators', so that whatever
# else the host does during a pair weighs on both sides alike; the last four (`--only`) take speculators' DFlash
# recipe apart inside ours: D-PACE slot weights and Muon, each alone and together, beside our default again
# (ours spell out every option they set, so that a later change of TrainConfig's defaults does not change them)
EXP = {"position_weight": "exp", "optimizer": "adamw"}
RUNS = [Run("ours-ce", "ours", "dflash", "ce", "dflashkit CE", {"loss": "ce", **EXP}),
        Run("speculators-dflash", "speculators", "dflash", "ce + D-PACE", "speculators DFlash"),
        Run("ours-kl", "ours", "dflash", "kl", "dflashkit KL", {"loss": "kl", **EXP}),
        Run("speculators-dflash2", "speculators", "dflash2", "KL + selector", "speculators DFlash2"),
        Run("ours-dpace", "ours", "dflash", "ce + D-PACE", "dflashkit CE, D-PACE weights",
            {"loss": "ce", "position_weight": "dpace", "optimizer": "adamw"}),
        Run("ours-muon", "ours", "dflash", "ce, Muon", "dflashkit CE, Muon",
            {"loss": "ce", "position_weight": "exp", "optimizer": "muon"}),
        Run("ours-muon-dpace", "ours", "dflash", "ce + D-PACE, Muon", "dflashkit CE, D-PACE weights, Muon",
            {"loss": "ce", "position_weight": "dpace", "optimizer": "muon"}),
        # the bundled 5-layer drafter fine-tuned further by each recipe (its own layers, taps and mask)
        Run("bundled-ft-old", "ours", "dflash", "ce, AdamW", "bundled drafter + old recipe (exp, AdamW)",
            {"init_from": str(BUNDLED), "lr": 2e-4, "loss": "ce", **EXP}),
        Run("bundled-ft-new", "ours", "dflash", "ce + D-PACE, Muon", "bundled drafter + new recipe (D-PACE, Muon)",
            {"init_from": str(BUNDLED), "lr": 2e-4, "loss": "ce", "position_weight": "dpace", "optimizer": "muon"})]


def write_batches(path: Path, steps: int) -> None:
    """The batch of every step, exactly as our trainer draws it (`Batches.get(step, 4)`), padded to MAX_LEN."""
    if path.is_file() and np.load(path)["ids"].shape[0] >= steps:
        return
    b = Batches(load_shards(DATA, "train"), MAX_LEN, SEED)
    ids = np.zeros((steps, BATCH, MAX_LEN), np.int32)
    mask = np.zeros((steps, BATCH, MAX_LEN), bool)
    lengths = np.zeros((steps, BATCH), np.int32)
    for s in range(steps):
        x, m = b.get(s, BATCH)
        ids[s, :, :x.shape[1]], mask[s, :, :x.shape[1]] = x.numpy(), m.numpy()
        # a sequence's length: its last supervised token + 1 (responses run to the end: EOS is supervised)
        lengths[s] = [int(np.nonzero(r)[0].max()) + 1 for r in m.numpy()]
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, ids=ids, mask=mask, lengths=lengths)
    os.replace(tmp, path)


def command(run: Run, d: Path, args, steps: int, seconds: float, ctx: dict) -> list[str]:
    if run.kind == "ours":
        recipe = dict(out_dir=str(d), data_dir=str(DATA), num_layers=LAYERS, block_size=BLOCK, steps=steps,
                      batch_size=BATCH, num_anchors=ANCHORS, max_len=MAX_LEN, bf16=False, target_dtype="float32",
                      mask_token_id=ctx["mask"], target_layer_ids=ctx["taps"], eval_every=10 ** 9,
                      eval_batches=0, save_every=50, log_every=1, time_limit_s=seconds, seed=SEED, device="cpu",
                      **run.recipe)
        (d / "recipe-in.json").write_text(json.dumps(recipe, indent=1) + "\n")
        return [sys.executable, "-m", "dflashkit.cli", "train", "--config", str(d / "recipe-in.json")]
    # speculators counts hidden_states ids (0 = embeddings): our decoder layer i is its id i + 1
    return [args.speculators_python, str(ROOT / "bench" / "speculators_train_worker.py"), "--target-dir",
            str(ctx["target_dir"]), "--batches", str(ctx["batches"]), "--arch", run.arch, "--layers", str(LAYERS),
            "--aux-ids", *[str(i + 1) for i in ctx["taps"]], "--mask-token-id", str(ctx["mask"]), "--block-size",
            str(BLOCK), "--max-anchors", str(BATCH * ANCHORS), "--steps", str(steps), "--seconds", str(seconds),
            "--seed", str(SEED), "--out", str(d)]


def log_steps(d: Path) -> list[dict]:
    f = d / "train_log.jsonl"
    return [r for r in map(json.loads, f.read_text().splitlines()) if "elapsed_s" in r] if f.is_file() else []


def step_rates(runs: list[Run], work: Path, args, ctx: dict) -> dict[str, float]:
    """Seconds per step of every trainer, measured over 4 steps with its pair running beside it as in training (the
    first step is warm-up); cached in work/NAME-probe/rate.json."""
    rates = {}
    for i in range(0, len(runs), 2):
        procs = []
        for run in runs[i:i + 2]:
            d = work / f"{run.name}-probe"
            if (d / "rate.json").is_file():
                continue
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            procs.append((d, subprocess.Popen(command(run, d, args, 4, 10 ** 6, ctx), env=ctx["env"],
                                              stdout=subprocess.DEVNULL, stderr=open(d / "stderr.txt", "w"))))
        for d, p in procs:
            if p.wait() != 0:
                raise SystemExit(f"the probe in {d} failed (exit {p.returncode}); see {d / 'stderr.txt'}")
            recs = log_steps(d)
            rate = (recs[-1]["elapsed_s"] - recs[0]["elapsed_s"]) / (len(recs) - 1)
            (d / "rate.json").write_text(json.dumps({"seconds_per_step": rate}) + "\n")
        for run in runs[i:i + 2]:
            rates[run.name] = json.loads((work / f"{run.name}-probe" / "rate.json").read_text())["seconds_per_step"]
    return rates


def train_all(runs: list[Run], work: Path, args, ctx: dict) -> None:
    """Two runs at a time (one thread each), each with the same budget; finished runs are kept."""
    seconds = args.minutes * 60
    todo = [r for r in runs if not (work / r.name / "finished.json").is_file()]
    for i in range(0, len(todo), 2):
        procs = []
        for run in todo[i:i + 2]:
            d = work / run.name
            d.mkdir(parents=True, exist_ok=True)
            steps = int(seconds / ctx["rates"][run.name])
            print(f"{run.name}: {steps} steps in {args.minutes} min", flush=True)
            procs.append((run, d, steps, time.time(), subprocess.Popen(
                command(run, d, args, steps, seconds, ctx), env=ctx["env"], stdout=subprocess.DEVNULL,
                stderr=open(d / "stderr.txt", "a"))))
        for run, d, steps, t0, p in procs:
            if p.wait() != 0:
                raise SystemExit(f"{run.name} failed (exit {p.returncode}); see {d / 'stderr.txt'}")
            recs = log_steps(d)
            (d / "finished.json").write_text(json.dumps(
                {"steps_planned": steps, "steps_done": recs[-1]["step"], "train_seconds": recs[-1]["elapsed_s"],
                 "wall_seconds": round(time.time() - t0, 1)}) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speculators-python", help="python of a virtualenv with speculators 0.9.0 (for its runs)")
    ap.add_argument("--minutes", type=float, default=30.0, help="training budget of each run")
    ap.add_argument("--work", default="runs/train-vs-speculators", help="run directories (resumable)")
    ap.add_argument("--out", default="bench/results/train-vs-speculators", help="results folder")
    ap.add_argument("--prompts", type=int, default=10, help="held-out prompts per dataset when decoding")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="tokens decoded per prompt")
    ap.add_argument("--only", default="", help="comma-separated run names, in the order given (default: the "
                    "first four: ours against speculators')")
    args = ap.parse_args()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    by_name = {r.name: r for r in RUNS}
    unknown = [n for n in args.only.split(",") if n and n not in by_name]
    if unknown:
        raise SystemExit(f"unknown runs {unknown}; known: {', '.join(by_name)}")
    runs = [by_name[n] for n in args.only.split(",")] if args.only else RUNS[:4]
    if any(r.kind == "speculators" for r in runs) and not args.speculators_python:
        raise SystemExit("speculators' runs need --speculators-python (its virtualenv: docs/training.md)")
    target_dir = resolve_target_dir(None)
    ctx = {"target_dir": target_dir, "mask": choose_mask_token_id(load_tokenizer(target_dir)),
           "taps": default_target_layer_ids(30, LAYERS), "batches": work / "batches.npz",
           "env": {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}}
    ctx["rates"] = step_rates(runs, work, args, {**ctx, "batches": _probe_batches(work)})
    write_batches(ctx["batches"], max(int(args.minutes * 60 / rate) for rate in ctx["rates"].values()) + 1)
    train_all(runs, work, args, ctx)
    tau_dir = work / "tau"
    subprocess.run([sys.executable, str(ROOT / "bench" / "drafter_tau.py"), "--prompts", str(args.prompts),
                    "--max-new-tokens", str(args.max_new_tokens), "--out", str(tau_dir),
                    *[a for r in runs for a in ("--drafter", str(work / r.name / "drafter"))]], check=True)
    report(runs, work, out, args, ctx)
    return 0


def _probe_batches(work: Path) -> Path:
    path = work / "probe-batches.npz"
    write_batches(path, 4)
    return path


def report(runs: list[Run], work: Path, out: Path, args, ctx: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tau = json.loads((work / "tau" / "drafter_tau.json").read_text())["results"]
    rows = []
    for run in runs:
        fin = json.loads((work / run.name / "finished.json").read_text())
        key = str(work / run.name / "drafter")
        per = {ds: {k: r[key][k] for k in ("tau", "first_slot", "differ_from_ar")} for ds, r in tau.items()}
        rows.append({"run": run.name, "trainer": run.label, "arch": run.arch, "loss": run.loss, **fin,
                     "seconds_per_step_probe": round(ctx["rates"][run.name], 2), "decoded": per})
    bundled = {ds: r["bundled"] for ds, r in tau.items()}
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "bench/train_vs_speculators.py " + " ".join(sys.argv[1:]).replace(str(ROOT) + "/", ""),
            "minutes_per_run": args.minutes, "batch": BATCH, "max_len": MAX_LEN, "anchors_per_step": BATCH * ANCHORS,
            "draft_layers": LAYERS, "taps": ctx["taps"], "block_size": BLOCK, "mask_token_id": ctx["mask"],
            "prompts_per_dataset": args.prompts, "max_new_tokens": args.max_new_tokens}
    (out / "train_vs_speculators.json").write_text(json.dumps({"meta": meta, "runs": rows, "bundled_reference":
                                                               bundled}, indent=2) + "\n")
    datasets = list(tau)
    md = [f"# Our objective against speculators' (`{meta['command']}`)", "",
          f"Each drafter: {LAYERS} layers, block {BLOCK}, full vocabulary, {args.minutes:g} min of training on one "
          f"thread, the same batches ({BATCH} x <= {MAX_LEN} tokens, {BATCH * ANCHORS} anchors a step). Decoded: "
          f"{args.prompts} prompts per dataset never trained on, {args.max_new_tokens} tokens, the plain chain, "
          "greedy, bf16: tau (first-slot acceptance).", "",
          "| trainer | objective | steps | " + " | ".join(datasets) + " | mean tau | differing |",
          "|---" * (5 + len(datasets)) + "|"]
    for r in rows:
        taus = [r["decoded"][ds]["tau"] for ds in datasets]
        cells = [f"{r['decoded'][ds]['tau']:.3f} ({r['decoded'][ds]['first_slot']:.2f})" for ds in datasets]
        md.append(f"| {r['trainer']} | {r['loss']} | {r['steps_done']} | " + " | ".join(cells) +
                  f" | **{np.mean(taus):.3f}** | {sum(r['decoded'][ds]['differ_from_ar'] for ds in datasets)} |")
    md += ["", "Reference, not trained here: the bundled 5-layer drafter (GPU-trained): " +
           ", ".join(f"{ds} {bundled[ds]['tau']:.3f}" for ds in datasets) + "."]
    (out / "train_vs_speculators.md").write_text("\n".join(md) + "\n")
    fig, ax = plt.subplots(figsize=(8, 4.6))
    w = 0.8 / len(rows)
    for i, r in enumerate(rows):
        ax.bar(np.arange(len(datasets)) + i * w, [r["decoded"][ds]["tau"] for ds in datasets], w, label=r["trainer"])
    ax.set_xticks(np.arange(len(datasets)) + w * (len(rows) - 1) / 2, datasets)
    ax.set_ylabel("decoded tau (plain chain)")
    ax.set_ylim(bottom=1.0)  # tau >= 1: one token a step without any accepted draft
    fine_tuned = any("init_from" in r.recipe for r in runs)
    what = "the bundled drafter fine-tuned" if fine_tuned else f"{LAYERS}-layer drafters"
    ax.set_title(f"{what}, {args.minutes:g} min each, same data")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    fig.tight_layout()
    fig.savefig(out / "train_vs_speculators.png", dpi=120)
    print("\n".join(md))


if __name__ == "__main__":
    raise SystemExit(main())
