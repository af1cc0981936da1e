"""Long prompts (2,000-4,000 tokens) for the policy sweep: a code file of HumanEval problems, finish the last one.

    .venv/bin/python bench/long_prompts.py --out bench/prompts/long.jsonl

Each prompt concatenates consecutive HumanEval problem statements (a realistic long code context) and asks for the
body of the last function; lengths are counted with the default target's chat template.
"""

from __future__ import annotations

import argparse
import json

from dflashkit.data import humaneval_prompts
from dflashkit.loader import encode_chat, load_tokenizer, resolve_target_dir


def build(tok, lo: int, start: int) -> tuple[str, int]:
    probs = [p["prompt"] for p in humaneval_prompts()]
    parts, k = [], start
    while True:
        parts.append(probs[k % len(probs)])
        k += 1
        text = ("Here is a Python module. Complete the body of its last function; answer with code only.\n\n"
                + "\n\n".join(parts))
        n = len(encode_chat(tok, text))
        if n >= lo:
            return text, n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/prompts/long.jsonl")
    args = ap.parse_args()
    tok = load_tokenizer(resolve_target_dir(None))
    rows = []
    for lo, start in ((2000, 0), (3800, 120), (2600, 40), (3200, 80)):  # --limit 2: the shortest and longest
        text, n = build(tok, lo, start)
        rows.append({"prompt": text, "tokens": n})
        print(n)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
