"""The real default target: SmolLM2-135M-Instruct from the bundled GGUF (converted once to a cache)."""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflashkit import DecodeConfig, DFlashEngine
from dflashkit.lookup import LookupParams
from dflashkit.loader import (BUNDLED_DRAFTER, probe_logits, convert_gguf, default_gguf, encode_chat,
                              load_default_drafter, load_target, resolve_target_dir)

pytestmark = pytest.mark.real

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "What is the capital of France? Answer in one sentence.",
           "List three uses of a paperclip."]


@pytest.fixture(scope="module")
def real():
    target, tok = load_target(dtype="float32")
    drafter, _ = load_default_drafter(target, tok)
    return DFlashEngine(target, drafter, tokenizer=tok, config=DecodeConfig()), tok


def test_conversion_is_reproducible_and_verified(tmp_path):
    cached = resolve_target_dir(None)
    manifest = json.loads((cached / "dflashkit-conversion.json").read_text())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # another thread count than the check below: the recorded digest must not depend on it
    try:
        again = convert_gguf(default_gguf(), tmp_path / "again")  # raises unless its logits equal the GGUF model's
    finally:
        torch.set_num_threads(threads)
    made = json.loads((again / "dflashkit-conversion.json").read_text())
    assert made["source_sha256"] == manifest["source_sha256"]
    assert (again / "model.safetensors").read_bytes() == (cached / "model.safetensors").read_bytes()
    # the recorded digest is the cached copy's probe computed here at 1 thread (2 above): equal only because the probe
    # pins its thread count; computed, not read from the cached manifest, which an older version may have made
    torch.set_num_threads(1)
    try:
        cached_probe = probe_logits(AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32))
    finally:
        torch.set_num_threads(threads)
    assert made["probe_logits_sha256"] == hashlib.sha256(cached_probe.numpy().tobytes()).hexdigest()


def test_the_same_gguf_elsewhere_finds_its_conversion_by_content(tmp_path, monkeypatch):
    """A copy of the default GGUF at another path (another virtualenv's site-packages) resolves to the cached
    conversion already made, not a second one: the cache is keyed by the file's bytes."""
    import shutil

    import dflashkit.loader as loader

    cached = resolve_target_dir(None)
    copy = tmp_path / "venv2" / default_gguf().name
    copy.parent.mkdir()
    shutil.copyfile(default_gguf(), copy)
    monkeypatch.setattr(loader, "convert_gguf", lambda *a: pytest.fail("converted the same model again"))
    assert resolve_target_dir(copy) == cached
    # the GGUF the cached copy reads its codes from (--quant int4) is found even when the recorded one has gone
    manifest = json.loads((cached / loader.MANIFEST).read_text())
    monkeypatch.setattr(loader.Path, "is_file", lambda p: str(p) != manifest["source"] and os.path.isfile(p))
    found = loader.gguf_source(cached)
    monkeypatch.undo()
    assert found != manifest["source"] and loader.content_key(Path(found)) == manifest["source_sha256"][:16]


def test_greedy_speculative_matches_autoregressive_up_to_near_ties(real, capsys):
    """float32: a block forward rounds differently from a one-token forward, so a divergence is allowed
    only where the target's top-2 logit gap is below 1e-3 (a near-tie); the test reports how many."""
    eng, tok = real
    prompts = [encode_chat(tok, p) for p in PROMPTS]
    n = 64
    ar = eng.generate(prompts, max_new_tokens=n, block_size=1)
    sp = eng.generate(prompts, max_new_tokens=n, block_size=8)
    # the same with an n-gram lookup branch beside the block (a draft tree)
    hybrid = DFlashEngine(eng.target, eng.drafter, tokenizer=tok,
                          config=DecodeConfig(lookup=LookupParams(max_tokens=8, skip_drafter_n=2)))
    sp_lookup = hybrid.generate(prompts, max_new_tokens=n, block_size=8)
    assert max(a for g in sp_lookup for a in g.stats.accepted) > 0
    # the CLI's tree: a pruned drafter tree over the 16K most frequent ids + an adaptive lookup branch, B=16,
    # drafted every step (policy="fixed"), so its tau does not depend on how fast this host is
    tree = DFlashEngine(eng.target, eng.drafter, tokenizer=tok, config=DecodeConfig.recommended(policy="fixed"))
    sp_tree = tree.generate(prompts, max_new_tokens=n)
    assert sum(g.stats.tau for g in sp_tree) / len(sp_tree) > 1.5
    # the CLI's default: the same tree under the adaptive policy, which drafts only where its timings say it pays.
    # Why no tau bound here: on a host where drafting costs more it rightly decodes more steps plainly (CI read 1.48)
    default = DFlashEngine(eng.target, eng.drafter, tokenizer=tok)  # DecodeConfig.recommended()
    assert default.config.policy == "adaptive"
    sp_default = default.generate(prompts, max_new_tokens=n)
    near_ties = 0
    runs = [(p, a, s) for p, a, *spec in zip(prompts, ar, sp, sp_lookup, sp_tree, sp_default) for s in spec]
    for p, a, s in runs:
        if a.tokens == s.tokens:
            continue
        i = next(k for k, (x, y) in enumerate(zip(a.tokens, s.tokens)) if x != y)
        with torch.no_grad():
            logits = eng.target.reference_logits(torch.tensor([p + a.tokens[:i]]))[0, -1]
        top2 = logits.topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < 1e-3, f"divergence at token {i} with top-2 gap {gap} (not a near-tie)"
        near_ties += 1
    with capsys.disabled():
        print(f"\n[real SmolLM2, float32] {near_ties} of {len(runs)} greedy outputs diverge, all at near-ties")


def test_lean_float32_logits_equal_transformers_on_real_text(real):
    """The lean forward computes SmolLM2 as transformers does: prefill and a verify block over the cache, in float32,
    as close to the float64 truth as transformers' own float32 (whose eager and sdpa paths differ by ~8e-5)."""
    eng, tok = real
    hf = load_target(dtype="float32", backend="hf")[0]
    lean = eng.target
    assert type(lean).__name__ == "LeanTarget"  # auto picks the lean backend for the default target
    ids = torch.tensor([encode_chat(tok, PROMPTS[0]) + encode_chat(tok, PROMPTS[2])])
    S = ids.shape[1]
    ref, truth = hf.reference_logits(ids), load_target(dtype="float64", backend="hf")[0].reference_logits(ids)
    cache = lean.new_cache(1, S)
    lean.forward(ids[:, :S - 16], torch.arange(S - 16)[None], cache, kv_len=S - 16, taps=False)
    h, _ = lean.forward(ids[:, S - 16:], torch.arange(S - 16, S)[None], cache, kv_len=S, taps=False)
    full, block = lean.reference_logits(ids), lean.logits(h)
    hf_err = (ref.double() - truth).abs().max()
    assert (full.double() - truth).abs().max() <= 1.5 * hf_err
    assert (block.double() - truth[:, S - 16:]).abs().max() <= 1.5 * hf_err
    assert (full - ref).abs().max() <= 3e-4 and (block - ref[:, S - 16:]).abs().max() <= 3e-4


@pytest.mark.parametrize("kernel,quant", [("torch", None), ("rowlinear", None), ("auto", "int4")])
def test_bf16_speculative_output_is_bitwise_autoregressive_on_the_real_target(capsys, kernel, quant):
    """bfloat16, the default dtype: the measured self-check says the lean kernels are batch-invariant here, and
    the chain and the default tree + lookup give exactly AR's tokens (no near-tie allowance). Under torch's
    F.linear, our rowlinear kernel, and the 4-bit target (the GGUF's own Q4_1 codes, exact against its own AR)."""
    from dflashkit.invariance import linear_row_change, measure
    from dflashkit.kernels import available, why_unavailable

    if (kernel == "rowlinear" or quant) and not available():
        pytest.skip(f"rowlinear kernel unavailable: {why_unavailable()}")
    target, tok = load_target(dtype="bfloat16", kernel=kernel, quant=quant)
    assert target.kernel == (quant or kernel)
    inv = measure(target)
    if kernel == "torch" and not inv.exact:  # torch's F.linear is row-invariant on some CPUs only
        cause = linear_row_change(target.linear_weights())
        assert cause, f"not batch-invariant although torch's F.linear is row-invariant here: {inv}"
        pytest.skip(f"{cause} on this CPU (our kernels are tested below)")
    assert inv.exact, f"the lean kernels are not batch-invariant on this machine: {inv}"
    drafter, _ = load_default_drafter(target, tok)
    prompts = [encode_chat(tok, p) for p in PROMPTS]
    ar = DFlashEngine(target, drafter, tokenizer=tok, config=DecodeConfig.autoregressive()).generate(
        prompts, max_new_tokens=40)
    chain = DFlashEngine(target, drafter, tokenizer=tok, config=DecodeConfig()).generate(prompts, max_new_tokens=40)
    # the fixed tree drafts every step (tau is checked on it); the default adaptive policy may decline to draft
    # where drafting does not pay on this machine, but whatever it verifies must still be AR's tokens
    tree = DFlashEngine(target, drafter, tokenizer=tok, config=DecodeConfig.recommended(policy="fixed")).generate(
        prompts, max_new_tokens=40)
    adaptive = DFlashEngine(target, drafter, tokenizer=tok).generate(prompts, max_new_tokens=40)
    assert [g.tokens for g in chain] == [g.tokens for g in ar]
    assert [g.tokens for g in tree] == [g.tokens for g in ar]
    assert [g.tokens for g in adaptive] == [g.tokens for g in ar]
    assert sum(g.stats.tau for g in tree) / len(tree) > 1.5
    with capsys.disabled():
        print(f"\n[real SmolLM2, bfloat16, lean, {quant or kernel}] chain and tree+lookup == AR on {len(prompts)} "
              f"prompts, tau "
              f"{sum(g.stats.tau for g in chain) / 3:.2f} / {sum(g.stats.tau for g in tree) / 3:.2f}")


def test_bf16_continuations_do_not_depend_on_how_the_prompt_was_prefilled():
    """A long prompt prefilled whole, or in chunks of 7 / 64 / 1,000 tokens with other rows decoding between the
    chunks (the server's chunked prefill): bit-identical greedy and seeded continuations, equal to plain decoding's,
    in bfloat16 on the real target and the default kernels."""
    from dflashkit import SamplingParams

    target, tok = load_target(dtype="bfloat16")
    drafter, _ = load_default_drafter(target, tok)
    eng = DFlashEngine(target, drafter, tokenizer=tok, config=DecodeConfig.recommended(policy="fixed"))
    text = " ".join(f"Step {i}: the river carried {i * 7 % 13} boats past the old mill before noon." for i in range(24))
    long = encode_chat(tok, f"Summarise this log in two sentences.\n{text}")
    assert len(long) > 300
    others = [encode_chat(tok, p) for p in PROMPTS[:2]]
    for params in (SamplingParams(), SamplingParams(temperature=0.7, seed=1234)):
        whole = eng.generate([long], sampling=params, max_new_tokens=24)[0].tokens
        ar = eng.generate([long], sampling=params, max_new_tokens=24, config=DecodeConfig.autoregressive())[0].tokens
        assert whole == ar
        for chunk in (7, 64, 1000):
            batch = eng.new_batch(1024)
            batch.add([eng.sequence(i + 1, p, SamplingParams(temperature=0.9), 40) for i, p in enumerate(others)])
            seq = eng.sequence(0, long, params, 24)
            pp = batch.begin_prefill(seq)
            while batch.prefill_chunk(pp, chunk) is None:
                batch.step()  # the other rows decode between the chunks
            while not seq.finished:
                batch.step()
            assert seq.generated == whole, f"chunks of {chunk}, {params}"


def test_cli_generate_json_and_stop_string():
    cmd = [sys.executable, "-m", "dflashkit.cli", "generate", "--prompt", PROMPTS[1], "--max-new-tokens", "40",
           "--json", "--dtype", "float32"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert "Paris" in res["text"] and res["stats"]["new_tokens"] <= 40 and res["stats"]["tau"] >= 1
    stopped = subprocess.run(cmd + ["--stop", "Paris"], capture_output=True, text=True, timeout=300)
    res2 = json.loads(stopped.stdout)
    assert "Paris" not in res2["text"] and res2["stats"]["finish_reason"] == "stop"
    assert res["text"].startswith(res2["text"])


@pytest.mark.parametrize("argv, message", [
    (["--block-size", "0"], "block"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--drafter", "/nonexistent"], "not a directory"),
    (["--target", "/nonexistent"], "does not exist"),
    (["--lookup", "-1"], "lookup length"),
    (["--tree", "-1"], "tree size"),
    (["--tree-min-prob", "1.5"], "tree_min_prob"),
    (["--draft-vocab", "99999"], "exceeds"),
    (["--lookup-per-n", "-2"], "tokens_per_n"),
    (["--lookup-corpus", "-1"], "corpus_n"),
])
def test_cli_bad_input_names_the_remedy(argv, message):
    out = subprocess.run([sys.executable, "-m", "dflashkit.cli", "generate", "--prompt", "hi", "--max-new-tokens", "4"]
                         + argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


def test_cli_rejects_bad_input_before_loading_and_explains_itself(tmp_path, capsys):
    from dflashkit.cli import main

    fake = tmp_path / "model.gguf"
    fake.write_text("not a model")
    for argv, message in [(["--prompt", "   "], "--prompt is empty"), (["--prompt", "hi", "--max-new-tokens", "0"],
                          "--max-new-tokens"), (["--prompt", "hi", "--target", str(fake)], "not a GGUF file")]:
        assert main(["generate"] + argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and "dflashkit 0." in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--lookup LOOKUP" in text and "(default: 16)" in text and "(default: 20)" in text
    assert "(default: None)" not in text and "--stream" in text and "(default: adaptive)" in text
    assert main(["bench", "--dataset", "mtbench"]) == 2  # a bad dataset name is caught before any weights load
    assert "choose from humaneval" in capsys.readouterr().err
    assert not _flags_without_help(), "every flag needs a description"


def _flags_without_help() -> list[str]:
    """Every subcommand's options (data's too) that show no description in --help."""
    import argparse

    from dflashkit.cli import build_parser

    missing, todo = [], [("dflashkit", build_parser())]
    while todo:
        name, p = todo.pop()
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += [(f"{name} {k}", sub) for k, sub in a.choices.items()]
            elif not a.help and a.option_strings:
                missing.append(f"{name} {a.option_strings[-1]}")
    return missing


def test_cli_generate_streams_and_compares_with_ar():
    cmd = [sys.executable, "-m", "dflashkit.cli", "generate", "--prompt", PROMPTS[1], "--max-new-tokens", "24",
           "--stream", "--compare"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "identical output: True" in out.stdout, out.stdout
    # the lean backend, with whichever kernel set `--kernel auto` picked on this CPU (e.g. LeanTarget+rowlinear+attend)
    assert re.search(r"exactness on this machine \(LeanTarget[+a-z0-9.]*, bfloat16\): bitwise", out.stdout), out.stdout
    assert "Paris" in out.stdout.split("[stats]")[0]  # the streamed answer came before the statistics


@pytest.mark.parametrize("quant", ["int4", "int4-a8"])
def test_cli_generate_int4_target_compares_with_its_own_ar(quant):
    """`--quant int4` / `int4-a8` through the CLI a user types: the GGUF's own 4-bit codes (int4-a8: on 8-bit
    activations), and DFlash output identical to that target's own AR output (its baseline), judged bitwise."""
    from dflashkit.kernels import available, why_unavailable

    if not available():
        pytest.skip(f"our kernels are unavailable here: {why_unavailable()}")
    cmd = [sys.executable, "-m", "dflashkit.cli", "generate", "--prompt", PROMPTS[1], "--max-new-tokens", "16",
           "--quant", quant, "--compare"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "identical output: True" in out.stdout, out.stdout
    line = rf"exactness on this machine \(LeanTarget\+{re.escape(quant)}[+a-z0-9.]*, bfloat16\): bitwise"
    assert re.search(line, out.stdout), out.stdout


def test_quant_auto_runs_the_gguf_codes_where_avx512_bf16_else_the_bf16_model(monkeypatch):
    """`--quant auto` (the default): the default GGUF target runs int4 (its own codes, plinear) where our kernels take
    AVX512-BF16 dot products, else the bf16 model; DFLASHKIT_BF16_WEIGHTS=1, and a GGUF whose codes cannot run (made
    to fail here), keep the bf16 model (on its codes' same bits where the CPU decodes them so)."""
    import dflashkit.backends.quant as quant
    from dflashkit.errors import DFlashError
    from dflashkit.kernels import available, isa, why_unavailable
    from dflashkit.loader import load_target

    if not available():
        pytest.skip(f"our kernels are unavailable here: {why_unavailable()}")
    wide = isa() in ("avx512bf16", "amx")
    t, _ = load_target(None, dtype="bfloat16")
    assert t.kernel == ("int4" if wide else "rowlinear"), t.engine_name
    real = quant.attach_gguf_codes

    def only_same_bits(*a, **k):  # the codes' own values fail as a GGUF of other tensor types would
        if not k.get("same_bits"):
            raise DFlashError("--quant int4 needs Q4_1 / Q8_0 tensors (a test)")
        return real(*a, **k)
    monkeypatch.setattr(quant, "attach_gguf_codes", only_same_bits)
    fell_back, _ = load_target(None, dtype="bfloat16")
    assert fell_back.kernel == "rowlinear" and ("+codes" in fell_back.engine_name) == wide, fell_back.engine_name
    with pytest.raises(DFlashError, match="Q4_1"):  # asked for by name, it is an error, not a fallback
        load_target(None, dtype="bfloat16", quant="int4")
    monkeypatch.undo()
    monkeypatch.setenv("DFLASHKIT_BF16_WEIGHTS", "1")
    assert load_target(None, dtype="bfloat16")[0].kernel == "rowlinear"


def test_the_default_target_reads_its_weights_as_gguf_codes_with_the_same_bits(monkeypatch, dot_product_isa):
    """On an AVX512-BF16 CPU the bf16 default target reads its weights as the GGUF's 4-bit codes (rowlinear decodes
    them to exactly the loaded bf16 values): prefill and verify logits and the drafter's taps equal, to the bit, those
    of the same target on its bf16 weights (on an AMX CPU: on the AVX-512 dot products, where both run; there bf16
    weights otherwise take the tile instructions, other bits)."""
    from dflashkit.loader import load_target

    codes, tok = load_target(None, dtype="bfloat16", quant="none")  # the bf16 model (auto: int4 on such CPUs)
    monkeypatch.setenv("DFLASHKIT_BF16_WEIGHTS", "1")
    plain, _ = load_target(None, dtype="bfloat16", quant="none")
    assert "+codes" in codes.engine_name and "+codes" not in plain.engine_name
    ids = torch.tensor([tok(PROMPTS[0])["input_ids"]])
    P = ids.shape[1]
    block = torch.randint(0, 5000, (1, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(P, P + 16)[None]
    got = []
    for t in (codes, plain):
        t.set_taps([1, 14, 28])
        c = t.new_cache(1, P + 16)
        h, f = t.forward(ids, torch.arange(P)[None], c, kv_len=P, taps=True)
        h2, f2 = t.forward(block, pos, c, kv_len=P + 16, slots=pos, taps=True)
        got.append([t.logits(h), f, t.logits(h2), f2, h2])
    for a, b in zip(*got):
        assert torch.equal(a, b)
    # the drafter's reduced-vocabulary head is those rows of the codes: the bf16 rows' logits, to the bit
    from dflashkit.kernels import RowLinear
    from dflashkit.proposers import draft_head

    d2t = torch.randperm(codes.vocab_size, generator=torch.Generator().manual_seed(1))[:4096].sort().values
    head = draft_head(codes, d2t)
    assert isinstance(head, RowLinear) and head.kind == "q8_0" and not isinstance(draft_head(plain, d2t), RowLinear)
    assert torch.equal(codes.logits(got[0][4], head), plain.logits(got[1][4], plain.lm_head_weight[d2t]))
    # ... except on AMX, where the bf16 rows run on the tiles (cheaper there than the codes' dot products)
    from dflashkit import kernels

    monkeypatch.setattr(kernels, "isa", lambda: "amx")
    assert torch.equal(draft_head(codes, d2t), codes.lm_head_weight[d2t])
    # the codes are cached in a folder of their own: engines that load every *.safetensors of the converted
    # directory (vLLM) must find the model's weights there and nothing else
    from dflashkit.loader import resolve_target_dir

    assert [p.name for p in resolve_target_dir(None).glob("*.safetensors")] == ["model.safetensors"]


def test_prompt_longer_than_context(real):
    eng, _ = real
    from dflashkit import DFlashError
    with pytest.raises(DFlashError, match="context"):
        eng.generate([[100] * 8200], max_new_tokens=8)


def test_cli_data_generate_regenerates_responses_and_resumes(tmp_path):
    """`dflashkit data generate` end to end on the real target (it once crashed on every call)."""
    from dflashkit.data import load_shards

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "split": "heldout",
                                           "messages": [{"role": "user", "content": p}]}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    cmd = [sys.executable, "-m", "dflashkit.cli", "data", "generate", "--prompts", str(prompts), "--out",
           str(tmp_path / "data"), "--split", "heldout", "--chunk-size", "2", "--max-new-tokens", "6",
           "--dtype", "float32"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"split": "heldout", "chunks": 2}
    shards = load_shards(tmp_path / "data", "heldout")
    assert sum(len(s) for s in shards) == 3
    first = (tmp_path / "data" / "heldout-00000.npz").stat().st_mtime_ns
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)  # finished chunks are kept
    assert again.returncode == 0 and (tmp_path / "data" / "heldout-00000.npz").stat().st_mtime_ns == first
    # a plain {"prompt": ...} file, the format `dflashkit train --prompts` takes (it crashed with KeyError 'split')
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    cmd = [sys.executable, "-m", "dflashkit.cli", "data", "generate", "--prompts", str(plain), "--out",
           str(tmp_path / "plain-data"), "--split", "train", "--max-new-tokens", "4", "--dtype", "float32"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"split": "train", "chunks": 1}
    assert sum(len(s) for s in load_shards(tmp_path / "plain-data", "train")) == 3  # none is held out at 2 %
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    out = subprocess.run(cmd[:6] + [str(broken)] + cmd[7:], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "one JSON object per line" in out.stderr and "Traceback" not in out.stderr


def test_cli_bench_and_export_run_end_to_end(tmp_path, capsys):
    """`dflashkit bench` and `dflashkit export` through the CLI entry point (their flag handling changed)."""
    from dflashkit.cli import main

    out = tmp_path / "bench"
    assert main(["bench", "--dataset", "humaneval", "--limit", "1", "--max-new-tokens", "4", "--block-size", "4",
                 "--methods", "ar,dflash,dflash-lookup", "--dtype", "float32", "--noise-prompts", "1",
                 "--batch-size", "1", "--sweep-rounds", "2", "--out", str(out)]) == 0
    report = json.loads((out / "results.json").read_text())
    rows = report["results"]["humaneval"]
    assert {c["1"]["rounds"] for c in report["sweeps"]["batch"]["humaneval"].values()} == {2}
    assert {"ar", "dflash-b4", "dflash-b4-tree20p0.03-lookup16-adaptive"} <= set(rows)  # the CLI's default system
    assert main(["bench", "--dataset", "humaneval", "--batch-size", "8", "--sweep-rounds", "0"]) == 2
    assert "--sweep-rounds >= 1" in capsys.readouterr().err
    assert main(["export", "--format", "zlab", "--out", str(tmp_path / "zlab")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["format"] == "zlab"
    assert (tmp_path / "zlab" / "config.json").is_file()
    # llama.cpp's GGUF: the draft body, the target GGUF's tokenizer, a reduced draft vocabulary (d2t + head rows)
    from gguf import GGUFReader

    assert main(["export", "--format", "gguf", "--draft-vocab", "4096", "--out", str(tmp_path / "d.gguf")]) == 0
    r = GGUFReader(str(tmp_path / "d.gguf"))
    assert r.fields["general.architecture"].contents() == "dflash"
    taps = json.loads((BUNDLED_DRAFTER / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    assert r.fields["dflash.target_layers"].contents() == [i + 1 for i in taps]  # llama.cpp counts layer inputs
    assert {t.name: list(t.shape) for t in r.tensors if t.name in ("d2t", "output.weight")} == {
        "d2t": [4096], "output.weight": [576, 4096]}
    assert main(["export", "--format", "zlab", "--draft-vocab", "8", "--out", str(tmp_path / "x")]) == 2
    assert "gguf only" in capsys.readouterr().err


def test_a_drafter_without_a_corpus_for_the_default_target_gets_the_bundled_one(tmp_path):
    """The lookup's corpus is the default target's earlier answers and its token ranking their tokens by frequency,
    shipped beside the bundled drafter: a drafter directory without them (a user's own drafter for the default
    target) gets them, so it drafts over the same draft vocabulary; the same data, not a copy."""
    from dflashkit.checkpoint import CORPUS, RANKING
    from dflashkit.loader import load_models

    for f in BUNDLED_DRAFTER.iterdir():
        if f.name not in (CORPUS, RANKING):
            (tmp_path / f.name).symlink_to(f)
    _, _, drafter, _ = load_models(drafter=str(tmp_path), dtype="float32", check=False)
    own = load_default_drafter(*load_target(dtype="float32", check=False))[0]
    assert drafter.corpus is not None and own.corpus is not None
    assert drafter.corpus.size == own.corpus.size > 0
    assert torch.equal(torch.as_tensor(drafter.corpus.padded), torch.as_tensor(own.corpus.padded))
    assert own.token_ranking and drafter.token_ranking == own.token_ranking