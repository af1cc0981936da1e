"""`dflashkit train --target T --out DIR`: a drafter for your own model in one command, resumable at every stage.

Stages (rerun the same command after an interruption: each finished piece is kept, the rest continues):
  1. prompts  DIR/prompts/prompts.jsonl: bundled ShareGPT first user turns (or --prompts FILE), benchmark
              overlaps dropped, a held-out split for evaluation;
  2. data     DIR/data/{train,heldout}-*.npz: the target's own greedy answers (the drafter must learn the target's
              distribution, not the dataset's), one resumable chunk at a time;
  3. train    DIR/checkpoint.pt (resumable) and DIR/drafter/ (Z Lab format: `generate --drafter DIR`, `export`);
  4. check    DIR/check.json: tau measured by real decoding on held-out prompts, against what the training
              objective predicts, with the silent-failure probes of `check-drafter` (`diagnosis.py`).

Presets size every stage: `cpu` (a try-out on a laptop: 2 drafter layers, a few hundred short answers, float32,
which is faster than bf16 on CPUs without bf16 units) and `gpu` (the recipe of the bundled drafter). `--steps` and
`--minutes` bound the run; `--config FILE` overrides any recipe field.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import DFlashError

log = logging.getLogger(__name__)

PRESETS = {
    "cpu": dict(prompts=256, heldout=8, max_prompt_tokens=192, max_new_tokens=128, chunk_size=16, dtype="float32",
                recipe=dict(num_layers=2, block_size=16, steps=300, batch_size=4, num_anchors=16, max_len=320,
                            bf16=False, target_dtype="float32", eval_every=100, eval_batches=2, save_every=10,
                            log_every=5)),
    "gpu": dict(prompts=None, heldout=64, max_prompt_tokens=192, max_new_tokens=320, chunk_size=512,
                dtype="bfloat16",
                recipe=dict(num_layers=5, block_size=16, steps=4000, batch_size=32, num_anchors=128, max_len=512,
                            bf16=True, target_dtype="bfloat16", eval_every=500, eval_batches=4, save_every=200,
                            log_every=25)),
}


@dataclass
class RunConfig:
    out: str
    target: str | None = None  # None = the default SmolLM2 target
    prompts: str | None = None  # a JSONL of {prompt} / {messages}; None = bundled ShareGPT
    preset: str = "auto"  # cpu | gpu | auto (gpu when CUDA is available)
    steps: int | None = None
    minutes: float | None = None  # the whole run's budget: data generation stops at it, training too
    device: str = "auto"
    overrides: dict = field(default_factory=dict)  # TrainConfig fields (from --config)
    check_prompts: int = 8
    check_tokens: int = 64

    def resolved_preset(self) -> dict:
        import torch

        name = self.preset
        if name == "auto":
            name = "gpu" if torch.cuda.is_available() and self.device != "cpu" else "cpu"
        if name not in PRESETS:
            raise DFlashError(f"unknown preset {name!r}; choose from auto, {', '.join(PRESETS)}.")
        return {**PRESETS[name], "name": name}


def split_prompts(records: list[dict], n_train: int | None, n_heldout: int) -> list[dict]:
    """Keep the first n_train train and n_heldout held-out records; a small user file with no held-out record
    gives its last quarter (at least 1, at most n_heldout) to the held-out split."""
    train = [r for r in records if r["split"] == "train"]
    held = [r for r in records if r["split"] == "heldout"][:n_heldout]
    if not held and len(train) > 1:
        k = max(1, min(n_heldout, len(train) // 4))
        held = [{**r, "split": "heldout"} for r in train[-k:]]
        train = train[:-k]
    return (train if n_train is None else train[:n_train]) + held


def _prompts_stage(cfg: RunConfig, preset: dict, out: Path) -> list[dict]:
    from .data import build_prompts, read_prompts, write_prompts

    path = out / "prompts" / "prompts.jsonl"
    if path.is_file():
        return read_prompts(path)
    records, report = build_prompts(0.02, cfg.prompts)
    records = split_prompts(records, preset["prompts"], preset["heldout"])
    if not any(r["split"] == "train" for r in records):
        raise DFlashError("no training prompts: give --prompts FILE with at least 2 prompts (one JSON per line).")
    report.update(kept=len(records), heldout=sum(r["split"] == "heldout" for r in records))
    write_prompts(records, report, out / "prompts")
    log.info("prompts: %d train, %d held out -> %s", report["kept"] - report["heldout"], report["heldout"], path)
    return records


def _data_stage(target, tok, records: list[dict], preset: dict, out: Path, deadline: float | None) -> bool:
    """Generate the chunks that are missing; False if the time budget ran out on the way."""
    from .data import generate_responses
    from .decode_config import DecodeConfig
    from .engine import DFlashEngine

    engine = DFlashEngine(target, None, tokenizer=tok, config=DecodeConfig.autoregressive())
    for split in ("train", "heldout"):
        generate_responses(engine, tok, records, out / "data", split, chunk_size=preset["chunk_size"],
                           max_prompt_tokens=preset["max_prompt_tokens"], max_new_tokens=preset["max_new_tokens"],
                           deadline=deadline)
        if deadline is not None and time.time() > deadline:
            return False  # maybe complete; a rerun skips every finished chunk at once
    return True


def _check_stage(target, tok, records: list[dict], cfg: RunConfig, out: Path, step: int) -> dict:
    from .checkpoint import load_drafter
    from .decode_config import DecodeConfig
    from .diagnosis import check
    from .engine import DFlashEngine
    from .loader import encode_chat

    path = out / "check.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("step") == step:
            return saved
    drafter = load_drafter(out / "drafter", dtype=target.dtype, device=target.device)
    engine = DFlashEngine(target, drafter, tokenizer=tok, config=DecodeConfig(policy="fixed"))
    held = [r for r in records if r["split"] == "heldout"][: cfg.check_prompts]
    d = check(engine, [encode_chat(tok, r["messages"]) for r in held], cfg.check_tokens)
    result = {"step": step, **d.to_json(), "summary": d.summary()}
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def run(cfg: RunConfig) -> dict:
    """Every stage in order, each resumed; returns {"drafter": DIR/drafter, "check": {...}} (or {"stopped": stage}
    when the time budget ran out: rerun the same command to continue)."""
    from .loader import load_target
    from .train import TrainConfig, train

    t0 = time.time()
    deadline = t0 + 60 * cfg.minutes if cfg.minutes else None
    preset = cfg.resolved_preset()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    records = _prompts_stage(cfg, preset, out)
    target, tok = load_target(cfg.target, dtype=preset["dtype"], device=_device(cfg.device))
    if tok is None:
        raise DFlashError("training needs the target's tokenizer (prompts are chat-templated); give a target "
                          "directory with tokenizer files.")
    if not _data_stage(target, tok, records, preset, out, deadline):
        log.info("time budget reached while generating data; rerun the same command to continue")
        return {"stopped": "data", "out": str(out)}
    recipe = {**preset["recipe"], **cfg.overrides}
    if cfg.steps:
        recipe["steps"] = cfg.steps
    remaining = None if deadline is None else max(deadline - time.time(), 1.0)
    tcfg = TrainConfig(out_dir=str(out), data_dir=str(out / "data"), target=cfg.target, device=cfg.device,
                       time_limit_s=remaining, **recipe)
    train(tcfg, target=target, tokenizer=tok)
    step = _saved_step(out)
    if step < tcfg.steps:
        return {"stopped": "train", "step": step, "steps": tcfg.steps, "out": str(out)}
    result = _check_stage(target, tok, records, cfg, out, step)
    return {"drafter": str(out / "drafter"), "steps": step, "minutes": round((time.time() - t0) / 60, 2),
            "check": result}


def _saved_step(out: Path) -> int:
    cfg = out / "drafter" / "config.json"
    if not cfg.is_file():
        return 0
    return int(json.loads(cfg.read_text()).get("dflashkit_train_step", 0))


def _device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
