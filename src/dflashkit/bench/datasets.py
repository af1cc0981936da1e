"""Benchmark datasets, all offline. Each item is a list of user turns (a later turn is asked after the method's
own previous answer).

`humaneval` (164, Z Lab's wrapper), `mt-bench` (80 x 2 turns), `mt-bench-t1` (first turns), `sharegpt-heldout`
(held out by conversation id, never trained on), `math` (word problems written for this repo), `speed-bench` (a
directory the user materialises; never bundled), or `--prompts FILE.jsonl`.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import DFlashError

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
        if not speed_bench_dir:
            raise DFlashError("speed-bench is not bundled (its licence forbids it): materialise it yourself and pass "
                              "--speed-bench-dir DIR (JSONL files with a 'prompt' or 'turns' field).")
        items = []
        for f in sorted(Path(speed_bench_dir).glob("*.jsonl")):
            for line in f.read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    items.append(list(rec["turns"]) if "turns" in rec else [rec["prompt"]])
    else:
        raise DFlashError(f"unknown dataset {name!r}; choose from humaneval, mt-bench, mt-bench-t1, sharegpt-heldout, "
                          "math, speed-bench, or pass --prompts FILE.jsonl.")
    return items[:limit] if limit else items


def load_prompt_file(path: str, limit: int | None = None) -> list[list[str]]:
    items = []
    for k, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DFlashError(f"{path} line {k + 1} is not JSON ({e}); one object per line.") from None
        if "prompt" in rec:
            items.append([rec["prompt"]])
        elif "messages" in rec:
            items.append([m["content"] for m in rec["messages"] if m.get("role") == "user"])
        else:
            raise DFlashError(f"{path} line {k + 1} has neither 'prompt' nor 'messages'.")
    return items[:limit] if limit else items
