"""Write a drafter's corpus.npz: the target's own answers (its training responses) for the corpus lookup.

With it, where a sequence's own n-gram lookup finds no match of 2 tokens or more, the default system copies the
continuation the target chose after the same words in those answers (`dflashkit.corpus`); verification decides,
so output stays exact. Use answers the target generated (`dflashkit data generate`), the prompts left out.

    .venv/bin/python scripts/lookup_corpus.py data/smollm2-135m-instruct src/dflashkit/drafters/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dflashkit.checkpoint import CORPUS
from dflashkit.corpus import Corpus
from dflashkit.data import load_shards


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("data", help="directory of train-*.npz shards (`dflashkit data generate`)")
    ap.add_argument("drafter", help="drafter directory to write corpus.npz into")
    args = ap.parse_args()
    corpus = Corpus.from_shards(load_shards(Path(args.data), "train"))
    path = Path(args.drafter) / CORPUS
    corpus.save(path)
    print(f"{path}: {len(corpus.answers())} answers, {corpus.size} tokens with borders, "
          f"{path.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
