"""The kernels (every C++ source) as built now vs as built at an earlier revision, A/B in real steps in one process.

    .venv/bin/python bench/kernels_ab.py --before REV --out bench/results/NAME [--aa] [--rounds 150] [--quant Q]
        [--python]

For kernel changes that keep the Python side's layouts (what `pack_codes` and the stacks hand the kernels), or with
--python for those that change them: the sources under src/dflashkit/kernels/ at REV are compiled here as a second
module (its own name; the class `Stack` renamed so both modules' types can live in one interpreter), and the default
engine (the default target, the bundled
drafter) is loaded twice: arm "before" with REV's module in place of the kernels (`kernels.load()` returns it while
that arm is built and while it runs), arm "after" with the current one. In each round every step runs on each arm
back to back, the order alternating round by round: one-row target steps of 1-16 new tokens after a 176-token
prompt (forward + LM head over every new token, as a verify computes it) and drafting steps at blocks 2, 4 and 16.
Also each arm's 4-token verify over its one-token step (issue 34's ratio) and whether the two arms' logits have the
same bits. --aa loads the current module in both arms (the A/A control: two engines, one module). --python: arm
"before" also packs its codes with REV's packing function and calls its layers with REV's `RowLinear.__call__` (REV's
kernels package, its Python files, loaded as a package of its own; the two swapped in while that arm is built and
runs): for a change of the packed layout. Writes kernels_ab.json, .md and .png into --out.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflashkit import kernels
from dflashkit.measurements import cpu_name

from draft_block import target_step  # noqa: E402  (bench/ is not a package)
from step_ab import ab_medians, ab_parser, ab_table, engine_steps, plot_ratios  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KERNELS = "src/dflashkit/kernels"


def rev_files(rev: str) -> list[str]:
    """The names under src/dflashkit/kernels/ at `rev`."""
    return subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{KERNELS}"], check=True,
                          capture_output=True, text=True).stdout.split()


def rev_text(rev: str, name: str) -> str:
    """src/dflashkit/kernels/NAME at `rev`."""
    return subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{KERNELS}/{name}"], check=True,
                          capture_output=True, text=True).stdout


def build_before(rev: str, where: Path):
    """Every kernel source at `rev`, compiled as the module "dflashkit_kernels_before"."""
    from torch.utils.cpp_extension import load

    for name in rev_files(rev):
        if name.endswith((".cpp", ".h")):
            (where / name).write_text(rev_text(rev, name))
    (where / "build").mkdir()
    # -DStack=...: pybind11 keys its types by the C++ type; both modules' `Stack` would otherwise collide
    return load(name="dflashkit_kernels_before", sources=sorted(str(p) for p in where.glob("*.cpp")),
                build_directory=str(where / "build"), extra_ldflags=["-fopenmp"],
                extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp", "-DStack=StackBefore", f"-I{where}"])


def python_before(rev: str, where: Path, mod) -> dict:
    """REV's packing function (`packing.pack_codes`; `_pack` in kernels/__init__.py before it moved) and
    `RowLinear.__call__` (the kernels package's Python files at REV, loaded as the package "dflashkit.kernels_before",
    whose `load()` returns `mod`)."""
    import importlib.util

    pkg = where / "kernels_before"
    pkg.mkdir()
    for name in (n for n in rev_files(rev) if n.endswith(".py")):
        (pkg / name).write_text(rev_text(rev, name))
    spec = importlib.util.spec_from_file_location("dflashkit.kernels_before", pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old
    spec.loader.exec_module(old)
    old._state["mod"] = mod
    return {"pack_codes": getattr(old, "pack_codes", None) or old._pack, "__call__": old.RowLinear.__call__}


NOW_PYTHON = {"pack_codes": kernels.pack_codes, "__call__": kernels.RowLinear.__call__}


def use(mod, python: dict) -> None:
    """Arm switch: `kernels.load()` returns `mod`; the codes pack and the layers run with `python`'s functions."""
    kernels._state["mod"] = mod
    kernels.pack_codes, kernels.RowLinear.__call__ = python["pack_codes"], python["__call__"]


def arm(mod, python: dict, ctx: int, quant: str | None) -> tuple[dict, object]:
    """One engine built under `use(mod, python)`: its steps (each run once) and its target."""
    use(mod, python)
    return engine_steps(ctx, quant)


def main() -> int:
    from dflashkit.bench.report import write_result

    ap = ab_parser(__doc__, "the current module in both arms (the A/A control)")
    ap.add_argument("--before", required=True, help="the revision whose kernel sources are arm A")
    ap.add_argument("--quant", default=None, help="the target's --quant (default: the host's default)")
    ap.add_argument("--python", action="store_true", help="arm A also packs and calls its layers as REV did")
    args = ap.parse_args()
    now = kernels.load()
    if now is None:
        raise SystemExit(f"the kernels are unavailable here: {kernels.why_unavailable()}")
    with torch.inference_mode(), tempfile.TemporaryDirectory() as tmp:
        mods = {"before": now if args.aa else build_before(args.before, Path(tmp)), "after": now}
        pys = {"before": python_before(args.before, Path(tmp), mods["before"]) if args.python and not args.aa
               else NOW_PYTHON, "after": NOW_PYTHON}
        built = {name: arm(mod, pys[name], args.context, args.quant) for name, mod in mods.items()}
        fns = {name: b[0] for name, b in built.items()}
        same = {}
        for w in (1, 4):  # a fresh w-token step per arm on the same ids: the logits' bits
            out = {}
            for name, (_, target) in built.items():
                use(mods[name], pys[name])
                out[name] = target_step(target, args.context, w)()
            same[f"w{w}"] = bool(torch.equal(out["before"], out["after"]))

        def prepare(name: str, key: str):
            use(mods[name], pys[name])
            return fns[name][key]

        try:
            ms = ab_medians(list(fns["after"]), args.rounds, prepare)
        finally:
            use(now, NOW_PYTHON)
    res = {"ms": ms, "same_logit_bits": same,
           "verify4_over_step1": {name: round(ms["target_w4"][name] / ms["target_w1"][name], 3) for name in mods},
           "meta": {"command": "bench/kernels_ab.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
                    "cpu": cpu_name(), "threads": torch.get_num_threads(), "rounds": args.rounds, "aa": args.aa,
                    "before": args.before, "python": args.python, "quant": args.quant, "context": args.context,
                    "engine": built["after"][1].engine_name}}
    write_result(args.out, "kernels_ab", res, report(res), plot)
    print(report(res))
    return 0


def report(res: dict) -> str:
    mt = res["meta"]
    arms = "the current kernels in both arms (A/A control)" if mt["aa"] else f"the kernels at {mt['before']} vs now"
    if mt.get("python") and not mt["aa"]:
        arms += f" (arm A packing its codes and calling its layers as {mt['before']} did)"
    same = ", ".join(f"{k[1:]}-token step {'yes' if v else 'NO'}" for k, v in res["same_logit_bits"].items())
    lines = ab_table("Kernels before / after in real steps", mt, arms, res["ms"])
    lines += ["", f"The same logit bits in both arms: {same}."]
    return "\n".join(lines) + "\n"


def plot(res: dict):
    return plot_ratios(res["ms"], "after / before kernels (step time)", (0.7, 1.1))


if __name__ == "__main__":
    raise SystemExit(main())
