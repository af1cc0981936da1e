"""What the one-process A/B scripts over target and drafting steps share (`bench/hugepages.py`,
`bench/attention_ab.py`): their steps' names in a table and their chart of B / A step-time ratios."""

from __future__ import annotations


def step_label(key: str) -> str:
    """"target_w4" -> "target, 4 new tokens"; "draft_b16" -> "drafting, block 16"; "rows8x4" -> "target, 8 rows x 4
    new tokens"."""
    if key.startswith("rows"):
        rows, w = key[4:].split("x")
        return f"target, {rows} rows x {w} new tokens"
    return f"target, {key[8:]} new tokens" if key.startswith("target") else f"drafting, block {key[7:]}"


def plot_ratios(ms: dict, ylabel: str, ylim: tuple[float, float]):
    """A bar per step of its "ratio" (B / A step time), the 1.0 line drawn."""
    import matplotlib.pyplot as plt

    keys = list(ms)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(range(len(keys)), [ms[k]["ratio"] for k in keys])
    ax.axhline(1.0, color="gray", ls="--")
    ax.set_xticks(range(len(keys)), [k.replace("target_", "").replace("draft_", "draft ") for k in keys])
    ax.set_ylabel(ylabel)
    ax.set_ylim(*ylim)
    return fig


def ab_parser(doc: str, aa_help: str):
    """The arguments every such script takes: --out, --rounds, --context and --aa (its A/A control)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--context", type=int, default=176)
    ap.add_argument("--aa", action="store_true", help=aa_help)
    return ap


WIDTHS = [1, 2, 4, 8, 16]  # the target steps' new tokens (one row, after a --context-token prompt)
BLOCKS = [2, 4, 16]  # the drafting steps' blocks


def engine_steps(ctx: int, quant: str | None = None) -> tuple[dict, object]:
    """The default engine (default target, bundled drafter; `--quant` `quant`, None: the default) loaded now, and its
    steps by name ("target_w4", "draft_b16"), each run once (what is built lazily is built now, under the caller's
    settings); and its target."""
    import torch

    from dflashkit import DFlashEngine
    from dflashkit.loader import load_models

    from draft_block import step_ms, target_step

    with torch.inference_mode():
        target, tok, drafter, _ = load_models(dtype="bfloat16", quant=quant)
        eng = DFlashEngine(target, drafter, tokenizer=tok)
        fns = {f"target_w{w}": target_step(target, ctx, w) for w in WIDTHS}
        fns.update({f"draft_b{b}": step_ms(eng, b, 1, ctx) for b in BLOCKS})
        for fn in fns.values():
            fn()
    return fns, target


def ab_medians(keys: list, rounds: int, prepare, arms=("before", "after")) -> dict:
    """{key: {arm: median ms, "ratio": after / before}}: each round runs every key under both arms back to back, the
    arms' order alternating round by round, after 10 warm-up rounds. prepare(arm, key) switches to the arm and
    returns the callable to time (the switch itself is not timed)."""
    import statistics
    import time

    runs: dict = {(arm, k): [] for arm in arms for k in keys}
    for i in range(rounds + 10):
        for key in keys:
            for arm in (arms if i % 2 else arms[::-1]):
                fn = prepare(arm, key)
                t0 = time.perf_counter()
                fn()
                if i >= 10:
                    runs[arm, key].append((time.perf_counter() - t0) * 1e3)
    ms = {key: {arm: round(statistics.median(runs[arm, key]), 3) for arm in arms} for key in keys}
    for v in ms.values():
        v["ratio"] = round(v[arms[1]] / v[arms[0]], 3)
    return ms


def ab_table(title: str, mt: dict, arms: str, ms: dict) -> list[str]:
    """A before / after report's head and step table (`ab_medians`'s ms; mt: the result's meta)."""
    lines = [f"# {title} ({mt['date']}, {mt['cpu']}, {mt['threads']} threads)", "",
             f"`{mt['command']}`: {arms}; medians of {mt['rounds']} rounds, the arms back to back step by step, 1 row, "
             f"{mt['context']}-token context; target {mt['engine']}.", "",
             "| step | before, ms | after, ms | ratio |", "|---|---|---|---|"]
    for key, v in ms.items():
        lines.append(f"| {step_label(key)} | {v['before']:.2f} | {v['after']:.2f} | {v['ratio']:.3f} |")
    lines += ["", f"4-token verify / one-token step: before {ms['target_w4']['before'] / ms['target_w1']['before']:.3f}x"
              f", after {ms['target_w4']['after'] / ms['target_w1']['after']:.3f}x."]
    return lines
