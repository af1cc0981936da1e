"""Trainer: exact resume after kill -9, and data-parallel training through torchrun (2 processes, gloo)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_target
from dflashkit.data import TokenShard
from dflashkit.train import TrainConfig, train


def tiny_setup(tmp_path: Path):
    t = make_target("qwen3", dtype=torch.float32)
    t.model.save_pretrained(tmp_path / "target")
    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    for split, n in (("train", 24), ("heldout", 4)):
        ex = []
        for i in range(n):
            plen = int(rng.integers(3, 8))
            toks = rng.integers(4, 90, size=plen + int(rng.integers(20, 40))).tolist()
            ex.append((toks, plen, f"{split}-{i}"))
        TokenShard.from_examples(ex).save(data / f"{split}-00000.npz")
    return tmp_path / "target", data


def recipe(tmp_path, target, data, name, **kw):
    cfg = dict(out_dir=str(tmp_path / name), data_dir=str(data), target=str(target), num_layers=1,
               target_layer_ids=[1, 3], block_size=4, mask_token_id=3, num_anchors=6, max_len=64, steps=8,
               batch_size=3, lr=1e-3, bf16=False, target_dtype="float32", device="cpu", log_every=1,
               eval_every=4, eval_batches=1, save_every=1, seed=5)
    cfg.update(kw)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "train_log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]  # after a resume the replayed steps overwrite the killed run's
    return out


def test_kill9_and_resume_reproduces_the_uninterrupted_run(tmp_path):
    target, data = tiny_setup(tmp_path)
    n = 300  # long enough to be killed mid-run
    train(TrainConfig.from_file(recipe(tmp_path, target, data, "full", steps=n, eval_every=100)))
    full = tmp_path / "full"
    cmd = [sys.executable, "-m", "dflashkit.cli", "train", "--config",
           str(recipe(tmp_path, target, data, "killed", steps=n, eval_every=100))]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = tmp_path / "killed" / "train_log.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 4):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(log.read_text().splitlines())
    assert done < n, "the run finished before it could be killed"
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)
    a, b = losses(full), losses(tmp_path / "killed")
    assert sorted(a) == sorted(b) == list(range(1, n + 1))
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-6, abs=1e-7), (step, a[step], b[step])
    assert (tmp_path / "killed" / "drafter" / "model.safetensors").exists()


DDP_SCRIPT = """
import hashlib, json, os, sys
from pathlib import Path
import torch
from dflashkit.data import load_shards
from dflashkit.train import Batches, TrainConfig, train
cfg = TrainConfig.from_file(sys.argv[1])
drafter = train(cfg)
rank = int(os.environ["RANK"])
h = hashlib.sha256()
for k, v in sorted(drafter.state_dict().items()):
    h.update(v.detach().double().numpy().tobytes())
ids, _ = Batches(load_shards(Path(cfg.data_dir), "train"), cfg.max_len, cfg.seed).get(0, cfg.batch_size, rank)
step = json.loads(Path(cfg.out_dir, "train_log.jsonl").read_text().splitlines()[-1])["step"] if rank == 0 else cfg.steps
Path(cfg.out_dir, f"rank{rank}-params.json").write_text(json.dumps(
    {"step": step, "checksum": h.hexdigest(), "first_batch": ids.tolist()}))
"""


def test_ddp_two_processes_keep_identical_weights(tmp_path):
    target, data = tiny_setup(tmp_path)
    cfg = recipe(tmp_path, target, data, "ddp", steps=3, eval_batches=0)
    script = tmp_path / "ddp_run.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, "TQDM_DISABLE": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          "29517", str(script), str(cfg)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    sums = [json.loads((tmp_path / "ddp" / f"rank{r}-params.json").read_text()) for r in (0, 1)]
    assert sums[0]["step"] == sums[1]["step"] == 3
    assert sums[0]["checksum"] == sums[1]["checksum"]
    # and the two ranks really trained on different data (else DDP would be trivially in sync)
    assert sums[0]["first_batch"] != sums[1]["first_batch"]


def test_the_kl_objective_trains_and_an_unknown_loss_names_the_choices(tmp_path):
    """loss "kl" runs end to end (the KL itself is checked against a reference in test_objective) and lowers its
    loss on this data; a misspelt loss fails before any work, naming the valid ones."""
    from dflashkit.errors import DFlashError

    target, data = tiny_setup(tmp_path)
    train(TrainConfig.from_file(recipe(tmp_path, target, data, "kl", loss="kl", steps=30, eval_every=30,
                                       lr=3e-3, optimizer="adamw", position_weight="exp")))
    got = losses(tmp_path / "kl")
    assert sorted(got) == list(range(1, 31)) and all(np.isfinite(v) and v >= 0 for v in got.values())
    assert np.mean([got[s] for s in range(26, 31)]) < 0.8 * np.mean([got[s] for s in range(1, 6)])
    with pytest.raises(DFlashError, match="loss must be one of ce, kl"):
        train(TrainConfig.from_file(recipe(tmp_path, target, data, "bad", loss="kl_div")))


def test_muons_float32_iteration_is_torchs_iteration(monkeypatch):
    """On a CPU without bf16 units Muon orthogonalises in float32 (torch's bf16 matmul there is ~40x slower): the same
    iteration as torch's bf16 one up to bf16's rounding, for wide and tall updates; the optimizer steps with it only
    where asked, and torch's own iteration is back in place after each step."""
    from torch.optim import _muon

    from dflashkit.optimizer import DrafterOptimizer, float32_newton_schulz, newton_schulz_fp32

    torch.manual_seed(0)
    coef = (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)
    for shape in ((48, 160), (160, 48)):
        g = torch.randn(shape)
        ours = newton_schulz_fp32(g, coef, 5, 1e-7)
        theirs = _muon._zeropower_via_newtonschulz(g, coef, 5, 1e-7).float()
        assert ours.dtype == torch.float32 and ours.shape == g.shape
        assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()  # bf16's rounding through 5 iterations
        assert not torch.equal(ours, theirs)
    torch_ns = _muon._zeropower_via_newtonschulz
    calls = []
    monkeypatch.setattr("dflashkit.optimizer.newton_schulz_fp32", lambda *a: calls.append(1) or newton_schulz_fp32(*a))
    for fp32 in (False, True):
        w = torch.nn.Parameter(torch.randn(48, 160))
        opt = DrafterOptimizer("muon", [torch.optim.Muon([w], lr=0.01)], muon_fp32=fp32)
        w.grad = torch.randn_like(w)
        opt.step()
        assert len(calls) == int(fp32) and _muon._zeropower_via_newtonschulz is torch_ns
    with float32_newton_schulz():
        assert _muon._zeropower_via_newtonschulz is not torch_ns
    assert _muon._zeropower_via_newtonschulz is torch_ns


def test_muon_and_dpace_train_and_resume_exactly(tmp_path):
    """speculators' recipe as options: Muon on the weight matrices (AdamW on the rest) with D-PACE slot weights lowers
    its loss; a run stopped after one step and resumed replays the uninterrupted one (both optimizers' states come
    back from checkpoint.pt); a checkpoint of one optimizer refuses to resume with the other, naming the remedy."""
    from dflashkit.errors import DFlashError

    target, data = tiny_setup(tmp_path)
    kw = dict(optimizer="muon", position_weight="dpace", loss="kl", lr=1e-2)  # KL: this random data has no CE to learn
    train(TrainConfig.from_file(recipe(tmp_path, target, data, "full", steps=30, eval_every=30, **kw)))
    full = losses(tmp_path / "full")
    assert sorted(full) == list(range(1, 31)) and all(np.isfinite(v) and v >= 0 for v in full.values())
    assert np.mean([full[s] for s in range(26, 31)]) < 0.8 * np.mean([full[s] for s in range(1, 6)])
    ckpt = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=False)
    assert len(ckpt["optimizer"]["parts"]) == 2  # Muon and AdamW
    # stopped after its first step (time limit 0), then resumed by the same recipe without the limit
    train(TrainConfig.from_file(recipe(tmp_path, target, data, "cut", steps=30, eval_every=30, time_limit_s=0, **kw)))
    assert sorted(losses(tmp_path / "cut")) == [1]
    train(TrainConfig.from_file(recipe(tmp_path, target, data, "cut", steps=30, eval_every=30, **kw)))
    cut = losses(tmp_path / "cut")
    assert sorted(cut) == sorted(full)
    for step in full:
        assert cut[step] == pytest.approx(full[step], rel=1e-6, abs=1e-7), (step, cut[step], full[step])
    with pytest.raises(DFlashError, match="another optimizer .*'muon'.*'adamw'.*\"optimizer\": \"muon\""):
        train(TrainConfig.from_file(recipe(tmp_path, target, data, "full", steps=31, lr=1e-2, optimizer="adamw")))
    with pytest.raises(DFlashError, match="optimizer must be one of adamw, muon"):
        train(TrainConfig.from_file(recipe(tmp_path, target, data, "bad", optimizer="sgd")))
    with pytest.raises(DFlashError, match="position_weight must be one of exp, dpace"):
        train(TrainConfig.from_file(recipe(tmp_path, target, data, "bad2", position_weight="linear")))


def test_bf16_autocast_where_the_hardware_has_it_and_float32_training_on_a_bf16_target():
    """bf16 None resolves to autocast on CUDA and on CPUs with bf16 units, float32 elsewhere (torch's bf16 backward on
    an AVX2-only CPU is ~35x slower); a recipe's explicit value stands. Float32 training on a bf16 target runs (its
    embedding rows and head are cast for the products) and gives autocast's loss up to bf16's rounding."""
    from contextlib import nullcontext

    from conftest import make_drafter
    from dflashkit.measurements import cpu_has_bf16_units
    from dflashkit.train import train_step_loss
    from dflashkit.train_precision import resolve_bf16

    cfg = TrainConfig(out_dir="-", data_dir="-", block_size=8, num_anchors=4)
    assert cfg.bf16 is None
    assert resolve_bf16(cfg, torch.device("cpu")).bf16 is cpu_has_bf16_units()
    assert resolve_bf16(cfg, torch.device("cuda")).bf16 is True
    for forced in (True, False):
        assert resolve_bf16(TrainConfig(out_dir="-", data_dir="-", bf16=forced), torch.device("cpu")).bf16 is forced
    t = make_target("llama", dtype=torch.bfloat16, backend="lean")
    dr = make_drafter(t, block_size=8).float()
    t.set_taps(dr.config.target_layer_ids)
    ids = torch.randint(4, 90, (2, 40), generator=torch.Generator().manual_seed(0))
    lm = torch.zeros_like(ids, dtype=torch.bool)
    lm[:, 12:] = True
    got = {}
    for bf16 in (False, True):
        c = TrainConfig(out_dir="-", data_dir="-", block_size=8, num_anchors=4, bf16=bf16)
        ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else nullcontext
        dr.zero_grad(set_to_none=True)
        loss, _ = train_step_loss(dr, t, ids, lm, c, torch.Generator().manual_seed(1), ctx)
        loss.backward()
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in dr.parameters())
        got[bf16] = float(loss.detach())
    assert got[False] == pytest.approx(got[True], rel=0.03)
