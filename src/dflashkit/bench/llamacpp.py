"""llama.cpp's own server as a bench peer: plain greedy decoding (`llamacpp-server`) and llama.cpp's DFlash with
OUR drafter exported to GGUF (`llamacpp-dflash`, block sizes of the run, full and reduced draft vocabulary).

The binaries come from `scripts/llamacpp-build.sh` (.llamacpp/bin, or $DFLASHKIT_LLAMACPP_BIN). One server per
row, one request at a time, prompt caching off (each prompt's prefill is paid, as in our rows). Times are the
server's own (`timings.prompt_ms` = TTFT, `timings.predicted_ms` = decoding); the verify cycles come from its log
("accepted a/k draft tokens" per cycle), so tau and per-position acceptance are llama.cpp's, not estimated.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from ..errors import DFlashError
from .process import free_port, stop
from .turn import Skip, Turn

ACCEPTED = re.compile(r"accepted\s+(\d+)/\s*(\d+) draft tokens")
REDUCED_VOCAB = 16384  # the reduced draft vocabulary row (`--draft-vocab` of the GGUF export)


def llamacpp_bin(tool: str) -> Path:
    """A llama.cpp tool built by scripts/llamacpp-build.sh; Skip (naming the remedy) when it is missing."""
    base = Path(os.environ.get("DFLASHKIT_LLAMACPP_BIN") or Path(__file__).resolve().parents[3] / ".llamacpp/bin")
    path = base / tool
    if not path.is_file():
        raise Skip(f"{path} is missing: run scripts/llamacpp-build.sh --tools-only (or set DFLASHKIT_LLAMACPP_BIN)")
    return path


class LlamaServerMethod:
    """One llama-server process: greedy AR (`drafter_gguf=None`) or DFlash drafting `block_size - 1` tokens."""

    def __init__(self, target_gguf: str, name: str, threads: int, drafter_gguf: str | None = None,
                 block_size: int = 1, ctx: int = 4096):
        self.name, self.block_size = name, (block_size if drafter_gguf else 1)
        self.port = free_port()
        cmd = [str(llamacpp_bin("llama-server")), "-m", target_gguf, "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(threads), "-tb", str(threads), "-c", str(ctx), "-np", "1", "--no-webui"]
        if drafter_gguf:
            # n-max: llama.cpp drafts 3 tokens unless told; p-min 0 (its default, stated): the whole block, as ours
            cmd += ["-md", drafter_gguf, "--spec-type", "draft-dflash", "--spec-draft-n-max", str(block_size - 1),
                    "--spec-draft-p-min", "0", "-td", str(threads)]
        self.log = Path(tempfile.gettempdir()) / f"dflashkit-{name}-{self.port}.log"
        env = {**os.environ, "LLAMA_TRACE": "1"}  # its per-cycle "accepted a/k draft tokens" log lines
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(120)

    def _wait_ready(self, timeout: float) -> None:
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                raise DFlashError(f"llama-server ({self.name}) exited: {self._tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.close()
        raise DFlashError(f"llama-server ({self.name}) did not come up in {timeout:.0f} s: {self._tail()}")

    def _tail(self) -> str:
        return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-5:])

    def complete(self, ids: list[int], max_new: int) -> dict:
        body = {"prompt": ids, "n_predict": max_new, "temperature": 0.0, "top_k": 1, "repeat_penalty": 1.0,
                "cache_prompt": False, "return_tokens": True, "stream": False}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def run(self, prompt_ids: list[list[int]], max_new: int) -> list[Turn]:
        out = []
        for p in prompt_ids:
            start = self.log.stat().st_size
            r = self.complete(p, max_new)
            with open(self.log, errors="replace") as f:
                f.seek(start)
                cycles = [int(a) for a, _ in ACCEPTED.findall(f.read())] if self.block_size > 1 else []
            t = r["timings"]
            toks = [int(x) for x in r.get("tokens", [])]
            out.append(Turn(toks, cycles, len(toks), t["prompt_ms"] / 1000, t["predicted_ms"] / 1000))
        return out

    def close(self) -> None:
        stop(self.proc)


def target_gguf(ctx) -> str:
    from ..loader import default_gguf

    t = ctx.cfg.target
    if t and not str(t).endswith(".gguf"):
        raise Skip("the llama.cpp peers need a .gguf target (or the default)")
    return str(t or default_gguf())


def llamacpp_server(ctx) -> dict:
    llamacpp_bin("llama-server")
    return {"llamacpp-server": LlamaServerMethod(target_gguf(ctx), "llamacpp-server", _threads())}


def llamacpp_dflash(ctx) -> dict:
    """Rows llamacpp-dflash-b{B} (full vocabulary) and llamacpp-dflash-b{B}-v16384 (reduced), B in the run's
    block sizes; our drafter is exported to GGUF for the run (a temporary file)."""
    from ..gguf_export import export_gguf

    llamacpp_bin("llama-server")
    ctx.need_drafter()
    target = target_gguf(ctx)
    out = Path(tempfile.mkdtemp(prefix="dflashkit-gguf-"))
    atexit.register(shutil.rmtree, out, True)  # 40-60 MB per file: gone when the bench ends
    files = {"": export_gguf(ctx.drafter, target, out / "drafter.gguf")}
    ranking = ctx.drafter.token_ranking
    if ctx.drafter.d2t is None and ranking is not None and len(ranking) >= REDUCED_VOCAB:
        files[f"-v{REDUCED_VOCAB}"] = export_gguf(ctx.drafter, target, out / "drafter-reduced.gguf",
                                                  head=ctx.target.lm_head_weight, draft_vocab=REDUCED_VOCAB)
    rows = {}
    for b in ctx.cfg.block_sizes:
        for suffix, f in files.items():
            name = f"llamacpp-dflash-b{b}{suffix}"
            rows[name] = LlamaServerMethod(target, name, _threads(), str(f), block_size=b)
    return rows


def _threads() -> int:
    import torch

    return torch.get_num_threads()
