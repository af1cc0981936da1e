"""`dflashkit bench`: tau, speed and exactness side by side with autoregressive decoding and the peers.

Datasets (all offline): `humaneval` (164, Z Lab's wrapper), `mt-bench` (80 x 2 turns: the second turn is asked
after the method's own first answer), `sharegpt-heldout` (held out by conversation id, never trained on),
`math` (word problems written for this repo), `speed-bench` (a directory the user materialises; never bundled),
or `--prompts FILE.jsonl`.

Methods: `ar` (our engine, block size 1: the baseline of `speedup_vs_ar`), `dflash` (our engine + drafter at
each block size, named `dflash-b{B}`), `hf` (transformers greedy `generate`), `hf-lookup` (prompt-lookup
decoding). A method whose optional dependency is absent is skipped with a message in the results.

Metrics per dataset and method (one record per turn): tau (bonus included), cumulative per-position
acceptance (1 + sum == tau), accepted-length histogram, tokens/s (decode), TPOT, TTFT, speedup vs `ar`, and
`mismatches_vs_ar`: greedy outputs that differ from our AR output, with how many part at a near-tie.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import DFlashError

log = logging.getLogger(__name__)

HUMANEVAL_WRAPPER = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


# ---- datasets: each item is a list of user turns ----------------------------------------------------------
def load_dataset(name: str, limit: int | None = None, speed_bench_dir: str | None = None) -> list[list[str]]:
    from . import data

    if name == "humaneval":
        items = [[HUMANEVAL_WRAPPER.format(p["prompt"].strip())] for p in data.humaneval_prompts()]
    elif name == "mt-bench":
        items = [list(q["turns"]) for q in data.mtbench_questions()]
    elif name == "mt-bench-t1":  # first turns only (the 80 prompts the training acceptance bar is set on)
        items = [[q["turns"][0]] for q in data.mtbench_questions()]
    elif name == "sharegpt-heldout":
        records, _ = data.build_prompts()
        items = [[r["messages"][0]["content"]] for r in records if r["split"] == "heldout"]
    elif name == "math":
        path = Path(__file__).parent / "datasets" / "math_word_problems.jsonl"  # written for this repo
        items = [[json.loads(line)["question"] + MATH_SUFFIX] for line in path.read_text().splitlines() if line.strip()]
    elif name == "speed-bench":
        if not speed_bench_dir:
            raise DFlashError("speed-bench is not bundled (its licence forbids it): materialise it yourself and pass "
                              "--speed-bench-dir DIR (JSONL files with a 'prompt' or 'turns' field).")
        items = []
        for f in sorted(Path(speed_bench_dir).glob("*.jsonl")):
            for line in f.read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    items.append(list(rec["turns"]) if "turns" in rec else [rec["prompt"]])
    else:
        raise DFlashError(f"unknown dataset {name!r}; choose from humaneval, mt-bench, mt-bench-t1, sharegpt-heldout, "
                          "math, speed-bench, or pass --prompts FILE.jsonl.")
    return items[:limit] if limit else items


def load_prompt_file(path: str, limit: int | None = None) -> list[list[str]]:
    items = []
    for k, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DFlashError(f"{path} line {k + 1} is not JSON ({e}); one object per line.") from None
        if "prompt" in rec:
            items.append([rec["prompt"]])
        elif "messages" in rec:
            items.append([m["content"] for m in rec["messages"] if m.get("role") == "user"])
        else:
            raise DFlashError(f"{path} line {k + 1} has neither 'prompt' nor 'messages'.")
    return items[:limit] if limit else items


# ---- metric arithmetic ------------------------------------------------------------------------------------
@dataclass
class Turn:
    """One generated turn of one method."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # per verify cycle (empty for non-speculative peers)
    new_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0


def aggregate(turns: list[Turn], block_size: int) -> dict:
    """tau over all cycles of all turns; acceptance[j] = share of cycles accepting >= j+1 drafts."""
    cycles = [a for t in turns for a in t.accepted]
    n = len(cycles)
    tau = sum(a + 1 for a in cycles) / n if n else 1.0
    acc = [sum(a > j for a in cycles) / n for j in range(block_size - 1)] if n else []
    hist = [0] * block_size
    for a in cycles:
        hist[a] += 1
    tok = sum(t.new_tokens - 1 for t in turns if t.new_tokens > 1)
    dec = sum(t.decode_s for t in turns if t.new_tokens > 1)
    tps = tok / dec if dec > 0 else 0.0
    return {"tau": round(tau, 4), "acceptance": [round(x, 4) for x in acc], "accepted_length_histogram": hist,
            "tokens_per_s": round(tps, 3), "tpot_ms": round(1000 / tps, 3) if tps else None,
            "ttft_ms": round(1000 * statistics.median(t.ttft_s for t in turns), 3) if turns else None,
            "turns": len(turns), "new_tokens": sum(t.new_tokens for t in turns)}


def near_tie_threshold(top1: float, dtype: torch.dtype) -> float:
    """Largest top-2 gap that still counts as a tie of rounding: 2 ulps of the top logit in half precision,
    1e-3 in float32 (the project's convention), 1e-9 in float64."""
    if dtype in (torch.bfloat16, torch.float16):
        mant = 7 if dtype == torch.bfloat16 else 10
        return 2 * 2.0 ** (math.floor(math.log2(max(abs(top1), 1e-30))) - mant)
    return 1e-3 if dtype == torch.float32 else 1e-9


@torch.no_grad()
def rounding_noise(target, prompt: list[int], tokens: list[int], block: int, seed: int = 0) -> list[dict]:
    """How far the verify path's rounding moves the target's top-2 gap, measured on one greedy sequence.

    prompt + tokens is an AR greedy output. The target runs over it twice: one token per forward (AR's path), and
    in blocks of `block` tokens that advance 1-4 positions at a time (a verify step at tau ~2: the rows past the
    accepted prefix are overwritten by the next block, as in DFlash). Per generated position: AR's top-2 gap,
    the same two tokens' gap on the block path, |difference| ("noise") and whether the block path's argmax
    differs ("flip"). Both paths are exact in exact arithmetic; everything measured here is rounding.
    """
    import random

    rng = random.Random(seed)
    P, n = len(prompt), len(tokens)
    seq = torch.tensor([prompt + tokens], device=target.device)
    rows: dict[str, dict[int, torch.Tensor]] = {"one": {}, "block": {}}
    for path, got in rows.items():
        cache = target.new_cache(1, P + n + block + 1)
        h, _ = target.forward(seq[:, :P], torch.arange(P, device=seq.device)[None], cache, kv_len=P, taps=False)
        got[0] = target.logits(h[:, -1:]).float()[0, 0]  # predicts tokens[0]; the same prefill on both paths
        p = P  # position of the next forward's first token (for blocks: the anchor of a verify step)
        while p - P < n - 1:
            q = 1 if path == "one" else min(block, P + n - p)
            h, _ = target.forward(seq[:, p:p + q], torch.arange(p, p + q, device=seq.device)[None], cache,
                                  kv_len=p + q, taps=False)
            logits = target.logits(h).float()[0]
            keep = 1 if path == "one" else min(rng.randint(1, 4), q)  # accepted + bonus rows of a verify step
            for j in range(keep):  # row j at position p + j predicts tokens[p - P + j + 1]
                got.setdefault(p - P + j + 1, logits[j])
            p += keep
    out = []
    for i in range(n):
        a, b = rows["one"][i], rows["block"][i]
        t1, t2 = a.topk(2).indices.tolist()
        ga, gb = float(a[t1] - a[t2]), float(b[t1] - b[t2])
        out.append({"gap": ga, "noise": abs(ga - gb), "flip": int(b.argmax()) != t1})
    return out


def noise_summary(rows: list[dict]) -> dict:
    """The measured size of a rounding tie: `max` is the bound `mismatches` uses."""
    noise = sorted(r["noise"] for r in rows)
    return {"positions": len(rows), "max": round(noise[-1], 6) if noise else 0.0,
            "p99": round(noise[min(len(noise) - 1, int(0.99 * (len(noise) - 1) + 0.5))], 6) if noise else 0.0,
            "flips": sum(r["flip"] for r in rows),
            "max_gap_flipped": round(max((r["gap"] for r in rows if r["flip"]), default=0.0), 6)}


# ---- methods ----------------------------------------------------------------------------------------------
class EngineMethod:
    def __init__(self, engine, block_size: int, sampling, name: str):
        self.engine, self.block_size, self.sampling, self.name = engine, block_size, sampling, name
        self.span = engine.depth_span(block_size)  # 1 + the deepest draft position (block or lookup branch)
        self.speculative = block_size > 1 or engine.lookup.enabled

    def run(self, prompt_ids: list[list[int]], max_new: int) -> list[Turn]:
        gens = self.engine.generate(prompt_ids, sampling=self.sampling, max_new_tokens=max_new, block_size=self.block_size)
        return [Turn(g.tokens, list(g.stats.accepted) if self.speculative else [], g.stats.new_tokens,
                     g.stats.ttft_s, g.stats.decode_s) for g in gens]


class HFMethod:
    """transformers `generate` (greedy or sampled), optionally with prompt-lookup decoding."""

    def __init__(self, target, sampling, name: str, lookup: int | None = None, eos: int | None = None):
        self.model, self.sampling, self.name, self.lookup, self.eos = target.model, sampling, name, lookup, eos

    def run(self, prompt_ids: list[list[int]], max_new: int) -> list[Turn]:
        out = []
        for p in prompt_ids:
            ids = torch.tensor([p], device=self.model.device)
            kw = dict(max_new_tokens=max_new, do_sample=not self.sampling.greedy, eos_token_id=self.eos,
                      pad_token_id=self.eos if self.eos is not None else 0)
            if not self.sampling.greedy:
                kw.update(temperature=self.sampling.temperature, top_p=self.sampling.top_p, top_k=self.sampling.top_k or None)
            if self.lookup:
                kw["prompt_lookup_num_tokens"] = self.lookup
            t0 = time.perf_counter()
            # An explicit all-ones mask: SmolLM2's pad id equals EOS, and without it generate() masks prompt tokens.
            first = self.model.generate(ids, attention_mask=torch.ones_like(ids), **{**kw, "max_new_tokens": 1})
            t1 = time.perf_counter()
            full = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            t2 = time.perf_counter()
            toks = full[0, len(p):].tolist()
            # decode time = full run minus one prefill-and-first-token (measured separately)
            out.append(Turn(toks, [], len(toks), t1 - t0, max(t2 - t1 - (t1 - t0), 1e-9)))
            del first
        return out


class ZLabMethod:
    """Z Lab's reference `dflash` package running OUR drafter (Z Lab format, full vocabulary) in its own
    virtualenv, through `zlab_worker.py` over a pipe. Greedy only."""

    def __init__(self, python: str, target_dir: str, drafter_dir: str, dtype: str, eos: int, block_size: int, name: str):
        import subprocess

        self.block_size, self.name = block_size, name
        src = str(Path(__file__).resolve().parents[1])
        self.proc = subprocess.Popen([python, "-m", "dflashkit.zlab_worker", target_dir, drafter_dir, dtype, str(eos)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env={**__import__("os").environ, "PYTHONPATH": src})
        first = json.loads(self.proc.stdout.readline() or '{"error": "worker died"}')
        if "error" in first:
            raise DFlashError(f"the Z Lab package could not load the drafter: {first['error']}")

    def run(self, prompt_ids: list[list[int]], max_new: int) -> list[Turn]:
        out = []
        for p in prompt_ids:
            self.proc.stdin.write(json.dumps({"ids": p, "max_new_tokens": max_new, "block_size": self.block_size}) + "\n")
            self.proc.stdin.flush()
            r = json.loads(self.proc.stdout.readline())
            # Z Lab logs a+1 per cycle (cut at a stop); our `accepted` holds a.
            out.append(Turn(r["tokens"], [a - 1 for a in r["acceptance_lengths"]], len(r["tokens"]), r["ttft_s"], r["decode_s"]))
        return out

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def vllm_python() -> str | None:
    """The interpreter of the vLLM virtualenv (scripts/vllm-env.sh)."""
    return peer_python("vllm")


def vllm_env(python: str, threads: int) -> dict:
    """Environment for a vLLM CPU worker: in-process engine (drafts can be recorded), `threads` OpenMP threads
    bound to cores 0..threads-1 (vLLM's default binds one core per socket), its bundled Intel OpenMP preloaded."""
    import os

    lib = Path(python).resolve().parents[1] / "lib"
    iomp = lib / "libiomp5.so"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    return env


class VLLMMethod:
    """vLLM 0.32 (CPU build, its own virtualenv) through `vllm_worker.py` over a pipe: plain greedy decoding
    (`drafter_dir=None`) or DFlash with OUR drafter in the Z Lab format. Greedy only, one prompt at a time."""

    def __init__(self, python: str, target_dir: str, drafter_dir: str | None, dtype: str, block_size: int,
                 name: str, threads: int):
        import subprocess

        import tempfile

        self.block_size, self.name = (block_size if drafter_dir else 1), name
        self.log = Path(tempfile.gettempdir()) / f"dflashkit-{name}.log"  # vLLM's own messages
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen([python, "-m", "dflashkit.vllm_worker", target_dir, drafter_dir or "-",
                                          dtype, str(block_size - 1)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, env=vllm_env(python, threads))
        first = json.loads(self.proc.stdout.readline() or '{"error": "the vLLM worker died while loading"}')
        if "error" in first:
            raise DFlashError(f"vLLM could not start ({name}): {first['error']} (log: {self.log})")

    def request(self, ids: list[int], max_new: int, trace: bool = False, time_first: bool = True) -> dict:
        self.proc.stdin.write(json.dumps({"ids": ids, "max_new_tokens": max_new, "trace": trace,
                                          "time_first": time_first}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise DFlashError(f"the vLLM worker ({self.name}) died; see {self.log}")
        return json.loads(line)

    def run(self, prompt_ids: list[list[int]], max_new: int) -> list[Turn]:
        out = []
        for p in prompt_ids:
            r = self.request(p, max_new)
            out.append(Turn(r["tokens"], accepted_from_counters(r["num_drafts"], r["accepted_per_pos"])
                            if self.block_size > 1 else [], len(r["tokens"]), r["ttft_s"], r["decode_s"]))
        return out

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def accepted_from_counters(num_drafts: int, per_pos: list[int]) -> list[int]:
    """vLLM's counters -> one accepted count per verification: per_pos[j] counts the drafts whose position j was
    accepted (acceptance is a prefix, so that means >= j+1 accepted); exactly k = per_pos[k-1] - per_pos[k]."""
    ge = [num_drafts] + list(per_pos) + [0]  # ge[k] = drafts with >= k accepted
    return [k for k in range(len(ge) - 1) for _ in range(ge[k] - ge[k + 1])]


class LlamaCppMethod:
    """llama.cpp greedy decoding of the same GGUF (optional: `scripts/llamacpp-build.sh`). It runs the
    quantized weights with its own kernels, so its greedy text may part from ours beyond near-ties."""

    def __init__(self, gguf: str, eos: int | None, name: str = "llamacpp"):
        from llama_cpp import Llama

        self.name, self.eos = name, eos
        self.llm = Llama(model_path=gguf, n_ctx=4096, n_threads=torch.get_num_threads(), verbose=False)

    def run(self, prompt_ids: list[list[int]], max_new: int) -> list[Turn]:
        out = []
        for p in prompt_ids:
            toks: list[int] = []
            t0 = time.perf_counter()
            t_first = t0
            # repeat_penalty 1.0: llama.cpp's default (1.1) would not be greedy decoding
            for tok in self.llm.generate(p, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
                if not toks:
                    t_first = time.perf_counter()
                toks.append(int(tok))
                if tok == self.eos or len(toks) >= max_new:
                    break
            out.append(Turn(toks, [], len(toks), t_first - t0, time.perf_counter() - t_first))
        return out


def peer_python(peer: str) -> str | None:
    """The interpreter of a peer's own virtualenv: $DFLASHKIT_<PEER>_PYTHON, else .venv-<peer>/ in the repo."""
    import os

    env = os.environ.get(f"DFLASHKIT_{peer.upper()}_PYTHON")
    if env:
        return env
    cand = Path(__file__).resolve().parents[2] / f".venv-{peer}" / "bin" / "python"
    return str(cand) if cand.exists() else None


def zlab_python() -> str | None:
    """The interpreter of the Z Lab virtualenv (scripts/zlab-env.sh)."""
    return peer_python("zlab")


def run_items(method, items: list[list[str]], tok, max_new: int, desc: str) -> tuple[list[Turn], list[list[int]]]:
    """Every item's turns, one prompt at a time; a later turn follows the method's OWN previous answer."""
    from tqdm import tqdm

    from .loader import encode_chat

    turns: list[Turn] = []
    texts: list[list[int]] = []
    for item in tqdm(items, desc=desc, unit="prompt"):
        history: list[dict] = []
        for user in item:
            history.append({"role": "user", "content": user})
            t = method.run([encode_chat(tok, history)], max_new)[0]
            turns.append(t)
            texts.append(t.tokens)
            history.append({"role": "assistant", "content": tok.decode(t.tokens, skip_special_tokens=True)})
    return turns, texts


def batch_sweep(method: "EngineMethod", prompts: list[list[int]], sizes: list[int], max_new: int, desc: str) -> dict:
    """Throughput with N prompts decoded together: tokens generated / wall time (prefill included), per N.
    Returns {N: {tokens_per_s, tau, prompts}}; the prompts are taken in order, in chunks of N."""
    from tqdm import tqdm

    out = {}
    for n in sizes:
        chunks = [prompts[i:i + n] for i in range(0, len(prompts), n)]
        toks, cycles, wall = 0, [], 0.0
        for chunk in tqdm(chunks, desc=f"{desc} batch {n}", unit="batch"):
            t0 = time.perf_counter()
            turns = method.run(chunk, max_new)
            wall += time.perf_counter() - t0
            toks += sum(t.new_tokens for t in turns)
            cycles += [a for t in turns for a in t.accepted]
        tau = sum(a + 1 for a in cycles) / len(cycles) if cycles else 1.0
        out[str(n)] = {"tokens_per_s": round(toks / wall, 3) if wall else 0.0, "tau": round(tau, 4),
                       "prompts": len(prompts)}
    return out


# ---- the runner -------------------------------------------------------------------------------------------
@dataclass
class BenchConfig:
    datasets: list[str]
    prompts_file: str | None = None
    limit: int | None = None
    max_new_tokens: int = 256
    block_sizes: list[int] = field(default_factory=lambda: [16])
    temperature: float = 0.0
    batch_size: int = 1
    temperatures: list[float] = field(default_factory=list)  # extra temperatures: ar/dflash rows named `m@T<t>`
    batch_sizes: list[int] = field(default_factory=list)  # throughput sweep for ar/dflash (first turns, batched)
    methods: list[str] = field(default_factory=lambda: ["ar", "dflash", "hf", "hf-lookup"])
    out: str = "bench/results/latest"
    target: str | None = None
    drafter: str | None = None
    dtype: str = "bfloat16"
    device: str = "cpu"
    speed_bench_dir: str | None = None
    noise_prompts: int = 8  # AR outputs (first turns) on which the near-tie bound is measured (`rounding_noise`)
    # methods `dflash-lookup` (DFlash block + n-gram lookup branch, `tree.py`), `dflash-tree` (a drafter tree
    # without lookup) and `lookup` (lookup alone):
    tree: int = 0  # drafter tree nodes of dflash-lookup and dflash-tree (0 = the chain)
    tree_min_prob: float = 0.0  # ... minus the paths the drafter gives less than this probability
    draft_vocab: int | None = 0  # dflash-lookup / dflash-tree: draft over the N most frequent ids (0 = all, None = the drafter's default)
    lookup_per_n: int = 0  # lookup tokens per matched suffix token (0 = always `lookup`)
    lookup: int = 8  # longest lookup proposal
    lookup_skip: int = 2  # skip the drafter when the lookup matched a suffix this long (0 = always draft)
    lookup_block_sizes: list[int] = field(default_factory=list)  # DFlash block sizes with lookup (default: block_sizes)
    command: str = ""


def run_bench(cfg: BenchConfig) -> dict:
    from .checkpoint import default_draft_vocab, load_drafter
    from .engine import DFlashEngine
    from .loader import encode_chat, load_default_drafter, load_target, parse_dtype
    from .lookup import LookupParams
    from .sampling import SamplingParams

    sampling = SamplingParams(temperature=cfg.temperature)
    target, tok = load_target(cfg.target, dtype=cfg.dtype, device=cfg.device)
    if cfg.drafter:
        drafter = load_drafter(cfg.drafter, dtype=parse_dtype(cfg.dtype), device=cfg.device)
    elif cfg.target is None:
        drafter, _ = load_default_drafter(target, tok)
    else:  # the bundled drafter is SmolLM2's: a custom target without --drafter runs the non-DFlash methods only
        drafter = None
    engine = DFlashEngine(target, drafter, tokenizer=tok)
    methods, skipped = {}, {}
    k = cfg.lookup
    for m in cfg.methods:
        if m == "ar":
            methods["ar"] = EngineMethod(engine, 1, sampling, "ar")
        elif m == "dflash" and drafter is None:
            skipped[m] = "no drafter for this target: pass --drafter DIR"
        elif m == "dflash":
            for b in cfg.block_sizes:
                methods[f"dflash-b{b}"] = EngineMethod(engine, b, sampling, f"dflash-b{b}")
        elif m in ("dflash-lookup", "dflash-tree") and drafter is None:
            skipped[m] = "no drafter for this target: pass --drafter DIR"
        elif m in ("dflash-lookup", "dflash-tree", "lookup"):
            if m == "dflash-tree" and cfg.tree < 1:
                raise DFlashError("method dflash-tree needs --tree N (drafter tree nodes, N >= 1).")
            kk = 0 if m == "dflash-tree" else k
            lk = DFlashEngine(target, drafter, tokenizer=tok, tree=cfg.tree if m != "lookup" else 0,
                              tree_min_prob=cfg.tree_min_prob if m != "lookup" else 0.0,
                              draft_vocab=default_draft_vocab(drafter, cfg.draft_vocab) if m != "lookup" else 0,
                              lookup=LookupParams(max_tokens=kk, skip_drafter_n=cfg.lookup_skip if m != "lookup" else 0,
                                                  tokens_per_n=cfg.lookup_per_n))
            for b in (cfg.lookup_block_sizes or cfg.block_sizes) if m != "lookup" else [1]:
                tree = f"-tree{cfg.tree}" + (f"p{cfg.tree_min_prob:g}" if cfg.tree_min_prob else "") if cfg.tree else ""
                name = (f"dflash-b{b}{tree}" + (f"-lookup{kk}" if kk else "")
                        if b > 1 else f"lookup{k}")
                methods[name] = EngineMethod(lk, b, sampling, name)
        elif m == "hf":
            methods["hf"] = HFMethod(target, sampling, "hf", eos=tok.eos_token_id)
        elif m == "hf-lookup":
            methods["hf-lookup"] = HFMethod(target, sampling, "hf-lookup", lookup=10, eos=tok.eos_token_id)
        elif m == "zlab":
            py = zlab_python()
            if py is None:
                skipped[m] = "no Z Lab virtualenv: run scripts/zlab-env.sh (or set DFLASHKIT_ZLAB_PYTHON)"
                continue
            from .loader import BUNDLED_DRAFTER, resolve_target_dir
            if drafter is None or drafter.d2t is not None:
                skipped[m] = ("no drafter for this target: pass --drafter DIR" if drafter is None else
                              "the Z Lab package drafts over the full vocabulary; this drafter has a reduced one")
                continue
            for b in cfg.block_sizes:
                methods[f"zlab-b{b}"] = ZLabMethod(py, str(resolve_target_dir(cfg.target)),
                                                   cfg.drafter or str(BUNDLED_DRAFTER), cfg.dtype,
                                                   tok.eos_token_id, b, f"zlab-b{b}")
        elif m == "llamacpp":
            from .loader import default_gguf
            gguf = cfg.target if cfg.target and str(cfg.target).endswith(".gguf") else (None if cfg.target else default_gguf())
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                skipped[m] = "llama-cpp-python is not installed: run scripts/llamacpp-build.sh (AMX-off build)"
                continue
            if gguf is None:
                skipped[m] = "llamacpp needs a .gguf target"
                continue
            methods["llamacpp"] = LlamaCppMethod(str(gguf), tok.eos_token_id)
        elif m in ("vllm", "vllm-dflash"):
            py = vllm_python()
            if py is None:
                skipped[m] = "no vLLM virtualenv: run scripts/vllm-env.sh (or set DFLASHKIT_VLLM_PYTHON)"
                continue
            if cfg.temperature != 0:
                skipped[m] = "the vLLM peers run greedy only"
                continue
            from .loader import BUNDLED_DRAFTER, resolve_target_dir
            tdir = str(resolve_target_dir(cfg.target))
            if m == "vllm":
                methods["vllm"] = VLLMMethod(py, tdir, None, cfg.dtype, 1, "vllm", torch.get_num_threads())
            elif drafter is None or drafter.d2t is not None:
                skipped[m] = ("no drafter for this target: pass --drafter DIR" if drafter is None else
                              "vLLM needs the Z Lab export of a full-vocabulary drafter")
            else:
                for b in cfg.block_sizes:
                    methods[f"vllm-dflash-b{b}"] = VLLMMethod(py, tdir, cfg.drafter or str(BUNDLED_DRAFTER), cfg.dtype,
                                                              b, f"vllm-dflash-b{b}", torch.get_num_threads())
        else:
            raise DFlashError(f"unknown method {m!r}; choose from ar, dflash, dflash-lookup, dflash-tree, lookup, hf, hf-lookup, llamacpp, "
                              "zlab, vllm, vllm-dflash.")
    for m, why in skipped.items():
        log.warning("skipping %s: %s", m, why)
    if "ar" not in methods:
        methods = {"ar": EngineMethod(engine, 1, sampling, "ar"), **methods}
    sets = {d: load_dataset(d, cfg.limit, cfg.speed_bench_dir) for d in cfg.datasets}
    if cfg.prompts_file:
        sets[Path(cfg.prompts_file).stem] = load_prompt_file(cfg.prompts_file, cfg.limit)
    for method in [m for m in methods.values() if isinstance(m, EngineMethod)]:  # warm-up
        method.run([encode_chat(tok, "Hello")], 4)
    results: dict = {}
    outputs: dict = {}
    engine_methods = {n: m for n, m in methods.items() if isinstance(m, EngineMethod)}
    for dname, items in sets.items():
        results[dname], outputs[dname] = {}, {}
        for mname, method in methods.items():
            turns, outputs[dname][mname] = run_items(method, items, tok, cfg.max_new_tokens, f"{dname}/{mname}")
            results[dname][mname] = aggregate(turns, max(getattr(method, "span", getattr(method, "block_size", 1)), 1))
        for t in cfg.temperatures:  # the same engine rows, sampled: tau and speed at T > 0 (outputs differ by design)
            for mname, method in engine_methods.items():
                name = f"{mname}@T{t:g}"
                sampled = EngineMethod(method.engine, method.block_size, SamplingParams(temperature=t, seed=0), name)
                turns, _ = run_items(sampled, items, tok, cfg.max_new_tokens, f"{dname}/{name}")
                results[dname][name] = aggregate(turns, max(sampled.span, 1))
        for mname, r in results[dname].items():
            base = mname.split("@")[1] if "@" in mname else None
            ar = results[dname]["ar" if base is None else f"ar@{base}"]["tokens_per_s"]
            r["speedup_vs_ar"] = round(r["tokens_per_s"] / ar, 4) if ar else None
            if cfg.temperature == 0 and base is None and mname != "ar":
                if "rounding_noise" not in results[dname]["ar"]:
                    results[dname]["ar"]["rounding_noise"], _ = calibrate_noise(
                        target, tok, sets[dname], outputs[dname]["ar"], max(cfg.block_sizes), cfg.noise_prompts)
                r["mismatches_vs_ar"] = mismatches(target, tok, sets[dname], outputs[dname]["ar"], outputs[dname][mname],
                                                   results[dname]["ar"]["rounding_noise"])
    sweeps: dict = {}
    if cfg.batch_sizes:
        sweeps["batch"] = {d: {m: batch_sweep(meth, [encode_chat(tok, it[0]) for it in items], cfg.batch_sizes,
                                              cfg.max_new_tokens, f"{d}/{m}")
                               for m, meth in engine_methods.items()} for d, items in sets.items()}
    for method in methods.values():
        if hasattr(method, "close"):
            method.close()
    return {
        "results": results,
        # every method's greedy/sampled token ids per turn (item order), written beside results.json so a
        # mismatch can be audited later without regenerating
        "outputs": outputs,
        "sweeps": sweeps,
        "skipped": skipped,
        "settings": {k: v for k, v in cfg.__dict__.items()},
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "dtype": cfg.dtype, "device": cfg.device},
        "versions": _versions(),
    }


def calibrate_noise(target, tok, items, ar_outputs, block: int, n_prompts: int) -> tuple[dict, list[dict]]:
    """`rounding_noise` over the first turns of the first `n_prompts` items (AR outputs): (its `noise_summary`
    with the prompt count and block size, the per-position rows)."""
    from tqdm import tqdm

    from .loader import encode_chat

    rows, off = [], 0
    for k, item in enumerate(tqdm(items[:n_prompts], desc="rounding noise", unit="prompt")):
        if len(ar_outputs[off]) > 1:
            rows += rounding_noise(target, encode_chat(tok, item[0]), ar_outputs[off], block, seed=k)
        off += len(item)
    return {"prompts": min(n_prompts, len(items)), "block_size": block, **noise_summary(rows)}, rows


def is_near_tie(gap: float, threshold: float, noise_bound: float) -> bool:
    """The near-tie rule: the top-2 gap is within 2 ulps (`near_tie_threshold`) or within the measured noise."""
    return gap <= max(threshold, noise_bound)


def first_divergence(target, prompt: list[int], a: list[int], b: list[int], noise_bound: float = 0.0) -> dict | None:
    """Where two greedy continuations part, and the target's top-2 logit gap there (one forward over the common
    prefix). None when they do not part at a token choice (equal, or one is a prefix: a stop)."""
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return None
    ids = torch.tensor([prompt + a[:i]], device=target.device)
    with torch.no_grad():
        top = target.model(input_ids=ids).logits[0, -1].float().topk(2).values.tolist()
    limit = near_tie_threshold(top[0], target.dtype)
    gap = top[0] - top[1]
    return {"index": i, "gap": gap, "threshold": limit, "noise_bound": noise_bound,
            "near_tie": is_near_tie(gap, limit, noise_bound)}


def mismatches(target, tok, items, ar_outputs, outputs, noise: dict | None = None) -> dict:
    """Greedy outputs that differ from AR; a difference counts as a near-tie when, at the first differing token,
    the target's top-2 logit gap (one forward over the AR prefix) is within `near_tie_threshold` (2 ulps) or
    within the rounding noise measured on this run's own sequences (`rounding_noise`, `noise["max"]`): a gap
    that the block-vs-one-token rounding difference was seen to move by at least as much.
    Outputs are flat, one per turn in item order. Multi-turn items are compared turn by turn up to the first
    differing turn (later turns follow different histories)."""
    from .loader import encode_chat

    total = near = near2 = 0
    off = 0
    details = []
    for k, item in enumerate(items):
        history: list[dict] = []
        for t, user in enumerate(item):
            a, b = ar_outputs[off + t], outputs[off + t]
            history.append({"role": "user", "content": user})
            if a != b:
                total += 1
                d = first_divergence(target, encode_chat(tok, history), a, b, (noise or {}).get("max", 0.0))
                near += d is not None and d["near_tie"]
                near2 += d is not None and d["gap"] <= d["threshold"]
                details.append({"item": k, "turn": t, **({key: (round(v, 5) if isinstance(v, float) else v)
                                                          for key, v in d.items()} if d else {"stop_only": True})})
                break
            history.append({"role": "assistant", "content": tok.decode(a, skip_special_tokens=True)})
        off += len(item)
    # details: where each differing output parts from AR and the target's top-2 gap there, to audit the rule
    return {"count": total, "near_ties": int(near), "near_ties_2ulp": int(near2), "details": details}


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for p in ("dflashkit", "torch", "transformers"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    return out


# ---- reports ----------------------------------------------------------------------------------------------
def markdown(report: dict) -> str:
    lines = ["| dataset | method | tau | tokens/s | speedup vs ar | TPOT ms | TTFT ms | mismatches vs ar (near-ties) |",
             "|---|---|---|---|---|---|---|---|"]
    for d, rows in report["results"].items():
        for m, r in rows.items():
            mm = r.get("mismatches_vs_ar")
            mm_s = f"{mm['count']} ({mm['near_ties']})" if mm else "-"
            lines.append(f"| {d} | {m} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f} | "
                         f"{r['tpot_ms'] or 0:.1f} | {r['ttft_ms'] or 0:.0f} | {mm_s} |")
    for d, rows in report["results"].items():
        nz = rows.get("ar", {}).get("rounding_noise")
        if nz:
            lines.append(f"\nnear-tie bound, {d}: 2 ulps of the top logit, or the rounding noise measured on {nz['prompts']} "
                         f"AR outputs (block {nz['block_size']} vs one token per forward: max top-2 gap change "
                         f"{nz['max']:g} over {nz['positions']} positions, argmax flips {nz['flips']}, largest gap "
                         f"that flipped {nz['max_gap_flipped']:g})")
    for d, rows in report.get("sweeps", {}).get("batch", {}).items():
        sizes = sorted({int(n) for r in rows.values() for n in r})
        lines += ["", f"Throughput (tokens/s, prefill included) vs batch size, {d} first turns:", "",
                  "| method | " + " | ".join(f"batch {n}" for n in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
        for m, r in rows.items():
            lines.append(f"| {m} | " + " | ".join(f"{r[str(n)]['tokens_per_s']:.1f} (tau {r[str(n)]['tau']:.2f})"
                                                   for n in sizes) + " |")
    for m, why in report.get("skipped", {}).items():
        lines.append(f"\nskipped `{m}`: {why}")
    return "\n".join(lines) + "\n"


def plots(report: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    res = report["results"]
    fig, ax = plt.subplots(figsize=(8, 4))
    datasets = list(res)
    methods = sorted({m for r in res.values() for m in r})
    w = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        ax.bar([k + i * w for k in range(len(datasets))], [res[d].get(m, {}).get("speedup_vs_ar") or 0 for d in datasets],
               width=w, label=m)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([k + w * (len(methods) - 1) / 2 for k in range(len(datasets))], datasets)
    ax.set_ylabel("speedup vs ar (same engine)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "speedup.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 4))
    for d, rows in res.items():
        for m, r in rows.items():
            if r["acceptance"]:
                ax.plot(range(1, len(r["acceptance"]) + 1), r["acceptance"], marker="o", label=f"{d} {m} (tau {r['tau']:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("cumulative acceptance")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "acceptance.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    # tau and tokens/s vs block size (ar is block size 1), one line per dataset and temperature
    curves = {}
    for d, rows in res.items():
        for m, r in rows.items():
            name, _, temp = m.partition("@")
            if name == "ar" or (name.startswith("dflash-b") and name[len("dflash-b"):].isdigit()):
                b = 1 if name == "ar" else int(name[len("dflash-b"):])
                curves.setdefault(f"{d}" + (f" @{temp}" if temp else ""), []).append((b, r["tau"], r["tokens_per_s"]))
    if any(len(c) > 2 for c in curves.values()):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for label, pts in curves.items():
            pts.sort()
            a1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            a2.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=label)
        for a, yl in ((a1, "tau (tokens per target pass)"), (a2, "tokens/s")):
            a.set_xscale("log", base=2)
            a.set_xlabel("block size (1 = ar)")
            a.set_ylabel(yl)
        a1.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / "block_size.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    batch = report.get("sweeps", {}).get("batch", {})
    if batch:
        fig, ax = plt.subplots(figsize=(8, 4))
        for d, rows in batch.items():
            for m, r in rows.items():
                sizes = sorted(int(n) for n in r)
                ax.plot(sizes, [r[str(n)]["tokens_per_s"] for n in sizes], marker="o", label=f"{d} {m}")
        ax.set_xlabel("batch size (prompts decoded together)")
        ax.set_ylabel("throughput, tokens/s")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / "batch.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    temps = {m for rows in res.values() for m in rows if "@" in m}
    if temps:
        fig, ax = plt.subplots(figsize=(8, 4))
        labels = [(d, m) for d, rows in res.items() for m in rows if m.startswith("dflash-b")]
        ax.bar(range(len(labels)), [res[d][m]["speedup_vs_ar"] or 0 for d, m in labels])
        ax.set_xticks(range(len(labels)), [f"{d}\n{m}" for d, m in labels], fontsize=7, rotation=30)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel("speedup vs ar at the same temperature")
        fig.tight_layout()
        paths.append(out / "temperature.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


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
