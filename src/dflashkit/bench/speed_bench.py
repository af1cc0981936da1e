"""SPEED-Bench (NVIDIA, arXiv 2604.09557; `nvidia/SPEED-Bench`) read as NVIDIA publishes it.

Each record: `question_id, category, sub_category, turns, source, src_id, difficulty, multiturn`. A multi-turn
record is answered turn by turn (each later turn follows the method's own previous answer, `runner.run_item`).
The published files leave some turns as a placeholder (their sources' licences forbid redistribution): NVIDIA's
`specdec_bench` (`python prepare_data.py --dataset speed --config qualitative`) fetches them and writes
`data/speed/<config>/test.parquet`, the file (or directory) to pass here. A placeholder left is refused, never
benchmarked as text.

The dataset is never bundled and never downloaded here (its licence and this project's no-hub rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..data import read_jsonl
from ..errors import DFlashError

# The text specdec_bench puts at the start of every turn whose data must be fetched from its source.
PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"
PREPARE = ("prepare the data with NVIDIA's specdec_bench (Model-Optimizer/examples/specdec_bench: "
           "`python prepare_data.py --dataset speed --config qualitative`) and pass its data/speed/<config>/ "
           "directory")
UNCATEGORISED = "all"  # a record without a category (the older {"prompt"} / {"turns"} JSONL)


@dataclass
class SpeedBenchItem:
    """One SPEED-Bench question: its user turns, asked in order."""

    question_id: str
    category: str
    turns: list[str]


def _parquet_records(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DFlashError(f"{path} is parquet, which needs pyarrow: `pip install pyarrow` (or "
                          "`pip install dflashkit[bench]`).") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises its own error types for a damaged file
        raise DFlashError(f"cannot read {path} as parquet ({e}); {PREPARE}.") from None


def _item(rec: dict, where: str) -> SpeedBenchItem:
    if not isinstance(rec, dict):
        raise DFlashError(f"{where} is not a record; SPEED-Bench records are objects with 'turns' and 'category'.")
    turns = rec.get("turns", [rec["prompt"]] if "prompt" in rec else None)
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise DFlashError(f"{where} has no usable 'turns' (a non-empty list of non-empty strings).")
    qid = str(rec.get("question_id", where))
    for t in turns:
        if t.startswith(PLACEHOLDER):
            raise DFlashError(f"question {qid} ({rec.get('category', '?')}) still holds SPEED-Bench's placeholder "
                              f"('{PLACEHOLDER[:40]}...'): its text must be fetched from the source; {PREPARE}.")
    if rec.get("multiturn") is False and len(turns) > 1:
        raise DFlashError(f"question {qid} says multiturn: false but has {len(turns)} turns; the file is "
                          "inconsistent, prepare it again.")
    return SpeedBenchItem(qid, str(rec.get("category") or UNCATEGORISED), list(turns))


def read_speed_bench(path: str | Path) -> list[SpeedBenchItem]:
    """Every record of a SPEED-Bench file (.parquet or .jsonl) or of every such file under a directory."""
    root = Path(path)
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.suffix in (".parquet", ".jsonl"))
    elif root.is_file():
        files = [root]
    else:
        raise DFlashError(f"{root} does not exist; {PREPARE}.")
    if not files:
        raise DFlashError(f"{root} holds no .parquet or .jsonl file; {PREPARE}.")
    items = []
    for f in files:
        recs = _parquet_records(f) if f.suffix == ".parquet" else [r for _, r in read_jsonl(f)]
        items += [_item(r, f"{f.name} record {k + 1}") for k, r in enumerate(recs)]
    return items


def by_category(items: list[SpeedBenchItem], limit: int | None = None) -> dict[str, list[list[str]]]:
    """{category: items' turns}, categories in the order they first appear, at most `limit` items each."""
    out: dict[str, list[list[str]]] = {}
    for it in items:
        group = out.setdefault(it.category, [])
        if limit is None or len(group) < limit:
            group.append(it.turns)
    return out
