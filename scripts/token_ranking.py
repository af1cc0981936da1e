"""Write a drafter's token_ranking.json: the target ids of its training responses, most frequent first.

With it, `--draft-vocab N` drafts over the N most frequent ids only (the drafter reads N rows of the target's
LM head instead of all of them; verification still uses the full vocabulary, so output stays exact).

    .venv/bin/python scripts/token_ranking.py data/smollm2-135m-instruct src/dflashkit/drafters/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from dflashkit.checkpoint import read_config, save_token_ranking
from dflashkit.data import load_shards
from dflashkit.draft_vocab import token_counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("data", help="directory of train-*.npz shards (`dflashkit data generate`)")
    ap.add_argument("drafter", help="drafter directory to write token_ranking.json into")
    ap.add_argument("--keep", type=int, default=16384, help="ids to rank (the most frequent)")
    args = ap.parse_args()
    counts = token_counts(load_shards(Path(args.data), "train"), read_config(args.drafter).vocab_size)
    order = np.argsort(-counts, kind="stable")[: args.keep]
    covered = counts[order].sum() / counts.sum()
    src = f"{args.data}: {int(counts.sum())} train response tokens; the top {args.keep} ids cover {covered:.4%}"
    print(save_token_ranking(args.drafter, order.tolist(), src), "-", src)


if __name__ == "__main__":
    main()
