"""What the one-process A/B scripts over target and drafting steps share (`bench/hugepages.py`,
`bench/attention_ab.py`): their steps' names in a table and their chart of B / A step-time ratios."""

from __future__ import annotations


def step_label(key: str) -> str:
    """"target_w4" -> "target, 4 new tokens"; "draft_b16" -> "drafting, block 16"."""
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
