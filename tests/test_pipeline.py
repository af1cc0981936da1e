"""`dflashkit train --target ... --out DIR` (one command, resumable) and `dflashkit check-drafter` on the real target."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflashkit.pipeline import split_prompts

PROMPTS = [
    "Write a haiku about the sea.", "What is 17 times 23?", "Name three primary colors.",
    "Explain what a list comprehension is in Python.", "Give me a synonym for happy.",
    "How many legs does a spider have?", "Write one sentence about autumn.", "What is the capital of Italy?",
    "Translate 'good morning' into French.", "List the days of the week.", "What does CPU stand for?",
    "Write a Python function that returns the square of a number.", "Why is the sky blue? One sentence.",
    "Suggest a name for a cat.", "What is the boiling point of water in Celsius?", "Count from 1 to 5.",
]


def test_split_prompts_holds_out_part_of_a_small_user_file():
    recs = [{"id": str(i), "messages": [], "split": "train"} for i in range(16)]
    out = split_prompts(recs, None, 8)
    assert sum(r["split"] == "heldout" for r in out) == 4 and len(out) == 16
    assert [r["id"] for r in out if r["split"] == "heldout"] == ["12", "13", "14", "15"]
    big = recs + [{"id": "h", "messages": [], "split": "heldout"}]
    out = split_prompts(big, 5, 8)
    assert [r["split"] for r in out].count("train") == 5 and out[-1]["id"] == "h"


def _cli(*args, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    return subprocess.Popen([sys.executable, "-m", "dflashkit.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


@pytest.mark.real
def test_train_one_command_resumes_after_a_kill_and_generate_takes_the_result(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    recipe = tmp_path / "small.json"  # a smaller try-out than the cpu preset, to keep the test short
    recipe.write_text(json.dumps({"save_every": 1, "batch_size": 2, "max_len": 192, "eval_every": 1000}))
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--prompts", str(prompts), "--steps", "6", "--preset", "cpu",
            "--config", str(recipe)]
    proc = _cli(*argv)
    ckpt = out / "checkpoint.pt"
    t0 = time.time()
    while not ckpt.exists() and proc.poll() is None and time.time() - t0 < 600:
        time.sleep(0.5)
    assert ckpt.exists(), proc.communicate()[0][-3000:]
    os.kill(proc.pid, signal.SIGKILL)  # mid-training: after the first saved step, before the last
    proc.wait()
    first = torch.load(ckpt, weights_only=False)["step"]
    assert 1 <= first < 6
    data = sorted(p.name for p in (out / "data").glob("*.npz"))
    assert data == ["heldout-00000.npz", "train-00000.npz"]
    stamps = {p: p.stat().st_mtime_ns for p in (out / "data").glob("*.npz")}

    proc = _cli(*argv)
    text = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, text[-3000:]
    assert "resumed from" in text and "generate held" not in text.split("resumed from")[1]
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # the data was not generated again
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 6
    check = json.loads((out / "check.json").read_text())
    assert check["step"] == 6 and check["decoded_tau"] >= 1.0 and "probes" in check

    gen = _cli("generate", "--drafter", str(out), "--prompt", "Name a fruit.", "--max-new-tokens", "8", "--json")
    text = gen.communicate(timeout=600)[0]
    assert gen.returncode == 0, text[-2000:]
    assert json.loads(text.strip().splitlines()[-1])["stats"]["new_tokens"] >= 1


# ---- check-drafter ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    from dflashkit import DecodeConfig, DFlashEngine
    from dflashkit.loader import load_default_drafter, load_target

    target, tok = load_target(dtype="float32")
    drafter, _ = load_default_drafter(target, tok)
    return DFlashEngine(target, drafter, tokenizer=tok, config=DecodeConfig(policy="fixed"))


def _prompts(engine, n=2):
    from dflashkit.bench.datasets import load_dataset
    from dflashkit.loader import encode_chat

    # MT-Bench questions, not the held-out ShareGPT set the CLI defaults to: loading ShareGPT costs a minute here
    return [encode_chat(engine.tokenizer, it[0]) for it in load_dataset("mt-bench-t1", n)]


@pytest.mark.real
def test_check_drafter_passes_the_bundled_drafter(engine):
    from dflashkit.diagnosis import check

    d = check(engine, _prompts(engine), 24)
    assert d.ok, d.summary()
    assert d.decoded_tau > 1.3 and abs(d.predicted_tau - d.decoded_tau) < 0.35, d.summary()


@pytest.mark.real
def test_check_drafter_cli_names_a_wrong_mask_token(tmp_path):
    from dflashkit.checkpoint import load_drafter, save_drafter
    from dflashkit.loader import BUNDLED_DRAFTER

    dr = load_drafter(BUNDLED_DRAFTER)
    bad = load_drafter(BUNDLED_DRAFTER).__class__(dr.config.replace(mask_token_id=0))
    bad.load_state_dict(dr.state_dict())
    save_drafter(bad, tmp_path / "bad")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    proc = _cli("check-drafter", str(tmp_path / "bad"), "--prompts", str(prompts), "--max-new-tokens", "24")
    text = proc.communicate(timeout=600)[0]
    assert proc.returncode == 1 and f"set mask_token_id to {dr.config.mask_token_id}" in text, text[-2000:]
    assert Path(tmp_path / "bad" / "config.json").is_file()


@pytest.mark.real
def test_check_drafter_flags_taps_shifted_by_two_layers(engine):
    """A drafter whose config names taps two layers off: decoding collapses and the tap probe finds taps that
    decode like the trained ones (it walks while acceptance rises; one layer of offset is harmless for this
    drafter, so the named fix may be one layer from the trained taps)."""
    from dflashkit import DecodeConfig, DFlashEngine
    from dflashkit.checkpoint import load_drafter
    from dflashkit.diagnosis import check
    from dflashkit.loader import BUNDLED_DRAFTER

    shifted = load_drafter(BUNDLED_DRAFTER)
    trained = list(shifted.config.target_layer_ids)
    shifted.config.target_layer_ids = [i + 2 for i in trained]
    bad = DFlashEngine(engine.target, shifted, tokenizer=engine.tokenizer, config=DecodeConfig(policy="fixed"))
    try:
        d = check(bad, _prompts(engine), 24)
    finally:
        engine.target.set_taps(trained)  # the shared target: the fixture's drafter taps these
    assert not d.ok and any("target_layer_ids" in f for f in d.findings), d.summary()
    finding = next(f for f in d.findings if "target_layer_ids" in f)
    named = [int(x) for x in finding.split("Set target_layer_ids to [")[1].split("]")[0].split(",")]
    assert all(abs(n - t) <= 1 for n, t in zip(named, trained)), d.findings
