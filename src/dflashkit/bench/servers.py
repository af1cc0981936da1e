"""Each engine's real OpenAI-compatible server as its own process, on loopback (`dflashkit bench-serve`).

- `dflashkit`: `dflashkit serve` as shipped (the default system). Its AR twin is the same process asked with
  `speculate: false`, so the default / AR ratio carries no process-to-process spread.
- `llama-server`: llama.cpp's server on the bundled Q4_1 GGUF, plain or drafting with our drafter exported to GGUF
  (`--spec-type draft-dflash`). Needs `scripts/llamacpp-build.sh --tools-only`.
- `vllm`: `vllm serve` (CPU build), plain or with our drafter's speculators export (`method: dflash`). Needs
  `scripts/vllm-env.sh`.
Every server gets the same threads; a missing peer is a `Skip` that names the command installing it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..errors import DFlashError
from .peers import Skip, vllm_env, vllm_python
from .process import free_port, stop

MODEL = "smollm2"  # the name every server is told to serve under


@dataclass
class Server:
    """A server process listening on `base`; `close()` stops it."""

    name: str
    base: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    log: Path

    def close(self) -> None:
        stop(self.proc)

    def tail(self) -> str:
        return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-5:])


def start(name: str, cmd: list[str], env: dict, log: Path, port: int, timeout: float = 900) -> Server:
    """Starts `cmd` and waits for its /health (a first start compiles and loads for minutes on 2 cores)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    server = Server(name, f"http://127.0.0.1:{port}", proc, log)
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise DFlashError(f"{name} exited ({proc.returncode}): {server.tail()}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(server.base + "/health", timeout=5) as r:
                if r.status == 200:
                    return server
        time.sleep(1)
    server.close()
    raise DFlashError(f"{name} did not answer /health in {timeout:.0f} s: {server.tail()}")


def dflashkit_server(logs: Path, threads: int, max_len: int) -> Server:
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "dflashkit"), "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model-name", MODEL, "--max-len", str(max_len)]
    return start("dflashkit serve", cmd, {**os.environ, "OMP_NUM_THREADS": str(threads)}, logs / "dflashkit.log",
                 port)


def llama_server(logs: Path, threads: int, max_len: int, drafter_gguf: str | None, block: int) -> Server:
    from ..loader import default_gguf
    from .llamacpp import llamacpp_bin

    binary = str(llamacpp_bin("llama-server"))  # Skip, naming scripts/llamacpp-build.sh, when it is not built
    port = free_port()
    cmd = [binary, "-m", str(default_gguf()), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-c", str(max_len * 32), "-np", "32", "--no-webui", "-a", MODEL]
    if drafter_gguf:  # the whole block drafted every step (p-min 0), as ours
        cmd += ["-md", drafter_gguf, "--spec-type", "draft-dflash", "--spec-draft-n-max", str(block - 1),
                "--spec-draft-p-min", "0", "-td", str(threads)]
    name = "llama-server" + ("-dflash" if drafter_gguf else "")
    return start(name, cmd, dict(os.environ), logs / f"{name}.log", port)


def vllm_server(logs: Path, threads: int, max_len: int, drafter_dir: str | None, block: int) -> Server:
    from ..loader import resolve_target_dir

    py = vllm_python()
    if py is None:
        raise Skip("no vLLM virtualenv: run scripts/vllm-env.sh (or set DFLASHKIT_VLLM_PYTHON)")
    port = free_port()
    cmd = [str(Path(py).parent / "vllm"), "serve", str(resolve_target_dir(None)), "--host", "127.0.0.1", "--port",
           str(port), "--dtype", "bfloat16", "--max-model-len", str(max_len), "--served-model-name", MODEL,
           "--max-num-seqs", "32"]
    if drafter_dir:
        cmd += ["--speculative-config", json.dumps({"method": "dflash", "model": drafter_dir,
                                                     "num_speculative_tokens": block - 1})]
    env = vllm_env(py, threads)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # a server keeps its engine in its own process
    name = "vllm" + ("-dflash" if drafter_dir else "")
    return start(name, cmd, env, logs / f"{name}.log", port)


def drafter_gguf(out: Path) -> str:
    """The bundled drafter as a llama.cpp DFlash GGUF (written for the run under `out`)."""
    from ..gguf_export import export_gguf
    from ..loader import default_gguf, load_models

    _, _, drafter, _ = load_models(None, None, dtype="float32")
    return str(export_gguf(drafter, default_gguf(), out / "drafter.gguf"))


def vllm_drafter(out: Path) -> str:
    """The bundled drafter in the speculators layout (what `dflashkit export --format speculators` writes), the
    layout vLLM's own training stack produces, written for the run under `out`."""
    from ..export import export_speculators
    from ..loader import load_models, resolve_target_dir

    target, _, drafter, _ = load_models(None, None, dtype="float32")
    return str(export_speculators(drafter, target, str(resolve_target_dir(None)), out / "speculators"))


def start_servers(names: set[str], logs: Path, threads: int, max_len: int, block: int,
                  stack: contextlib.ExitStack) -> dict:
    """{server name: Server, or the Skip that says why not}; each server stops when `stack` closes."""
    import shutil
    import tempfile

    scratch = Path(tempfile.mkdtemp(prefix="dflashkit-bench-serve-"))  # the exported drafters: not results
    stack.callback(shutil.rmtree, scratch, True)
    makers = {"dflashkit": lambda: dflashkit_server(logs, threads, max_len),
              "llama-server": lambda: llama_server(logs, threads, max_len, None, 1),
              "llama-server-dflash": lambda: llama_server(logs, threads, max_len, drafter_gguf(scratch), block),
              "vllm": lambda: vllm_server(logs, threads, max_len, None, 1),
              "vllm-dflash": lambda: vllm_server(logs, threads, max_len, vllm_drafter(scratch), block)}
    out = {}
    for name in sorted(names, key=list(makers).index):
        try:
            out[name] = makers[name]()
        except Skip as why:
            out[name] = why
            continue
        stack.callback(out[name].close)
    return out
