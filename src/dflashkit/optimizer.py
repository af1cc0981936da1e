"""The drafter's optimizer: Muon over the weight matrices with AdamW over the rest (speculators' DFlash recipe, our
default), or AdamW over every trainable parameter. Either way one object that the training loop steps, schedules
(through `param_groups`, each with its `lr_scale`) and checkpoints.

Muon (`torch.optim.Muon`) orthogonalises the update of a 2-D matrix; vectors (norms, DFlash2's base kernels) and the
selector's codebooks (token-indexed rows, like embeddings) stay on AdamW, as in speculators. Its lr is matched to
AdamW's update size ("match_rms_adamw"), so one `lr` serves both.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .errors import DFlashError
from .measurements import cpu_has_bf16_units

OPTIMIZERS = ("adamw", "muon")


def param_groups(drafter, selector_lr_scale: float) -> list[dict]:
    """The trainable parameters: one group at lr, as before the scale existed (so checkpoints written then resume);
    with selector_lr_scale != 1, DFlash2's selector in a second group at lr x scale (an empty group is left out).
    Each group: {"params": [...], "names": [...], "lr_scale": float}."""
    named = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
    if selector_lr_scale == 1.0:
        splits = [(named, 1.0)]
    else:
        new = [(n, p) for n, p in named if n.startswith("candidate_selector.")]
        old = [(n, p) for n, p in named if not n.startswith("candidate_selector.")]
        splits = [(old, 1.0), (new, selector_lr_scale)]
    return [{"params": [p for _, p in g], "names": [n for n, _ in g], "lr_scale": s} for g, s in splits if g]


def muon_eligible(name: str, p: torch.Tensor) -> bool:
    """A matrix Muon can orthogonalise: 2-D, both sides > 1, not a token-indexed codebook."""
    return p.ndim == 2 and min(p.shape) > 1 and "codebook" not in name


def newton_schulz_fp32(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                       eps: float) -> torch.Tensor:
    """Muon's orthogonalisation as torch computes it (`torch.optim._muon._zeropower_via_newtonschulz`: the same
    quintic iteration, coefficients, steps and normalisation), in float32 instead of bf16. grad [A, B] -> [A, B]."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@contextlib.contextmanager
def float32_newton_schulz():
    """torch's Muon steps with `newton_schulz_fp32` while inside. Why: torch runs the iteration in bf16, and on a CPU
    without bf16 units its bf16 matmul is ~40x slower than float32 (AMD EPYC, AVX2, 2 threads: one iteration on a
    576 x 1536 update 1.1 s vs 26 ms), so the optimizer step took ~2.5 minutes of a CPU training step."""
    from torch.optim import _muon

    torch_ns = getattr(_muon, "_zeropower_via_newtonschulz", None)
    if torch_ns is None:  # another torch than the pinned one: its own iteration
        yield
        return
    _muon._zeropower_via_newtonschulz = newton_schulz_fp32
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = torch_ns


@dataclass
class DrafterOptimizer:
    name: str  # "adamw" | "muon"
    parts: list[torch.optim.Optimizer]  # adamw: [AdamW]; muon: [Muon, AdamW] (less an empty one)
    muon_fp32: bool = False  # Muon's iteration in float32 (`float32_newton_schulz`): CPUs without bf16 units

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.parts for g in o.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.parts:
            fp32 = self.muon_fp32 and isinstance(o, torch.optim.Muon)
            with float32_newton_schulz() if fp32 else contextlib.nullcontext():
                o.step()

    def state_dict(self) -> dict:
        # adamw: AdamW's own state, as checkpoints were written before Muon existed (so they resume); muon: its parts.
        if self.name == "adamw":
            return self.parts[0].state_dict()
        return {"parts": [o.state_dict() for o in self.parts]}

    def load_state_dict(self, state: dict) -> None:
        written = "muon" if "parts" in state else "adamw"
        if written != self.name:
            raise DFlashError(f"checkpoint.pt was written with another optimizer ({written!r}) than the recipe's "
                              f"({self.name!r}); add \"optimizer\": \"{written}\" to the recipe (`--config FILE`) "
                              "to resume it, or train into a new out_dir.")
        for o, s in zip(self.parts, state["parts"] if written == "muon" else [state], strict=True):
            o.load_state_dict(s)


def build_optimizer(drafter, cfg) -> DrafterOptimizer:
    """cfg: a TrainConfig (optimizer, lr, betas, weight_decay, selector_lr_scale)."""
    if cfg.optimizer not in OPTIMIZERS:
        raise DFlashError(f"optimizer must be one of {', '.join(OPTIMIZERS)} (got {cfg.optimizer!r}).")
    groups = param_groups(drafter, cfg.selector_lr_scale)
    adamw = dict(lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return DrafterOptimizer("adamw", [torch.optim.AdamW(groups, **adamw)])
    matrices, rest = [], []
    for g in groups:
        pairs = list(zip(g["names"], g["params"]))
        for out, keep in ((matrices, True), (rest, False)):
            chosen = [(n, p) for n, p in pairs if muon_eligible(n, p) == keep]
            if chosen:
                out.append({"params": [p for _, p in chosen], "names": [n for n, _ in chosen],
                            "lr_scale": g["lr_scale"]})
    parts = []
    if matrices:
        parts.append(torch.optim.Muon(matrices, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=0.95,
                                      nesterov=True, adjust_lr_fn="match_rms_adamw"))
    if rest:
        parts.append(torch.optim.AdamW(rest, **adamw))
    on_cpu = all(p.device.type == "cpu" for g in matrices for p in g["params"])
    return DrafterOptimizer("muon", parts, muon_fp32=on_cpu and not cpu_has_bf16_units())
