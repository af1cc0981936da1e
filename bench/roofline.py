"""Every target step and drafting step as a fraction of this machine's roofline.

    .venv/bin/python bench/roofline.py --out bench/results/roofline [--repeats 3] [--context 176]

The machine: streaming read bandwidth (a 512 MB float32 tensor summed by torch's threads) and the peak
dot-product rate (torch's fp32 and bf16 GEMM at 1024 x 2048 x 2048; the faster one). The engine as `dflashkit
generate` runs it (the default target on its default kernels, bf16): a target step of `w` new tokens per row
(w = 1, 2, 4, 8, 16, 32) for `rows` rows (1, 2, 4, 8, 16) after a `--context`-token prompt, forward plus the LM head
over every new token, as a verify pass computes it; and the bundled drafter's drafting step (one block
of 16 per row) at 1-16 rows, and at one row with blocks of 2 and 4 (the blocks the step policy drafts). For each:
  bytes = the weights the step reads (codes, scales, the head) + the K/V it attends to (bf16);
  FLOPs = 2 x weight elements x tokens + the attention's 4 x context x heads x head_dim per token and layer;
  roofline = max(bytes / bandwidth, FLOPs / peak); fraction = roofline / measured (1.0 = at the roofline).
Medians of `--repeats` rounds, each timing the machine's probes and every step once (3 calls) back to back, so a
slow stretch of the host falls on all of them alike. Writes roofline.json, roofline.md and roofline.png into --out.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from dflashkit.measurements import cpu_has_bf16_units, cpu_name

from draft_block import median_ms  # noqa: E402  (bench/ is not a package)

WIDTHS, ROWS = [1, 2, 4, 8, 16, 32], [1, 2, 4, 8, 16]
SHORT_BLOCKS = [2, 4]  # drafting blocks timed at one row beside the drafter's own (16)


def machine_probes() -> dict:
    """The machine's probes, timed in the same rounds as the steps: a 512 MB float32 sum (streaming bandwidth) and
    torch's fp32 and bf16 GEMM at 1024 x 2048 x 2048 (the peak dot-product rate: the faster). The bf16 GEMM only
    where the CPU has a bf16 unit (AVX512-BF16, AMX): elsewhere torch runs it at ~0.3 GFLOP/s (an AMD EPYC with
    AVX2), ~30 s a call that can never be the faster."""
    a = torch.ones(128 * 1024 * 1024)
    probes = {"m_stream": a.sum}
    for dt in (torch.float32, torch.bfloat16) if cpu_has_bf16_units() else (torch.float32,):
        x, w = torch.randn(1024, 2048).to(dt), torch.randn(2048, 2048).to(dt)
        probes["m_" + str(dt).split(".")[1]] = lambda x=x, w=w: x @ w
    return probes


def machine(ms: dict) -> dict:
    """Streaming bandwidth (GB/s) and GEMM rates (GFLOP/s) from the probes' median ms."""
    rates = {k[2:]: 2 * 1024 * 2048 * 2048 / ms[k] / 1e6 for k in ("m_float32", "m_bfloat16") if k in ms}
    return {"bandwidth_gb_s": 128 * 1024 * 1024 * 4 / ms["m_stream"] / 1e6, "gemm_gflop_s": rates,
            "peak_gflop_s": max(rates.values())}


def nbytes(w) -> int:
    """Bytes a weight occupies as the kernels read it (a RowLinear's codes, scales and minima, or a tensor)."""
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    parts = w.packed() if w.path != "rowlinear" else (w.codes, w.scale, w.minimum)  # qlinear, plinear: packed
    return sum(t.numel() * t.element_size() for t in parts)


def target_shape(t) -> dict:
    """Weight bytes, weight elements (per token: 2 FLOPs each) and the attention's sizes of a lean target."""
    head = getattr(t, "head", None)
    ws = [w for ly in t._layers for w in (ly.wqkv, ly.wgu, ly.wo, ly.wdown)] + [t.lm_head_weight if head is None
                                                                                 else head]
    shape = lambda w: tuple(w.shape)  # noqa: E731 - RowLinear and tensors both have .shape [N, K]
    c = t.config
    return {"weight_bytes": sum(nbytes(w) for w in ws), "weight_elems": sum(a * b for a, b in map(shape, ws)),
            "layers": len(t._layers), "kv_heads": c.num_key_value_heads, "heads": c.num_attention_heads,
            "head_dim": getattr(c, "head_dim", c.hidden_size // c.num_attention_heads)}


def roofline(ms: float, bytes_: float, flops: float, m: dict) -> dict:
    floor = max(bytes_ / m["bandwidth_gb_s"] / 1e6, flops / m["peak_gflop_s"] / 1e6)
    return {"ms": round(ms, 3), "roofline_ms": round(floor, 3), "fraction": round(floor / ms, 3),
            "bound": "memory" if bytes_ / m["bandwidth_gb_s"] >= flops / m["peak_gflop_s"] else "compute"}


def target_steps(t, ctx: int, rows_list=ROWS, widths=WIDTHS) -> dict:
    """Each target step to time ("{rows}x{w}"): (the step, the bytes it reads, its FLOPs)."""
    s = target_shape(t)
    out = {}
    for rows in rows_list:
        cache = t.new_cache(rows, ctx + max(widths) + 1)
        ids = torch.randint(4, t.vocab_size, (rows, ctx + max(widths)), generator=torch.Generator().manual_seed(0))
        t.forward(ids[:, :ctx], torch.arange(ctx).expand(rows, ctx), cache, kv_len=ctx, taps=False)
        for w in widths:
            def step(w=w, ids=ids, cache=cache, pos=torch.arange(ctx, ctx + w).expand(rows, w)):
                h, _ = t.forward(ids[:, ctx:ctx + w], pos, cache, kv_len=ctx + w, taps=False)
                return t.logits(h)
            kv = rows * (ctx + w) * s["layers"] * 2 * s["kv_heads"] * s["head_dim"] * 2
            flops = 2 * s["weight_elems"] * rows * w + 4 * rows * w * (ctx + w) * s["heads"] * s["head_dim"] * s["layers"]
            out[f"{rows}x{w}"] = (step, s["weight_bytes"] + kv, flops)
    return out


def drafter_steps(target, tok, ctx: int, draft_vocab: int | None) -> dict:
    """The bundled drafter's drafting step (its block of B queries per row) at 1-16 rows, after a ctx-token prompt,
    and at one row its short blocks ("1_b{b}"): (the step, bytes, FLOPs). draft_vocab as `DecodeConfig.draft_vocab`
    (None: the drafter's default, as `dflashkit generate` runs it)."""
    from dflashkit import DecodeConfig, DFlashEngine
    from dflashkit.loader import load_default_drafter
    from dflashkit.proposers import DraftView

    drafter, _ = load_default_drafter(target, tok)
    eng = DFlashEngine(target, drafter, tokenizer=tok, config=DecodeConfig(policy="fixed", draft_vocab=draft_vocab))
    prop = eng.drafter_proposer(eng.config)
    B, dc = prop.block_size, drafter.config
    params = sum(p.numel() for n, p in drafter.named_parameters() if "embed" not in n)
    head = prop.head if prop.head is not None else target.lm_head_weight
    out = {}
    for rows in ROWS:
        batch = eng.new_batch(ctx + 64)
        prompt = torch.randint(4, target.vocab_size, (ctx,), generator=torch.Generator().manual_seed(1)).tolist()
        batch.add([eng.sequence(i, prompt, max_new_tokens=8) for i in range(rows)])
        view = DraftView(batch.anchor, batch.start, max(batch.starts), batch.seqs, batch.starts)
        prop.propose(batch.dstate, view)  # ingests the prompt's features once; later calls only draft

        def cost(b: int, rows=rows) -> tuple:  # a block of b per row: bytes, FLOPs
            bytes_ = params * 2 + nbytes(head) + rows * (ctx + b) * dc.num_hidden_layers * 2 * \
                dc.num_key_value_heads * dc.head_dim * 2
            flops = 2 * (params * b + head.shape[0] * head.shape[1] * (b - 1)) * rows + \
                4 * rows * b * (ctx + b) * dc.num_attention_heads * dc.head_dim * dc.num_hidden_layers
            return bytes_, flops
        out[str(rows)] = (lambda st=batch.dstate, v=view: prop.propose(st, v), *cost(B))
        if rows == 1:  # also the short blocks the step policy drafts (`propose(block=...)`)
            for b in SHORT_BLOCKS:
                out[f"1_b{b}"] = (lambda st=batch.dstate, v=view, b=b: prop.propose(st, v, block=b), *cost(b))
    return out


def timed(steps: dict, repeats: int) -> tuple[dict, dict]:
    """The machine (`machine`) and every step's median ms as a fraction of its roofline: `repeats` rounds, each
    timing the machine's probes and every step back to back, so a slow stretch of the host falls on all of them
    alike, not on the few timed then."""
    ms = median_ms({**machine_probes(), **{k: v[0] for k, v in steps.items()}}, repeats, inner=3)
    m = machine(ms)
    return m, {k: roofline(ms[k], bytes_, flops, m) for k, (_, bytes_, flops) in steps.items()}


def main() -> int:
    from dflashkit.kernels import isa, set_isa
    from dflashkit.loader import load_target
    from dflashkit.bench.report import write_result

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/roofline")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--context", type=int, default=176)
    ap.add_argument("--isa", default="auto", choices=("auto", "avx512bf16", "avx2"),
                    help="rowlinear's instruction path (`kernels.set_isa`): A/B runs of one host's paths")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="the drafting step's draft vocabulary (default: the drafter's own, 16,384 ids for the bundled "
                         "one, as `dflashkit generate` drafts; 0: the full vocabulary)")
    ap.add_argument("--quant", default="auto", choices=("auto", "none", "int4", "int4-a8"),
                    help="the target's kernels, as `dflashkit generate --quant` (default: %(default)s, the default "
                         "target: int4 on AVX512-BF16 CPUs)")
    args = ap.parse_args()
    set_isa(args.isa)  # before the target loads: the plan (and the bits) follow the path
    target, tok = load_target(dtype="bfloat16", quant=args.quant)
    with torch.inference_mode():
        t_steps, d_steps = target_steps(target, args.context), drafter_steps(target, tok, args.context, args.draft_vocab)
        m, res = timed({**{f"t{k}": v for k, v in t_steps.items()}, **{f"d{k}": v for k, v in d_steps.items()}},
                       args.repeats)
        steps, drafts = ({k[1:]: v for k, v in res.items() if k[0] == c} for c in "td")
    one = steps["1x1"]["ms"]
    meta = {"command": "bench/roofline.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
            "cpu": cpu_name(), "threads": torch.get_num_threads(), "engine": getattr(target, "engine_name", "?"),
            "rowlinear_isa": isa(), "context": args.context, "draft_vocab": args.draft_vocab, **m, **target_shape(target)}
    res = {"meta": meta, "target": steps, "drafter": drafts,
           "verify4_over_step1": round(steps["1x4"]["ms"] / one, 3),
           "draft1_over_step1": round(drafts["1"]["ms"] / one, 3),
           **{f"draft1_b{b}_over_step1": round(drafts[f"1_b{b}"]["ms"] / one, 3) for b in SHORT_BLOCKS}}
    write_result(args.out, "roofline", res, report(res), plot)
    print(report(res))
    return 0


def report(res: dict) -> str:
    mt, t = res["meta"], res["target"]
    lines = [f"# Steps against this machine's roofline ({mt['date']}, {mt['cpu']}, {mt['threads']} threads)", "",
             f"`{mt['command']}`. Engine {mt['engine']} (rowlinear: {mt['rowlinear_isa']}), bf16, context "
             f"{mt['context']} tokens. Measured: streaming read {mt['bandwidth_gb_s']:.1f} GB/s; GEMM "
             + ", ".join(f"{k} {v:.1f}" for k, v in mt["gemm_gflop_s"].items()) + " GFLOP/s (peak: the faster). "
             f"The target reads {mt['weight_bytes'] / 1e6:.1f} MB of weights per step.", "",
             "Target step (forward + LM head over every new token): ms, and roofline / measured.", "",
             "| rows \\ new tokens per row | " + " | ".join(map(str, WIDTHS)) + " |",
             "|---|" + "---|" * len(WIDTHS)]
    for r in ROWS:
        lines.append(f"| {r} | " + " | ".join(f"{t[f'{r}x{w}']['ms']:.1f} ({t[f'{r}x{w}']['fraction']:.0%})"
                                               for w in WIDTHS) + " |")
    d = res["drafter"]
    vocab = {None: "its default draft vocabulary", 0: "the full vocabulary"}.get(mt.get("draft_vocab"),
                                                                               f"a {mt.get('draft_vocab')}-id vocabulary")
    lines += ["", f"Drafting step (the bundled drafter, one block per row, {vocab}): ms, and roofline / measured.", "",
              "| rows | " + " | ".join(map(str, ROWS)) + " |", "|---|" + "---|" * len(ROWS),
              "| ms (fraction) | " + " | ".join(f"{d[str(r)]['ms']:.1f} ({d[str(r)]['fraction']:.0%})" for r in ROWS)
              + " |", "", f"A 4-token verify costs **{res['verify4_over_step1']:.2f}x** a one-token step; a drafting "
              f"step at one row **{res['draft1_over_step1']:.2f}x**"
              + "".join(f", at block {b} **{res[f'draft1_b{b}_over_step1']:.2f}x** ({d[f'1_b{b}']['ms']:.2f} ms)"
                        for b in SHORT_BLOCKS if f"draft1_b{b}_over_step1" in res) + "."]
    return "\n".join(lines) + "\n"


def plot(res: dict):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for r in ROWS:
        ax[0].plot(WIDTHS, [res["target"][f"{r}x{w}"]["fraction"] for w in WIDTHS], "o-", label=f"{r} rows")
        ax[1].plot(WIDTHS, [res["target"][f"{r}x{w}"]["ms"] / res["target"]["1x1"]["ms"] for w in WIDTHS], "o-",
                   label=f"{r} rows")
    ax[0].axhline(0.5, color="grey", ls="--", lw=1)
    ax[0].set(xscale="log", xlabel="new tokens per row", ylabel="roofline / measured", title="target step")
    ax[1].set(xscale="log", yscale="log", xlabel="new tokens per row", ylabel="x a one-token step at one row",
              title="target step cost")
    ax[0].legend(fontsize=8)
    return fig


if __name__ == "__main__":
    sys.exit(main())
