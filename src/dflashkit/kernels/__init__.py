"""Our own CPU kernels: `RowLinear`, a linear layer whose output rows do not depend on how many rows are
computed (fp32 products, or for 4/8-bit weights optionally 8-bit activations and integer dot products), and
`attend`, the lean target's attention in one row-invariant call per layer.

The C++ sources (module.cpp, rowlinear.cpp, qlinear.cpp, plinear.cpp, attention.cpp, layers.cpp, keylists.cpp,
argmax.cpp, drafttree.cpp; simd.h holds the helpers the kernels share) are compiled once per torch version with
torch's extension builder (g++ and the `ninja` package) into ~/.cache/dflashkit/kernels and loaded from there
afterwards.
Where they cannot be built (no compiler, no AVX2/FMA, not x86-64), `available()` says why and callers keep torch's
kernels.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

from ..measurements import cache_dir
from . import hugepages
from .packing import pack_codes

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(n) for n in ("module.cpp", "rowlinear.cpp", "qlinear.cpp", "plinear.cpp",
                                                  "attention.cpp", "layers.cpp", "keylists.cpp", "argmax.cpp",
                                                  "drafttree.cpp", "verifytree.cpp",
                                                  "corpusmatch.cpp", "rowcopy.cpp")]
HEADERS = [Path(__file__).with_name(n) for n in ("simd.h", "ops.h")]
KINDS = {"bf16": 0, "q4_1": 1, "q8_0": 2}
PATHS = {"rowlinear": 0, "qlinear": 1, "plinear": 2}  # which kernel a stacked linear calls (layers.cpp `Linear`)
_state: dict = {}


def _build_dir() -> Path:
    d = cache_dir() / "kernels" / f"torch-{torch.__version__.split('+')[0]}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the pip package's binary sits next to this interpreter (a venv that
    is used without being activated, as `make test` does, does not have it on PATH)."""
    dirs = [str(Path(sys.executable).parent)]
    try:
        import ninja

        dirs.insert(0, str(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    path = os.environ.get("PATH", "").split(os.pathsep)
    os.environ["PATH"] = os.pathsep.join([d for d in dict.fromkeys(dirs) if d not in path] + path)


@contextlib.contextmanager
def build_lock():
    """Held while one process builds or loads the kernels. Why our own lock around torch's builder: torch marks a
    build with a `lock` file that a killed builder leaves behind (a server stopped mid-compile, a test's deadline),
    and every later build then waits on it forever. An flock is released by the kernel when its holder dies; whoever
    holds it is the only builder, so a `lock` file found then is stale and is removed."""
    import fcntl

    d = _build_dir()
    with open(d / "dflashkit-build.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that is building dflashkit's kernels in %s", d)
            fcntl.flock(f, fcntl.LOCK_EX)
        stale = d / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that was killed; building again", stale)
            stale.unlink(missing_ok=True)
        try:
            yield d
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load():
    """The compiled module, or None (the reason in `why_unavailable()`). Compiles on first use (~1-2 minutes of g++
    on 2 cores)."""
    if "mod" in _state:
        return _state["mod"]
    _state["mod"], _state["why"] = None, ""
    cap = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() not in ("x86_64", "amd64") or cap not in ("AVX2", "AVX512"):
        _state["why"] = f"needs an x86-64 CPU with AVX2 (this one: {platform.machine()}, torch capability {cap})"
        return None
    try:
        from torch.utils.cpp_extension import load as build

        _put_ninja_on_path()

        t0 = time.time()
        if not any(_build_dir().glob("dflashkit_kernels*.so")):
            log.info("compiling dflashkit's CPU kernels once into %s (~1-2 minutes of g++)", _build_dir())
        # Why the headers' hash is a build flag: torch's builder versions an extension by its sources and flags
        # only, so an edited header alone would not make it rebuild (the old .so would load).
        headers = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
        with build_lock() as d:
            mod = build(name="dflashkit_kernels", sources=[str(f) for f in SOURCES], build_directory=str(d),
                        # -fopenmp: at::parallel_for is OpenMP in torch's CPU build; without it the kernel runs on one
                        # thread. The libgomp.so.1 it links is the copy torch already loaded (same soname): one runtime.
                        extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp", f"-DDFLASHKIT_HEADERS={headers}"],
                        extra_ldflags=["-fopenmp"], verbose=False)
        log.info("row-invariant kernels ready (%.1f s; built or loaded from %s)", time.time() - t0, _build_dir())
        _state["mod"] = mod
    except Exception as e:  # noqa: BLE001 - any build failure means: fall back, and say why
        _state["why"] = f"could not build the kernels ({type(e).__name__}: {str(e).strip()[:300]})"
        log.warning("row-invariant kernels unavailable: %s; using torch's F.linear", _state["why"])
    return _state["mod"]


def isa() -> str:
    """The instruction set of rowlinear's bf16 path on this CPU ("amx": bf16 weights on AMX tiles, 4/8-bit codes on
    AVX512-BF16 dot products; "avx512bf16"; or "avx2"; their bits differ)."""
    mod = load()
    return mod.rowlinear_isa() if mod is not None else ""


def set_isa(name: str) -> str:
    """"avx2": rowlinear's bf16 path runs its 8-lane AVX2 code on any CPU (tests of that path on AVX512 hosts, A/B
    benchmarks); "avx512bf16": an AMX CPU stays on its AVX-512 dot products; "auto": the best this CPU has.
    Process-wide; set it before loading targets (it changes bits)."""
    return _loaded().rowlinear_set_isa(name)


def source_id() -> str:
    """A short hash of the kernels' sources: what a cached measurement of their speed (the step cost model) must
    be keyed by, so that a changed kernel is measured again instead of priced by its predecessor."""
    if "source_id" not in _state:
        _state["source_id"] = hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES + HEADERS)).hexdigest()[:12]
    return _state["source_id"]


def _loaded():
    """The compiled module, built if need be; an error saying why where it cannot be (for calls with no fallback)."""
    mod = load()
    if mod is None:
        raise RuntimeError(f"dflashkit kernels unavailable: {why_unavailable()}")
    return mod


def available() -> bool:
    return load() is not None


def on_cpu(*tensors: torch.Tensor):
    """The compiled module where it already runs in this process and every tensor is on the CPU, else None: the caller
    keeps its torch / Python version (the argmax, the drafter's top-k and beam here; tree.py's verify tree,
    verifytree.cpp; corpus.py's match, corpusmatch.cpp; the drafter's feature writes, rowcopy.cpp). Never builds."""
    mod = _state.get("mod")
    return mod if mod is not None and all(t.device.type == "cpu" for t in tensors) else None


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> [...] int64: torch.argmax(logits, -1), for bf16 CPU logits without an fp32 copy where this
    process already runs our kernels (argmax.cpp: the same index, first maximum, NaN first); otherwise torch's
    argmax over the fp32 widening (exact for bf16/fp16: the same order, the same first maximum; torch's CPU argmax
    over bf16 itself is ~5x slower). Never builds the kernels."""
    mod = on_cpu(logits)
    if mod is not None and logits.dtype == torch.bfloat16 and logits.shape[-1]:
        return mod.argmax_bf16(logits)
    return logits.float().argmax(-1)


def draft_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """logits [..., V] bf16 -> (log-probabilities [..., k] float32, ids [..., k]): each row's k best under
    log_softmax, best first, ties to the lower id (drafttree.cpp). None where this process does not already run our
    kernels or the logits are not bf16 on the CPU: the caller keeps torch's log_softmax + topk. Never builds."""
    mod = on_cpu(logits)
    if mod is None or logits.dtype != torch.bfloat16 or not 1 <= k <= logits.shape[-1]:
        return None
    return mod.draft_topk(logits, k)


def beam_tree(tokens: torch.Tensor, logp: torch.Tensor, n: int, min_prob: float) -> tuple | None:
    """tree.py `topk_tree`'s beam for unconditioned slots in one call (drafttree.cpp): tokens [b, D, K] int64, logp
    [b, D, K] float32 -> (tokens, parent, depth, alive, score), each [b, n']. None where this process does not
    already run our kernels or the inputs are not on the CPU (the caller keeps the torch version). Never builds."""
    mod = on_cpu(tokens)
    if mod is None or logp.dtype != torch.float32 or n < 1:
        return None
    return mod.beam_tree(tokens, logp, n, math.log(min_prob) if min_prob > 0 else -math.inf)


def why_unavailable() -> str:
    load()
    return _state.get("why", "")


class RowLinear:
    """A weight [N, K] in one of KINDS, applied to flattened rows: `layer(x [M, K]) -> [M, N]` in bf16 (or fp32
    with `out_fp32=True`). Every output row is computed the same way whatever M is (rowlinear.cpp)."""

    def __init__(self, kind: str, codes: torch.Tensor, n_out: int, in_features: int,
                 scale: torch.Tensor | None = None, minimum: torch.Tensor | None = None, int8_acts: bool = False,
                 exact_codes: bool = False):
        if kind not in KINDS:
            raise ValueError(f"unknown weight kind {kind!r}; one of {', '.join(KINDS)}")
        if int8_acts and kind == "bf16":
            raise ValueError("8-bit activations need 4/8-bit weights (q4_1, q8_0), not bf16")
        # int8_acts: each token's row rounded to int8 per 32-block, integer dot products (qlinear.cpp) - the way
        # llama.cpp computes; a different (coarser) layer than the fp32-product one, row-invariant too.
        self.int8_acts = int8_acts
        # exact_codes: 4/8-bit codes enter the products as their own values (w = d * q (+ m), never rounded to bf16;
        # plinear.cpp on AVX512-BF16 CPUs), instead of decoded to bf16 weights; the `--quant int4` target.
        self.exact_codes = exact_codes and not int8_acts
        if in_features % 32:
            raise ValueError(f"in_features must be a multiple of 32 (got {in_features})")
        self.kind, self.codes, self.n_out, self.in_features = kind, codes.contiguous(), n_out, in_features
        empty = torch.empty(0, dtype=torch.float32)
        self.scale = empty if scale is None else scale.to(torch.float32).contiguous()
        self.minimum = empty if minimum is None else minimum.to(torch.float32).contiguous()
        self.shape = (n_out, in_features)
        self._packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # `packed`, once computed

    @classmethod
    def from_bf16(cls, w: torch.Tensor) -> "RowLinear":
        """w [N, K] in bfloat16: the same weights, a row-invariant kernel."""
        if w.dtype != torch.bfloat16:
            raise ValueError(f"from_bf16 needs a bfloat16 weight (got {w.dtype})")
        return cls("bf16", w.contiguous().view(torch.int16), w.shape[0], w.shape[1])

    @classmethod
    def q8_from_bf16(cls, w: torch.Tensor) -> "RowLinear":
        """w [N, K] quantised to Q8_0 (per 32-block d = max|w| / 127, q = round(w / d)) on 8-bit activations
        (qlinear): another layer than w's, about half its bytes, for weights whose exact values matter less than
        their cost (a drafter's: only its acceptance counts)."""
        n, k = w.shape
        if k % 32:
            raise ValueError(f"in_features must be a multiple of 32 (got {k})")
        b = w.detach().float().reshape(n, k // 32, 32)
        d = b.abs().amax(-1) / 127.0
        q = torch.round(b / torch.where(d > 0, d, torch.ones_like(d))[..., None]).clamp(-127, 127).to(torch.int8)
        return cls("q8_0", q.reshape(n, k), n, k, d, None, int8_acts=True)

    @classmethod
    def q4_from_bf16(cls, w: torch.Tensor) -> "RowLinear":
        """w [N, K] quantised to Q4_1 as GGML quantises (per 32-block min and d = (max - min) / 15 in fp32,
        q = trunc((w - min) / d + 0.5) in 0..15, d and min stored as fp16) on 8-bit activations (qlinear): a quarter
        of w's bytes and a coarser layer than `q8_from_bf16`'s, for weights judged by what they cost and accept (a
        drafter's)."""
        n, k = w.shape
        if k % 32:
            raise ValueError(f"in_features must be a multiple of 32 (got {k})")
        b = w.detach().float().reshape(n, k // 32, 32)
        lo = b.amin(-1, keepdim=True)
        d = (b.amax(-1, keepdim=True) - lo) / 15
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.trunc((b - lo) * inv + 0.5).clamp(0, 15).to(torch.uint8)
        # GGML's Q4_1 bytes: byte j of a block holds element j (low nibble) and element j + 16 (high nibble)
        codes = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2)
        return cls("q4_1", codes, n, k, d[..., 0].half(), lo[..., 0].half(), int8_acts=True)

    @classmethod
    def from_ggml(cls, kind: str, raw: torch.Tensor, n_out: int, in_features: int) -> "RowLinear":
        """raw: a GGUF tensor's bytes as uint8 [N, bytes per row] (GGML block layout, 32 weights per block)."""
        nb = in_features // 32
        blocks = raw.reshape(n_out, nb, -1)
        if kind == "q4_1":  # block: fp16 d, fp16 m, 16 bytes of nibbles
            d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
            m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
            return cls(kind, blocks[..., 4:20].reshape(n_out, -1), n_out, in_features, d, m)
        if kind == "q8_0":  # block: fp16 d, 32 int8
            d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
            return cls(kind, blocks[..., 2:34].reshape(n_out, -1).view(torch.int8), n_out, in_features, d)
        raise ValueError(f"unsupported GGML type {kind!r} (supported: q4_1, q8_0)")

    @staticmethod
    def cat(parts: list["RowLinear"]) -> "RowLinear":
        """The layers stacked along the output rows (fused qkv, gate/up); all of one kind and input width."""
        if len({(p.kind, p.in_features) for p in parts}) != 1:
            raise ValueError("RowLinear.cat needs layers of one kind and one input width")
        opt = (lambda ts: torch.cat(ts) if ts[0].numel() else None)
        if len({(p.int8_acts, p.exact_codes) for p in parts}) != 1:
            raise ValueError("RowLinear.cat needs layers that all read their codes alike (8-bit activations, exact)")
        return RowLinear(parts[0].kind, torch.cat([p.codes for p in parts]), sum(p.n_out for p in parts),
                         parts[0].in_features, opt([p.scale for p in parts]), opt([p.minimum for p in parts]),
                         parts[0].int8_acts, parts[0].exact_codes)

    def select_rows(self, index: torch.Tensor) -> "RowLinear":
        """The layer restricted to output rows `index` (e.g. undoing a row permutation)."""
        pick = (lambda t: t.reshape(self.n_out, -1)[index] if t.numel() else t)
        return RowLinear(self.kind, pick(self.codes), len(index), self.in_features, pick(self.scale) if
                         self.scale.numel() else None, pick(self.minimum) if self.minimum.numel() else None,
                         self.int8_acts, self.exact_codes)

    def _read_as(self, int8_acts: bool = False, exact_codes: bool = False) -> "RowLinear":
        """The same weights, their codes read another way."""
        return RowLinear(self.kind, self.codes, self.n_out, self.in_features,
                         self.scale if self.scale.numel() else None, self.minimum if self.minimum.numel() else None,
                         int8_acts, exact_codes)

    def with_int8_acts(self) -> "RowLinear":
        """The same weights applied to 8-bit activations with integer dot products (`qlinear.cpp`)."""
        return self._read_as(int8_acts=True)

    def with_exact_codes(self) -> "RowLinear":
        """The same codes read as their own values on bf16 activations (`exact_codes`; plinear.cpp)."""
        if self.kind == "bf16":
            raise ValueError("exact codes need 4/8-bit weights (q4_1, q8_0), not bf16")
        return self._read_as(exact_codes=True)

    @property
    def path(self) -> str:
        """The kernel that reads this layer here: "qlinear" (8-bit activations), "plinear" (the codes' exact values
        on an AVX512-BF16 CPU), else "rowlinear" (whose AVX2 path multiplies the codes' exact fp32 values too).
        Asked when the layer runs or is stacked: the ISA may be switched (`set_isa`) in between."""
        if self.int8_acts:
            return "qlinear"
        mod = load() if self.exact_codes else None
        if mod is not None and mod.plinear_available():
            return "plinear"
        return "rowlinear"

    def packed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The codes as qlinear.cpp and plinear.cpp read them. qlinear (8-bit activations): groups of 16 rows, each
        block's codes in 64-byte chunks holding four consecutive elements of the 16 rows (stated in qlinear.cpp);
        scales fp32 [groups, blocks, 16]; q4_1 mins fp32 / q8_0 int32 corrections (128 x the block's code sum)
        alike. plinear (exact codes): one uint8 tensor of records, codes and fp16 scales together, per band of 32
        rows and block (stated in plinear.cpp), and two empty tensors. Rows past N are zeros. Computed once, then
        kept."""
        if self._packed is None:  # on huge pages: the kernels stream these every step (hugepages.py)
            self._packed = tuple(hugepages.place(t) for t in pack_codes(self))
        return self._packed

    def dequantize(self) -> torch.Tensor:
        """The weights as fp32 [N, K], computed in torch (for checks and for the reference model)."""
        n, k = self.shape
        if self.kind == "bf16":
            return self.codes.view(torch.bfloat16).float()
        if self.kind == "q8_0":
            return (self.codes.float().view(n, k // 32, 32) * self.scale.view(n, -1, 1)).view(n, k)
        b = self.codes.view(n, k // 32, 16)
        q = torch.cat([b & 0x0F, b >> 4], dim=-1).float()  # element j low nibble, j + 16 high nibble
        return torch.addcmul(self.minimum.view(n, -1, 1), self.scale.view(n, -1, 1), q).view(n, k)

    def as_bf16(self) -> torch.Tensor:
        """The weights [N, K] in bfloat16 as rowlinear's AVX512-BF16 path decodes 4/8-bit codes: fma(d, q, m) (Q8_0:
        d * q) rounded once to fp32, then to bf16. `dequantize` computes exactly that fp32 value: d is an fp16 value
        (11 significant bits) and q has at most 8, so d * q is exact in fp32 and only the addition rounds."""
        return self.dequantize().bfloat16()

    def __call__(self, x: torch.Tensor, out_fp32: bool = False) -> torch.Tensor:
        """x [M, K] (bf16 or fp32) -> [M, N]."""
        mod = load()
        if mod is None:
            raise RuntimeError(f"row-invariant kernels unavailable: {why_unavailable()}")
        path = self.path
        if path == "qlinear":
            return mod.qlinear(x, *self.packed(), KINDS[self.kind], self.n_out, not out_fp32)
        if path == "plinear" and x.dtype == torch.bfloat16:  # fp32 rows: rowlinear's fp32 products (exact codes too)
            return mod.plinear(x, self.packed()[0], KINDS[self.kind], self.n_out, not out_fp32)
        return mod.rowlinear(x, self.codes, self.scale, self.minimum, KINDS[self.kind], self.n_out, not out_fp32)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, head: torch.Tensor, tail: torch.Tensor,
           scale: float) -> torch.Tensor:
    """q [B, Q, nh, hd] bf16; keys / values: a cache layer [B, kvh, T, hd (+1)]; head [B, Q, S] bool; tail [B, Q, L]
    slots (-1: none) -> o [B, Q, nh * hd] bf16 (attention.cpp)."""
    return _loaded().attend(q, keys, values, head, tail, scale)


def set_attention_layout(name: str) -> str:
    """"split": `attend` keeps short key lists on its per-(query, head) layout; "auto": it runs them grouped per
    (query, kv head) (head dims 64 and 128; 16 lanes on AVX-512, 8 on AVX2). The same bits either way (tests, A/B
    benchmarks). Returns the previous one."""
    return _loaded().attend_set_layout(name)


def key_lists(positions: torch.Tensor, slots: torch.Tensor, kv_len: int, visible: torch.Tensor | None,
              tail_depth: int, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """positions / slots [B, Q] int64, visible [B, 1, Q, kv_len] bool or None -> (head [B, Q, kv_len] bool, tail
    [B, Q, L] slots, -1: none): each query's key lists for `attend` (keylists.cpp; backends/lean.py `_Split`)."""
    return _loaded().key_lists(positions, slots, kv_len, visible, tail_depth, L)


def use_rowlinear_in(module: torch.nn.Module) -> int:
    """Route every bias-free bfloat16 `nn.Linear` of `module` through `RowLinear` (for inference only: the drafter
    next to a target on our kernels, where torch's bf16 GEMM on 16-128 rows is what a drafting step waits for).
    The kernel reads the same weight storage, moved onto huge pages (as the target's, `hugepages.py`; the
    Parameter's data is replaced in place). Returns how many layers were routed."""
    n = 0
    for m in module.modules():
        if (isinstance(m, torch.nn.Linear) and m.bias is None and m.weight.dtype == torch.bfloat16
                and m.in_features % 32 == 0 and m.weight.is_contiguous() and m.weight.device.type == "cpu"):
            m.weight.data = hugepages.place(m.weight.data)
            lin = RowLinear.from_bf16(m.weight.detach())
            m.forward = (lambda x, lin=lin: lin(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], lin.n_out))
            n += 1
    return n


def stack_linear(w: RowLinear):
    """`w` as the layer stack's C++ linear (kernels/layers.cpp reads the same code, scale and minimum tensors)."""
    path = w.path
    codes, scale, minimum = w.packed() if path != "rowlinear" else (w.codes, w.scale, w.minimum)
    return load().StackLinear(codes, scale, minimum, KINDS[w.kind], w.n_out, PATHS[path])
