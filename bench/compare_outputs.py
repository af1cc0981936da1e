"""Do two benchmark runs give the same tokens? Compares outputs.json.gz of two `dflashkit bench` result folders,
method by method and turn by turn, and writes comparison.json + comparison.md into the first folder's parent.

    .venv/bin/python bench/compare_outputs.py bench/results/house-check/before bench/results/house-check/after
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path


def outputs(folder: Path) -> dict:
    with gzip.open(folder / "outputs.json.gz", "rt") as f:
        return json.load(f)


def compare(a: dict, b: dict) -> dict:
    rows = {}
    for dataset in sorted(set(a) | set(b)):
        for method in sorted(set(a.get(dataset, {})) | set(b.get(dataset, {}))):
            x, y = a.get(dataset, {}).get(method), b.get(dataset, {}).get(method)
            if x is None or y is None:
                rows[f"{dataset}/{method}"] = {"turns": None, "identical": None, "missing_in": "a" if x is None else "b"}
                continue
            same = sum(p == q for p, q in zip(x, y))
            rows[f"{dataset}/{method}"] = {"turns": max(len(x), len(y)), "identical": same,
                                           "tokens": sum(len(p) for p in x)}
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    args = ap.parse_args()
    a, b = Path(args.a), Path(args.b)
    rows = compare(outputs(a), outputs(b))
    out = a.parent
    (out / "comparison.json").write_text(json.dumps({"a": str(a), "b": str(b), "rows": rows}, indent=2) + "\n")
    lines = [f"# Same tokens? `{a}` vs `{b}`", "", "| dataset/method | turns | identical | tokens |", "|---|---|---|---|"]
    lines += [f"| {k} | {r['turns']} | {r['identical']} | {r.get('tokens', '-')} |" for k, r in rows.items()]
    (out / "comparison.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["turns"] is not None and r["identical"] == r["turns"] for r in rows.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
