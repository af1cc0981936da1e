"""Quick sweep of draft-tree settings: every config decodes the same prompts (256 new tokens, bf16, batch 1),
interleaved prompt by prompt so that machine drift hits all configs alike. Used to choose the CLI defaults
(`bench/results/tree-sweeps.md`); the full-set numbers come from `dflashkit bench` (`bench/results/tree-256`).

    .venv/bin/python bench/tree_sweep.py DATASET N START "NAME,BLOCK,TREE,LOOKUP,SKIP,PMIN,PER_N,DRAFT_VOCAB ..."
    .venv/bin/python bench/tree_sweep.py humaneval 20 100 "ar,1,0,0,0,0,0,0 D,16,20,16,3,0.03,4,16384"

The first config must be named `ar` (the reference for speedup and identical outputs)."""
import sys, time, torch
torch.set_num_threads(2)
from dflashkit.bench import load_dataset
from dflashkit.loader import load_target, load_default_drafter, encode_chat
from dflashkit import DecodeConfig, DFlashEngine
from dflashkit.lookup import LookupParams
ds, n, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
configs = [c.split(",") for c in sys.argv[4].split()]
t, tok = load_target(None, dtype="bfloat16")
dr, _ = load_default_drafter(t, tok)
engs = {}
for c in configs:
    name, b, tree, lk, skip, pmin, per, dv = c[0], *map(int, c[1:5]), float(c[5]), int(c[6]), int(c[7])
    lookup = LookupParams(max_tokens=lk, skip_drafter_n=skip, tokens_per_n=per)
    engs[name] = (DFlashEngine(t, dr, tok, config=DecodeConfig(lookup=lookup, tree=tree, tree_min_prob=pmin,
                                                                draft_vocab=dv)), b)
prompts = [encode_chat(tok, p[0]) for p in load_dataset(ds)[start:start + n]]
for name, (e, b) in engs.items():
    e.generate([prompts[0]], max_new_tokens=16, block_size=b)
res = {c[0]: {"tok": 0, "s": 0.0, "passes": 0} for c in configs}
outs = {}
for i, p in enumerate(prompts):
    for name, (e, b) in engs.items():
        a = time.perf_counter()
        g = e.generate([p], max_new_tokens=256, block_size=b)[0]
        dt = time.perf_counter() - a
        r = res[name]; r["tok"] += len(g.tokens); r["s"] += dt; r["passes"] += len(g.stats.accepted) + 1
        outs.setdefault(name, []).append(g.tokens)
ar = res["ar"]["tok"] / res["ar"]["s"]
for name, r in res.items():
    same = sum(x == y for x, y in zip(outs[name], outs["ar"]))
    print(f"{ds} {start}+{n} {name:22s} tau {r['tok']/r['passes']:.2f}  {r['tok']/r['s']:.1f} tok/s  {r['tok']/r['s']/ar:.2f}x  identical {same}/{len(prompts)}", flush=True)
