"""Drafter training: one recipe file holds every hyper-parameter; `dflashkit train --config FILE` runs it.

- online target features (the frozen target runs inside the step, bf16);
- Muon + AdamW (or AdamW alone: `optimizer.py`), linear warmup + cosine decay, gradient clipping, bf16 autocast
  where the device has bf16 units (float32 elsewhere), gradient accumulation;
- per-position accuracy and simulated tau on the held-out split; JSONL log (+ TensorBoard if installed);
- atomic checkpoints every `save_every` steps and exact resume: the batch and anchors of step k are a pure
  function of (seed, k, rank), so a resumed run replays exactly what the uninterrupted one would have done;
- data parallel through torchrun (DDP; gloo on CPU, nccl on CUDA).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .checkpoint import atomic_write, load_drafter, save_drafter
from .data import TokenShard, load_shards
from .config import ARCHS
from .draft_vocab import frequent_tokens, with_draft_vocab
from .drafter import DFlashDrafter, dflash2_from
from .errors import DFlashError
from .objective import (build_blocks, decode_path_tau, dflash_loss, sample_anchors, selector_loss, simulated_tau,
                        teacher_rows, training_forward)
from .optimizer import build_optimizer
from .train_precision import FrozenParts, frozen_parts, resolve_bf16

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    out_dir: str
    data_dir: str
    target: str | None = None  # None = the default SmolLM2 target
    # drafter architecture
    num_layers: int = 4
    target_layer_ids: list[int] = field(default_factory=list)  # [] = the spec's default rule
    block_size: int = 16
    mask_token_id: int | None = None  # None = loader.choose_mask_token_id
    init_from: str | None = None  # an existing drafter directory to fine-tune
    # "dflash2": the candidate selector and the convolutions (`dflash2.py`); with init_from a v1 drafter, they start
    # where it drafts exactly v1's chain (`drafter.dflash2_from`). selector_alpha weighs the selector's loss.
    arch: str = "dflash"
    selector_alpha: float = 1.0
    selector_rank: int | None = None  # the selector's codebook rank (None: DFlashConfig's, 256 as Z Lab's)
    # What trains: "all"; "selector" (the candidate selector alone: no gradient runs through the layers, a fine-tune
    # of a converted v1 drafter at a fraction of a full step's cost on a CPU); "dflash2" (the selector and the
    # convolutions).
    train_only: str = "all"
    # DFlash2's selector learns at lr x this: from a trained v1 drafter it starts at the unary scores, and the layers'
    # small lr barely moves it. (Not the convolutions: their zero-started dynamic kernel blows up at a large Adam lr.)
    selector_lr_scale: float = 1.0
    # Reduced draft vocabulary: the most frequent target tokens of the training responses (None = full).
    # The loss and the drafting run over these rows of the LM head only; verification stays exact.
    draft_vocab_size: int | None = None
    # objective: "ce", cross-entropy to the data's tokens (the target's own greedy answers); "kl", KL(target ||
    # drafter) to the target's whole distribution at each slot (speculators' default for DFlash2)
    loss: str = "ce"
    # slot weights: "dpace", D-PACE's (`objective.dpace_weights`, speculators' DFlash default); "exp", exp(-(j-1)/gamma)
    # The default with optimizer "muon" since bench/results/train-recipe-parts/ (mean decoded tau 1.268 vs 1.108).
    position_weight: str = "dpace"
    dpace_alpha: float = 0.5
    num_anchors: int = 64
    gamma: float = 7.0
    max_len: int = 512
    # optimisation
    steps: int = 1000
    batch_size: int = 8  # sequences per rank per micro-step
    grad_accum: int = 1
    optimizer: str = "muon"  # Muon on the weight matrices, AdamW on the rest (`optimizer.py`); or "adamw"
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    # bf16 autocast. None: where the device runs bf16 matmuls in hardware (CUDA; CPUs with AVX512-BF16 or AMX),
    # float32 elsewhere: on an AVX2-only CPU torch's bf16 matmul backward is ~35x slower than float32's
    # (bench/results/train-cpu-fp32/). `train` writes the value it resolved into recipe.json.
    bf16: bool | None = None
    target_dtype: str = "bfloat16"
    device: str = "auto"
    seed: int = 0
    # bookkeeping
    log_every: int = 10
    eval_every: int = 200
    eval_batches: int = 4
    save_every: int = 200
    time_limit_s: float | None = None  # stop (and save) after this much wall time

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "TrainConfig":
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DFlashError(f"cannot read the recipe {path} ({e}); give a JSON file of TrainConfig fields.") from None
        cls.check_keys(d)
        return cls(**d)

    @classmethod
    def check_keys(cls, d: dict, exclude: tuple = ()) -> None:
        """Raise DFlashError naming the valid keys if `d` has a key that is no field (or one of `exclude`)."""
        known = {f.name for f in dataclasses.fields(cls)} - set(exclude)
        unknown = sorted(set(d) - known)
        if unknown:
            raise DFlashError(f"unknown recipe keys {unknown}; valid keys: {sorted(known)}.")


TRAIN_ONLY = ("all", "selector", "dflash2")
LOSSES = ("ce", "kl")
POSITION_WEIGHTS = ("exp", "dpace")


def lr_at(step: int, cfg: TrainConfig) -> float:
    warm = max(1, int(cfg.warmup_ratio * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, cfg.steps - warm))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


class Batches:
    """Step k's batch is a pure function of (seed, k, rank): exact resume without data-loader state."""

    def __init__(self, shards: list[TokenShard], max_len: int, seed: int):
        self.examples = [(s, i) for s in shards for i in range(len(s)) if len(s.example(i)[0]) - s.prompt_lens[i] >= 2]
        if not self.examples:
            raise DFlashError("the data has no example with at least 2 response tokens; regenerate the data.")
        self.max_len, self.seed = max_len, seed

    def get(self, step: int, batch: int, rank: int = 0, pad_id: int = 0):
        rng = np.random.default_rng([self.seed, step, rank])
        picks = rng.integers(0, len(self.examples), size=batch)
        seqs, masks = [], []
        for k in picks:
            shard, i = self.examples[k]
            toks, plen = shard.example(i)
            toks = toks[: self.max_len]
            m = np.arange(len(toks)) >= plen
            seqs.append(toks)
            masks.append(m)
        S = max(len(t) for t in seqs)
        ids = torch.full((batch, S), pad_id, dtype=torch.long)
        lm = torch.zeros((batch, S), dtype=torch.bool)
        for r, (t, m) in enumerate(zip(seqs, masks)):
            ids[r, : len(t)] = torch.from_numpy(t.astype(np.int64))
            lm[r, : len(m)] = torch.from_numpy(m)
        return ids, lm


def unwrap(model) -> DFlashDrafter:
    """The drafter inside a DistributedDataParallel wrapper (or the drafter itself)."""
    return model.module if hasattr(model, "module") else model


def features_and_blocks(drafter, target, ids, loss_mask, cfg: TrainConfig, gen: torch.Generator):
    """Target taps [B, S, k*H] (in the drafter's dtype unless autocast mixes them), random-anchor blocks, and with
    loss "kl" each slot's teacher row [B, N*Bq, H] (else None)."""
    raw = unwrap(drafter)
    feats = target.features(ids)
    taps = feats.taps if cfg.bf16 else feats.taps.to(next(raw.parameters()).dtype)
    anchors, valid = sample_anchors(loss_mask, cfg.num_anchors, gen)
    blocks = build_blocks(ids, loss_mask, anchors, valid, cfg.block_size, raw.config.mask_token_id, cfg.gamma)
    teacher = teacher_rows(feats.final.to(taps.dtype), blocks) if cfg.loss == "kl" else None
    return taps, blocks, teacher


def train_step_loss(drafter, target, ids, loss_mask, cfg: TrainConfig, gen: torch.Generator, autocast, vocab=None,
                    parts: FrozenParts | None = None):
    """vocab: None, or (d2t_head [Vd, H], t2d [V]) for a reduced draft vocabulary. parts: the frozen target's parts
    in the step's dtype (`frozen_parts` of the same vocab), made once per run by `train`; None makes them here."""
    selector = unwrap(drafter).candidate_selector
    if parts is None:
        parts = frozen_parts(target, cfg, vocab, next(unwrap(drafter).parameters()).dtype)
    if cfg.train_only == "selector":
        # Why a separate path: no gradient reaches the target or the drafter's layers, so their forward runs without
        # a graph, and one logits pass gives both the selector's loss and the per-slot stats (the frozen unary loss
        # is not computed: it cannot change). About half a full step's time on a CPU.
        with torch.no_grad():
            taps, blocks, _ = features_and_blocks(drafter, target, ids, loss_mask, cfg, gen)
            with autocast():
                hidden = training_forward(drafter, parts.embed, taps, blocks)
        with autocast():
            loss, stats = selector_loss(hidden, blocks, parts.head, selector, softcap=target.softcap,
                                        unary_stats=True)
        return loss, {**stats, "selector_loss": loss.detach()}
    taps, blocks, teacher = features_and_blocks(drafter, target, ids, loss_mask, cfg, gen)
    head, t2d = parts.vocab if parts.vocab is not None else (None, None)
    with autocast():
        hidden = training_forward(drafter, parts.embed, taps, blocks)
        loss, stats = dflash_loss(hidden, blocks, parts.head, cfg.block_size, softcap=target.softcap,
                                  d2t_head=head, t2d=t2d, teacher=teacher,
                                  dpace_alpha=cfg.dpace_alpha if cfg.position_weight == "dpace" else None)
        if selector is not None:  # DFlash2: unary + alpha * selector (over the full vocabulary's top-k)
            extra, more = selector_loss(hidden, blocks, parts.head, selector, softcap=target.softcap)
            loss, stats = loss + cfg.selector_alpha * extra, {**stats, **more, "selector_loss": extra.detach()}
        return loss, stats


@torch.no_grad()
def evaluate(drafter, target, batches: Batches, cfg: TrainConfig, autocast, device, vocab=None,
             anchor_chunk: int = 64) -> dict:
    """Held-out per-position accuracy and tau, with a block anchored at EVERY response position.

    eval_tau: the tau greedy decoding would see (`decode_path_tau`: walk the anchors decoding visits), the number
    to compare with `dflashkit bench`. eval_tau_uniform: the mean over all anchors (optimistic, kept for reference).
    """
    raw = unwrap(drafter)
    raw.eval()
    Bq = cfg.block_size
    correct = torch.zeros(Bq, device=device)
    count = torch.zeros(Bq, device=device)
    prefixes, tokens, passes = [], 0, 0
    embed = frozen_parts(target, cfg, None, next(raw.parameters()).dtype).embed
    for k in range(cfg.eval_batches):
        ids, lm = batches.get(k, cfg.batch_size, rank=10_000)
        ids, lm = ids.to(device), lm.to(device)
        B, S = ids.shape
        taps = target.taps(ids)
        if not cfg.bf16:
            taps = taps.to(next(raw.parameters()).dtype)
        anchors, valid = sample_anchors(lm, S)  # every candidate, ascending
        runs = torch.zeros(anchors.shape, dtype=torch.long, device=device)
        for lo in range(0, anchors.shape[1], anchor_chunk):
            a, v = anchors[:, lo:lo + anchor_chunk], valid[:, lo:lo + anchor_chunk]
            if not v.any():
                break
            blocks = build_blocks(ids, lm, a, v, Bq, raw.config.mask_token_id, cfg.gamma)
            with autocast():
                hidden = training_forward(raw, embed, taps, blocks)
            if vocab is None:
                pred = target.logits(hidden.to(target.dtype)).argmax(-1)  # [B, n*Bq]
            else:  # drafting over the reduced vocabulary, as inference does
                pred = raw.draft_to_target_ids()[target.logits(hidden.to(target.dtype), vocab[0]).argmax(-1)]
            ok = (pred == blocks.labels).view(B, -1, Bq)[..., 1:]
            sup = (blocks.weights > 0).view(B, -1, Bq)[..., 1:]
            correct[1:] += (ok & sup).sum((0, 1)).float()
            count[1:] += sup.sum((0, 1)).float()
            prefixes.append(ok[sup.all(-1)])
            # Why `ok & sup`: a block running past the end of the response commits only up to that end.
            runs[:, lo:lo + anchor_chunk] = (ok & sup).int().cumprod(-1).sum(-1) + 1
        for r in range(B):  # one decode path per held-out response
            t, p = decode_path_tau(runs[r][valid[r]].tolist())
            tokens, passes = tokens + t, passes + p
    raw.train()
    acc = (correct / count.clamp(min=1))[1:].tolist()
    return {"eval_acc": [round(a, 4) for a in acc], "eval_tau": round(tokens / max(passes, 1), 4),
            "eval_tau_uniform": round(simulated_tau(torch.cat(prefixes)), 4)}


def _setup_distributed(cfg: TrainConfig):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.device == "auto":
        device = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(cfg.device)
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return world, rank, device


def build_drafter(cfg: TrainConfig, target, tokenizer) -> DFlashDrafter:
    from .loader import choose_mask_token_id, default_drafter_config

    if cfg.arch not in ARCHS:
        raise DFlashError(f"arch must be one of {', '.join(ARCHS)} (got {cfg.arch!r}).")
    if cfg.init_from:
        drafter = load_drafter(cfg.init_from)
        if cfg.arch == "dflash2" and drafter.config.arch == "dflash":
            return dflash2_from(drafter, **_selector_fields(cfg))
        return drafter
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else choose_mask_token_id(tokenizer)
    dc = default_drafter_config(target, mask, num_layers=cfg.num_layers, block_size=cfg.block_size,
                                target_layer_ids=cfg.target_layer_ids or None)
    return DFlashDrafter(dc.replace(arch=cfg.arch, **(_selector_fields(cfg) if cfg.arch == "dflash2" else {}))
                         ).init_weights(cfg.seed)


def _selector_fields(cfg: TrainConfig) -> dict:
    return {} if cfg.selector_rank is None else {"selector_rank": cfg.selector_rank}


def _prepare(cfg: TrainConfig, target, tokenizer, device):
    """(target, drafter on device, train shards, reduced-vocabulary head or None) for the recipe."""
    from .loader import load_target

    if target is None:
        target, tokenizer = load_target(cfg.target, dtype=cfg.target_dtype, device=str(device))
    drafter = build_drafter(cfg, target, tokenizer)
    train_shards = load_shards(Path(cfg.data_dir), "train")
    if cfg.draft_vocab_size and drafter.config.draft_vocab_size != cfg.draft_vocab_size:
        drafter = with_draft_vocab(drafter, frequent_tokens(train_shards, cfg.draft_vocab_size, target.vocab_size))
    drafter = drafter.to(device)
    if cfg.loss not in LOSSES:
        raise DFlashError(f"loss must be one of {', '.join(LOSSES)} (got {cfg.loss!r}).")
    if cfg.position_weight not in POSITION_WEIGHTS:
        raise DFlashError(f"position_weight must be one of {', '.join(POSITION_WEIGHTS)} "
                          f"(got {cfg.position_weight!r}).")
    if not 0.0 < cfg.dpace_alpha <= 1.0:
        raise DFlashError(f"dpace_alpha must be in (0, 1] (got {cfg.dpace_alpha}).")
    if cfg.train_only not in TRAIN_ONLY:
        raise DFlashError(f"train_only must be one of {', '.join(TRAIN_ONLY)} (got {cfg.train_only!r}).")
    if cfg.train_only != "all":
        if drafter.candidate_selector is None:
            raise DFlashError(f"train_only={cfg.train_only!r} trains DFlash2's parts; give arch \"dflash2\".")
        parts = ("candidate_selector.",) + (("_conv.",) if cfg.train_only == "dflash2" else ())
        for name, p in drafter.named_parameters():
            p.requires_grad_(any(x in name for x in parts))
    target.set_taps(drafter.config.target_layer_ids)
    vocab = None
    if drafter.d2t is not None:
        d2t = drafter.draft_to_target_ids()
        t2d = torch.full((target.vocab_size,), -1, dtype=torch.long, device=device)
        t2d[d2t] = torch.arange(d2t.numel(), device=device)
        vocab = (target.lm_head_weight[d2t], t2d)
    return target, drafter, train_shards, vocab


def _resume(drafter: DFlashDrafter, opt, ckpt: Path, device) -> int:
    """Load checkpoint.pt if there is one; returns the step to continue from."""
    if not ckpt.exists():
        return 0
    state = torch.load(ckpt, map_location=device, weights_only=False)
    drafter.load_state_dict(state["drafter"])
    opt.load_state_dict(state["optimizer"])
    log.info("resumed from %s at step %d", ckpt, state["step"])
    return state["step"]


def _open_logs(cfg: TrainConfig, out: Path, rank: int):
    """(tensorboard writer or None, train_log.jsonl handle or None); rank 0 also writes recipe.json."""
    if rank != 0:
        return None, None
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    writer = None
    try:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(str(out / "tb"))
    except Exception:  # tensorboard is optional
        writer = None
    return writer, open(out / "train_log.jsonl", "a")


def train(cfg: TrainConfig, target=None, tokenizer=None) -> DFlashDrafter:
    """Run (or resume) the recipe; returns the trained drafter. `cfg.out_dir` holds `drafter/` (Z Lab format),
    `checkpoint.pt` (resumable state), `train_log.jsonl` and `recipe.json`."""
    from tqdm import tqdm

    world, rank, device = _setup_distributed(cfg)
    cfg = resolve_bf16(cfg, device)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out_dir)
    target, drafter, train_shards, vocab = _prepare(cfg, target, tokenizer, device)
    opt = build_optimizer(drafter, cfg)
    step = _resume(drafter, opt, out / "checkpoint.pt", device)
    model = drafter
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(drafter, device_ids=[device.index] if device.type == "cuda"
                                                          else None)
    train_batches = Batches(train_shards, cfg.max_len, cfg.seed)
    parts = frozen_parts(target, cfg, vocab, next(drafter.parameters()).dtype)  # a float32 run's head cast once
    try:
        eval_batches = Batches(load_shards(Path(cfg.data_dir), "heldout"), cfg.max_len, cfg.seed)
    except DFlashError:
        eval_batches = None

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16)

    writer, logf = _open_logs(cfg, out, rank)
    t_start = time.time()
    bar = tqdm(total=cfg.steps, initial=step, desc="train", disable=rank != 0)
    drafter.train()
    while step < cfg.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg) * g["lr_scale"]
        opt.zero_grad(set_to_none=True)
        tot_loss, correct, count, sel = 0.0, 0, 0, [0.0, 0.0, 0.0]  # sel: DFlash2's selector loss, hits, held
        for micro in range(cfg.grad_accum):
            ids, lm = train_batches.get(step * cfg.grad_accum + micro, cfg.batch_size, rank)
            gen = torch.Generator(device=device).manual_seed(hash((cfg.seed, step, micro, rank)) % (2**62))
            loss, st = train_step_loss(model, target, ids.to(device), lm.to(device), cfg, gen, autocast, vocab, parts)
            (loss / cfg.grad_accum).backward()
            tot_loss += loss.detach().item() / cfg.grad_accum
            correct, count = correct + st["correct"], count + st["count"]
            if "selector_loss" in st:
                sel = [sel[0] + float(st["selector_loss"]) / cfg.grad_accum, sel[1] + float(st["selector_hits"]),
                       sel[2] + float(st["selector_held"])]
        gnorm = float(torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip))
        opt.step()
        step += 1
        bar.update(1)
        if rank == 0 and (step % cfg.log_every == 0 or step == cfg.steps):
            acc = (correct / count.clamp(min=1))[1:]
            rec = {"step": step, "loss": round(tot_loss, 5), "lr": lr_at(step - 1, cfg), "grad_norm": round(gnorm, 4),
                   "acc1": round(float(acc[0]), 4), "acc_mean": round(float(acc.mean()), 4),
                   "elapsed_s": round(time.time() - t_start, 1)}
            if sel[2]:  # the selector's teacher-forced choice, where the top-k held the label
                rec.update(selector_loss=round(sel[0], 5), selector_acc=round(sel[1] / sel[2], 4))
            if eval_batches is not None and cfg.eval_batches > 0 and (step % cfg.eval_every == 0 or step == cfg.steps):
                rec.update(evaluate(model, target, eval_batches, cfg, autocast, device, vocab))
            _write_log(rec, logf, writer, bar, step)
        out_of_time = cfg.time_limit_s is not None and time.time() - t_start > cfg.time_limit_s
        if rank == 0 and (step % cfg.save_every == 0 or step == cfg.steps or out_of_time):
            save_checkpoint(drafter, opt, step, out)
        if out_of_time:
            log.info("time limit reached at step %d; rerun the same command to continue", step)
            break
    bar.close()
    if logf:
        logf.close()
    if world > 1:
        torch.distributed.barrier()
    return drafter


def _write_log(rec: dict, logf, writer, bar, step: int) -> None:
    logf.write(json.dumps(rec) + "\n")
    logf.flush()
    bar.set_postfix(loss=rec["loss"], acc1=rec["acc1"])
    if writer:
        for k, v in rec.items():
            if isinstance(v, (int, float)):
                writer.add_scalar(k, v, step)


def save_checkpoint(drafter: DFlashDrafter, opt, step: int, out: Path) -> None:
    """Resumable state (checkpoint.pt) and the servable drafter (drafter/, Z Lab format), both atomic."""
    atomic_write(out / "checkpoint.pt", lambda p: torch.save(
        {"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step}, p))
    save_drafter(drafter, out / "drafter", extra_config={"dflashkit_train_step": step})
