"""Which kernels run the model: one `KernelPlan`, chosen once when the target loads (`choose`), applied to the
target (`apply`) and, by the engine, to its drafter (`apply_to_drafter`).

- linears: torch's `F.linear`, or our row-invariant `rowlinear` on the bf16 weights (read as the GGUF's own codes
  where those decode to exactly these bits), or `int4` / `int4-a8` on the GGUF's codes (a different target with its
  own AR baseline);
- attention: torch's ops, or ours (`attend`, one C++ call per layer) with our linears;
- stack: a Llama-style target's layers as one C++ call per forward (target and drafter alike).
The plan's `identity` (the plan plus our kernels' sources) is the one key of everything cached about a forward's bits
or speed: the exactness self-check (`invariance.py`) and the step cost model (`step_cost.py`), through
`measurements.engine_identity`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import DFlashError

log = logging.getLogger(__name__)

KERNELS = ("auto", "torch", "rowlinear")
QUANTS = ("auto", "none", "int4", "int4-a8")  # int4-a8: the same codes, 8-bit activations (integer dot products)


@dataclass(frozen=True)
class KernelPlan:
    linear: str = "torch"  # torch | rowlinear | int4 | int4-a8
    isa: str = ""  # the instruction path our kernels take on this CPU (`kernels.isa`; "" under torch's)
    codes: bool = False  # rowlinear reads the bf16 weights as the GGUF's codes (the same bits, a third of the bytes)
    attention: str = "torch"  # torch | attend
    stack: bool = False  # the decoder layers as one C++ call per forward
    sources: str = ""  # our kernels' source digest ("" under torch's): a changed kernel keeps its name
    # int4 chosen by --quant auto: `apply` falls back to the bf16 model where it cannot run (not a kernel: not compared)
    auto: bool = field(default=False, compare=False)

    @property
    def ours(self) -> bool:
        """Our C++ kernels run the linears (then the attention and the drafter's linears too)."""
        return self.linear != "torch"

    @property
    def parts(self) -> list[str]:
        """E.g. ["rowlinear.avx2", "attend", "layers"] (torch's kernels: []). Why the ISA for rowlinear and int4:
        one instruction sequence per CPU kind (their bits differ); int4-a8 computes the same bits on each of its
        paths (kernels/qlinear.cpp)."""
        linear = f"{self.linear}.{self.isa}" if self.linear in ("rowlinear", "int4") else self.linear
        return ([linear] if self.ours else []) + (["codes"] if self.codes else []) + (
            ["attend"] if self.attention == "attend" else []) + (["layers"] if self.stack else [])

    @property
    def identity(self) -> str:
        """The plan, plus our kernels' sources wherever any of them run."""
        parts = self.parts
        return "+".join(parts) + f"/kernels-{self.sources}" if parts else "torch"


TORCH = KernelPlan()


def plan_of(target) -> KernelPlan:
    """The plan a target runs (a backend without one runs torch's kernels)."""
    return getattr(target, "kernel_plan", None) or TORCH


def check_names(backend: str, kernel: str, quant: str | None) -> None:
    """The CLI's --kernel / --quant, checked before the weights load."""
    if kernel not in KERNELS:
        raise DFlashError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}.")
    if (quant or "none") not in QUANTS:
        raise DFlashError(f"unknown quantisation {quant!r}; choose one of {', '.join(QUANTS)}.")
    if (kernel == "rowlinear" or quant not in (None, "none", "auto")) and backend == "hf":
        raise DFlashError("--kernel rowlinear and --quant int4 run on the lean backend; drop --backend hf.")


def choose(target, gguf: Path | None, kernel: str = "auto", quant: str | None = None) -> KernelPlan:
    """The plan for `target` (gguf: the GGUF it was converted from, or None).

    `auto`: rowlinear for a bf16 lean target on a CPU wherever our kernels build, torch's elsewhere. Why not torch's
    bf16 GEMM on CPUs with bf16 units: measured on an AMD EPYC with AVX512-BF16 (no AMX), oneDNN picks kernels by the
    row count (SmolLM2's down projection gives a row other bits from 3-6 rows on), so verified tokens could part
    from AR at rounding ties; and our kernel was also faster there (AR 33.5 vs 17.9 tok/s, one prompt, 2 threads).
    Exactness first: `--kernel torch` stays available, labelled by the self-check. Codes: on AVX512-BF16 rowlinear
    decodes a Q4_1 GGUF's codes to exactly the bf16 weights (one-token step 17.6 -> 10.7 ms, bench/results/kernels);
    an AVX2 CPU decodes them to fp32 (other bits), so the bf16 weights stay there.

    `--quant auto` (the default; None is auto): with `--kernel auto`, a GGUF target in bf16 on a CPU whose our kernels
    run on AVX512-BF16 dot products runs `int4`, the GGUF's own codes (plinear.cpp); else none. Why: plain decoding
    1.24x (AMD EPYC) and 1.45x (Xeon) llama.cpp against the bf16 weights' 0.95x / 1.08x on held-out prompts, and
    against the float32 model level with them (bench/results/int4-exact-amd, int4-exact, target-fidelity).
    `DFLASHKIT_BF16_WEIGHTS=1` keeps the bf16 weights; a GGUF whose tensors are not Q4_1 / Q8_0 falls back to them."""
    from .kernels import available, isa, source_id

    quant = quant or "auto"
    lean = callable(getattr(target, "use_rowlinear", None))  # the lean backend: the one our kernels can run

    def ours() -> bool:  # asked only where the choice depends on it: `available` builds the kernels on first use
        return lean and target.dtype == torch.bfloat16 and str(target.device) == "cpu" and available()

    def dot_codes() -> bool:  # the GGUF's codes read on AVX512-BF16 dot products (bf16's `codes`; auto's int4)
        return gguf is not None and isa() in ("avx512bf16", "amx") and not os.environ.get("DFLASHKIT_BF16_WEIGHTS")

    auto = quant == "auto"
    if auto:
        quant = "int4" if kernel == "auto" and ours() and dot_codes() else "none"
        if quant == "none" and kernel == "auto" and gguf is not None and ours() and isa() == "avx2":
            log.info("--quant auto: the bf16 weights run (this CPU has no AVX512-BF16). --quant int4-a8 runs the "
                     "GGUF's codes on 8-bit activations as llama.cpp does: ~2x faster plain decoding on AVX2, "
                     "a coarser arithmetic (bench/results/peers-avx2, target-fidelity)")
    if kernel == "auto" and quant == "none":
        kernel = "rowlinear" if ours() else "torch"
    if kernel == "torch" and quant == "none":
        return TORCH
    if not lean:
        raise DFlashError(f"--kernel/--quant need the lean backend, which does not implement "
                          f"{target.architecture}; drop them.")
    if quant != "none" and gguf is None:
        raise DFlashError("--quant int4 reads a GGUF's own 4-bit codes; this target is not a GGUF target. "
                          "Give --target FILE.gguf (Q4_1), or drop --quant.")
    codes = quant == "none" and dot_codes()
    return KernelPlan(linear="rowlinear" if quant == "none" else quant, isa=isa(), codes=codes, attention="attend",
                      stack=not target.layers_unsupported(), sources=source_id(), auto=auto and quant == "int4")


def apply(plan: KernelPlan, target, gguf: Path | None, cache: Path) -> KernelPlan:
    """Put `plan` on the target (cache: where converted codes are kept); returns the plan it runs: the same, or
    without codes where the GGUF's codes turned out not to be the loaded bits."""
    if not plan.ours:
        return plan_of(target)
    from .backends.quant import NotTheSameBits, attach_gguf_codes

    if plan.linear in ("int4", "int4-a8"):
        try:
            attach_gguf_codes(target, gguf, int8_acts=plan.linear == "int4-a8", cache_dir=cache)
        except DFlashError as e:  # the target is left as it was
            if not plan.auto:
                raise
            log.info("--quant auto: the GGUF's codes cannot run here (%s); the bf16 weights run", e)
            return apply(choose(target, gguf, "auto", "none"), target, gguf, cache)
    else:
        target.use_rowlinear()
        if plan.codes:
            try:
                attach_gguf_codes(target, gguf, same_bits=True, cache_dir=cache)
            except (NotTheSameBits, OSError) as e:
                log.info("bf16 weights kept (the GGUF's codes are not the same bits here: %s)", e)
    # Our kernels come together: the attention too is one row-invariant C++ call per layer (bench/results/kernels:
    # with it a 16-token verify costs ~1.8x a one-token step here, without it ~2.5x, with torch's kernels ~5x) ...
    target.use_fused_attention()
    # ... and a Llama-style target's layers one C++ call per forward (kernels/layers.cpp; one-token step on the same
    # kernels: 29.5 -> 22.7 ms in bf16, 19.6 -> 11.6 with int4-a8). Other architectures keep the per-op forward.
    if plan.stack:
        target.use_layer_stack()
    else:
        log.info("layer stack not used: %s; the per-op forward runs the layers", target.stack_unsupported())
    return plan_of(target)


def apply_to_drafter(plan: KernelPlan, drafter: torch.nn.Module) -> None:
    """The drafter runs what its target runs: our linears (its bf16 weights, no codes) and, with a stacked target,
    its layers as one C++ call (`drafter.layer_stack`; the draft cache's value rows then take the stack's layout,
    `proposers.DrafterProposer`)."""
    if not plan.ours:
        return
    from .drafter import layer_stack
    from .kernels import use_rowlinear_in

    use_rowlinear_in(drafter)
    if plan.stack:
        drafter.stack = layer_stack(drafter)
