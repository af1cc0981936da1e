"""Measurements cached per machine: what they depend on (`machine_key`) and the JSON table they are kept in
(`lookup`, `store`; written atomically, so a concurrent reader sees the old or the new table). The exactness
self-check (`invariance.py`) and the step cost model (`step_cost.py`) are measured once per machine this way."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch


def cache_dir() -> Path:
    """Where dflashkit keeps what it made or measured on this machine (converted targets, compiled kernels, the
    cost model, the self-check): $DFLASHKIT_CACHE, else $XDG_CACHE_HOME/dflashkit, else ~/.cache/dflashkit."""
    root = os.environ.get("DFLASHKIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dflashkit")
    return Path(root)


def machine_key(*parts) -> str:
    """A short digest of `parts` plus the CPU (model and flags), torch build and thread count."""
    # the raw flags line, its newline kept: the key of every cost file written so far
    flags = next((ln for ln in _cpuinfo().splitlines(keepends=True) if ln.startswith("flags")), "")
    cpu = platform.processor() or platform.machine()
    raw = "|".join(map(str, parts)) + f"|{torch.__version__}|{torch.get_num_threads()}|{cpu}|{flags}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags() -> list[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them ("avx2", "avx512_bf16", ...); [] where it cannot be read."""
    return next((ln.split(":", 1)[1].split() for ln in _cpuinfo().splitlines() if ln.startswith("flags")), [])


def cpu_has_bf16_units() -> bool:
    """AVX512-BF16 or AMX-BF16 in the CPU's flags (False where they cannot be read): where torch's bf16 matmuls run
    on hardware."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_name() -> str:
    """The CPU's model name and the units our kernels' speed depends on, for benchmark reports:
    "Intel(R) Xeon(R) Processor (avx2, avx512f, avx512_bf16, amx_bf16)"."""
    model = next((ln.split(":", 1)[1].strip() for ln in _cpuinfo().splitlines() if ln.startswith("model name")),
                 platform.processor() or platform.machine())
    flags = cpu_flags()
    units = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]
    return f"{model} ({', '.join(units)})"


def median_ms(fn, repeats: int, inner: int = 3) -> float:
    """ms per call of `fn`: the median of `repeats` means of `inner` calls, after one warm-up call (benchmarks)."""
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        runs.append((time.perf_counter() - t0) / inner * 1000)
    return statistics.median(runs)


def _table(file) -> dict:
    if file and os.path.isfile(file):
        try:
            with open(file) as f:
                return json.load(f)
        except (OSError, ValueError):  # a damaged cache is measured again, not trusted
            return {}
    return {}


def lookup(file: str | os.PathLike | None, key: str) -> dict | None:
    """The entry stored under `key` in `file`, or None."""
    return _table(file).get(key)


def store(file: str | os.PathLike | None, key: str, value: dict) -> None:
    """Add `value` under `key` to the JSON table in `file` (nothing when file is None)."""
    if not file:
        return
    table = _table(file)
    table[key] = value
    os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
    tmp = f"{file}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
    os.replace(tmp, file)


def engine_identity(target) -> str:
    """The backend and its kernel plan's identity (our kernels' sources included): the key of anything cached about
    a forward's bits or speed (a changed kernel keeps the plan's name)."""
    plan = getattr(target, "kernel_plan", None)  # `kernel_plan.KernelPlan`; a backend without one runs torch's
    return f"{type(target).__name__}:{'torch' if plan is None else plan.identity}"
