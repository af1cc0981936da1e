"""Our row-invariant linear kernel (kernels/rowlinear.cpp): the right products, the GGML block layouts as the gguf
library writes them, rows that do not depend on how many rows are computed, and a lean target that stays exact."""

import numpy as np
import pytest
import torch
from conftest import assert_invariant_unless_torch_linear_is_not, make_drafter, make_target

from dflashkit import DecodeConfig, DFlashEngine
from dflashkit.errors import DFlashError
from dflashkit.invariance import measure
from dflashkit.kernels import RowLinear, available, set_isa, why_unavailable
from dflashkit.loader import apply_kernels

pytestmark = pytest.mark.skipif(not available(), reason=f"rowlinear kernel unavailable: {why_unavailable()}")


def _ggml(kind: str, w: torch.Tensor) -> RowLinear:
    """w [N, K] fp32 quantised by the gguf library itself (llama.cpp's reference layout)."""
    import gguf

    qt = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}[kind]
    raw = gguf.quants.quantize(w.numpy(), qt)  # [N, bytes per row] uint8
    return RowLinear.from_ggml(kind, torch.from_numpy(np.ascontiguousarray(raw)), *w.shape), raw, qt


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_ggml_blocks_dequantise_as_the_gguf_library_does(kind):
    import gguf

    w = torch.randn(40, 96)
    lin, raw, qt = _ggml(kind, w)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qt)).float()
    assert torch.allclose(lin.dequantize(), ref, rtol=1e-6, atol=1e-6)
    x = torch.randn(5, 96)
    assert torch.allclose(lin(x, out_fp32=True), x @ ref.T, rtol=1e-4, atol=1e-4)


def test_a_drafters_q4_copy_is_the_gguf_librarys_q4_1():
    """`RowLinear.q4_from_bf16` (the drafter's Q4_1 layers) quantises as GGML does: the same codes, scales and
    minimums as the gguf library's Q4_1 of the same weights, read on 8-bit activations."""
    w = (torch.randn(48, 128) * 0.05).bfloat16()
    w[3, :32] = 0.25  # a constant block (d = 0)
    ours = RowLinear.q4_from_bf16(w)
    ref, _, _ = _ggml("q4_1", w.float())
    assert torch.equal(ours.codes, ref.codes) and torch.equal(ours.scale, ref.scale)
    assert torch.equal(ours.minimum, ref.minimum) and ours.path == "qlinear"
    x = torch.randn(3, 128).bfloat16()
    assert torch.equal(ours(x).view(torch.int16), ref.with_int8_acts()(x).view(torch.int16))


@pytest.mark.parametrize("m", [2, 3, 17])
def test_bf16_outputs_are_the_fp32_outputs_rounded_as_torch_rounds(m):
    """The kernels round fp32 sums to bf16 eight lanes at a time (simd.h `bf16_round8`) with a scalar tail: each must
    round to nearest even exactly as torch does, over magnitudes from subnormal to overflow (13 outputs a row, so
    both paths run), and keep NaN a NaN."""
    g = torch.Generator().manual_seed(m)
    w = torch.randn(13, 32, generator=g).bfloat16()
    lin = RowLinear.from_bf16(w)
    exps = torch.tensor([0.0, -133.0, 126.0, -127.0, 60.0, -90.0])  # row 1: subnormal sums, row 2: some overflow
    scale = 2.0 ** exps[torch.arange(m) % len(exps)][:, None]
    x = (torch.randn(m, 32, generator=g) * scale).bfloat16()
    x[0, 0] = float("nan")
    fp32 = lin(x, out_fp32=True)
    got, want = lin(x), fp32.bfloat16()
    nan = fp32.isnan()
    assert nan[0].all() and got[nan].isnan().all()
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert (fp32[1].abs() < 2.0 ** -126).any()  # subnormal sums are among them
    # Exact ties: y[n] = (1 + n 2^-7) + 2^-8, halfway between two bf16 values, n even rounds down, n odd up
    ties = torch.zeros(13, 32)
    ties[:, 0], ties[:, 1] = 1 + torch.arange(13) * 2.0 ** -7, 1.0
    x = torch.zeros(m, 32)
    x[:, 0], x[:, 1] = 1.0, 2.0 ** -8
    lin = RowLinear.from_bf16(ties.bfloat16())
    got, fp32 = lin(x.bfloat16()), lin(x.bfloat16(), out_fp32=True)
    assert torch.equal(got.view(torch.int16), fp32.bfloat16().view(torch.int16))
    assert torch.equal(got[0].float(), 1 + (torch.arange(13) + torch.arange(13) % 2) * 2.0 ** -7)


@pytest.fixture(params=["auto", "avx512bf16", "avx2"])
def isa(request):
    """The kernels as this CPU runs them ("auto": rowlinear's bf16 weights on AMX tiles on AMX CPUs, on 16-lane bf16
    dot products on AVX512-BF16 CPUs; qlinear's 16-lane VNNI tile on AVX512-VNNI CPUs), the AVX-512 dot products
    forced on an AMX CPU, and the 8-lane AVX2 paths forced, so every path this host has is tested."""
    got = set_isa(request.param)
    if request.param != "auto" and got != request.param:
        set_isa("auto")
        pytest.skip(f"this CPU has no {request.param}")
    yield got
    set_isa("auto")


@pytest.mark.parametrize("kind", ["bf16", "q4_1", "q8_0", "q4_1-a8", "q8_0-a8", "q4_1-exact", "q8_0-exact"])
@pytest.mark.parametrize("n_out,k", [(7, 32), (130, 64), (49, 608)])
def test_rows_are_bit_identical_whatever_the_row_count(kind, n_out, k, isa):
    """The property exactness rests on: y[m] has the same bits computed alone, in any block, at any offset."""
    if kind in ("q4_1", "q8_0") and isa == "avx2":
        pytest.skip("the ISA switch concerns the bf16 and the 8-bit-activation paths only")
    torch.manual_seed(n_out + k)
    w = torch.randn(n_out, k)
    lin = RowLinear.from_bf16(w.bfloat16()) if kind == "bf16" else _ggml(kind.split("-")[0], w)[0]
    lin = lin.with_int8_acts() if kind.endswith("-a8") else lin.with_exact_codes() if kind.endswith("-exact") else lin
    x = torch.randn(37, k).bfloat16()
    full = lin(x)
    assert full.dtype == torch.bfloat16 and full.shape == (37, n_out)
    w = lin.dequantize()
    if kind in ("q4_1", "q8_0") and isa in ("avx512bf16", "amx"):  # decoded to bf16 there (`RowLinear.as_bf16`)
        w = lin.as_bf16().float()
    ref = x.float() @ w.T
    # 8-bit activations round each input to ~1/254 of its block's range: error ~1-2 % of the output's scale
    atol = 0.02 * float(ref.abs().max()) if lin.int8_acts else 2e-2
    assert torch.allclose(full.float(), ref, rtol=2e-2, atol=atol)
    for m in (1, 2, 3, 4, 5, 8, 16, 17, 33):
        for start in (0, 37 - m):
            assert torch.equal(lin(x[start:start + m]), full[start:start + m]), (m, start)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_4bit_codes_on_bf16_dot_products_are_the_bf16_layer_of_their_rounded_weights(kind, dot_product_isa):
    """On AVX512-BF16 CPUs rowlinear decodes 4/8-bit codes to bf16 once per tile and runs the bf16 kernel's dot
    products: the output is, to the bit, the bf16 layer of those rounded weights, at every row count. (On AMX CPUs bf16
    weights take the tile instructions, other bits, while codes stay on the dot products: compared there.)"""
    torch.manual_seed(5)
    lin = _ggml(kind, torch.randn(53, 608))[0]
    twin = RowLinear.from_bf16(lin.as_bf16())
    x = torch.randn(21, 608).bfloat16()
    for m in (1, 2, 5, 21):
        assert torch.equal(lin(x[:m], out_fp32=True).view(torch.int32), twin(x[:m], out_fp32=True).view(torch.int32))


def _int8_definition(lin: RowLinear, x: torch.Tensor) -> torch.Tensor:
    """qlinear.cpp's layer written plainly: each token's 32-blocks rounded to int8 with d = max|x| / 127 (x * (1 / d),
    half to even), the exact integer dot with the weight codes per block, then for b = 0, 1, ... the fp32 chain
    acc = fma(float(i_b), d_w * d_x, acc) (and for Q4_1 acc = fma(m_w, s_x, acc)); an fma is computed in float64
    (the product i_b * (d_w * d_x) is exact there) and rounded once to fp32."""
    n, k = lin.shape
    xb = x.float().view(x.shape[0], k // 32, 32)
    d = xb.abs().amax(-1) / 127.0  # fp32, as the kernel
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None])  # [M, nb, 32]
    s = d * q.sum(-1)  # fp32
    if lin.kind == "q4_1":
        b = lin.codes.view(n, k // 32, 16)
        wq = torch.cat([b & 0x0F, b >> 4], dim=-1).double()  # [N, nb, 32]
    else:
        wq = lin.codes.view(n, k // 32, 32).double()
    isum = torch.einsum("mbj,nbj->mnb", q.double(), wq)  # exact integers
    fma = (lambda a, b, c: (a.double() * b.double() + c.double()).float())
    acc = torch.zeros(x.shape[0], n)
    for blk in range(k // 32):
        acc = fma(isum[:, :, blk], lin.scale.view(n, -1)[None, :, blk] * d[:, None, blk], acc)
        if lin.kind == "q4_1":
            acc = fma(lin.minimum.view(n, -1)[None, :, blk], s[:, None, blk], acc)
    return acc


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("k", [192, 160])  # an even and an odd number of 32-blocks
def test_int8_activations_compute_their_definition(kind, k):
    torch.manual_seed(3)
    w = torch.randn(70, k)  # 70 rows: four full groups of 16 and a partial one
    lin = _ggml(kind, w)[0].with_int8_acts()
    x = torch.randn(9, k) * torch.linspace(0.1, 3, k)
    x[2, :32] = 0  # an all-zero block: d = 0, its products 0
    got = lin(x, out_fp32=True)
    assert torch.equal(got, _int8_definition(lin, x))
    # and the same layer as the fp32-product kernel, up to the activations' 8-bit rounding
    fp = _ggml(kind, w)[0](x, out_fp32=True)
    assert torch.allclose(got, fp, rtol=0.02, atol=0.02 * float(fp.abs().max()))
    with pytest.raises(ValueError, match="8-bit activations"):
        RowLinear.from_bf16(w.bfloat16()).with_int8_acts()


def _exact_codes_definition(lin: RowLinear, x: torch.Tensor) -> torch.Tensor:
    """plinear.cpp's layer written plainly in fp32 torch ops (each rounded to nearest even). Per block, chains start
    at 0 and take the element pairs (a, c) in the packed order, each as S += v_c x_c, then S += v_a x_a (`dpbf16ps`
    adds a pair's high word first; its products are exact). Q4_1: one chain of v = 128 + q, then acc = fma(S, d, acc),
    acc = fma(m - 128 d, X_b, acc) (X_b: the block's activations summed in element order). Q8_0: one chain of v = q
    over the pairs (2 i, 2 i + 1) in element order, then acc = fma(S, d, acc)."""
    n, k = lin.shape
    nb, rows = k // 32, x.shape[0]
    if lin.kind == "q4_1":
        b = lin.codes.view(n, nb, 16)
        chains = [128 + torch.cat([b & 0x0F, b >> 4], dim=-1).float()]  # [N, nb, 32] in element order
        pairs = [(8 * p + a, 8 * p + c, 0) for p in range(4) for a, c in ((0, 2), (4, 6), (1, 3), (5, 7))]
    else:
        chains = [lin.codes.view(n, nb, 32).float()]
        pairs = [(2 * i, 2 * i + 1, 0) for i in range(16)]
    xf = x.float().view(rows, nb, 32)
    fma = (lambda a, b, c: (a.double() * b.double() + c.double()).float())
    acc = torch.zeros(rows, n)
    for blk in range(nb):
        s = [torch.zeros(rows, n) for _ in chains]
        for a, c, ch in pairs:
            s[ch] = s[ch] + chains[ch][None, :, blk, c] * xf[:, None, blk, c]
            s[ch] = s[ch] + chains[ch][None, :, blk, a] * xf[:, None, blk, a]
        d = lin.scale.view(n, -1)[:, blk]
        total = torch.zeros(rows)
        for j in range(32):
            total = total + xf[:, blk, j]
        if lin.kind == "q4_1":
            acc = fma(s[0], d[None], acc)
            acc = fma((lin.minimum.view(n, -1)[:, blk] - 128 * d)[None], total[:, None], acc)
        else:
            acc = fma(s[0], d[None], acc)
    return acc


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("k", [192, 160])  # an even and an odd number of 32-blocks
def test_exact_codes_compute_their_definition(kind, k):
    """`--quant int4` on an AVX512-BF16 CPU (plinear.cpp): codes enter bf16 products as 128 + a nibble, so the layer
    is the codes' own weights (d q + m, d q) against bf16 activations, with fp32 sums; equal to its definition to the
    bit and far closer to the float64 product than the bf16-rounded weights' layer."""
    lin = _ggml(kind, torch.randn(70, k))[0].with_exact_codes()  # four full groups of 16 rows and a partial one
    if lin.path != "plinear":
        pytest.skip("no AVX512-BF16 here: --quant int4 runs rowlinear's fp32 products (tested above)")
    torch.manual_seed(4)
    x = (torch.randn(9, k) * torch.linspace(0.1, 3, k)).bfloat16()
    x[2, :32] = 0  # an all-zero block
    got = lin(x, out_fp32=True)
    assert torch.equal(got, _exact_codes_definition(lin, x))
    exact = (x.double() @ lin.dequantize().double().T)
    rounded = x.float() @ lin.as_bf16().float().T  # the bf16 model's weights
    assert (got.double() - exact).abs().max() * 20 < (rounded.double() - exact).abs().max()
    assert lin(x).dtype == torch.bfloat16 and torch.equal(lin(x), got.bfloat16())
    with pytest.raises(ValueError, match="exact codes"):
        RowLinear.from_bf16(torch.zeros(4, 32, dtype=torch.bfloat16)).with_exact_codes()


def test_exact_codes_refuse_scales_that_are_not_fp16():
    """plinear's records hold the scales in fp16, the GGUF's own; a layer whose scales fp16 cannot hold (a Q8_0 copy
    quantised here, d = max|w| / 127 in fp32) is refused with the remedy, never rounded into other bits."""
    lin = RowLinear.q8_from_bf16(torch.randn(40, 64).bfloat16())
    exact = RowLinear("q8_0", lin.codes, 40, 64, lin.scale, exact_codes=True)
    if exact.path != "plinear":
        pytest.skip("no AVX512-BF16 here: exact codes run rowlinear's fp32 products, which read fp32 scales")
    with pytest.raises(ValueError, match="fp16 values.*with_int8_acts"):
        exact(torch.randn(2, 64).bfloat16())


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("k", [32, 160, 608])  # one block, and even / odd block counts
def test_int8_activation_paths_give_the_same_bits(kind, k):
    """qlinear's AVX2 path and (on AVX512-VNNI CPUs) its VNNI path compute one arithmetic: the exact integer block
    sums, then one fp32 chain over the blocks per element. So their outputs are equal to the bit, whatever the rows.
    (On a CPU without VNNI both runs take the AVX2 path.)"""
    torch.manual_seed(k)
    lin = _ggml(kind, torch.randn(45, k))[0].with_int8_acts()
    x = torch.randn(19, k) * torch.linspace(0.01, 4, k)
    x[3, :32] = 0  # an all-zero block
    x[5] = 0  # an all-zero row: y = 0 exactly (+0 for q8_0; the Q4_1 minimum's term is 0 too)
    got = {}
    for name in ("auto", "avx2"):
        set_isa(name)
        try:
            got[name] = [lin(x[:m], out_fp32=True) for m in (1, 2, 3, 4, 5, 8, 19)]
        finally:
            set_isa("auto")
    for a, b in zip(got["auto"], got["avx2"]):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))  # the bits, signed zeros included


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        RowLinear.from_bf16(torch.zeros(4, 33, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        RowLinear.from_bf16(torch.zeros(4, 32))
    lin = RowLinear.from_bf16(torch.zeros(4, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        lin(torch.zeros(2, 16, dtype=torch.bfloat16))


@pytest.mark.parametrize("n,prompt,seed", [(8, 29, 1), (16, 40, 2)])
def test_lean_with_rowlinear_is_bitwise_batch_invariant(arch, n, prompt, seed):
    t = make_target(arch, torch.bfloat16, backend="lean")
    t.use_rowlinear()
    assert t.engine_name.startswith("LeanTarget+rowlinear.")
    inv = measure(t, n=n, prompt=prompt, seed=seed)
    assert inv.exact and inv.max_diff == 0.0, inv


def test_lean_with_rowlinear_speculative_greedy_output_is_ar():
    t = make_target("llama", torch.bfloat16, backend="lean")
    ref = t.logits(t.forward(torch.tensor([[5, 6, 7]]), torch.arange(3)[None], t.new_cache(1, 3), kv_len=3,
                             taps=False)[0])
    t.use_rowlinear()
    ours = t.logits(t.forward(torch.tensor([[5, 6, 7]]), torch.arange(3)[None], t.new_cache(1, 3), kv_len=3,
                              taps=False)[0])
    assert torch.allclose(ours.float(), ref.float(), atol=0.1)  # the same model, another summation order
    eng = DFlashEngine(t, make_drafter(t, block_size=8), eos_token_ids=[],
                       config=DecodeConfig(tree=12, policy="fixed"))
    prompts = [[5, 9, 11, 3], [7, 7, 1, 30, 31, 2, 8]]
    ar = eng.generate(prompts, max_new_tokens=40, config=DecodeConfig.autoregressive())
    assert [g.tokens for g in eng.generate(prompts, max_new_tokens=40)] == [g.tokens for g in ar]


def _to_codes(t, kernel: str) -> None:
    """A tiny lean target's linears as Q4_1 codes (head Q8_0), as `--quant KERNEL` runs a GGUF's own codes (a tiny
    model has no GGUF: its bf16 weights are quantised by the gguf library here): "int4-a8" on 8-bit activations
    (qlinear.cpp), "int4" on bf16 ones (plinear.cpp; skips where this CPU has no such path)."""
    t.use_rowlinear()
    codes = {"int4-a8": RowLinear.with_int8_acts, "int4": RowLinear.with_exact_codes}[kernel]
    q = (lambda kind, lin: codes(_ggml(kind, lin.dequantize())[0]))
    for layer in t._layers:
        for name in ("wqkv", "wgu", "wo", "wdown"):
            setattr(layer, name, q("q4_1", getattr(layer, name)))
    t.head = q("q8_0", t.head)
    t.kernel = kernel
    if kernel == "int4" and t.head.path != "plinear":
        pytest.skip("no AVX512-BF16 here: --quant int4 runs rowlinear's fp32 products")


@pytest.mark.parametrize("n,prompt,seed", [(8, 29, 1), (16, 40, 2)])
def test_int8_activation_target_is_bitwise_batch_invariant_and_speculation_is_ar(arch, n, prompt, seed):
    t = make_target(arch, torch.bfloat16, backend="lean")
    _to_codes(t, "int4-a8")
    t.use_fused_attention()
    inv = measure(t, n=n, prompt=prompt, seed=seed)
    assert inv.exact and inv.max_diff == 0.0, inv
    eng = DFlashEngine(t, make_drafter(t, block_size=8), eos_token_ids=[],
                       config=DecodeConfig(tree=12, policy="fixed"))
    prompts = [[5, 9, 11, 3], [7, 7, 1, 30, 31, 2, 8]]
    ar = eng.generate(prompts, max_new_tokens=24, config=DecodeConfig.autoregressive())
    assert [g.tokens for g in eng.generate(prompts, max_new_tokens=24)] == [g.tokens for g in ar]


def test_a_build_killed_mid_compile_does_not_hang_the_next_load():
    """torch's builder marks a build with a `lock` file; a builder killed mid-compile (a server stopped at a test's
    deadline) leaves it, and torch alone then waits on it forever. The next load removes it and goes on."""
    import subprocess
    import sys

    from dflashkit.kernels import build_lock

    with build_lock() as d:  # no build of ours is running while the stale mark is made
        (d / "lock").touch()
    code = "from dflashkit import kernels; assert kernels.load() is not None, kernels.why_unavailable()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert not (d / "lock").exists()


def test_kernel_flags_are_checked(tmp_path):
    hf = make_target("llama", torch.bfloat16)
    with pytest.raises(DFlashError, match="lean backend"):
        apply_kernels(hf, tmp_path, kernel="rowlinear")
    lean = make_target("llama", torch.float32, backend="lean")
    with pytest.raises(DFlashError, match="bfloat16"):
        apply_kernels(lean, tmp_path, kernel="rowlinear")
    with pytest.raises(DFlashError, match="not a GGUF target"):
        apply_kernels(make_target("llama", torch.bfloat16, backend="lean"), tmp_path, quant="int4")


@pytest.mark.parametrize("n,prompt,seed", [(8, 29, 1), (16, 40, 2)])
def test_lean_with_fused_attention_is_bitwise_batch_invariant(arch, n, prompt, seed):
    """The one-call attention (kernels/attention.cpp), alone and with rowlinear: blocks, trees, ragged batches."""
    t = make_target(arch, torch.bfloat16, backend="lean")
    t.use_fused_attention()
    assert_invariant_unless_torch_linear_is_not(t, measure(t, n=n, prompt=prompt, seed=seed))
    t.use_rowlinear()
    assert t.engine_name.startswith("LeanTarget+rowlinear.") and t.engine_name.endswith("+attend")
    inv = measure(t, n=n, prompt=prompt, seed=seed)
    assert inv.exact and inv.max_diff == 0.0, inv


def test_fused_attention_computes_the_same_model(arch):
    """Same logits as the tensor-op attention up to bf16 rounding (fp32 scores instead of bf16 ones), incl. Gemma 3's
    sliding window and a prompt longer than the gathered tail."""
    ref = make_target(arch, torch.bfloat16, backend="lean")
    ids = torch.randint(4, 90, (2, 70), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(70).expand(2, 70)
    a = ref.logits(ref.forward(ids, pos, ref.new_cache(2, 80), kv_len=70, taps=False)[0]).float()
    ref.use_fused_attention()
    b = ref.logits(ref.forward(ids, pos, ref.new_cache(2, 80), kv_len=70, taps=False)[0]).float()
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


STACKED_ARCHS = ["llama", "qwen3"]  # Llama-style layers: what the layer stack (kernels/layers.cpp) implements


def _stacked(arch: str, codes: str = "bf16"):
    t = make_target(arch, torch.bfloat16, backend="lean")
    t.use_rowlinear() if codes == "bf16" else _to_codes(t, codes)
    t.use_fused_attention()
    t.use_layer_stack()
    return t


@pytest.mark.parametrize("arch", STACKED_ARCHS)
@pytest.mark.parametrize("codes", ["bf16", "int4-a8", "int4"])
@pytest.mark.parametrize("n,prompt,seed", [(8, 29, 1), (16, 40, 2)])
def test_layer_stack_is_bitwise_batch_invariant(arch, codes, n, prompt, seed, isa):
    """All layers in one C++ call: a token's logits have the same bits alone, in a block, in a tree, in a ragged
    batch, with bf16 (on each of rowlinear's paths), with 4-bit codes on 8-bit activations and on bf16 ones (the
    team forward: one OpenMP team per layer)."""
    t = _stacked(arch, codes)
    assert t.engine_name.endswith("+attend+layers") and (codes != "bf16" or f"rowlinear.{isa}" in t.engine_name)
    inv = measure(t, n=n, prompt=prompt, seed=seed)
    assert inv.exact and inv.max_diff == 0.0, inv


@pytest.fixture
def avx2_path():
    """rowlinear's 8-lane fp32 path, the one bf16 weights take on a CPU without AVX512-BF16 (forced on one that has
    it), for this test only."""
    set_isa("avx2")
    yield
    set_isa("auto")


@pytest.mark.parametrize("arch", STACKED_ARCHS)
@pytest.mark.parametrize("codes", ["int4", "int4-a8", "bf16"])
@pytest.mark.parametrize("rows,width", [(1, 1), (1, 4), (1, 7), (3, 1), (2, 5)])
def test_the_team_forward_gives_the_per_step_loops_bits(arch, codes, rows, width, request):
    """Where every linear reads packed codes (plinear's, qlinear's) or runs rowlinear's fp32 path (bf16 weights on
    an AVX2 CPU), the stack runs each forward as one OpenMP team sharing the glue (layers.cpp `forward_team`); the
    per-step loop is the reference: the same logits, taps and cache, bit for bit, on the prompt's prefill and on the
    step after it."""
    if codes == "bf16":
        request.getfixturevalue("avx2_path")
    t = _stacked(arch, codes)
    t.tap_ids = [1, 4]
    ids = torch.randint(4, 90, (rows, 30 + width), generator=torch.Generator().manual_seed(rows * 10 + width))
    runs = []
    for team in (False, True):
        t.stack.set_team(team)
        assert t.stack.on_team() == team
        cache = t.new_cache(rows, 40)
        out = list(t.forward(ids[:, :30], torch.arange(30).expand(rows, 30), cache, kv_len=30))
        out += t.forward(ids[:, 30:], torch.arange(30, 30 + width).expand(rows, width), cache, kv_len=30 + width)
        runs.append([t.logits(out[0]), t.logits(out[2]), out[1], out[3], *cache.keys, *cache.values])
    t.stack.set_team(True)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", STACKED_ARCHS)
def test_layer_stack_computes_the_same_model(arch):
    """The stack and the per-op forward round alike except the norms' sums (and exp's last bits): both are as close
    to the fp32 model, their logits agree, the taps agree, and both write the same K/V into the cache."""
    ids = torch.randint(4, 90, (2, 40), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(40).expand(2, 40)
    ref = make_target(arch, torch.float32, backend="lean")
    exact = ref.logits(ref.forward(ids, pos, ref.new_cache(2, 48), kv_len=40, taps=False)[0])
    t = make_target(arch, torch.bfloat16, backend="lean")
    t.use_rowlinear()
    t.use_fused_attention()
    t.tap_ids = [1, 4]
    runs = []
    for stacked in (False, True):
        if stacked:
            t.use_layer_stack()
        cache = t.new_cache(2, 48)
        hidden, feats = t.forward(ids, pos, cache, kv_len=40)
        runs.append((t.logits(hidden).float(), feats.float(), cache))
    (a, fa, ca), (b, fb, cb) = runs
    err_ops, err_stack = (a - exact).abs().mean(), (b - exact).abs().mean()
    assert err_stack < 1.5 * err_ops + 1e-3, (err_stack, err_ops)
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    assert fb.shape == fa.shape and (fa - fb).abs().max() < 0.05 * fa.abs().max()
    for layer in range(t.num_layers):  # the cache layout (incl. the values' trailing 1.0) is the per-op one
        assert (ca.keys[layer][:, :, :40].float() - cb.keys[layer][:, :, :40].float()).abs().max() < 0.1
        assert torch.equal(ca.values[layer][..., -1], cb.values[layer][..., -1])


@pytest.mark.parametrize("arch", STACKED_ARCHS)
def test_layer_stack_speculative_greedy_output_is_ar(arch):
    t = _stacked(arch)
    eng = DFlashEngine(t, make_drafter(t, block_size=8), eos_token_ids=[],
                       config=DecodeConfig(tree=12, policy="fixed"))
    prompts = [[5, 9, 11, 3], [7, 7, 1, 30, 31, 2, 8]]
    ar = eng.generate(prompts, max_new_tokens=32, config=DecodeConfig.autoregressive())
    assert [g.tokens for g in eng.generate(prompts, max_new_tokens=32)] == [g.tokens for g in ar]


def test_layer_stack_silu_lookup_is_the_function_for_every_bf16_input():
    """The stack's SiLU reads a table of bf16(g / (1 + expf(-g))) over all 65,536 bf16 inputs: it must hold what
    the function, with the C library's own expf, gives for each (the stack computed it per element before)."""
    import ctypes
    import ctypes.util

    from dflashkit.kernels import load

    expf = ctypes.CDLL(ctypes.util.find_library("m")).expf
    expf.restype, expf.argtypes = ctypes.c_float, [ctypes.c_float]
    g = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().numpy()
    with np.errstate(all="ignore"):
        e = np.array([expf(float(-v)) for v in g], dtype=np.float32)
        want = torch.from_numpy(g / (np.float32(1.0) + e)).bfloat16().view(torch.int16)
    got = load().Stack.silu_table()
    nan = want.view(torch.bfloat16).isnan()  # NaN inputs, and -inf (-inf / inf): any NaN's bits will do
    assert torch.equal(got[~nan], want[~nan])
    assert torch.isnan(got.view(torch.bfloat16)[nan]).all()


def test_layer_stack_refuses_what_it_does_not_implement():
    with pytest.raises(DFlashError, match="needs our linear and attention kernels"):
        make_target("llama", torch.bfloat16, backend="lean").use_layer_stack()
    g = make_target("gemma3", torch.bfloat16, backend="lean")
    g.use_rowlinear()
    g.use_fused_attention()
    with pytest.raises(DFlashError, match="not Llama-style"):
        g.use_layer_stack()
    t = _stacked("llama")
    x, rot, cache = torch.zeros(1, 1, 32, dtype=torch.bfloat16), torch.zeros(1, 1, 8, dtype=torch.bfloat16), \
        t.new_cache(1, 4)
    with pytest.raises(RuntimeError, match="Stack.forward: slot 9 lies outside the cache"):
        t.stack.forward(x, rot, rot, cache.keys, cache.values, torch.tensor([[9]]),
                        torch.zeros(1, 1, 4, dtype=torch.bool), torch.full((1, 1, 33), -1), [])
    with pytest.raises(RuntimeError, match="Stack.context: slot 9 lies outside the cache"):
        t.stack.context(x, rot, rot, cache.keys, cache.values, torch.tensor([[9]]))
    with pytest.raises(RuntimeError, match="Stack.context: the layers were added without their kv linears"):
        t.stack.context(x, rot, rot, cache.keys, cache.values, torch.tensor([[3]]))


@pytest.mark.parametrize("arch", STACKED_ARCHS)
@pytest.mark.parametrize("weights", ["bf16", "q8_0", "q4_1"])
def test_the_drafter_runs_on_the_layer_stack_beside_a_stacked_target(arch, weights, monkeypatch):
    """Next to a stacked target the engine runs the drafter's layers as one C++ call too (`drafter.layer_stack`):
    on its bf16 weights its drafts are the per-op drafter's up to bf16 rounding (a block's K/V written into the
    draft cache at the block's positions, the context before the anchor and the whole block visible) and the
    context's values are the per-op values to the bit; on Q8_0 copies with 8-bit activations (the default) they
    are close to them, on Q4_1 copies (DFLASHKIT_DRAFTER_WEIGHTS=q4_1) less close; greedy output stays AR's
    whatever they are."""
    from dflashkit import DFlashConfig, DFlashDrafter
    from dflashkit.proposers import DraftView

    if weights == "bf16":
        monkeypatch.setenv("DFLASHKIT_DRAFTER_BF16", "1")
    elif weights == "q4_1":
        monkeypatch.setenv("DFLASHKIT_DRAFTER_WEIGHTS", "q4_1")
    tol = {"bf16": 0.05, "q8_0": 0.05, "q4_1": 0.2}[weights]  # x the values' scale (8-bit: a few per cent)
    t = _stacked(arch)
    cfg = DFlashConfig(hidden_size=t.hidden_size, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, intermediate_size=64, vocab_size=t.vocab_size, num_target_layers=t.num_layers,
                       mask_token_id=3, block_size=8, target_layer_ids=[1, 3], rope_theta=10000.0)
    drafter = DFlashDrafter(cfg).init_weights(1, std=0.3).to(torch.bfloat16)
    eng = DFlashEngine(t, drafter, eos_token_ids=[], config=DecodeConfig(tree=12, policy="fixed"))
    stacked = eng.drafter_proposer(eng.config)
    assert stacked.stack is not None and drafter.stack_weights == weights
    per_op = type(stacked)(drafter, t, 8)
    per_op.stack = None  # the same drafter through its torch modules
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(3, 20, 2 * t.hidden_size, generator=g).to(torch.bfloat16)
    pos = torch.arange(20).expand(3, 20)
    start = torch.tensor([20, 14, 9])  # ragged rows: each sees its own context only
    view = DraftView(torch.tensor([5, 6, 7]), start, 20, [])
    out, caches = [], []
    for prop in (stacked, per_op):
        state = prop.prefill(feats, pos, pos[:, -1], 40)
        prop.ingest(state)  # (drafting then writes the block's own K/V past each row's start: compare before)
        caches.append(([k.clone() for k in state.cache.keys], [v.clone() for v in state.cache.values]))
        _, logp = prop.draft(state, view, k=4, probs=True)
        out.append(logp)
    a, b = out
    assert (a[..., 0] - b[..., 0]).abs().max() < 2 * tol * b[..., 0].abs().max() + 0.05
    # the context's K/V, written by the stack in one call (`Stack.context`): on bf16 weights the per-op values to the
    # bit (the same linear kernel), the keys up to the norm's rounding; the stack's value rows end in 1.0
    for layer in range(cfg.num_hidden_layers):
        ks, vs = caches[0][0][layer][:, :, :20], caches[0][1][layer][:, :, :20]
        kp, vp = caches[1][0][layer][:, :, :20], caches[1][1][layer][:, :, :20]
        assert (vs[..., 8] == 1).all()
        if weights == "bf16":
            assert torch.equal(vs[..., :8], vp)
            torch.testing.assert_close(ks.float(), kp.float(), rtol=0.02, atol=0.02)
        else:  # 8/4-bit weights, 8-bit activations: within `tol` of the values' scale
            scale = float(vp.detach().float().abs().max())
            torch.testing.assert_close(vs[..., :8].float(), vp.float(), rtol=tol, atol=tol * scale)
            kscale = float(kp.detach().float().abs().max())
            torch.testing.assert_close(ks.float(), kp.float(), rtol=tol, atol=tol * kscale)
    prompts = [[5, 9, 11, 3], [7, 7, 1, 30, 31, 2, 8]]
    ar = eng.generate(prompts, max_new_tokens=32, config=DecodeConfig.autoregressive())
    assert [x.tokens for x in eng.generate(prompts, max_new_tokens=32)] == [x.tokens for x in ar]


def test_the_drafters_team_forward_gives_its_per_step_loops_bits(isa):
    """The drafter's stack (Q8_0 copies on 8-bit activations, qlinear) runs on the team too: the block's states and
    the K/V it writes are the per-step loop's to the bit, on each of qlinear's paths (with the AVX2 one, the
    attention runs as its own call between two team regions)."""
    from dflashkit import DFlashConfig, DFlashDrafter
    from dflashkit.proposers import DraftView

    t = _stacked("llama")
    cfg = DFlashConfig(hidden_size=t.hidden_size, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, intermediate_size=64, vocab_size=t.vocab_size, num_target_layers=t.num_layers,
                       mask_token_id=3, block_size=8, target_layer_ids=[1, 3], rope_theta=10000.0)
    eng = DFlashEngine(t, DFlashDrafter(cfg).init_weights(1, std=0.3).to(torch.bfloat16), eos_token_ids=[],
                       config=DecodeConfig(tree=0, policy="fixed"))
    prop = eng.drafter_proposer(eng.config)
    feats = torch.randn(3, 20, 2 * t.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    pos = torch.arange(20).expand(3, 20)
    view = DraftView(torch.tensor([5, 6, 7]), torch.tensor([20, 14, 9]), 20, [])
    runs = []
    for team in (False, True):
        prop.stack.set_team(team)
        assert prop.stack.on_team() == team
        state = prop.prefill(feats, pos, pos[:, -1], 40)
        prop.ingest(state, view.starts)
        runs.append([prop._hidden(state, view, block)
                     for block in (2, 8)] + [*state.cache.keys, *state.cache.values])
    prop.stack.set_team(True)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kernel,group", [(2, 16), (3, 8)])
def test_the_stacks_dflash2_convolution_is_the_modules_to_the_bit(kernel, group):
    """layers.cpp `convolve` (both of a sublayer's convolutions) against `DynamicConv` in bf16: the same op order and
    roundings, so the same bits; each row's block of Q slots alone (a tap never reads the block before)."""
    from dflashkit.dflash2 import DynamicConv
    from dflashkit.kernels import load

    torch.manual_seed(kernel)
    H, Q, B = 64, 8, 3
    conv = DynamicConv(H, kernel, group)
    with torch.no_grad():
        conv.base_kernel.normal_(0, 0.5)
        conv.kernel_projection.weight.normal_(0, 0.3)
    conv = conv.bfloat16()
    x = torch.randn(B, Q, H).bfloat16()
    with torch.no_grad():
        before, dynamic = conv.prepare(x, Q)
        after = conv.finish(x, dynamic, Q)
        dyn = conv.kernel_projection(x).view(B * Q, -1)
    ours = [load().Stack.convolve(x.view(-1, H), dyn, conv.base_kernel.detach(), part, group, Q).view(B, Q, H)
            for part in (0, 1)]
    assert torch.equal(ours[0], before) and torch.equal(ours[1], after)
    assert not torch.equal(before, x)  # the taps did mix the slots


@pytest.mark.parametrize("weights", ["bf16", "q8_0"])
def test_a_dflash2_drafter_runs_its_convolutions_on_the_layer_stack(weights, monkeypatch):
    """DFlash2's grouped dynamic convolutions run inside the drafter's stack (layers.cpp `convolve`, the module's op
    order and roundings): on bf16 weights a block's states are the per-op drafter's up to bf16 rounding, on Q8_0 copies
    close to them, and far from what the same layers give with the convolutions taken out (so they did run); the
    selector's chain then drafts from them, and greedy output stays AR's."""
    from dflashkit import DFlashConfig, DFlashDrafter
    from dflashkit.proposers import DraftView

    if weights == "bf16":
        monkeypatch.setenv("DFLASHKIT_DRAFTER_BF16", "1")
    t = _stacked("llama")
    cfg = DFlashConfig(hidden_size=t.hidden_size, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, intermediate_size=64, vocab_size=t.vocab_size, num_target_layers=t.num_layers,
                       mask_token_id=3, block_size=8, target_layer_ids=[1, 3], rope_theta=10000.0, arch="dflash2",
                       conv_kernel_size=3, conv_group_size=8, selector_rank=16, selector_top_k=6)
    drafter = DFlashDrafter(cfg).init_weights(1, std=0.3).to(torch.bfloat16)
    eng = DFlashEngine(t, drafter, eos_token_ids=[], config=DecodeConfig(tree=0, policy="fixed"))
    stacked = eng.drafter_proposer(eng.config)
    assert stacked.stack is not None and drafter.stack_weights == weights
    per_op = type(stacked)(drafter, t, 8)
    per_op.stack = None
    feats = torch.randn(3, 20, 2 * t.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    pos = torch.arange(20).expand(3, 20)
    view = DraftView(torch.tensor([5, 6, 7]), torch.tensor([20, 14, 9]), 20, [])
    hidden = []
    for prop in (stacked, per_op):
        state = prop.prefill(feats, pos, pos[:, -1], 40)
        prop.ingest(state, view.starts)
        hidden.append(prop._hidden(state, view).float())
        if prop is stacked:
            nodes = prop.propose(state, view)  # the selector's path over the stacked states
            assert nodes.tokens.shape[0] == 3
    a, b = hidden
    err = (a - b).abs().max()
    assert err < {"bf16": 0.05, "q8_0": 0.15}[weights] * b.abs().max()
    for layer in drafter.layers:  # the same layers without their convolutions
        layer.attention_conv.init_identity()
        layer.mlp_conv.init_identity()
    state = per_op.prefill(feats, pos, pos[:, -1], 40)
    per_op.ingest(state, view.starts)
    assert (per_op._hidden(state, view).float() - b).abs().max() > 4 * err
    drafter.load_state_dict(DFlashDrafter(cfg).init_weights(1, std=0.3).to(torch.bfloat16).state_dict())
    prompts = [[5, 9, 11, 3], [7, 7, 1, 30, 31, 2, 8]]
    ar = eng.generate(prompts, max_new_tokens=32, config=DecodeConfig.autoregressive())
    assert [x.tokens for x in eng.generate(prompts, max_new_tokens=32)] == [x.tokens for x in ar]


def test_one_kernel_plan_is_chosen_applied_and_keys_the_measurements(tmp_path):
    """`kernel_plan.choose` decides once; `apply` puts it on the target, whose `kernel_plan` then reads the same;
    the engine puts it on the drafter (its linears our kernel, its layers stacked with a stacked target); the plan's
    identity (with our sources) is the self-check's and the cost model's key."""
    from dflashkit import kernel_plan
    from dflashkit.engine import DFlashEngine
    from dflashkit.measurements import engine_identity

    t = make_target("llama", torch.bfloat16, backend="lean")
    plan = kernel_plan.choose(t, None)
    assert plan.linear == "rowlinear" and plan.attention == "attend" and plan.stack and not plan.codes
    assert kernel_plan.apply(plan, t, None, tmp_path) == plan == t.kernel_plan
    assert engine_identity(t).endswith(f"rowlinear.{plan.isa}+attend+layers/kernels-{plan.sources}") and plan.isa
    from dflashkit import DFlashConfig, DFlashDrafter

    cfg = DFlashConfig(hidden_size=t.hidden_size, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, intermediate_size=64, vocab_size=t.vocab_size, num_target_layers=t.num_layers,
                       mask_token_id=3, block_size=8, target_layer_ids=[1, 3], rope_theta=10000.0)
    eng = DFlashEngine(t, DFlashDrafter(cfg).init_weights(1, std=0.3).to(torch.bfloat16), eos_token_ids=[])
    assert eng.drafter.stack is not None and eng.drafter_proposer(eng.config).stack is not None
    hf = make_target("llama", torch.bfloat16)
    assert kernel_plan.choose(hf, None) == kernel_plan.TORCH and engine_identity(hf) == "HFTarget:torch"
    with pytest.raises(DFlashError, match="not a GGUF target"):
        kernel_plan.choose(make_target("llama", torch.bfloat16, backend="lean"), None, quant="int4")


@pytest.mark.parametrize("V", [1, 16, 49152 + 5])
def test_argmax_over_bf16_logits_is_torchs(V):
    """kernels.argmax (argmax.cpp) scans bf16 logits as their bits: it must return torch's index on every row, the
    first maximum where values tie (here: few distinct values, -0 beside +0), a row's first NaN, -inf rows."""
    from dflashkit.kernels import argmax, load

    load()  # argmax uses the kernels only once this process runs them
    g = torch.Generator().manual_seed(V)
    x = (torch.randn(3, 5, V, generator=g) * 4).round().bfloat16()  # ties everywhere
    x[0, 0] = -0.0
    x[0, 1] = 0.0
    x[0, 1, V // 2:] = -0.0  # +0 and -0 compare equal: the first wins
    x[0, 2] = -1.0
    x[0, 2, -1] = 0.0
    x[0, 2, V // 2] = -0.0  # ... also where -0 comes first
    x[1, 0] = float("-inf")
    x[1, 1, V // 3] = float("nan")
    x[1, 1, -1] = float("nan")
    x[1, 2, -1] = float("inf")
    x[2, 0] = -torch.rand(V, generator=g).bfloat16() - 1  # all negative
    got = argmax(x)
    assert got.dtype == torch.long and got.shape == (3, 5)
    assert torch.equal(got, x.float().argmax(-1))
    assert torch.equal(argmax(x[:, 1:3].transpose(0, 1)), x[:, 1:3].transpose(0, 1).float().argmax(-1))  # strided


@pytest.mark.parametrize("V", [5, 4096, 4096 + 3])
def test_draft_topk_is_log_softmax_topk_in_a_stable_order(V):
    """kernels.draft_topk (drafttree.cpp): each row's k best ids under log_softmax, best first and ties to the lower
    id (a stable descending sort's order: bf16 logits tie often), and their log-probabilities as torch's."""
    from dflashkit.kernels import draft_topk, load

    load()  # draft_topk uses the kernels only once this process runs them
    g = torch.Generator().manual_seed(V)
    x = (torch.randn(2, 7, V, generator=g) * 3).bfloat16()
    x[1, 0] = (torch.randn(V, generator=g) * 2).round().bfloat16()  # few distinct values: ties among the best
    x[1, 1] = -30.0
    x[1, 1, -1] = 1.0  # one clear best, the rest tied
    for k in sorted({1, min(3, V), min(16, V)}):
        for logits in (x, x.transpose(0, 1)):  # and strided input
            lp, ids = draft_topk(logits, k)
            assert lp.dtype == torch.float32 and ids.dtype == torch.long and ids.shape == logits.shape[:-1] + (k,)
            val, order = logits.float().log_softmax(-1).sort(dim=-1, descending=True, stable=True)
            assert torch.equal(ids, order[..., :k])
            torch.testing.assert_close(lp, val[..., :k], rtol=0, atol=1e-5)
    assert draft_topk(x.float(), 2) is None  # not bf16: the caller keeps torch's


@pytest.mark.parametrize("seed", range(3))
def test_beam_tree_in_cpp_builds_topk_trees_tree(seed, monkeypatch):
    """kernels.beam_tree (drafttree.cpp) runs tree.py `topk_tree`'s rule in one call: with distinct scores it must
    give the torch version's nodes exactly (tokens, parents, depths, padding, scores), pruned or not; with tied
    scores (log-probs on a coarse grid) the same number of nodes and the same scores, the tree prefix-closed."""
    from dflashkit import kernels, tree

    kernels.load()
    g = torch.Generator().manual_seed(seed)
    for b, D, K, n, p in [(1, 3, 16, 20, 0.0), (3, 15, 16, 20, 0.03), (2, 1, 4, 3, 0.0), (4, 4, 5, 30, 0.05),
                          (2, 6, 16, 64, 0.0), (2, 3, 4, 5, 0.9)]:
        logp, idx = torch.randn(b, D, 64, generator=g).mul(2).log_softmax(-1).topk(K, dim=-1)
        for coarse in (False, True):
            lp = (logp * 4).round() / 4 if coarse else logp
            assert kernels.beam_tree(idx + 7, lp, n, p) is not None
            fast = tree.topk_tree(idx + 7, lp, n, p)
            with monkeypatch.context() as m:
                m.setattr(kernels, "beam_tree", lambda *a: None)
                ref = tree.topk_tree(idx + 7, lp, n, p)
            assert fast.max_depth == ref.max_depth and (fast.alive is None) == (ref.alive is None)
            assert torch.equal(fast.logp.sort(1).values, ref.logp.sort(1).values)
            if not coarse:
                for name in ("tokens", "parent", "depth", "alive", "logp"):
                    assert (getattr(fast, name) is None) or torch.equal(getattr(fast, name), getattr(ref, name)), name
            for r in range(b):
                live = fast.alive[r] if fast.alive is not None else torch.ones_like(fast.parent[r], dtype=torch.bool)
                for i in range(fast.parent.shape[1]):
                    par = int(fast.parent[r, i])
                    assert par < i + 1 and (par == 0 or fast.depth[r, par - 1] == fast.depth[r, i] - 1)
                    assert not live[i] or par == 0 or live[par - 1]  # a kept node's parent is kept


def test_nan_drafts_give_a_full_tree_not_a_crash():
    """A drafter whose logits hold NaN drafts garbage but must not crash the process: drafttree.cpp ranks NaN as
    -infinity, so the per-slot top-k and the beam still hold k candidates (a short list once read past its end)."""
    from dflashkit import kernels, tree

    kernels.load()
    logits = torch.randn(1, 3, 40).bfloat16()
    logits[0, 1, 5] = float("nan")  # one NaN: that slot's sum is NaN, so all its log-probs are
    lp, ids = kernels.draft_topk(logits, 16)
    assert ids.shape == (1, 3, 16) and bool(((ids >= 0) & (ids < 40)).all())
    assert len(set(ids[0, 1].tolist())) == 16  # 16 distinct ids even beside the NaN
    for logp in (lp, torch.full((1, 3, 16), float("nan"))):
        nodes = tree.topk_tree(ids, logp, 20)
        assert nodes.tokens.shape == (1, 20) and bool((nodes.parent[0] < torch.arange(1, 21)).all())


@pytest.mark.parametrize("arch", STACKED_ARCHS)
def test_training_features_are_the_ones_decoding_gives(arch, monkeypatch):
    """Where our kernels run on a CPU without bf16 units, a lean target's training taps come from its own forward (the
    layer stack): a row's taps have the same bits alone and beside a longer row, equal the prefill's taps that
    decoding hands the drafter, and stay within bf16's rounding of HF's forward (the reference the target keeps
    loaded). On a CPU with bf16 units (forced here either way) they are HF's, as before."""
    from dflashkit.backends.hf import HFTarget

    t = _stacked(arch)
    t.set_taps([1, 3])
    ids = torch.randint(4, 90, (2, 37), generator=torch.Generator().manual_seed(4))
    ref = HFTarget.features(t, ids)
    monkeypatch.setattr("dflashkit.measurements.cpu_has_bf16_units", lambda: True)
    hf = t.features(ids)
    assert torch.equal(hf.taps, ref.taps) and torch.equal(hf.final, ref.final)
    monkeypatch.setattr("dflashkit.measurements.cpu_has_bf16_units", lambda: False)
    both = t.features(ids)
    alone = t.features(ids[:1, :21])
    assert both.taps.shape == (2, 37, 2 * t.hidden_size) and both.final.shape == (2, 37, t.hidden_size)
    assert torch.equal(alone.taps[0], both.taps[0, :21]) and torch.equal(alone.final[0], both.final[0, :21])
    pos = torch.arange(37).expand(2, 37)
    final, taps = t.forward(ids, pos, t.new_cache(2, 48), kv_len=37)
    assert torch.equal(taps, both.taps) and torch.equal(final, both.final)
    assert (ref.taps.float() - both.taps.float()).abs().max() < 0.05 * ref.taps.float().abs().max()
