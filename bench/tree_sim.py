"""What would other draft shapes buy with the SAME drafter? A replay on the AR outputs of a bench run.

Greedy decoding is deterministic, so the committed text of every speculative method is the AR output (up to
bf16 near-ties). This script anchors a block at every response position of each AR output (one drafter
forward per 64 anchors, the training-path forward, which equals the inference forward per anchor), records
the rank of the true next tokens in the drafter's logits at each block slot, and then walks the path greedy
decoding takes for each draft shape:
  - chain:          the plain DFlash block (argmax per slot);
  - tree N:         the N most frequent rank paths (Medusa-style static tree of the drafter's top-k per slot),
                    chosen on the first half of the prompts and scored on the second half;
  - + lookup K:     a K-token n-gram lookup branch beside it (`dflashkit.lookup`, max_n 4);
  - lookup K alone.
tau = tokens / target passes along that path. It needs no timing, so it may run beside other work.

    .venv/bin/python bench/tree_sim.py bench/results/acceptance-256 --out bench/results/tree-sim
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

import torch
from tqdm import tqdm

from dflashkit.bench import load_dataset
from dflashkit.loader import encode_chat, load_default_drafter, load_target
from dflashkit.lookup import LookupParams, propose
from dflashkit.objective import build_blocks, training_forward

MAX_RANK = 8  # ranks >= this count as "not in the tree"


@torch.inference_mode()
def ranks_of_truth(target, drafter, prompt: list[int], out: list[int], chunk: int = 64) -> list[list[int]]:
    """For every anchor position t of the response: the rank of token t+j in slot j's draft logits, j = 1..B-1."""
    B = drafter.config.block_size
    ids = torch.tensor(prompt + out)[None]
    S, P = ids.shape[1], len(prompt)
    taps = target.taps(ids)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, P:] = True
    rows = []
    for lo in range(P, S - 1, chunk):
        a = torch.arange(lo, min(lo + chunk, S - 1))[None]
        blocks = build_blocks(ids, loss_mask, a, torch.ones_like(a, dtype=torch.bool), B,
                              drafter.config.mask_token_id, 7.0)
        h = training_forward(drafter, target.embed, taps, blocks).view(a.shape[1], B, -1)[:, 1:]
        logits = target.logits(h).float()  # [N, B-1, V]
        pos = a[0][:, None] + torch.arange(1, B)
        truth = ids[0, pos.clamp(max=S - 1)]
        rank = (logits > logits.gather(-1, truth[..., None])).sum(-1)
        rows += torch.where(pos < S, rank, 10 ** 6).tolist()
    return rows


def walk(rec: dict, accepted) -> tuple[int, int]:
    """(tokens, target passes) along greedy decoding's path; accepted(rec, i, t) -> drafts accepted at anchor t."""
    P, S = rec["P"], len(rec["ids"])
    t, passes, toks = P, 0, 1  # the first token comes from the prefill
    while t < S - 1:
        a = accepted(rec, t - P, t)
        passes += 1
        t += a + 1
        toks += a + 1
    return min(toks, S - P), passes


def chain(rec, i, t):
    a = 0
    for r in rec["ranks"][i]:
        if r != 0:
            break
        a += 1
    return a


def static_tree(recs: list[dict], nodes: int) -> set:
    counts = collections.Counter()
    for rec in recs:
        for ranks in rec["ranks"]:
            path = ()
            for r in ranks:
                if r >= MAX_RANK:
                    break
                path += (r,)
                counts[path] += 1
    return set(sorted(counts, key=lambda p: (-counts[p], len(p)))[:nodes])


def in_tree(tree: set):
    def f(rec, i, t):
        path, a = (), 0
        for r in rec["ranks"][i]:
            path += (r,)
            if path not in tree:
                break
            a += 1
        return a
    return f


def with_lookup(base, k: int):
    params = LookupParams(max_tokens=k)

    def f(rec, i, t):
        ids = rec["ids"]
        prop, _ = propose(ids[: t + 1], params)
        b = 0
        for j, x in enumerate(prop):
            if t + 1 + j >= len(ids) or ids[t + 1 + j] != x:
                break
            b += 1
        return max(base(rec, i, t) if base else 0, b)
    return f


def tau(recs, fn) -> float:
    tok = passes = 0
    for rec in recs:
        a, b = walk(rec, fn)
        tok, passes = tok + a, passes + b
    return round(tok / passes, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a bench result directory with outputs.json.gz (ar outputs, first turns)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    outputs = json.loads(gzip.open(Path(args.run) / "outputs.json.gz", "rt").read())
    target, tok = load_target(dtype="bfloat16")
    drafter, _ = load_default_drafter(target, tok)
    target.set_taps(drafter.config.target_layer_ids)
    report = {"source": args.run, "dtype": "bfloat16", "results": {}}
    for dname, methods in outputs.items():
        items = load_dataset(dname, args.limit)
        recs = []
        for item, out in tqdm(list(zip(items, methods["ar"])), desc=dname, unit="prompt"):
            prompt = encode_chat(tok, [{"role": "user", "content": item[0]}])
            recs.append({"P": len(prompt), "ids": prompt + out, "ranks": ranks_of_truth(target, drafter, prompt, out)})
        cal, ev = recs[: len(recs) // 2], recs[len(recs) // 2:]
        rows = {"chain (all prompts)": tau(recs, chain), "chain": tau(ev, chain)}
        for k in (8, 15):
            rows[f"lookup {k} alone"] = tau(ev, with_lookup(None, k))
            rows[f"chain + lookup {k}"] = tau(ev, with_lookup(chain, k))
        for n in (15, 32, 64):
            tree = static_tree(cal, n)
            rows[f"tree {n}"] = tau(ev, in_tree(tree))
            rows[f"tree {n} + lookup 8"] = tau(ev, with_lookup(in_tree(tree), 8))
        # how often the true token is within the drafter's top-k at each slot, given all earlier slots were right
        cover = {}
        for k in (1, 2, 4, 8):
            hits = [0] * 15
            for rec in recs:
                for ranks in rec["ranks"]:
                    for j, r in enumerate(ranks[:15]):
                        if r >= k:
                            break
                        hits[j] += 1
            n_anchor = sum(len(r["ranks"]) for r in recs)
            cover[f"top{k}"] = [round(h / n_anchor, 4) for h in hits[:6]]
        report["results"][dname] = {"prompts": len(recs), "eval_prompts": len(ev), "tau": rows,
                                    "cumulative_topk_coverage_slots_1_6": cover}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tree_sim.json").write_text(json.dumps(report, indent=1))
    lines = [f"# Draft shapes replayed on the AR outputs of `{args.run}` (bundled drafter, bf16)", "",
             "tau along greedy decoding's path; trees are chosen on the first half of the prompts and scored on "
             "the second half (`chain (all prompts)` is the plain block on every prompt).", ""]
    names = list(next(iter(report["results"].values()))["tau"])
    lines += ["| draft shape | " + " | ".join(report["results"]) + " |", "|---" * (len(report["results"]) + 1) + "|"]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(str(r["tau"][n]) for r in report["results"].values()) + " |")
    lines += ["", "Cumulative top-k coverage (the true tokens of slots 1..j all within the drafter's top k), slots 1-6:", ""]
    for d, r in report["results"].items():
        for k, v in r["cumulative_topk_coverage_slots_1_6"].items():
            lines.append(f"- {d} {k}: {v}")
    (out / "tree_sim.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
