"""Weights on transparent huge pages: `place(t)` copies a tensor the kernels stream every step into anonymous memory
advised as 2 MiB pages (`madvise(MADV_HUGEPAGE)`).

Why: a decoding step streams ~100 MB of codes. On 4 KiB pages that is ~25,000 pages whose translations miss the TLB
and are walked each step; on 2 MiB pages, ~50. Linux's default (`transparent_hugepage/enabled` = madvise) gives
huge pages only to memory that asks for them, and torch's allocator does not ask (unless THP_MEM_ALLOC_ENABLE=1).
Measured (AMD EPYC, int4 default target): one- and two-token steps ~4-9 % shorter, bench/results/hugepages-amd/.

The memory comes from 64 MiB chunks (bump allocation, 64-byte aligned tensors) so that the scales and small tensors
beside the codes do not each round up to a 2 MiB page. Nothing changes where the system offers no transparent huge
pages (`never`, not Linux): `place` returns the tensor itself. DFLASHKIT_HUGE_PAGES=0 turns it off (A/B runs).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HUGE = 2 << 20
CHUNK = 64 << 20
ALIGN = 64
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_state: dict = {}


def enabled() -> bool:
    """Whether `place` copies onto huge pages here (read once)."""
    if "on" not in _state:
        mode = ""
        try:
            mode = _THP.read_text()
        except OSError:
            pass
        _state["on"] = (hasattr(mmap, "MADV_HUGEPAGE") and ("[always]" in mode or "[madvise]" in mode)
                        and os.environ.get("DFLASHKIT_HUGE_PAGES", "1") != "0")
        log.debug("weights on transparent huge pages: %s (%s)", _state["on"], mode.strip() or "no THP")
    return _state["on"]


def set_enabled(on: bool) -> None:
    """Force `place` on or off for what is placed next, whatever the system offers (A/B runs and tests that load
    one engine each way in one process)."""
    _state.clear()
    _state["on"] = on


def _chunk(nbytes: int) -> torch.Tensor:
    """A fresh uint8 [nbytes] starting on a 2 MiB boundary, advised as huge pages before any page is touched (a
    page already faulted in as 4 KiB would stay so)."""
    # Why MAP_PRIVATE: Python's default for anonymous maps is MAP_SHARED, i.e. shmem, whose huge pages obey another
    # switch (shmem_enabled, "never" by default): the advice would be silently ignored. Page-aligned only, hence
    # the slack to align within.
    mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    buf = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive as long as any view of it
    off = -buf.data_ptr() % HUGE
    return buf[off:off + nbytes]


def place(t: torch.Tensor) -> torch.Tensor:
    """t (contiguous, CPU) copied onto huge pages, the same dtype, shape and values; t itself where `enabled()` is
    False, t is not on the CPU or is empty."""
    if not enabled() or t.device.type != "cpu" or t.numel() == 0:
        return t
    t = t.contiguous()
    n = t.numel() * t.element_size()
    used = _state.get("used", CHUNK)
    if used + n > CHUNK:  # a new chunk; the old one's untouched tail costs no memory
        if n > CHUNK:  # a tensor of its own
            return _copy_into(_chunk(-(-n // HUGE) * HUGE), t, 0)
        _state["buf"], used = _chunk(CHUNK), 0
    _state["used"] = -(-(used + n) // ALIGN) * ALIGN
    return _copy_into(_state["buf"], t, used)


def trim() -> None:
    """Hand the heap's free memory back to the system (glibc's `malloc_trim`), after tensors were moved here. Why:
    torch frees the moved tensors' old storage into glibc's heap (allocations of a few MB come from it once glibc's
    mmap threshold has risen), which keeps it resident: the default bf16 target held ~130 MB more without this."""
    if not enabled():
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        pass


def _copy_into(buf: torch.Tensor, t: torch.Tensor, off: int) -> torch.Tensor:
    n = t.numel() * t.element_size()
    out = buf[off:off + n].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
