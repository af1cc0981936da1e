"""Benchmark datasets, all offline. Each item is a list of user turns (a later turn is asked after the method's
own previous answer).

`humaneval` (164, Z Lab's wrapper), `mt-bench` (80 x 2 turns), `mt-bench-t1` (first turns), `sharegpt-heldout`
(held out by conversation id, never trained on), `math` (word problems written for this repo), `speed-bench`
(NVIDIA's files, which the user prepares; never bundled: `speed_bench.py`), `speed-bench-like` (categories built
offline: `categories.py`), or `--prompts FILE.jsonl`. The last two come as one set per category (`load_sets`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..data import read_jsonl
from ..errors import DFlashError
from .categories import speed_bench_like
from .speed_bench import PREPARE, by_category, read_speed_bench

HUMANEVAL_WRAPPER = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                     "```python\n{}\n```")
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


# ---- datasets: each item is a list of user turns ----------------------------------------------------------
def load_dataset(name: str, limit: int | None = None, speed_bench_dir: str | None = None) -> list[list[str]]:
    from .. import data

    if name == "humaneval":
        items = [[HUMANEVAL_WRAPPER.format(p["prompt"].strip())] for p in data.humaneval_prompts()]
    elif name == "mt-bench":
        items = [list(q["turns"]) for q in data.mtbench_questions()]
    elif name == "mt-bench-t1":  # first turns only (the 80 prompts the training acceptance bar is set on)
        items = [[q["turns"][0]] for q in data.mtbench_questions()]
    elif name == "sharegpt-heldout":
        records, _ = data.build_prompts()
        items = [[r["messages"][0]["content"]] for r in records if r["split"] == "heldout"]
    elif name == "math":
        path = Path(__file__).parents[1] / "datasets" / "math_word_problems.jsonl"  # written for this repo
        items = [[json.loads(line)["question"] + MATH_SUFFIX] for line in path.read_text().splitlines() if line.strip()]
    elif name == "speed-bench":
        items = [it.turns for it in read_speed_bench(_speed_bench_path(speed_bench_dir))]
    elif name == "speed-bench-like":
        raise DFlashError("speed-bench-like comes one set per category, sized with the target's tokenizer: "
                          "`load_sets('speed-bench-like', tok=...)` (`dflashkit bench --dataset speed-bench-like`).")
    else:
        raise DFlashError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}, or pass --prompts FILE.jsonl.")
    return items[:limit] if limit else items


DATASETS = ("humaneval", "mt-bench", "mt-bench-t1", "sharegpt-heldout", "math", "speed-bench", "speed-bench-like")


def _speed_bench_path(speed_bench_dir: str | None) -> str:
    if not speed_bench_dir:
        raise DFlashError(f"speed-bench is not bundled (its licence forbids it): {PREPARE}, as --speed-bench-dir "
                          "DIR. Without it, `--dataset speed-bench-like` runs categories built offline.")
    return speed_bench_dir


def check_dataset(name: str, speed_bench_dir: str | None = None) -> None:
    """Fails as `load_sets` would, before any weights load (SPEED-Bench's files are read: a placeholder is found)."""
    if name == "speed-bench":
        read_speed_bench(_speed_bench_path(speed_bench_dir))
    elif name != "speed-bench-like":
        load_dataset(name, 1)


def load_sets(name: str, limit: int | None = None, speed_bench_dir: str | None = None,
              tok=None) -> dict[str, list[list[str]]]:
    """{set name: items}: one set, or for `speed-bench` / `speed-bench-like` one per category, named
    `<dataset>/<category>` (`limit`: items per category)."""
    if name == "speed-bench":
        cats = by_category(read_speed_bench(_speed_bench_path(speed_bench_dir)), limit)
    elif name == "speed-bench-like":
        cats = speed_bench_like(tok, load_dataset("humaneval"), load_dataset("math"), limit)
    else:
        return {name: load_dataset(name, limit, speed_bench_dir)}
    return {f"{name}/{c}": items for c, items in cats.items()}


def load_prompt_file(path: str, limit: int | None = None) -> list[list[str]]:
    items = []
    for line, rec in read_jsonl(path):
        if isinstance(rec, dict) and "prompt" in rec:
            items.append([rec["prompt"]])
        elif isinstance(rec, dict) and "messages" in rec:
            items.append([m["content"] for m in rec["messages"] if m.get("role") == "user"])
        else:
            raise DFlashError(f"{path} line {line} has neither 'prompt' nor 'messages'.")
    return items[:limit] if limit else items
