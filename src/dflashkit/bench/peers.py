"""Peers: every method the benchmark can run, by name, in one registry (`PEERS`).

A method turns token-id prompts into `Turn`s. Ours: `ar` (block size 1, the baseline of `speedup_vs_ar`),
`dflash` (the plain block at each `--block-size`, `dflash-b{B}`), `dflash-lookup` (the configured tree + lookup
branch), `dflash-tree` (the tree alone), `lookup` (the lookup branch alone). Others: `hf` / `hf-lookup`
(transformers `generate`, with prompt-lookup decoding), `zlab` (Z Lab's package running our drafter), `llamacpp`
(llama.cpp greedy on the GGUF), `vllm` / `vllm-dflash` (vLLM's CPU build). A peer whose optional dependency is
absent raises `Skip` with the remedy, and the report lists it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..decode_config import DecodeConfig
from ..errors import DFlashError
from ..lookup import LookupParams
from .llamacpp import llamacpp_dflash, llamacpp_server  # llama.cpp's own binaries (scripts/llamacpp-build.sh)
from .turn import Skip, Turn


class EngineMethod:
    """Our engine with one `DecodeConfig` (resolved): `ar` is block size 1 without lookup."""

    def __init__(self, engine, config, sampling, name: str):
        self.engine, self.config, self.sampling, self.name = engine, engine.resolve(config), sampling, name
        self.span = self.config.depth_span  # 1 + the deepest draft position (block, tree or lookup branch)
        self.block_size = self.config.block_size

    def with_sampling(self, sampling, name: str) -> "EngineMethod":
        return EngineMethod(self.engine, self.config, sampling, name)

    def policy_stats(self):
        """A copy of the adaptive policy's running counts (None for a fixed row): diff two for one run's."""
        import dataclasses
        stats = getattr(self.engine.policy(self.config), "stats", None)  # FixedPolicy keeps none
        return None if stats is None else dataclasses.replace(stats)

    def run(self, prompt_ids: list[list[int]], max_new: int) -> list[Turn]:
        gens = self.engine.generate(prompt_ids, sampling=self.sampling, max_new_tokens=max_new, config=self.config)
        spec = self.config.speculative
        return [Turn(g.tokens, list(g.stats.accepted) if spec else [], g.stats.new_tokens, g.stats.ttft_s,
                     g.stats.decode_s) for g in gens]


class HFMethod:
    """transformers `generate` (greedy or sampled), optionally with prompt-lookup decoding (HF backend only)."""

    def __init__(self, target, sampling, name: str, lookup: int | None = None, eos: int | None = None):
        if not hasattr(target, "hf_generate"):
            raise Skip("the hf peers need the Hugging Face backend")
        self.target, self.sampling, self.name, self.lookup, self.eos = target, sampling, name, lookup, eos

    def run(self, prompt_ids: list[list[int]], max_new: int) -> list[Turn]:
        out = []
        for p in prompt_ids:
            t0 = time.perf_counter()
            self.target.hf_generate(p, 1, self.eos, self.sampling, self.lookup)
            t1 = time.perf_counter()
            toks = self.target.hf_generate(p, max_new, self.eos, self.sampling, self.lookup)
            t2 = time.perf_counter()
            # decode time = full run minus one prefill-and-first-token (measured separately)
            out.append(Turn(toks, [], len(toks), t1 - t0, max(t2 - t1 - (t1 - t0), 1e-9)))
        return out


class ZLabMethod:
    """Z Lab's reference `dflash` package running OUR drafter (Z Lab format, full vocabulary) in its own
    virtualenv, through `zlab_worker.py` over a pipe. Greedy only."""

    def __init__(self, python: str, target_dir: str, drafter_dir: str, dtype: str, eos: int, block_size: int,
                 name: str):
        import subprocess

        self.block_size, self.name = block_size, name
        src = str(Path(__file__).resolve().parents[2])
        self.proc = subprocess.Popen([python, "-m", "dflashkit.zlab_worker", target_dir, drafter_dir, dtype, str(eos)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env={**os.environ, "PYTHONPATH": src})
        first = json.loads(self.proc.stdout.readline() or '{"error": "worker died"}')
        if "error" in first:
            raise DFlashError(f"the Z Lab package could not load the drafter: {first['error']}")

    def run(self, prompt_ids: list[list[int]], max_new: int) -> list[Turn]:
        out = []
        for p in prompt_ids:
            req = {"ids": p, "max_new_tokens": max_new, "block_size": self.block_size}
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            r = json.loads(self.proc.stdout.readline())
            # Z Lab logs a+1 per cycle (cut at a stop); our `accepted` holds a.
            out.append(Turn(r["tokens"], [a - 1 for a in r["acceptance_lengths"]], len(r["tokens"]), r["ttft_s"],
                            r["decode_s"]))
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
    lib = Path(python).resolve().parents[1] / "lib"
    iomp = lib / "libiomp5.so"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
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
    env = os.environ.get(f"DFLASHKIT_{peer.upper()}_PYTHON")
    if env:
        return env
    cand = Path(__file__).resolve().parents[3] / f".venv-{peer}" / "bin" / "python"
    return str(cand) if cand.exists() else None


def zlab_python() -> str | None:
    """The interpreter of the Z Lab virtualenv (scripts/zlab-env.sh)."""
    return peer_python("zlab")


# ---- the registry: method name -> factory(ctx) -> {row name: method} -----------------------------------------
@dataclass
class BenchContext:
    """What a peer factory may use: the run's settings, our target, tokenizer, drafter (or None) and engine."""

    cfg: object  # runner.BenchConfig
    target: object
    tok: object
    drafter: object
    engine: object
    sampling: object

    def need_drafter(self) -> None:
        if self.drafter is None:
            raise Skip("no drafter for this target: pass --drafter DIR")

    def target_dir(self) -> str:
        from ..loader import resolve_target_dir
        return str(resolve_target_dir(self.cfg.target))

    def drafter_dir(self, peer: str) -> str:
        from ..loader import BUNDLED_DRAFTER
        self.need_drafter()
        if self.drafter.d2t is not None:
            raise Skip(f"{peer} drafts over the full vocabulary (the Z Lab export); this drafter has a reduced one")
        return self.cfg.drafter or str(BUNDLED_DRAFTER)


def _ours(ctx: BenchContext, name: str, config: DecodeConfig) -> EngineMethod:
    return EngineMethod(ctx.engine, config, ctx.sampling, name)


def _ar(ctx):
    return {"ar": _ours(ctx, "ar", DecodeConfig.autoregressive())}


def _dflash(ctx):
    ctx.need_drafter()
    return {f"dflash-b{b}": _ours(ctx, f"dflash-b{b}", DecodeConfig(block_size=b)) for b in ctx.cfg.block_sizes}


def _tree_rows(ctx, lookup: bool, policy: str | None = None):
    """dflash-lookup / dflash-tree: the configured drafter tree (and lookup branch) at each lookup block size, with
    the configured step policy (or `policy`); the row name ends in it."""
    ctx.need_drafter()
    d = ctx.cfg.decode.replace(policy=policy)
    if not lookup and d.tree < 1:
        raise DFlashError("method dflash-tree needs --tree N (drafter tree nodes, N >= 1).")
    lk = d.lookup if lookup else LookupParams()
    tree = f"-tree{d.tree}" + (f"p{d.tree_min_prob:g}" if d.tree_min_prob else "") if d.tree else ""
    rows = {}
    for b in ctx.cfg.lookup_block_sizes or ctx.cfg.block_sizes:
        name = f"dflash-b{b}{tree}" + (f"-lookup{lk.max_tokens}" if lk.enabled else "") + f"-{d.policy}"
        rows[name] = _ours(ctx, name, d.replace(block_size=b, lookup=lk))
    return rows


def _lookup(ctx):
    lk = ctx.cfg.decode.lookup
    name = f"lookup{lk.max_tokens}"
    return {name: _ours(ctx, name, DecodeConfig(block_size=1, lookup=LookupParams(
        max_tokens=lk.max_tokens, max_n=lk.max_n, min_n=lk.min_n, tokens_per_n=lk.tokens_per_n)))}


def _hf(ctx, lookup: int | None = None):
    name = "hf-lookup" if lookup else "hf"
    return {name: HFMethod(ctx.target, ctx.sampling, name, lookup=lookup, eos=ctx.tok.eos_token_id)}


def _zlab(ctx):
    py = zlab_python()
    if py is None:
        raise Skip("no Z Lab virtualenv: run scripts/zlab-env.sh (or set DFLASHKIT_ZLAB_PYTHON)")
    ddir, tdir = ctx.drafter_dir("the Z Lab package"), ctx.target_dir()
    return {f"zlab-b{b}": ZLabMethod(py, tdir, ddir, ctx.cfg.dtype, ctx.tok.eos_token_id, b, f"zlab-b{b}")
            for b in ctx.cfg.block_sizes}


def _llamacpp(ctx):
    from ..loader import default_gguf
    t = ctx.cfg.target
    gguf = t if t and str(t).endswith(".gguf") else (None if t else default_gguf())
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise Skip("llama-cpp-python is not installed: run scripts/llamacpp-build.sh (AMX-off build)") from None
    if gguf is None:
        raise Skip("llamacpp needs a .gguf target")
    return {"llamacpp": LlamaCppMethod(str(gguf), ctx.tok.eos_token_id)}


def _llama_server(ctx, dflash: bool):
    return llamacpp_dflash(ctx) if dflash else llamacpp_server(ctx)


def _vllm(ctx, dflash: bool):
    py = vllm_python()
    if py is None:
        raise Skip("no vLLM virtualenv: run scripts/vllm-env.sh (or set DFLASHKIT_VLLM_PYTHON)")
    if ctx.cfg.temperature != 0:
        raise Skip("the vLLM peers run greedy only")
    threads, tdir = torch.get_num_threads(), ctx.target_dir()
    if not dflash:
        return {"vllm": VLLMMethod(py, tdir, None, ctx.cfg.dtype, 1, "vllm", threads)}
    ddir = ctx.drafter_dir("vLLM")
    return {f"vllm-dflash-b{b}": VLLMMethod(py, tdir, ddir, ctx.cfg.dtype, b, f"vllm-dflash-b{b}", threads)
            for b in ctx.cfg.block_sizes}


PEERS = {
    "ar": _ar,
    "dflash": _dflash,
    "dflash-lookup": lambda ctx: _tree_rows(ctx, lookup=True),
    "dflash-lookup-fixed": lambda ctx: _tree_rows(ctx, lookup=True, policy="fixed"),
    "dflash-tree": lambda ctx: _tree_rows(ctx, lookup=False),
    "lookup": _lookup,
    "hf": _hf,
    "hf-lookup": lambda ctx: _hf(ctx, lookup=10),
    "zlab": _zlab,
    "llamacpp": _llamacpp,
    "llamacpp-server": lambda ctx: _llama_server(ctx, dflash=False),
    "llamacpp-dflash": lambda ctx: _llama_server(ctx, dflash=True),
    "vllm": lambda ctx: _vllm(ctx, dflash=False),
    "vllm-dflash": lambda ctx: _vllm(ctx, dflash=True),
}


def build_methods(ctx: BenchContext, names: list[str]) -> tuple[dict, dict]:
    """({row name: method}, {method: why skipped}) for the requested method names; `ar` always runs (first)."""
    methods, skipped = {}, {}
    for m in names:
        if m not in PEERS:
            raise DFlashError(f"unknown method {m!r}; choose from {', '.join(PEERS)}.")
        try:
            methods.update(PEERS[m](ctx))
        except Skip as e:
            skipped[m] = str(e)
    if "ar" not in methods:
        methods = {**_ar(ctx), **methods}
    return methods, skipped
