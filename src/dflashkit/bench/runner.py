"""`dflashkit bench`: runs every method on every dataset, one prompt at a time, and collects the report.

Per dataset and method (one record per turn): tau (bonus included), cumulative per-position acceptance
(1 + sum == tau), accepted-length histogram, tokens/s (decode), TPOT, TTFT, speedup vs `ar`, and
`mismatches_vs_ar` (greedy outputs that differ from our AR output, with how many part at a near-tie).
Optional sweeps: extra temperatures (rows `m@T<t>`) and batch sizes (throughput, prefill included).
"""

from __future__ import annotations

import logging
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import stats
from ..decode_config import DecodeConfig
from .datasets import load_prompt_file, load_sets
from ..invariance import mode as exactness_mode
from .exactness import calibrate_noise, mismatches
from .peers import BenchContext, EngineMethod, Turn, build_methods

log = logging.getLogger(__name__)


@dataclass
class BenchConfig:
    datasets: list[str]
    prompts_file: str | None = None
    limit: int | None = None
    max_new_tokens: int = 256
    block_sizes: list[int] = field(default_factory=lambda: [16])  # the plain `dflash` rows (and peers' blocks)
    temperature: float = 0.0
    temperatures: list[float] = field(default_factory=list)  # extra temperatures: ar/dflash rows named `m@T<t>`
    batch_sizes: list[int] = field(default_factory=list)  # throughput sweep of our rows (first turns, batched)
    sweep_rounds: int = 1  # times the sweep runs its chunks (`batch_sweep`)
    methods: list[str] = field(default_factory=lambda: ["ar", "dflash", "hf", "hf-lookup"])
    out: str = "bench/results/latest"
    target: str | None = None
    drafter: str | None = None
    dtype: str = "bfloat16"
    device: str = "cpu"
    backend: str = "auto"  # the target forward (`loader.make_target`)
    kernel: str = "auto"  # lean linears (`kernel_plan.choose`)
    quant: str = "auto"  # int4 / int4-a8: the GGUF's own codes (int4-a8: with 8-bit activations); auto: `--quant`
    speed_bench_dir: str | None = None
    noise_prompts: int = 8  # AR outputs (first turns) on which the near-tie bound is measured (`rounding_noise`)
    # the tree / lookup settings of the dflash-lookup, dflash-tree and lookup rows (the same defaults as the CLI)
    decode: DecodeConfig = field(default_factory=DecodeConfig.recommended)
    lookup_block_sizes: list[int] = field(default_factory=list)  # their block sizes (default: block_sizes)
    command: str = ""


# A peer's speculative rows against the same engine's plain decoding (speedup_vs_ar is against OUR ar).
OWN_AR = (("llamacpp-dflash", "llamacpp-server"), ("vllm-dflash", "vllm"), ("hf-lookup", "hf"))


def own_ar(method: str) -> str | None:
    """The row that is plain greedy decoding in `method`'s own engine (None for a peer without one here)."""
    for prefix, base in OWN_AR:
        if method.startswith(prefix) or method == base:
            return base
    if method.startswith("zlab"):
        return None  # Z Lab's package runs our target: its rows compare with our ar
    if method == "llamacpp":
        return method
    return "ar@" + method.split("@")[1] if "@" in method else "ar"


def aggregate(turns: list[Turn], span: int) -> dict:
    """tau over all cycles of all turns (`stats.py`), acceptance by position, histogram, speed."""
    cycles = [a for t in turns for a in t.accepted]
    tok = sum(t.new_tokens - 1 for t in turns if t.new_tokens > 1)
    dec = sum(t.decode_s for t in turns if t.new_tokens > 1)
    tps = tok / dec if dec > 0 else 0.0
    return {"tau": round(stats.tau(cycles), 4), "acceptance": [round(x, 4) for x in stats.acceptance(cycles, span)],
            "accepted_length_histogram": stats.histogram(cycles, span),
            "tokens_per_s": round(tps, 3), "tpot_ms": round(1000 / tps, 3) if tps else None,
            "ttft_ms": round(1000 * statistics.median(t.ttft_s for t in turns), 3) if turns else None,
            "turns": len(turns), "new_tokens": sum(t.new_tokens for t in turns)}


def run_item(method, item: list[str], tok, max_new: int) -> list[Turn]:
    """One item's turns, one prompt at a time; a later turn follows the method's OWN previous answer."""
    from ..loader import encode_chat

    turns: list[Turn] = []
    history: list[dict] = []
    for user in item:
        history.append({"role": "user", "content": user})
        t = method.run([encode_chat(tok, history)], max_new)[0]
        turns.append(t)
        history.append({"role": "assistant", "content": tok.decode(t.tokens, skip_special_tokens=True)})
    return turns


def turn_order(names: list[str], k: int) -> list[str]:
    """The order in which methods take their turns in the k-th round of a lockstep comparison (one step of each in
    turn): who goes first rotates, and the cycle's direction flips every round, so that over 2 x len(names) rounds
    each method follows each other method equally often. Why the direction: a method's step runs slower right after
    a heavy one (measured, batch 8: an AR step after a fixed-tree step, whose verify is 37 nodes wide, at 0.956x an
    AR step after an AR step); rotating alone keeps the cycle, so the default always followed the fixed tree and AR
    always followed the default, and the sweep charged the default ~4 % it did not cost."""
    cycle = list(names) if k % 2 == 0 else list(names)[::-1]
    r = (k // 2) % len(cycle)
    return cycle[r:] + cycle[:r]


@dataclass
class LockstepRun:
    """One method's share of a lockstep comparison (`run_lockstep`)."""

    tokens: int = 0  # tokens generated after each prompt's first
    decode_s: float = 0.0  # the time of the steps that generated them
    total_s: float = 0.0  # every step, the prefill's included
    accepted: list[int] = field(default_factory=list)  # accepted drafts per verify step, of the finished rows

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s else 0.0


def run_lockstep(streams: dict) -> dict[str, LockstepRun]:
    """streams: name -> an engine's `stream(...)` iterator over the same prompts. Every method advances IN LOCKSTEP:
    one step of each in turn (the order `turn_order` gives), each step timed on its own.

    Why lockstep: a shared host's speed drifts +-10 % over seconds (the same AR chunk ran 2.17 s, then 2.51 s), so
    even back-to-back chunks differed by as much as the 5 % in question; steps taken in turn see the same drift.
    Decode = the steps after the first yield (every prompt prefilled and its first token sampled)."""
    res = {m: LockstepRun() for m in streams}
    gens, started = dict(streams), set()
    while gens:
        for m in list(gens):
            t0 = time.perf_counter()
            step = next(gens[m], None)
            dt = time.perf_counter() - t0
            if step is None:
                del gens[m]
                continue
            r = res[m]
            r.total_s += dt
            if m in started:
                r.tokens += sum(len(o.tokens) for o in step)
                r.decode_s += dt
            started.add(m)
            r.accepted += [a for o in step if o.finished for a in o.stats.accepted]
    return res


def run_interleaved(methods: dict, items: list[list[str]], tok, max_new: int, desc: str) -> dict[str, list[Turn]]:
    """Every method on every item, item by item: each item runs under every method in turn before the next item.
    Why: a shared host's speed drifts by 10-30 % over minutes; methods run back to back over all items would each
    see a different stretch of it, and their ratio would measure the drift. Interleaved, drift hits all alike."""
    from tqdm import tqdm

    turns: dict[str, list[Turn]] = {m: [] for m in methods}
    for item in tqdm(items, desc=f"{desc} ({len(methods)} methods interleaved)", unit="prompt"):
        for name, method in methods.items():
            turns[name] += run_item(method, item, tok, max_new)
    return turns


def batch_sweep(methods: dict, prompts: list[list[int]], sizes: list[int], max_new: int, desc: str,
                rounds: int = 1) -> dict:
    """Throughput with N prompts decoded together: tokens generated / wall time (prefill included), per N and method.
    Returns {method: {N: {tokens_per_s, decode_tokens_per_s, tau, prompts, rounds}}}; the prompts are taken in
    order, in chunks of N, and every chunk is run by each method in turn (`turn_order`), `rounds` times over. Why
    interleaved: run one method's chunks after the other's, the host's drift between the two runs (~10 % within
    minutes here) read as a difference between the methods (the default at batch 8 measured 0.92-0.93x AR that way,
    0.998x interleaved). Why rounds: over 5-10 chunks of 8 the same code's ratio moved by +-5 % between runs
    (bench/results/batch-turns/)."""
    from tqdm import tqdm

    out: dict = {m: {} for m in methods}
    for n in sizes:
        chunks = [prompts[i:i + n] for i in range(0, len(prompts), n)]
        toks = {m: 0 for m in methods}
        wall = {m: 0.0 for m in methods}
        dec_toks = {m: 0 for m in methods}  # tokens after each row's first ...
        dec_wall = {m: 0.0 for m in methods}  # ... and the wall time after the chunk's prefill
        cycles: dict = {m: [] for m in methods}
        before = {m: meth.policy_stats() for m, meth in methods.items()}
        for k in tqdm(range(rounds * len(chunks)), desc=f"{desc} batch {n} ({len(methods)} methods interleaved)",
                      unit="batch"):
            chunk = chunks[k % len(chunks)]
            # rotated by the round: in each round a chunk's first method is another one than in the round before
            order, r = turn_order(list(methods), k), (k // len(chunks)) % len(methods)
            for m in order[r:] + order[:r]:
                t0 = time.perf_counter()
                turns = methods[m].run(chunk, max_new)
                dt = time.perf_counter() - t0
                wall[m] += dt
                toks[m] += sum(t.new_tokens for t in turns)
                # Why the steps apart: one long prompt's prefill can take most of a sweep (a 4,374-token prompt ~60 %
                # of 80 held-out prompts at batch 8) and its noise decide the total. The chunk's rows join together
                # after its whole prefill (`DecodeBatch.add`), so the last first token marks the prefill's end.
                dec_toks[m] += sum(max(t.new_tokens - 1, 0) for t in turns)
                dec_wall[m] += dt - max((t.ttft_s for t in turns), default=0.0)
                cycles[m] += [a for t in turns for a in t.accepted]
        for m, meth in methods.items():
            cell = {"tokens_per_s": round(toks[m] / wall[m], 3) if wall[m] else 0.0,
                    "decode_tokens_per_s": round(dec_toks[m] / dec_wall[m], 3) if dec_wall[m] > 0 else 0.0,
                    "tau": round(stats.tau(cycles[m]), 4), "prompts": len(prompts), "rounds": rounds}
            if before[m] is not None:  # what the adaptive policy chose at this batch size
                cell["policy"] = meth.policy_stats().since(before[m]).summary()
            out[m][str(n)] = cell
    return out


def load_models(cfg: BenchConfig) -> BenchContext:
    """Our target, tokenizer, drafter (None for a custom target without --drafter) and engine."""
    from ..engine import DFlashEngine
    from ..loader import load_models as load
    from ..sampling import SamplingParams

    # a custom target without --drafter has no drafter: the non-DFlash methods only
    target, tok, drafter, _ = load(cfg.target, cfg.drafter, dtype=cfg.dtype, device=cfg.device, backend=cfg.backend,
                                    kernel=cfg.kernel, quant=cfg.quant)
    engine = DFlashEngine(target, drafter, tokenizer=tok, config=DecodeConfig())
    return BenchContext(cfg, target, tok, drafter, engine, SamplingParams(temperature=cfg.temperature))


def run_dataset(ctx: BenchContext, methods: dict, items: list[list[str]], dname: str) -> tuple[dict, dict]:
    """Every method (and every extra temperature of our rows) on one dataset: (results, outputs)."""
    from ..sampling import SamplingParams

    cfg = ctx.cfg
    results, outputs = {}, {}
    before = {n: m.policy_stats() for n, m in methods.items() if isinstance(m, EngineMethod)}
    runs = run_interleaved(methods, items, ctx.tok, cfg.max_new_tokens, dname)
    for mname, method in methods.items():
        outputs[mname] = [t.tokens for t in runs[mname]]
        results[mname] = aggregate(runs[mname], max(getattr(method, "span", getattr(method, "block_size", 1)), 1))
        if before.get(mname) is not None:
            results[mname]["policy"] = method.policy_stats().since(before[mname]).summary()
    for t in cfg.temperatures:  # our rows, sampled: tau and speed at T > 0 (outputs differ by design)
        sampled = {}
        for mname, method in ((n, m) for n, m in methods.items() if isinstance(m, EngineMethod)):
            s = method.with_sampling(SamplingParams(temperature=t, seed=0), f"{mname}@T{t:g}")
            sampled[s.name] = s
        for sname, sturns in run_interleaved(sampled, items, ctx.tok, cfg.max_new_tokens, dname).items():
            results[sname] = aggregate(sturns, max(sampled[sname].span, 1))
    for mname, r in results.items():
        base = mname.split("@")[1] if "@" in mname else None
        ar = results["ar" if base is None else f"ar@{base}"]["tokens_per_s"]
        r["speedup_vs_ar"] = round(r["tokens_per_s"] / ar, 4) if ar else None
        own = results.get(own_ar(mname) or "", {}).get("tokens_per_s")
        r["speedup_vs_own_ar"] = round(r["tokens_per_s"] / own, 4) if own else None
        if cfg.temperature == 0 and base is None and mname != "ar":
            if ctx.target.batch_invariant:  # measured bitwise: no rounding noise to allow, any mismatch is a bug
                r["mismatches_vs_ar"] = mismatches(ctx.target, ctx.tok, items, outputs["ar"], outputs[mname])
                continue
            if "rounding_noise" not in results["ar"]:
                results["ar"]["rounding_noise"], _ = calibrate_noise(
                    ctx.target, ctx.tok, items, outputs["ar"], max(cfg.block_sizes), cfg.noise_prompts)
            r["mismatches_vs_ar"] = mismatches(ctx.target, ctx.tok, items, outputs["ar"], outputs[mname],
                                               results["ar"]["rounding_noise"])
    return results, outputs


def run_bench(cfg: BenchConfig) -> dict:
    from ..loader import encode_chat

    ctx = load_models(cfg)
    methods, skipped = build_methods(ctx, cfg.methods)
    for m, why in skipped.items():
        log.warning("skipping %s: %s", m, why)
    sets = {k: v for d in cfg.datasets for k, v in load_sets(d, cfg.limit, cfg.speed_bench_dir, ctx.tok).items()}
    if cfg.prompts_file:
        sets[Path(cfg.prompts_file).stem] = load_prompt_file(cfg.prompts_file, cfg.limit)
    ours = {n: m for n, m in methods.items() if isinstance(m, EngineMethod)}
    for method in ours.values():  # warm-up
        method.run([encode_chat(ctx.tok, "Hello")], 4)
    results, outputs, sweeps = {}, {}, {}
    for dname, items in sets.items():
        results[dname], outputs[dname] = run_dataset(ctx, methods, items, dname)
    if cfg.batch_sizes:
        sweeps["batch"] = {d: batch_sweep(ours, [encode_chat(ctx.tok, it[0]) for it in items], cfg.batch_sizes,
                                          cfg.max_new_tokens, d, cfg.sweep_rounds) for d, items in sets.items()}
    for method in methods.values():
        if hasattr(method, "close"):
            method.close()
    calibration = {n: m.engine.policy(m.config).acc.report() for n, m in ours.items() if m.policy_stats() is not None}
    return {
        "calibration": calibration,  # the adaptive rows' acceptance model: predicted vs observed (calibration.png)
        "results": results,
        # every method's greedy/sampled token ids per turn (item order), written beside results.json so a
        # mismatch can be audited later without regenerating
        "outputs": outputs,
        "sweeps": sweeps,
        "skipped": skipped,
        "settings": settings(cfg),
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "dtype": cfg.dtype, "device": cfg.device,
                    "backend": getattr(ctx.target, "engine_name", type(ctx.target).__name__),
                    "exactness": exactness_mode(ctx.target)},
        "versions": _versions(),
    }


def settings(cfg: BenchConfig) -> dict:
    """The run's settings as JSON (the decode config flattened: tree, tree_min_prob, draft_vocab, lookup...)."""
    import dataclasses

    out = {k: v for k, v in cfg.__dict__.items() if k != "decode"}
    out["decode"] = dataclasses.asdict(cfg.decode)
    return out


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for p in ("dflashkit", "torch", "transformers"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    return out
