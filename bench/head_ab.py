"""The LM head on 8-bit codes (plinear.cpp's Q8_0 path) as built now vs as built at an earlier revision, A/B in one
process, in real target and drafting steps.

    .venv/bin/python bench/head_ab.py --out bench/results/head-one-chain [--before dab7f81] [--aa] [--rounds 150]

The default engine (the default target, the bundled drafter) is loaded once. Arm "before" is plinear.cpp as it was
at --before (with ops.h and simd.h of that revision, compiled here as a module of its own that only holds plinear),
reading the head's codes in the layout that revision's `_pack` gave them (qlinear's: `with_int8_acts().packed()`);
arm "after" is the current kernel. Each arm swaps the target's head and the drafter's head rows (its draft
vocabulary: the head's rows, `proposers.draft_head`); every other kernel is the same. Steps: one-row target steps
of 1-16 new tokens after a 176-token prompt (forward + LM head over every new token, as a verify computes it) and
drafting steps at blocks 2, 4 and 16, each step under both arms back to back, the order alternating round by
round. Also each arm's 4-token verify over its one-token step (issue 34's ratio) and how far the two heads' logits
lie apart. --aa runs "after" in both arms (the A/A control). Writes head_ab.json, .md and .png into --out.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflashkit import DFlashEngine
from dflashkit.kernels import RowLinear
from dflashkit.loader import load_models
from dflashkit.measurements import cpu_name

from draft_block import drafting_step, target_step  # noqa: E402  (bench/ is not a package)
from step_ab import BLOCKS, WIDTHS, ab_medians, ab_parser, ab_table, plot_ratios  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WRAP = """#include <torch/extension.h>
#include "ops.h"
bool plinear_available() { return true; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("plinear", &plinear); }
"""


def build_before(rev: str, where: Path):
    """plinear.cpp (and the headers it includes) at `rev`, as a module of its own."""
    from torch.utils.cpp_extension import load

    for name in ("plinear.cpp", "ops.h", "simd.h"):
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:src/dflashkit/kernels/{name}"],
                              check=True, capture_output=True, text=True).stdout
        (where / name).write_text(text)
    (where / "wrap.cpp").write_text(WRAP)
    (where / "build").mkdir()
    return load(name="plinear_before", sources=[str(where / "plinear.cpp"), str(where / "wrap.cpp")],
                build_directory=str(where / "build"), extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
                extra_ldflags=["-fopenmp"])


class BeforeHead(RowLinear):
    """A q8_0 `RowLinear` with exact codes, run by the earlier revision's plinear on qlinear's layout (a RowLinear
    still: `LeanTarget.logits` takes the drafter's head rows as one)."""

    def __init__(self, mod, lin: RowLinear):  # noqa: D107 - the same layer's fields, another kernel
        self.__dict__.update(lin.__dict__)
        self.mod, self.parts = mod, lin.with_int8_acts().packed()

    def __call__(self, x: torch.Tensor, out_fp32: bool = False) -> torch.Tensor:
        return self.mod.plinear(x, *self.parts, 2, self.n_out, not out_fp32)


def main() -> int:
    from dflashkit.bench.report import write_result

    ap = ab_parser(__doc__, '"after" in both arms (the A/A control)')
    ap.add_argument("--before", default="dab7f81", help="the revision whose plinear.cpp is arm A")
    args = ap.parse_args()
    with torch.inference_mode(), tempfile.TemporaryDirectory() as tmp:
        mod = build_before(args.before, Path(tmp))
        target, tok, drafter, _ = load_models(dtype="bfloat16")
        if target.head is None or target.head.kind != "q8_0" or target.head.path != "plinear":
            raise SystemExit("the target's head does not run on plinear's Q8_0 path here (an AVX512-BF16 CPU, "
                             "--quant int4): nothing to compare")
        eng = DFlashEngine(target, drafter, tokenizer=tok)
        fns = {f"target_w{w}": target_step(target, args.context, w) for w in WIDTHS}
        props = {}
        for b in BLOCKS:
            props[b], fns[f"draft_b{b}"] = drafting_step(eng, b, 1, args.context)
        heads = {"after": (target.head, {b: p.head for b, p in props.items()})}
        heads["before"] = heads["after"] if args.aa else (
            BeforeHead(mod, target.head), {b: BeforeHead(mod, p.head) for b, p in props.items()})
        x = torch.randn(16, target.head.in_features, generator=torch.Generator().manual_seed(2)).bfloat16()
        ya, yb = heads["after"][0](x, True), BeforeHead(mod, target.head)(x, True)
        exact = x.double() @ target.head.dequantize().double().T
        gap = {"max_abs_diff_over_max_abs": float((ya - yb).abs().max() / ya.abs().max()),
               "argmax_equal_rows": int((ya.argmax(-1) == yb.argmax(-1)).sum()), "rows": 16,
               "max_abs_err_vs_float64": {"after": float((ya.double() - exact).abs().max()),
                                          "before": float((yb.double() - exact).abs().max())}}

        def prepare(arm: str, key: str):
            target.head = heads[arm][0]
            for b, p in props.items():
                p.head = heads[arm][1][b]
            return fns[key]

        try:
            ms = ab_medians(list(fns), args.rounds, prepare)
        finally:
            target.head = heads["after"][0]
    res = {"ms": ms, "logits": gap,
           "verify4_over_step1": {arm: round(ms["target_w4"][arm] / ms["target_w1"][arm], 3) for arm in heads},
           "meta": {"command": "bench/head_ab.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
                    "cpu": cpu_name(), "threads": torch.get_num_threads(), "rounds": args.rounds, "aa": args.aa,
                    "before": args.before, "context": args.context, "engine": target.engine_name}}
    write_result(args.out, "head_ab", res, report(res), plot)
    print(report(res))
    return 0


def report(res: dict) -> str:
    mt, g = res["meta"], res["logits"]
    arms = '"after" in both arms (A/A control)' if mt["aa"] else f"the head's kernel at {mt['before']} vs now"
    lines = ab_table("The LM head's Q8_0 kernel in real steps", mt, arms, res["ms"])
    err = g["max_abs_err_vs_float64"]
    lines += ["", f"The two heads' logits on {g['rows']} random rows: max |after - before| / max |after| "
              f"{g['max_abs_diff_over_max_abs']:.2e}, the same argmax on {g['argmax_equal_rows']} rows; max |error| "
              f"against the codes' product in float64: before {err['before']:.2e}, after {err['after']:.2e}."]
    return "\n".join(lines) + "\n"


def plot(res: dict):
    return plot_ratios(res["ms"], "after / before head kernel (step time)", (0.7, 1.1))


if __name__ == "__main__":
    raise SystemExit(main())
