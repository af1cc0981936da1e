"""Drafter checkpoints in the Z Lab layout: `config.json` + `model.safetensors` (dflash-spec §6.1).

Tensor names carry no prefix (`fc.weight`, `layers.0.self_attn.q_proj.weight`, ...); there is no
embedding and no LM head (both are the target's). An optional `d2t` tensor holds the reduced draft
vocabulary map (offsets, target_id = draft_id + d2t[draft_id], as in EAGLE-3 / speculators).
Writes are atomic (temp file + rename), so an interrupted save never leaves a half checkpoint.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import DFlashConfig
from .corpus import Corpus
from .drafter import DFlashDrafter
from .errors import DFlashError

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def atomic_write(path: Path, write) -> None:
    """Call write(tmp_path), then rename over `path` (same directory, so the rename is atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_drafter(drafter: DFlashDrafter, out_dir: str | os.PathLike, extra_config: dict | None = None) -> Path:
    out = Path(out_dir)
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    cfg = drafter.config.to_hf_dict()
    cfg["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    cfg.update(extra_config or {})
    atomic_write(out / WEIGHTS, lambda p: save_file(state, p, metadata={"format": "pt"}))
    atomic_write(out / CONFIG, lambda p: Path(p).write_text(json.dumps(cfg, indent=2) + "\n"))
    return out


def read_config(path: str | os.PathLike, num_target_layers: int | None = None) -> DFlashConfig:
    """The drafter's config: Z Lab's layout, or speculators' (which needs `num_target_layers`, its target's)."""
    p = Path(path)
    cfg_file = p / CONFIG
    if not cfg_file.is_file():
        raise DFlashError(f"no {CONFIG} in drafter directory {p}; give a directory holding {CONFIG} and {WEIGHTS}.")
    try:
        d = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise DFlashError(f"{cfg_file} is not valid JSON ({e}); the checkpoint is corrupt, re-export or "
                          "re-download it.") from None
    if "speculators_model_type" in d:
        return DFlashConfig.from_speculators(d, num_target_layers)
    return DFlashConfig.from_hf_dict(d)


RANKING = "token_ranking.json"  # optional: target ids by training frequency, for `DFlashEngine(draft_vocab=N)`
CORPUS = "corpus.npz"  # optional: the target's answers the drafter trained on, for the corpus lookup (`corpus.py`)


def save_token_ranking(out_dir: str | os.PathLike, ids: list[int], source: str) -> Path:
    """Write the most frequent target ids of a drafter's training responses, most frequent first."""
    path = Path(out_dir) / RANKING
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps({"source": source, "ids": [int(i) for i in ids]})))
    return path


def load_token_ranking(path: str | os.PathLike) -> list[int] | None:
    """The ids of a drafter directory's `token_ranking.json`, or None if it has none."""
    f = Path(path) / RANKING
    if not f.is_file():
        return None
    try:
        return [int(i) for i in json.loads(f.read_text())["ids"]]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise DFlashError(f"{f} is corrupt ({e}); delete it (it only speeds up drafting) or rewrite it.") from None


def load_drafter(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", num_target_layers: int | None = None) -> DFlashDrafter:
    """Load a Z Lab-format drafter directory (or a `dflashkit train` output directory, whose drafter/ it takes), or a
    speculators-layout one (`num_target_layers`: its target's, which that layout does not record).
    Missing or unexpected tensors are errors, never silent."""
    p = Path(path)
    if not (p / CONFIG).is_file() and (p / "drafter" / CONFIG).is_file():
        p = p / "drafter"
    if not p.is_dir():
        raise DFlashError(f"drafter path {p} is not a directory; give a Z Lab-format drafter directory.")
    cfg = read_config(p, num_target_layers)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise DFlashError(f"no *.safetensors weights in {p}; the checkpoint is incomplete, re-export or "
                          "re-download it.")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise DFlashError(f"cannot read {f} ({e}); the file is corrupt or truncated, re-export or "
                              "re-download it.") from None
    for name in CODEBOOKS:  # Z Lab's DFlash2 checkpoints may name them without `.weight` (its own key mapping)
        if name in state and f"{name}.weight" not in state:
            state[f"{name}.weight"] = state.pop(name)
    if "d2t" in state and cfg.draft_vocab_size is None:
        cfg = cfg.replace(draft_vocab_size=state["d2t"].numel())
    drafter = DFlashDrafter(cfg)
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise DFlashError(
            f"drafter weights in {p} do not match its config: missing {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{'...' if len(unexpected) > 8 else ''}. The checkpoint is not a DFlash drafter "
            "for this config; re-export it with `dflashkit export --format zlab`."
        )
    bad = [(k, tuple(state[k].shape), tuple(v.shape)) for k, v in expected.items() if state[k].shape != v.shape]
    if bad:
        raise DFlashError(f"tensor shapes do not match config.json: {bad[:4]} (name, file, config); the checkpoint "
                          "is corrupt.")
    drafter.load_state_dict(state)
    drafter.token_ranking = load_token_ranking(p)
    drafter.corpus = Corpus.load(p / CORPUS) if (p / CORPUS).is_file() else None
    return drafter.to(device=device, dtype=dtype)
