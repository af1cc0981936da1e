"""Benchmark reports: results.json (+ outputs.json.gz, every turn's token ids), results.md and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

def markdown(report: dict) -> str:
    lines = ["| dataset | method | tau | tokens/s | vs our ar | vs its engine's ar | TPOT ms | TTFT ms | "
             "mismatches vs ar (near-ties) |", "|---|---|---|---|---|---|---|---|---|"]
    for d, rows in report["results"].items():
        for m, r in rows.items():
            mm = r.get("mismatches_vs_ar")
            mm_s = f"{mm['count']} ({mm['near_ties']})" if mm else "-"
            own = r.get("speedup_vs_own_ar")
            own_s = "-" if own is None else f"{own:.2f}"
            lines.append(f"| {d} | {m} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f} | "
                         f"{own_s} | {r['tpot_ms'] or 0:.1f} | {r['ttft_ms'] or 0:.0f} | {mm_s} |")
    mach = report.get("machine", {})
    if mach.get("exactness") == "bitwise":
        lines.append(f"\nexactness: bitwise ({mach.get('backend')}, {mach.get('dtype')}: verified logits equal "
                     "one-token logits on this machine, measured at start-up), so every mismatch vs ar of our rows "
                     "is a bug; peer rows (hf, llamacpp, vllm, zlab) run other kernels or weights.")
    for d, rows in report["results"].items():
        nz = rows.get("ar", {}).get("rounding_noise")
        if nz:
            lines.append(f"\nnear-tie bound, {d}: 2 ulps of the top logit, or the rounding noise measured on "
                         f"{nz['prompts']} "
                         f"AR outputs (block {nz['block_size']} vs one token per forward: max top-2 gap change "
                         f"{nz['max']:g} over {nz['positions']} positions, argmax flips {nz['flips']}, largest gap "
                         f"that flipped {nz['max_gap_flipped']:g})")
    for d, rows in report.get("sweeps", {}).get("batch", {}).items():
        sizes = sorted({int(n) for r in rows.values() for n in r})
        lines += ["", f"Throughput (tokens/s, prefill included; decode: the tokens after each row's first over the "
                  f"time after the chunk's prefill) vs batch size, {d} first turns:", "",
                  "| method | " + " | ".join(f"batch {n}" for n in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
        for m, r in rows.items():
            lines.append(f"| {m} | " + " | ".join(_batch_cell(r[str(n)]) for n in sizes) + " |")
        lines += _adaptive_ratios(rows, sizes)
    pol = [(d, m, r["policy"]) for d, rows in report["results"].items() for m, r in rows.items() if "policy" in r]
    if pol:
        lines += ["", "What the adaptive policy chose (per step: run the drafter or not; draft nodes verified per "
                  "row):", "",
                  "| dataset | method | steps | drafter ran | draft nodes per row | mean verify width |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {d} | {m} | {p['steps']} | {100 * p['drafter_fraction']:.0f} % | {p['nodes_per_row']:.2f} | "
                  f"{p['mean_width']:.2f} |" for d, m, p in pol]
    lines += _category_table(report)
    for m, why in report.get("skipped", {}).items():
        lines.append(f"\nskipped `{m}`: {why}")
    return "\n".join(lines) + "\n"


def categories(report: dict) -> dict[str, dict[str, dict]]:
    """{dataset: {category: rows}} of the sets that came one per category (`datasets.load_sets`: `name/category`)."""
    out: dict[str, dict[str, dict]] = {}
    for d, rows in report["results"].items():
        if "/" in d:
            name, cat = d.split("/", 1)
            out.setdefault(name, {})[cat] = rows
    return out


def _category_table(report: dict) -> list[str]:
    lines = []
    for name, cats in categories(report).items():
        lines += ["", f"Per category, {name} (tau with the bonus token; accepted at k: the share of verify steps "
                  "that kept at least k drafts):", "",
                  "| category | turns | method | tau | accepted at 1 / 2 / 3 / 4 | tokens/s | vs ar | "
                  "differing from ar |", "|---|---|---|---|---|---|---|---|"]
        for cat, rows in cats.items():
            for m, r in rows.items():
                acc = " / ".join(f"{a:.2f}" for a in (r["acceptance"] + [0.0] * 4)[:4]) if m != "ar" else "-"
                mm = r.get("mismatches_vs_ar")
                lines.append(f"| {cat} | {r['turns']} | {m} | {r['tau']:.2f} | {acc} | {r['tokens_per_s']:.1f} | "
                             f"{r['speedup_vs_ar']:.2f} | {mm['count'] if mm else '-'} |")
    return lines


def _adaptive_ratios(rows: dict, sizes: list[int]) -> list[str]:
    """Each adaptive row's throughput / the better of ar and its fixed twin, per batch size (the policy's bar)."""
    out = []
    for m, r in rows.items():
        twin = m.removesuffix("-adaptive") + "-fixed"
        if m.endswith("-adaptive") and twin in rows and "ar" in rows:
            best = [max(rows["ar"][str(n)]["tokens_per_s"], rows[twin][str(n)]["tokens_per_s"]) for n in sizes]
            out.append(f"| {m} / max(ar, fixed) | " + " | ".join(
                f"{r[str(n)]['tokens_per_s'] / b:.3f}" if b else "-" for n, b in zip(sizes, best)) + " |")
    return out


def _batch_cell(r: dict) -> str:
    p = r.get("policy")
    extra = f", drafter {100 * p['drafter_fraction']:.0f} %, {p['nodes_per_row']:.1f} nodes/row" if p else ""
    dec = f"decode {r['decode_tokens_per_s']:.1f}, " if "decode_tokens_per_s" in r else ""
    return f"{r['tokens_per_s']:.1f} ({dec}tau {r['tau']:.2f}{extra})"


def plots(report: dict, out: Path) -> list[Path]:
    """Every plot the report's rows allow: speedup.png, acceptance.png, block_size.png, batch.png, temperature.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, draw in (("speedup", _speedup), ("acceptance", _acceptance), ("block_size", _block_size),
                       ("batch", _batch), ("policy", _policy), ("calibration", _calibration),
                       ("temperature", _temperature), ("categories", _categories)):
        fig = draw(plt, report)
        if fig is not None:
            fig.tight_layout()
            paths.append(out / f"{name}.png")
            fig.savefig(paths[-1], dpi=120)
            plt.close(fig)
    return paths


def _speedup(plt, report: dict):
    res = report["results"]
    fig, ax = plt.subplots(figsize=(8, 4))
    datasets = list(res)
    methods = sorted({m for r in res.values() for m in r})
    w = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        ax.bar([k + i * w for k in range(len(datasets))],
               [res[d].get(m, {}).get("speedup_vs_own_ar", res[d].get(m, {}).get("speedup_vs_ar")) or 0
                for d in datasets], width=w, label=m)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([k + w * (len(methods) - 1) / 2 for k in range(len(datasets))], datasets)
    ax.set_ylabel("speedup vs the same engine's AR")
    ax.legend(fontsize=8)
    return fig


def _acceptance(plt, report: dict):
    fig, ax = plt.subplots(figsize=(8, 4))
    for d, rows in report["results"].items():
        for m, r in rows.items():
            if r["acceptance"]:
                ax.plot(range(1, len(r["acceptance"]) + 1), r["acceptance"], marker="o",
                        label=f"{d} {m} (tau {r['tau']:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("cumulative acceptance")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    return fig


def _block_size(plt, report: dict):
    """tau and tokens/s vs block size (ar is block size 1), one line per dataset and temperature."""
    curves = {}
    for d, rows in report["results"].items():
        for m, r in rows.items():
            name, _, temp = m.partition("@")
            if name == "ar" or (name.startswith("dflash-b") and name[len("dflash-b"):].isdigit()):
                b = 1 if name == "ar" else int(name[len("dflash-b"):])
                curves.setdefault(f"{d}" + (f" @{temp}" if temp else ""), []).append((b, r["tau"], r["tokens_per_s"]))
    if not any(len(c) > 2 for c in curves.values()):
        return None
    return _two_panels(plt, curves, "block size (1 = ar)", ("tau (tokens per target pass)", "tokens/s"))


def _two_panels(plt, curves: dict, xlabel: str, ylabels: tuple[str, str]):
    """curves: {label: [(x, left y, right y)]} -> two side-by-side panels, log2 x."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label, pts in curves.items():
        pts.sort()
        for i, a in enumerate(axes):
            a.plot([p[0] for p in pts], [p[1 + i] for p in pts], marker="o", label=label)
    for a, yl in zip(axes, ylabels):
        a.set_xscale("log", base=2)
        a.set_xlabel(xlabel)
        a.set_ylabel(yl)
    axes[0].legend(fontsize=7)
    return fig


def _batch(plt, report: dict):
    batch = report.get("sweeps", {}).get("batch", {})
    if not batch:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    for d, rows in batch.items():
        for m, r in rows.items():
            sizes = sorted(int(n) for n in r)
            ax.plot(sizes, [r[str(n)]["tokens_per_s"] for n in sizes], marker="o", label=f"{d} {m}")
    ax.set_xlabel("batch size (prompts decoded together)")
    ax.set_ylabel("throughput, tokens/s")
    ax.legend(fontsize=8)
    return fig


def _policy(plt, report: dict):
    """The adaptive policy's chosen draft size (nodes verified per row per step) and the observed tokens per pass,
    against batch size."""
    rows = [(d, m, r) for d, ms in report.get("sweeps", {}).get("batch", {}).items() for m, r in ms.items()
            if any("policy" in x for x in r.values())]
    if not rows:
        return None
    curves = {f"{d} {m}": [(int(n), x["policy"]["nodes_per_row"], x["tau"]) for n, x in r.items()]
              for d, m, r in rows}
    return _two_panels(plt, curves, "batch size", ("draft nodes verified per row per step",
                                                    "tau (tokens per target pass)"))


def _calibration(plt, report: dict):
    """The adaptive policy's acceptance model: the drafter's claimed path probability vs the observed acceptance
    (left), and each verified node's predicted acceptance, as predicted before verification, vs observed (right)."""
    cal = {m: c for m, c in report.get("calibration", {}).items() if sum(c.get("predicted_nodes", [])) > 0}
    if not cal:
        return None
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(10, 4))
    for m, c in cal.items():
        pts = [(x, y) for x, y, n in zip(c["claimed"], c["observed"], c["drafted"]) if n >= 10]
        a0.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        pts = [(x, y) for x, y, n in zip(c["predicted_mean"], c["predicted_observed"], c["predicted_nodes"]) if n >= 10]
        a1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    for a, xl in ((a0, "drafter's path probability (claimed)"), (a1, "predicted acceptance (calibrated)")):
        a.plot([0, 1], [0, 1], color="grey", linestyle=":")
        a.set_xlabel(xl)
        a.set_ylabel("observed acceptance")
        a.set_xlim(0, 1)
        a.set_ylim(0, 1)
    a1.legend(fontsize=7)
    return fig


def _temperature(plt, report: dict):
    res = report["results"]
    if not any("@" in m for rows in res.values() for m in rows):
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [(d, m) for d, rows in res.items() for m in rows if m.startswith("dflash-b")]
    ax.bar(range(len(labels)), [res[d][m]["speedup_vs_ar"] or 0 for d, m in labels])
    ax.set_xticks(range(len(labels)), [f"{d}\n{m}" for d, m in labels], fontsize=7, rotation=30)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("speedup vs ar at the same temperature")
    return fig


def _categories(plt, report: dict):
    """Per category: tau (left) and speedup vs ar (right) of every method but ar, one bar each."""
    cats = {f"{c}" if len(categories(report)) == 1 else f"{n}/{c}": rows
            for n, cs in categories(report).items() for c, rows in cs.items()}
    if not cats:
        return None
    methods = [m for m in dict.fromkeys(m for rows in cats.values() for m in rows) if m != "ar"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    w = 0.8 / max(1, len(methods))
    for ax, key, label in ((axes[0], "tau", "tau (tokens per verify step)"), (axes[1], "speedup_vs_ar", "vs our AR")):
        for i, m in enumerate(methods):
            ax.bar([k + i * w for k in range(len(cats))], [rows.get(m, {}).get(key) or 0 for rows in cats.values()],
                   width=w, label=m)
        ax.set_xticks([k + w * (len(methods) - 1) / 2 for k in range(len(cats))], list(cats), rotation=45,
                      ha="right", fontsize=8)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    return fig


def write_markdown(report: dict, out: Path, footer: str = "") -> None:
    """DIR/results.md: the command, then `markdown(report)` (and `footer`)."""
    (out / "results.md").write_text(f"# Benchmark\n\n`{report['settings'].get('command', '')}`\n\n"
                                    + markdown(report) + footer)


def write_report(report: dict, out_dir: str | Path) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    import gzip

    report = dict(report)
    outputs = report.pop("outputs", None)
    if outputs is not None:  # token ids of every turn: bulky, so compressed and out of results.json
        with gzip.open(out / "outputs.json.gz", "wt") as f:
            json.dump(outputs, f)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, out)
    plots(report, out)
    return report


def write_result(out_dir: str | Path, stem: str, res: dict, text: str, plot) -> None:
    """A bench script's result in `out_dir` (created): `res` as STEM.json, `text` as STEM.md, and the matplotlib
    figure `plot(res)` returns as STEM.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / f"{stem}.md").write_text(text)
    fig = plot(res)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=100)
    plt.close(fig)
