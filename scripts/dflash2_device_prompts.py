"""The prompts a lent GPU answers before it fine-tunes the bundled drafter into DFlash2: every ShareGPT first turn and
second turn (`build_prompts(second_turns=True)`) whose conversation is not yet in the committed data, at most
--max-tokens prompt tokens, written as gzipped JSONL with their token ids (the GPU needs no tokenizer work).

    .venv/bin/python scripts/dflash2_device_prompts.py --out .gpu2/prompts.jsonl.gz

See docs/training.md ("Continuing on a lent GPU") for the whole device procedure.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dflashkit.data import TokenShard, build_prompts  # noqa: E402
from dflashkit.loader import encode_chat, load_tokenizer, resolve_target_dir  # noqa: E402

log = logging.getLogger("prompts")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the .jsonl.gz to write")
    ap.add_argument("--data", default="data/smollm2-135m-instruct", help="committed shards: their ids are skipped")
    ap.add_argument("--max-tokens", type=int, default=320, help="longest prompt kept, in tokens")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    records, report = build_prompts(second_turns=True)
    have = {str(i) for f in Path(args.data).glob("*.npz") for i in TokenShard.load(f).ids}
    tok = load_tokenizer(resolve_target_dir(None))
    keep = []
    for r in records:
        if r["id"] not in have:
            ids = encode_chat(tok, r["messages"])
            if len(ids) <= args.max_tokens:
                keep.append({**r, "prompt_ids": ids})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(args.out, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
    kinds = collections.Counter(f"{r['split']}/{'second' if r['id'].endswith('/t2') else 'first'}" for r in keep)
    log.info("%d prompts (%s) of %d records; %d already answered", len(keep), dict(kinds), len(records), len(have))
    return 0


if __name__ == "__main__":
    sys.exit(main())
