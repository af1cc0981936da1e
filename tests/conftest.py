"""Tiny random targets of three architectures (Llama, Qwen3, Gemma3) and drafters for them."""

import os

import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen3Config)

from dflashkit import DFlashConfig, DFlashDrafter, Target
from dflashkit.backends.lean import LeanTarget

VOCAB = 96

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on a 2-core machine: two OpenMP pools of two threads each would spin against each
    # other. One thread per worker, and for the subprocesses (CLI, torchrun, servers) the tests start.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_sessionstart(session):
    """Build the CPU kernels once, in the controller, before the workers start: on a fresh machine the first build
    takes minutes of g++, and a test with a deadline (a server start) would otherwise pay for it."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        from dflashkit import kernels

        kernels.load()


@pytest.fixture
def dot_product_isa():
    """rowlinear on its AVX-512 BF16 dot products (an AMX CPU kept off its tiles) for one test, or a skip where the CPU
    has none; "auto" again afterwards."""
    from dflashkit import kernels

    if not kernels.available():
        pytest.skip(f"our kernels are unavailable here: {kernels.why_unavailable()}")
    got = kernels.set_isa("avx512bf16")
    if got == "avx512bf16":
        yield got
    kernels.set_isa("auto")
    if got != "avx512bf16":
        pytest.skip("this CPU has no AVX512-BF16: 4-bit codes take the 8-lane fp32 path")


def tiny_config(arch: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        return LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=True)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=8, tie_word_embeddings=False)
    if arch == "gemma3":
        return Gemma3TextConfig(**common, head_dim=8, sliding_window=8, layer_types=None,
                                sliding_window_pattern=3, query_pre_attn_scalar=8)
    raise ValueError(arch)


def make_target(arch: str, dtype=torch.float64, seed: int = 0, backend: str = "hf") -> Target:
    """A tiny random target; backend "hf" (transformers' modules) or "lean" (dflashkit's own forward)."""
    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    # Sharper logits than the default init, so greedy continuations are varied rather than constant.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model = model.to(dtype)
    return LeanTarget(model) if backend == "lean" else Target(model)


def make_drafter(target: Target, block_size: int = 8, layers: int = 2, seed: int = 1, mask_token_id: int = 3,
                 draft_vocab_size=None, arch: str = "dflash") -> DFlashDrafter:
    """A tiny random drafter for `target`; arch "dflash2" adds the convolutions and the candidate selector."""
    v2 = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=16, selector_top_k=6) if arch == "dflash2" else {}
    cfg = DFlashConfig(hidden_size=target.hidden_size, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, intermediate_size=48, vocab_size=target.vocab_size,
                       num_target_layers=target.num_layers, mask_token_id=mask_token_id, block_size=block_size,
                       target_layer_ids=[1, 3], rope_theta=10000.0, draft_vocab_size=draft_vocab_size, arch=arch,
                       **v2)
    return DFlashDrafter(cfg).init_weights(seed, std=0.3).to(target.dtype)


ARCHS = ["llama", "qwen3", "gemma3"]


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


def skip_random_drafts_on_lean(backend: str, oracle: bool) -> None:
    """CI time: on the lean backend the greedy tests run their oracle half (drafts mostly accepted, every acceptance
    length and tree branch exercised); the random-draft half adds little there and runs on hf."""
    if backend == "lean" and not oracle:
        pytest.skip("random drafts run on the hf backend; lean runs the oracle cases")


@pytest.fixture(params=["hf", "lean"])
def backend(request):
    """The lossless tests run on both target backends."""
    return request.param


# ---- the real server (test_server.py, test_server_hardening.py) ------------------------------------------------
@pytest.fixture(scope="session")
def server():
    """The real SmolLM2 (float32, block 8, the adaptive step policy as `dflashkit serve` runs it) behind the OpenAI
    server, shared by the server test modules."""
    from dflashkit import DecodeConfig, DFlashEngine
    from dflashkit.loader import load_default_drafter, load_target
    from dflashkit.server import build_app, serve_in_thread

    target, tok = load_target(dtype="float32")
    drafter, _ = load_default_drafter(target, tok)
    engine = DFlashEngine(target, drafter, tokenizer=tok, config=DecodeConfig(block_size=8, policy="adaptive"))
    app = build_app(engine, tok, "smollm2-test", max_batch=8, max_queue=16, max_len=1024)
    srv, th, url = serve_in_thread(app)
    yield {"url": url, "engine": engine, "tok": tok, "app": app}
    srv.should_exit = True
    th.join(30)


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server["url"] + "/v1", api_key="none", max_retries=0, timeout=120)


def assert_invariant_unless_torch_linear_is_not(t, inv) -> None:
    """For a lean target on torch's kernels: bitwise batch invariance, unless torch's own F.linear is shown not to be
    row-invariant on this CPU for the target's weight shapes (`linear_row_change`; oneDNN picks kernels by shape:
    on an AVX512-BF16 EPYC it changes, on AVX2 hosts it did not). Our forward's own invariance is then still tested
    on our kernels (tests/test_kernels.py), and the self-check names the cause (tests/test_lean.py,
    test_the_self_check_names_a_torch_linear_that_changes_with_the_row_count)."""
    from dflashkit.invariance import linear_row_change

    if inv.exact and inv.max_diff == 0.0:
        return
    change = linear_row_change(t.linear_weights())
    assert change is not None, f"not batch-invariant although torch's F.linear is row-invariant here: {inv}"
