"""Weights placed on transparent huge pages (kernels/hugepages.py): the same values, aligned, in memory the kernel
is asked to back with 2 MiB pages (a private mapping advised MADV_HUGEPAGE), and nothing changes where it is off."""

import re
from pathlib import Path

import pytest
import torch

from dflashkit.kernels import hugepages


def vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping holding addr (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= addr < int(m.group(2), 16)
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(hugepages, "_state", {})


def test_placed_tensors_keep_their_values_on_advised_private_memory(fresh):
    if not hugepages.enabled():
        pytest.skip("no transparent huge pages here (or DFLASHKIT_HUGE_PAGES=0)")
    g = torch.Generator().manual_seed(0)
    ts = [torch.randint(-128, 127, (300, 33), generator=g, dtype=torch.int8), torch.randn(17, 5, generator=g),
          torch.randn(3, 7, generator=g).bfloat16(), torch.randn(2, 3, generator=g)[:, 1]]  # last: not contiguous
    big = torch.randint(0, 255, (hugepages.CHUNK + 5,), generator=g, dtype=torch.uint8)
    placed = [hugepages.place(t) for t in ts + [big]]
    for t, p in zip(ts + [big], placed):
        assert p.dtype == t.dtype and p.shape == t.shape and torch.equal(p, t) and p.is_contiguous()
        assert p.data_ptr() != t.data_ptr() and p.data_ptr() % hugepages.ALIGN == 0
    assert placed[0].data_ptr() % hugepages.HUGE == 0 and placed[-1].data_ptr() % hugepages.HUGE == 0
    assert placed[1].data_ptr() - placed[0].data_ptr() == 9920  # 300 * 33 bytes, then the next 64-byte boundary
    for p in placed:
        flags = vm_flags(p.data_ptr())
        assert "hg" in flags and "sh" not in flags, flags  # advised; private (shmem ignores the advice)


def test_nothing_moves_where_huge_pages_are_off(fresh, monkeypatch):
    monkeypatch.setenv("DFLASHKIT_HUGE_PAGES", "0")
    t = torch.randn(4, 4)
    assert not hugepages.enabled() and hugepages.place(t) is t
    assert hugepages.place(torch.empty(0)).numel() == 0


def _on_huge_pages(t: torch.Tensor) -> bool:
    return "hg" in vm_flags(t.data_ptr())


def test_rowlinear_targets_and_drafters_stream_their_bf16_weights_from_huge_pages(fresh):
    """`use_rowlinear` (the bf16 weights: `--quant none`, the default on AVX2 CPUs) and `use_rowlinear_in` (the
    drafter) move the weights the kernels stream onto huge pages. HF's projections and the tied embedding follow
    them (stored once), and the logits keep their bits."""
    from conftest import make_drafter, make_target

    from dflashkit.kernels import available, use_rowlinear_in

    if not hugepages.enabled() or not available():
        pytest.skip("no transparent huge pages or no dflashkit kernels here")
    ids, pos = torch.tensor([[5, 6, 7, 9]]), torch.arange(4)[None]
    logits = []
    for on in (False, True):
        hugepages.set_enabled(on)
        t = make_target("llama", torch.bfloat16, backend="lean")
        t.use_rowlinear()
        logits.append(t.logits(t.forward(ids, pos, t.new_cache(1, 4), kv_len=4, taps=False)[0]))
    assert torch.equal(logits[0], logits[1])
    hf = t.layers[0]
    layer = t._layers[0]
    for w in (layer.wqkv, layer.wgu, layer.wo, layer.wdown, t.head):
        assert _on_huge_pages(w.codes), w
    assert hf.self_attn.k_proj.weight.untyped_storage().data_ptr() == layer.wqkv.codes.untyped_storage().data_ptr()
    assert hf.mlp.down_proj.weight.data_ptr() == layer.wdown.codes.data_ptr()
    emb = t.model.get_input_embeddings().weight
    assert emb.data_ptr() == t.head.codes.data_ptr()  # tied: one copy, on huge pages
    d = make_drafter(t).to(torch.bfloat16)
    before = {n: p.clone() for n, p in d.named_parameters()}
    assert use_rowlinear_in(d) > 0
    fc = d.fc.weight
    assert _on_huge_pages(fc) and all(torch.equal(p, before[n]) for n, p in d.named_parameters())
