"""Our GGUF writer against llama.cpp's own converter, without building llama.cpp: a drafter's `dflashkit export
--format gguf` file compared key by key and tensor by tensor with what `convert_hf_to_gguf.py` makes of its Z Lab
export, in f32 and f16.

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    .venv/bin/python scripts/gguf_converter_check.py --drafter DIR \
        --llamacpp-src llama_cpp_python-0.3.36/vendor/llama.cpp --out bench/results/dflash2-gguf

The converter needs `sentencepiece` in the running interpreter (SmolLM2's vocabulary path imports it).
Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dflashkit.checkpoint import load_drafter  # noqa: E402
from dflashkit.export import export_zlab  # noqa: E402
from dflashkit.gguf_export import compare_gguf, export_gguf  # noqa: E402
from dflashkit.loader import default_gguf, resolve_target_dir  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--llamacpp-src", required=True, help="llama.cpp's source tree (convert_hf_to_gguf.py, gguf-py/)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    src = Path(args.llamacpp_src)
    dr = load_drafter(args.drafter, dtype=torch.float32)
    work = Path(tempfile.mkdtemp())
    zlab = export_zlab(dr, work / "zlab", dtype=torch.float32)
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    res = {}
    for kind in ("f32", "f16"):
        conv = work / f"converter-{kind}.gguf"
        r = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(zlab), "--target-model-dir",
                            str(resolve_target_dir(None)), "--outfile", str(conv), "--outtype", kind],
                           capture_output=True, text=True, env=env)
        if r.returncode:
            raise SystemExit(f"llama.cpp's converter failed: {r.stderr[-2000:]}")
        ours = export_gguf(dr, default_gguf(), work / f"ours-{kind}.gguf", gguf_type=kind)
        res[kind] = compare_gguf(ours, conv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"drafter": args.drafter, "arch": dr.config.arch, "llamacpp_src": src.name if src.name != "llama.cpp"
            else f"{src.parent.parent.name}/vendor/llama.cpp"}
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": res}, indent=2) + "\n")
    md = [f"# `dflashkit export --format gguf` vs llama.cpp's converter ({dr.config.arch} drafter)", "",
          f"`scripts/gguf_converter_check.py --drafter {args.drafter} --llamacpp-src {meta['llamacpp_src']}`", "",
          "| type | keys compared | keys differing | tensors compared | tensors differing | identical |",
          "|---|---|---|---|---|---|"]
    for kind, r in res.items():
        md.append(f"| {kind} | {r['keys_compared']} | {len(r['keys_differing'])} | {r['tensors_compared']} | "
                  f"{len(r['tensors_differing'])} | {r['identical']} |")
    md += ["", "Keys only ours writes: " + ", ".join(sorted({k for r in res.values() for k in r["extra_keys"]}))]
    (out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(r["identical"] for r in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
