// The lean target's decoder layers in ONE call per forward (`Stack`), for Llama-style layers (Llama, SmolLM2,
// Qwen3's per-head q/k norms): RMSNorm, the fused qkv linear, per-head norms, rotary, the K/V cache write, the
// attention (attention.cpp), o_proj, the residual adds, the SiLU-gated MLP, the taps and the model's final norm.
//
// Why it exists: per layer the Python forward runs ~40 small torch ops around the kernels (~10 us each, ~1,200 a
// step for a 30-layer model): a one-token step spent as much time there as streaming its weights. Here the glue is
// plain loops over rows.
//
// Why it stays exact: every elementwise step reads one token's row and nothing else (the norm's sum of squares is
// one 8-lane accumulator in a fixed order over the hidden dim), the linears are rowlinear / qlinear and the
// attention is `attend`, all row-invariant. So a token's hidden state has the same bits alone or in a block. The
// rounding follows HF's bf16 modules op by op (each torch op on bf16 computes in fp32 and rounds to bf16): the norm
// scales in fp32, rounds, then multiplies by its bf16 weight and rounds; rotary rounds q*cos, rotate(q)*sin and
// their sum; SiLU rounds silu(g), then g*u. Only the norm's summation order and exp's last bits differ from torch's
// kernels: this is its own kernel set (`+layers` in the engine name), exact against its own AR.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using dflashkit::bf16_round;
using dflashkit::bf16x8;
using dflashkit::hsum8;
using dflashkit::widen;
using dflashkit::bf16_round8;
using dflashkit::widen8;
using dflashkit::store8x16;

inline const uint16_t* bits(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
inline uint16_t* bits_mut(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// HF's RMSNorm on one bf16 row of n (n % 8 == 0): y = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))).
inline void rms_row(const uint16_t* x, const uint16_t* w, int64_t n, float eps, uint16_t* y) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k += 8) {
    const __m256 v = bf16x8(x + k);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const float r = 1.0f / std::sqrt(hsum8(acc) / static_cast<float>(n) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  for (int64_t k = 0; k < n; k += 8) {
    const __m256 scaled = widen8(bf16_round8(_mm256_mul_ps(bf16x8(x + k), rv)));
    store8x16(y + k, bf16_round8(_mm256_mul_ps(bf16x8(w + k), scaled)));
  }
}

// NeoX rotary on one head's row of hd (hd % 8 == 0), in place: x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)).
// tmp: 2 hd floats (the row widened, then rotate_half of it).
inline void rotate_row(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t hd, float* tmp) {
  const int64_t half = hd / 2;
  float* rot = tmp + hd;
  for (int64_t k = 0; k < hd; ++k) tmp[k] = widen(x[k]);
  for (int64_t k = 0; k < hd; ++k) rot[k] = k < half ? -tmp[k + half] : tmp[k - half];
  for (int64_t k = 0; k < hd; k += 8) {
    const __m256 a = widen8(bf16_round8(_mm256_mul_ps(_mm256_loadu_ps(tmp + k), bf16x8(cos + k))));
    const __m256 b = widen8(bf16_round8(_mm256_mul_ps(_mm256_loadu_ps(rot + k), bf16x8(sin + k))));
    store8x16(x + k, bf16_round8(_mm256_add_ps(a, b)));
  }
}

// A linear layer as RowLinear holds it (kernels/__init__.py): codes, scales, minimums, kind, rows, and which kernel
// reads them (`RowLinear.path`: 0 rowlinear, 1 qlinear on packed codes, 2 plinear on packed codes).
struct Linear {
  torch::Tensor codes, d, m;
  int64_t kind, n_out, path;
  PackedLinear pw{};  // the packed codes as plinear / qlinear read them (paths 1 and 2; `make_linear`): the team's
  // x [M, K] bf16 -> [M, n_out] bf16, or the fp32 sums before that rounding (bf16 = false: the caller rounds them
  // as it reads them, `silu_mul`, `add_rows`)
  torch::Tensor operator()(const torch::Tensor& x, bool bf16 = true) const {
    if (path == 1) return qlinear(x, codes, d, m, kind, n_out, bf16);
    if (path == 2) return plinear(x, codes, kind, n_out, bf16);
    return rowlinear(x, codes, d, m, kind, n_out, bf16);
  }
  // K: the packed codes' (pw), or from rowlinear's own codes [N, K * bytes per weight]
  int64_t in_features() const {
    if (pw.codes) return pw.K;
    const int64_t bytes = codes.numel() * codes.element_size();
    return kind == 0 ? bytes / n_out / 2 : (kind == 1 ? bytes / n_out * 2 : bytes / n_out);
  }
  // Whether the team forward can run it: packed codes (plinear's, qlinear's), or rowlinear's codes where rowlinear
  // runs its fp32 path (asked at every forward: the ISA may be switched between calls). rowlinear's codes are read
  // through the tensors at each call, not a pointer kept here: the huge-page move (hugepages.py) may replace them.
  bool on_team() const { return pw.codes || (path == 0 && rowlinear_fp32_path()); }
};

Linear make_linear(torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t kind, int64_t n_out, int64_t path) {
  Linear l{codes, d, m, kind, n_out, path};
  const int64_t bytes = codes.numel() * codes.element_size();
  if (path == 1 && (kind == 1 || kind == 2)) {  // K from the packed size: groups x blocks x bytes
    const int64_t per = packed_group_count(n_out) * (kind == 1 ? 256 : 512);
    l.pw = {static_cast<const uint8_t*>(codes.data_ptr()), d.data_ptr<float>(), m.data_ptr(), kind, bytes / per * 32,
            n_out};
  }
  if (path == 2 && (kind == 1 || kind == 2)) {  // bands x blocks x records; scales inside the records
    const int64_t per = plinear_band_count(n_out) * plinear_record_bytes(kind);
    l.pw = {static_cast<const uint8_t*>(codes.data_ptr()), nullptr, nullptr, kind, bytes / per * 32, n_out};
  }
  return l;
}

// bf16(silu(g)) for a bf16 g given by its bits.
uint16_t silu_bits(uint16_t gb) {
  const float g = widen(gb);
  return bf16_round(g / (1.0f + std::exp(-g)));
}

// bf16(silu(g)) for every bf16 g, indexed by g's bits: computed once by `silu_bits` itself, so a lookup has the
// bits the function would return (a bf16 input has only 65,536 values). Why: the function's exp and division
// cost ~20x a lookup, and a token's MLP applies it to every intermediate element (1,536 x 30 layers per token).
const std::vector<uint16_t>& silu_table() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> t(65537, 0);  // + 1 entry: silu_mul reads 32 bits at an entry (the top 16 unused)
    for (uint32_t b = 0; b < 65536; ++b) t[b] = silu_bits(static_cast<uint16_t>(b));
    return t;
  }();
  return table;
}

// The table as an int16 tensor [65536] (tests compare it with the function evaluated through the C library).
torch::Tensor silu_table_tensor() {
  const auto& t = silu_table();
  return torch::from_blob(const_cast<uint16_t*>(t.data()), {65536}, torch::kInt16).clone();
}

// x = bf16(x + bf16(a)) over n elements (n % 8 == 0), as torch's bf16 add of a linear's bf16 output; a: the linear's
// fp32 sums, rounded here as `round_to_bf16` would.
inline void add_span(uint16_t* x, const float* a, int64_t n) {
  for (int64_t k = 0; k < n; k += 8) {
    const __m256 ab = widen8(bf16_round8(_mm256_loadu_ps(a + k)));
    store8x16(x + k, bf16_round8(_mm256_add_ps(bf16x8(x + k), ab)));
  }
}

// y = bf16(bf16(silu(g)) * u) over n elements, g and u fp32 sums first rounded to bf16 as `round_to_bf16` would.
inline void silu_span(const float* g, const float* u, int64_t n, uint16_t* y) {
  const uint16_t* silu = silu_table().data();
  const int* table = reinterpret_cast<const int*>(silu);  // 32-bit reads: the entry and the next (one padding entry)
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {  // the entries as fp32 bits: each read's low 16 bits moved to the top
    const __m256i idx = _mm256_cvtepu16_epi32(bf16_round8(_mm256_loadu_ps(g + c)));
    const __m256i sg = _mm256_slli_epi32(_mm256_i32gather_epi32(table, idx, 2), 16);
    const __m256 ub = widen8(bf16_round8(_mm256_loadu_ps(u + c)));
    store8x16(y + c, bf16_round8(_mm256_mul_ps(_mm256_castsi256_ps(sg), ub)));
  }
  for (; c < n; ++c) y[c] = bf16_round(widen(silu[bf16_round(g[c])]) * widen(bf16_round(u[c])));
}

// A DFlash2 layer's grouped dynamic causal convolution around one sublayer (dflash2.py `DynamicConv`): the kernel
// projection (H -> 2 K G: the dynamic taps of the convolution before the sublayer, then of the one after it) and the
// base taps [2, K, H] bf16 (the module's `base[o].to(x.dtype)`).
struct Conv {
  Linear proj;
  torch::Tensor base;
  int64_t K, group;
};

struct Layer {
  torch::Tensor ln_in, ln_post, q_norm, k_norm;  // bf16 weights; q/k norms empty where the model has none
  Linear qkv, o, gate_up, down;
  double scaling;
  std::vector<Linear> kv;  // a drafter's k/v rows alone (`Stack.context`); empty for a target's layers
  std::vector<Conv> convs;  // DFlash2: the attention's and the MLP's convolutions (`Stack.add_convs`); else empty
};

// y[t] = sum_o (base[o] + dyn[t, o, g]) * x[t - o] over each row's block of Q slots (x[t - o] = 0 before its first
// slot), in the torch module's op order and bf16 roundings: acc = bf16(acc + bf16(base * x)), then
// acc = bf16(acc + dyn * x), tap by tap (each product of two bf16 values exact in fp32). x [M, H] bf16 (M = B Q);
// dyn [M, 2, K, G] bf16, `part` 0: the convolution before the sublayer, 1: after it. Returns bf16 [M, H], or its
// values as fp32 (out_fp32: what `add_rows` reads). Not row-invariant across blocks by design: a slot reads the
// slots before it in its own block (a drafter's numbers need not be; verification keeps the output exact).
torch::Tensor convolve(const torch::Tensor& x, const torch::Tensor& dyn, int64_t part, const Conv& cv, int64_t Q,
                       bool out_fp32) {
  const int64_t M = x.size(0), H = x.size(1), K = cv.K, G = H / cv.group;
  torch::Tensor y = torch::empty({M, H}, x.options().dtype(out_fp32 ? torch::kFloat : torch::kBFloat16));
  const uint16_t *xp = bits(x), *dp = bits(dyn), *bp = bits(cv.base) + part * K * H;
  float* yf = out_fp32 ? y.data_ptr<float>() : nullptr;
  uint16_t* yb = out_fp32 ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, M, 4, [&](int64_t a, int64_t z) {
    for (int64_t r = a; r < z; ++r) {
      const int64_t t = r % Q;
      for (int64_t c = 0; c < H; c += 8) {  // group % 8 == 0: the 8 columns share one dynamic tap
        __m256 acc = _mm256_setzero_ps();
        for (int64_t o = 0; o < K; ++o) {
          const __m256 v = t >= o ? bf16x8(xp + (r - o) * H + c) : _mm256_setzero_ps();
          const __m256 based = widen8(bf16_round8(_mm256_mul_ps(bf16x8(bp + o * H + c), v)));
          acc = widen8(bf16_round8(_mm256_add_ps(acc, based)));
          const __m256 d = _mm256_set1_ps(widen(dp[((r * 2 + part) * K + o) * G + c / cv.group]));
          acc = widen8(bf16_round8(_mm256_add_ps(acc, _mm256_mul_ps(d, v))));
        }
        if (yf) _mm256_storeu_ps(yf + r * H + c, acc);
        else store8x16(yb + r * H + c, bf16_round8(acc));
      }
    }
  });
  return y;
}

}  // namespace

class Stack {
 public:
  Stack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : nh_(heads), kvh_(kv_heads), hd_(head_dim), eps_(static_cast<float>(eps)) {
    TORCH_CHECK(head_dim % 8 == 0 && heads % kv_heads == 0, "Stack: head dim % 8 and heads % kv heads must be 0");
  }

  void add_layer(torch::Tensor ln_in, torch::Tensor ln_post, torch::Tensor q_norm, torch::Tensor k_norm,
                 std::vector<Linear> linears, double scaling) {
    TORCH_CHECK(linears.size() == 4 || linears.size() == 5,
                "Stack.add_layer: linears are qkv, o, gate_up, down (and a drafter's kv)");
    for (const auto* t : {&ln_in, &ln_post})
      TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->is_contiguous(), "Stack: norm weights must be bf16");
    TORCH_CHECK(linears[0].n_out == (nh_ + 2 * kvh_) * hd_, "Stack: qkv rows must be (heads + 2 kv heads) * hd");
    layers_.push_back({ln_in, ln_post, q_norm, k_norm, linears[0], linears[1], linears[2], linears[3], scaling,
                       std::vector<Linear>(linears.begin() + 4, linears.end())});
    if (linears.size() == 5)
      TORCH_CHECK(linears[4].n_out == 2 * kvh_ * hd_, "Stack: kv rows must be 2 * kv heads * hd");
  }

  // DFlash2: layer i's two convolutions (the attention's, then the MLP's), each its kernel projection (n_out 2 K G)
  // and its base taps bf16 [2, K, H]; group: channels per dynamic tap (a multiple of 8 dividing H).
  void add_convs(int64_t i, Linear attn_proj, torch::Tensor attn_base, Linear mlp_proj, torch::Tensor mlp_base,
                 int64_t kernel_size, int64_t group) {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(layers_.size()), "Stack.add_convs: no layer ", i);
    const int64_t H = layers_[i].ln_in.numel(), K = kernel_size;
    TORCH_CHECK(K >= 1 && group % 8 == 0 && H % group == 0,
                "Stack.add_convs: group must be a multiple of 8 dividing H");
    for (const auto* b : {&attn_base, &mlp_base})
      TORCH_CHECK(b->scalar_type() == torch::kBFloat16 && b->is_contiguous() &&
                      b->sizes() == torch::IntArrayRef({2, K, H}), "Stack.add_convs: base taps must be bf16 [2, K, H]");
    for (const auto* p : {&attn_proj, &mlp_proj})
      TORCH_CHECK(p->n_out == 2 * K * (H / group), "Stack.add_convs: a kernel projection has 2 K (H / group) rows");
    layers_[i].convs = {{attn_proj, attn_base, K, group}, {mlp_proj, mlp_base, K, group}};
  }

  // The model's final norm (bf16 [H]), applied by `forward` to the last layer's output: one `rms_row` per row
  // instead of HF's module, whose ~8 torch ops each cost ~20 us run right after a step has streamed the weights
  // through the caches (measured on an AMD EPYC: ~0.14 ms a step, against ~18 us warm).
  void set_final_norm(torch::Tensor w) {
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 1 && w.is_contiguous(),
                "Stack.set_final_norm: the weight must be a contiguous bf16 [H]");
    final_norm_ = w;
  }

  // false: `forward` runs its per-step loop even where the team forward could (tests compare the two, A/B
  // benchmarks); returns the setting before. Both give the same bits.
  bool set_team(bool on) {
    const bool was = team_;
    team_ = on;
    return was;
  }

  // x [B, Q, H] bf16 (embedded); cos / sin [B, Q, hd] bf16 (each token's rotary row); keys / values: the cache
  // layers [B, kvh, T, hd] / [B, kvh, T, hd + 1] (written at `slots` [B, Q] int64; the value's last column is 1.0,
  // see backends/lean.py); head [B, Q, S] bool, tail [B, Q, L] int64: `attend`'s key lists; taps: layer indices
  // whose output is returned, concatenated, in that order. Returns (x after the last layer [B, Q, H], normed by the
  // final norm where one is set, taps [B, Q, len(taps) * H] or empty).
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                                   std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values,
                                                   torch::Tensor slots, torch::Tensor head, torch::Tensor tail,
                                                   std::vector<int64_t> taps) {
    const int64_t B = x.size(0), Q = x.size(1), H = x.size(2), M = B * Q, nl = layers_.size();
    check_rows("Stack.forward", x, cos, sin, keys, values, slots);
    cos = cos.contiguous(), sin = sin.contiguous(), slots = slots.contiguous();
    x = x.reshape({M, H}).contiguous().clone();
    torch::Tensor feats = torch::empty({M, static_cast<int64_t>(taps.size()) * H}, x.options());
    torch::Tensor h = torch::empty({M, H}, x.options());
    TORCH_CHECK(!final_norm_.defined() || final_norm_.numel() == H,
                "Stack.forward: the final norm's weight must have H elements");
    if (on_team() && H == layers_[0].ln_in.numel()) {
      forward_team(x, h, feats, cos, sin, keys, values, slots, head, tail, taps, B, Q);
      return {(final_norm_.defined() ? h : x).view({B, Q, H}), feats.view({B, Q, -1})};
    }
    for (int64_t i = 0; i < nl; ++i) {
      const Layer& ly = layers_[i];
      const torch::Tensor& kc = keys[i];
      const torch::Tensor& vc = values[i];
      const bool conv = !ly.convs.empty();  // DFlash2: a convolution before and after each sublayer
      norm_rows(x, ly.ln_in, h);
      torch::Tensor dyn = conv ? ly.convs[0].proj(h) : torch::Tensor();  // [M, 2 K G] bf16
      torch::Tensor qkv = ly.qkv(conv ? convolve(h, dyn, 0, ly.convs[0], Q, false) : h);  // [M, (nh + 2 kvh) hd]
      torch::Tensor q = torch::empty({B, Q, nh_, hd_}, x.options());
      heads(qkv, ly, cos, sin, q, kc, vc, slots, nh_, Q);
      torch::Tensor a = attend(q, kc, vc, head, tail, ly.scaling).view({M, nh_ * hd_});
      add_rows(x, conv ? convolve(ly.o(a), dyn, 1, ly.convs[0], Q, true) : ly.o(a, false));
      norm_rows(x, ly.ln_post, h);
      if (conv) dyn = ly.convs[1].proj(h);
      torch::Tensor m = ly.down(silu_mul(ly.gate_up(conv ? convolve(h, dyn, 0, ly.convs[1], Q, false) : h, false)),
                                conv);  // gate_up: [M, 2 I] fp32; down: fp32 sums, bf16 where a convolution reads it
      add_rows(x, conv ? convolve(m, dyn, 1, ly.convs[1], Q, true) : m);
      for (size_t t = 0; t < taps.size(); ++t)
        if (taps[t] == i) copy_tap(x, feats, t);
    }
    if (final_norm_.defined()) {
      norm_rows(x, final_norm_, h);
      x = h;
    }
    return {x.view({B, Q, H}), feats.view({B, Q, -1})};
  }

  // A drafter's context K/V: x [B, R, H] bf16, its fused and normed target features (context rows are never queries,
  // so no layer's input norm applies); cos / sin [B, R, hd]; slots [B, R] int64. Per layer: the kv linear, the k
  // norm and rotary, written into the cache layers at `slots` as `forward` writes a block's (values with their 1.0).
  // Why in C++: the same steps as ~15 small torch ops per layer cost ~0.6 ms of a ~3 ms drafting step.
  void context(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> keys,
               std::vector<torch::Tensor> values, torch::Tensor slots) {
    const int64_t B = x.size(0), R = x.size(1), H = x.size(2), M = B * R, nl = layers_.size();
    check_rows("Stack.context", x, cos, sin, keys, values, slots);
    cos = cos.contiguous(), sin = sin.contiguous(), slots = slots.contiguous();
    x = x.reshape({M, H}).contiguous();
    torch::Tensor none;
    for (int64_t i = 0; i < nl; ++i) {
      const Layer& ly = layers_[i];
      TORCH_CHECK(!ly.kv.empty(), "Stack.context: the layers were added without their kv linears");
      heads(ly.kv[0](x), ly, cos, sin, none, keys[i], values[i], slots, 0, R);
    }
  }

  // A drafter's fuse (`DFlashDrafter.fuse`: hidden_norm(fc(taps))) for `context_taps`: fc's linear and the norm's
  // bf16 weight [H].
  void set_fuse(const Linear& fc, torch::Tensor norm) {
    TORCH_CHECK(norm.scalar_type() == torch::kBFloat16 && norm.dim() == 1 && norm.is_contiguous() &&
                    norm.numel() == fc.n_out,
                "Stack.set_fuse: the norm's weight must be a contiguous bf16 [H], H the linear's rows");
    fuse_ = {fc};
    fuse_norm_ = norm;
  }

  // `context` of the target's taps [B, R, k H] bf16 as they are: fused (fc, then the norm as `rms_row`) here first.
  // Why: fc's call and the ~6 torch ops of the norm cost ~0.5 ms of a drafted step right after a target step has
  // streamed its weights through the caches (measured on an AMD EPYC, AVX2: fc 0.29 ms, the norm 0.23 ms).
  void context_taps(torch::Tensor taps, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> keys,
                    std::vector<torch::Tensor> values, torch::Tensor slots) {
    TORCH_CHECK(!fuse_.empty(), "Stack.context_taps: no fuse set (set_fuse)");
    TORCH_CHECK(taps.scalar_type() == torch::kBFloat16 && taps.dim() == 3 && taps.size(2) == fuse_[0].in_features(),
                "Stack.context_taps: taps must be bf16 [B, R, k H], k H the fuse linear's input width");
    const int64_t B = taps.size(0), R = taps.size(1);
    torch::Tensor y = fuse_[0](taps.reshape({B * R, taps.size(2)}).contiguous());  // bf16 [M, H]
    torch::Tensor h = torch::empty_like(y);
    norm_rows(y, fuse_norm_, h);
    context(h.view({B, R, -1}), cos, sin, keys, values, slots);
  }

 private:
  // What `forward` and `context` check of their arguments, before any thread writes the cache: x bf16 [B, Q, H],
  // one cache layer per layer, each contiguous [B, kvh, T, hd] / [B, kvh, T, hd + 1], cos / sin [B, Q, hd], slots
  // [B, Q] int64 inside the cache. `who` names the caller.
  void check_rows(const char* who, const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                  const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                  const torch::Tensor& slots) const {
    const int64_t B = x.size(0), Q = x.size(1), H = x.size(2), nl = layers_.size();
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && H % 32 == 0, who, ": x must be bf16 [B, Q, H]");
    TORCH_CHECK(static_cast<int64_t>(keys.size()) == nl && static_cast<int64_t>(values.size()) == nl, who,
                ": one cache layer per layer");
    for (int64_t i = 0; i < nl; ++i) {
      const torch::Tensor &kc = keys[i], &vc = values[i];
      TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.size(0) == B && kc.size(1) == kvh_ &&
                      kc.size(3) == hd_ && vc.size(3) == hd_ + 1 && vc.size(2) == kc.size(2),
                  who, ": cache layers must be contiguous [B, kvh, T, hd] / [B, kvh, T, hd + 1]");
    }
    TORCH_CHECK(cos.sizes() == torch::IntArrayRef({B, Q, hd_}) && sin.sizes() == cos.sizes() &&
                    slots.sizes() == torch::IntArrayRef({B, Q}) && slots.scalar_type() == torch::kLong,
                who, ": cos / sin [B, Q, hd] and slots [B, Q] int64");
    const torch::Tensor s = slots.contiguous();
    const int64_t T = keys.empty() ? 0 : keys[0].size(2);
    const int64_t* sp = s.data_ptr<int64_t>();
    for (int64_t r = 0; r < B * Q; ++r)
      TORCH_CHECK(sp[r] >= 0 && sp[r] < T, who, ": slot ", sp[r], " lies outside the cache (", T, " slots)");
  }

  // feats[:, t H : (t + 1) H] = x [M, H], row by row. Why not narrow().copy_(): a dispatched strided copy per tap
  // per step cost ~0.1 ms of a 15 ms step at 8 rows (measured: the forward with 5 taps against none), and every plain
  // step of the default pays it; a row copy is the same bits.
  static void copy_tap(const torch::Tensor& x, torch::Tensor& feats, size_t t) {
    const int64_t M = x.size(0), H = x.size(1), W = feats.size(1);
    const uint16_t* xp = bits(x);
    uint16_t* fp = bits_mut(feats);
    for (int64_t r = 0; r < M; ++r) std::memcpy(fp + r * W + t * H, xp + r * H, H * sizeof(uint16_t));
  }

  void norm_rows(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& y) const {
    const int64_t M = x.size(0), H = x.size(1);
    const uint16_t *xp = bits(x), *wp = bits(w);
    uint16_t* yp = bits_mut(y);
    at::parallel_for(0, M, 16, [&](int64_t a, int64_t z) {
      for (int64_t r = a; r < z; ++r) rms_row(xp + r * H, wp, H, eps_, yp + r * H);
    });
  }

  // x = bf16(x + bf16(a)), as torch's bf16 add of the linear's bf16 output; a [M, H] fp32: the linear's sums, rounded
  // here as `round_to_bf16` would (one pass over the rows instead of two).
  static void add_rows(torch::Tensor& x, const torch::Tensor& a) {
    uint16_t* xp = bits_mut(x);
    const float* ap = a.data_ptr<float>();
    at::parallel_for(0, x.numel() / 8, 1024, [&](int64_t s, int64_t e) {  // numel % 8 == 0 (H % 32 == 0)
      add_span(xp + 8 * s, ap + 8 * s, 8 * (e - s));
    });
  }

  // gu [M, 2 I] fp32 (gate_up's sums) -> bf16(bf16(silu(g)) * u) [M, I] bf16, g and u first rounded to bf16 as
  // `round_to_bf16` would: the same bits as rounding gate_up's output, then this on bf16 rows.
  static torch::Tensor silu_mul(const torch::Tensor& gu) {
    const int64_t M = gu.size(0), I = gu.size(1) / 2;
    torch::Tensor y = torch::empty({M, I}, gu.options().dtype(torch::kBFloat16));
    const float* gp = gu.data_ptr<float>();
    uint16_t* yp = bits_mut(y);
    at::parallel_for(0, M, std::max<int64_t>(1, 8192 / I), [&](int64_t a, int64_t z) {
      for (int64_t r = a; r < z; ++r) silu_span(gp + r * 2 * I, gp + r * 2 * I + I, I, yp + r * I);
    });
    return y;
  }

  // Where a layer's heads go (`heads`, `qkv_step`): q [M, nq, hd] (nq = nh_, or 0: k and v alone), the cache
  // layers k [B, kvh, T, hd] / v [B, kvh, T, hd + 1] at each token's slot, with the rotary rows and per-head norms.
  struct HeadsTo {
    uint16_t *q, *k, *v;
    const uint16_t *cos, *sin, *qn, *kn;  // qn / kn null where the model has no per-head norms
    const int64_t* slots;
    int64_t nq, Q, T;
  };

  HeadsTo heads_to(const Layer& ly, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& q,
                   const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& slots, int64_t nq,
                   int64_t Q) const {
    const uint16_t* qn = ly.q_norm.defined() && ly.q_norm.numel() ? bits(ly.q_norm) : nullptr;
    const uint16_t* kn = ly.k_norm.defined() && ly.k_norm.numel() ? bits(ly.k_norm) : nullptr;
    return {nq ? bits_mut(q) : nullptr, reinterpret_cast<uint16_t*>(kc.data_ptr()),
            reinterpret_cast<uint16_t*>(vc.data_ptr()), bits(cos), bits(sin), qn, kn, slots.data_ptr<int64_t>(),
            nq, Q, kc.size(2)};
  }

  // Head j of token r from its hd bf16 values at `src` (j < nq: a q head, then kvh k heads, then kvh v heads): the
  // per-head norm (Qwen3) and rotary for q and k; q into o.q, k / v (+ 1.0) into the cache. row: hd, tmp: 2 hd.
  void head(const HeadsTo& o, int64_t r, int64_t j, const uint16_t* src, uint16_t* row, float* tmp) const {
    const int64_t hd = hd_, b = r / o.Q, slot = o.slots[r];
    if (j >= o.nq + kvh_) {
      uint16_t* dst = o.v + ((b * kvh_ + (j - o.nq - kvh_)) * o.T + slot) * (hd + 1);
      std::memcpy(dst, src, hd * 2);
      dst[hd] = bf16_round(1.0f);
      return;
    }
    const bool is_q = j < o.nq;
    uint16_t* dst = is_q ? o.q + (r * o.nq + j) * hd : o.k + ((b * kvh_ + (j - o.nq)) * o.T + slot) * hd;
    const uint16_t* norm = is_q ? o.qn : o.kn;
    if (norm) rms_row(src, norm, hd, eps_, row);
    else std::memcpy(row, src, hd * 2);
    rotate_row(row, o.cos + r * hd, o.sin + r * hd, hd, tmp);
    std::memcpy(dst, row, hd * 2);
  }

  // Per token: its row of nq q heads (nh_, or 0: k and v alone), then k and v heads, each through `head`.
  void heads(const torch::Tensor& qkv, const Layer& ly, const torch::Tensor& cos, const torch::Tensor& sin,
             torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& slots,
             int64_t nq, int64_t Q) const {
    const int64_t M = qkv.size(0), hd = hd_, nj = nq + 2 * kvh_;
    const HeadsTo o = heads_to(ly, cos, sin, q, kc, vc, slots, nq, Q);
    const uint16_t* src = bits(qkv);
    at::parallel_for(0, M, 4, [&](int64_t a, int64_t z) {
      std::vector<uint16_t> row(hd);
      std::vector<float> tmp(2 * hd);
      for (int64_t r = a; r < z; ++r)
        for (int64_t j = 0; j < nj; ++j) head(o, r, j, src + (r * nj + j) * hd, row.data(), tmp.data());
    });
  }

  // ---- the team forward ------------------------------------------------------------------------------------
  // Where every linear reads packed codes (plinear's: the int4 target on AVX512-BF16 CPUs; qlinear's: the drafter's
  // Q8_0 copies, the int4-a8 target) or runs rowlinear's fp32 path (the bf16 target on AVX2-only CPUs; there the
  // second thread sat idle ~21 % of a one-token step while the first ran the glue between the forks), `forward` runs
  // as ONE OpenMP team (or, where `attend` would not take its grouped short-list layout, one team per layer between
  // the attention calls): the threads go through the steps together, a barrier between them, and share the glue too
  // (norms, SiLU, the residual adds, the activations' layout, the heads' rotary) instead of the calling thread
  // running it while the other waits for the next fork.
  // Why: at 4 tokens the second thread sat idle ~37 % of a step (the glue on the first thread, a fork/join per step).
  // Each step's work splits by rows, blocks, weight groups, heads or attention units, and every element is computed
  // whole by one thread in the per-step loop's order: the same bits (tests compare the two).

  // The buffers the team's steps share: rows M, hidden H, attention width A, intermediate I.
  struct Bufs {
    int64_t M, H, A, I;
    uint16_t *x, *h, *act;  // the residual [M, H], its norm [M, H], SiLU's output [M, I]
    uint32_t* pairs;        // the next plinear Q4_1 linear's activations laid out (plinear_lay_out)
    float *sums, *y;        // their block sums; a linear's fp32 sums [M, N]
    QlinearActs qa;         // the next qlinear linear's activations as int8 blocks (qlinear_quantize)
    float* xf;              // the next rowlinear linear's activations widened to fp32 [M, K] (rowlinear_widen)
  };

  // Whether `forward` runs on the team (`set_team` on, every linear on packed codes or on rowlinear's fp32 path
  // (`Linear::on_team`), no DFlash2 convolutions, the linears' shapes the model's: K = H for qkv and gate_up, the
  // attention width for o, one intermediate size for down).
 public:
  bool on_team() const {
    if (layers_.empty() || !team_) return false;
    const int64_t H = layers_[0].ln_in.numel(), I = layers_[0].down.in_features();
    for (const Layer& ly : layers_) {
      for (const Linear* l : {&ly.qkv, &ly.o, &ly.gate_up, &ly.down})
        if (!l->on_team() || !ly.convs.empty()) return false;
      if (ly.qkv.in_features() != H || ly.gate_up.in_features() != H || ly.o.in_features() != nh_ * hd_ ||
          ly.down.in_features() != I ||
          ly.gate_up.n_out != 2 * I || ly.o.n_out != H || ly.down.n_out != H || I % 32)
        return false;
    }
    return true;
  }

 private:
  // y = L(x) over this thread's weight groups (rowlinear: tiles of rows); x [M, K] bf16, prepared by the step before
  // (`prepare`).
  static void tiles(const Linear& L, const uint16_t* x, const Bufs& b, int tid, int nt) {
    if (L.path == 0) {
      const auto [t0, t1] = thread_share(rowlinear_tile_count(L.n_out), tid, nt);
      rowlinear_tiles(L.codes, L.d, L.m, L.kind, L.n_out, L.in_features(), b.xf, b.M, t0, t1, b.y);
      return;
    }
    if (L.path == 2) {
      const auto [j0, j1] = thread_share(plinear_band_count(L.n_out), tid, nt);
      plinear_bands(L.pw, x, b.pairs, b.sums, b.M, j0, j1, b.y);
      return;
    }
    const auto [g0, g1] = thread_share(packed_group_count(L.n_out), tid, nt);
    qlinear_groups(L.pw, b.qa, b.M, g0, g1, b.y);
  }

  // Blocks [f0, f1) of x's 32-element blocks made ready for L: laid out (plinear's Q4_1), quantized (qlinear) or
  // widened to fp32 (rowlinear).
  static void prepare(const Linear& L, const uint16_t* x, int64_t f0, int64_t f1, const Bufs& b) {
    if (L.path == 2 && L.kind == 1) plinear_lay_out(x, f0, f1, b.pairs, b.sums);
    if (L.path == 1) qlinear_quantize(x, f0, f1, b.qa);
    if (L.path == 0) rowlinear_widen(x, f0, f1, b.xf);
  }
  static bool prepares(const Linear& L) { return L.path != 2 || L.kind == 1; }

  // This thread's rows: x += the linear's sums in y (add), the taps at layer i, then the norm `w` into h, prepared
  // for `next` (null: the final norm, no linear follows).
  void rows_step(bool add, const Bufs& b, int64_t i, const std::vector<int64_t>& taps, uint16_t* feats,
                 const torch::Tensor& w, const Linear* next, int tid, int nt) const {
    const auto [r0, r1] = thread_share(b.M, tid, nt);
    const int64_t H = b.H, W = static_cast<int64_t>(taps.size()) * H;
    for (int64_t r = r0; r < r1; ++r) {
      if (add) add_span(b.x + r * H, b.y + r * H, H);
      for (size_t t = 0; t < taps.size(); ++t)
        if (taps[t] == i) std::memcpy(feats + r * W + t * H, b.x + r * H, H * 2);
      if (w.defined()) rms_row(b.x + r * H, bits(w), H, eps_, b.h + r * H);
    }
    if (next) prepare(*next, b.h, r0 * H / 32, r1 * H / 32, b);
  }

  // Layer ly's qkv over h (prepared), then its heads from the fp32 sums (each head's row rounded as `round_to_bf16`
  // would, then `head`), split by (token, head).
  void qkv_step(const Layer& ly, const Bufs& b, const HeadsTo& o, int tid, int nt) const {
    tiles(ly.qkv, b.h, b, tid, nt);
#pragma omp barrier
    const int64_t nj = nh_ + 2 * kvh_, hd = hd_;
    std::vector<uint16_t> in(hd), row(hd);
    std::vector<float> tmp(2 * hd);
    const auto [a, z] = thread_share(b.M * nj, tid, nt);
    for (int64_t it = a; it < z; ++it) {
      const float* src = b.y + it * hd;  // token it / nj, head it % nj: the row is nj heads of hd
      for (int64_t k = 0; k < hd; k += 8) store8x16(in.data() + k, bf16_round8(_mm256_loadu_ps(src + k)));
      head(o, it / nj, it % nj, in.data(), row.data(), tmp.data());
    }
  }

  // Layer i after its attention (a [M, A] bf16): o, the add and the post norm, gate_up, SiLU, down, the add, the
  // taps, and the next layer's norm and qkv with its heads (or the final norm).
  void mlp_step(int64_t i, const uint16_t* a, const Bufs& b, const std::vector<int64_t>& taps, uint16_t* feats,
                const HeadsTo* next_heads, int tid, int nt) const {
    const Layer& ly = layers_[i];
    if (prepares(ly.o)) {
      const auto [f0, f1] = thread_share(b.M * b.A / 32, tid, nt);
      prepare(ly.o, a, f0, f1, b);
#pragma omp barrier
    }
    tiles(ly.o, a, b, tid, nt);
#pragma omp barrier
    rows_step(true, b, -1, taps, feats, ly.ln_post, &ly.gate_up, tid, nt);
#pragma omp barrier
    tiles(ly.gate_up, b.h, b, tid, nt);
#pragma omp barrier
    const int64_t I = b.I, per_row = I / 32;
    const auto [f0, f1] = thread_share(b.M * per_row, tid, nt);  // SiLU by 32-element blocks, each made ready for down
    for (int64_t f = f0; f < f1; ++f) {
      const int64_t r = f / per_row, c = f % per_row * 32;
      silu_span(b.y + r * 2 * I + c, b.y + r * 2 * I + I + c, 32, b.act + r * I + c);
    }
    prepare(ly.down, b.act, f0, f1, b);
#pragma omp barrier
    tiles(ly.down, b.act, b, tid, nt);
#pragma omp barrier
    const bool last = i + 1 == static_cast<int64_t>(layers_.size());
    const Linear* next = last ? nullptr : &layers_[i + 1].qkv;
    rows_step(true, b, i, taps, feats, last ? final_norm_ : layers_[i + 1].ln_in, next, tid, nt);
    if (last) return;
#pragma omp barrier
    qkv_step(layers_[i + 1], b, *next_heads, tid, nt);
  }

  template <class F>
  static void team(F&& f) {
#pragma omp parallel num_threads(at::get_num_threads())
    f(omp_get_thread_num(), omp_get_num_threads());
  }

  void forward_team(torch::Tensor& x, torch::Tensor& h, torch::Tensor& feats, const torch::Tensor& cos,
                    const torch::Tensor& sin, const std::vector<torch::Tensor>& keys,
                    const std::vector<torch::Tensor>& values, const torch::Tensor& slots, const torch::Tensor& head,
                    const torch::Tensor& tail, const std::vector<int64_t>& taps, int64_t B, int64_t Q) const {
    const int64_t M = x.size(0), H = x.size(1), A = nh_ * hd_, I = layers_[0].down.in_features(), nl = layers_.size();
    const int64_t K = std::max({H, A, I}), N = std::max({layers_[0].qkv.n_out, 2 * I, H});
    const auto opt = x.options();
    torch::Tensor act = torch::empty({M, I}, opt), q = torch::empty({B, Q, nh_, hd_}, opt);
    torch::Tensor pairs = torch::empty({M * K / 32 * 16}, opt.dtype(torch::kInt));
    torch::Tensor sums = torch::empty({M * K / 32}, opt.dtype(torch::kFloat));
    torch::Tensor y = torch::empty({M, N}, opt.dtype(torch::kFloat));
    torch::Tensor qu = torch::empty({2, M * K}, opt.dtype(torch::kByte));  // qlinear's int8 blocks, then + 128
    torch::Tensor ds = torch::empty({2, M * K / 32}, y.options());         // their scales, then d * sum(q)
    const QlinearActs qa{reinterpret_cast<int8_t*>(qu.data_ptr<uint8_t>()), qu.data_ptr<uint8_t>() + M * K,
                         ds.data_ptr<float>(), ds.data_ptr<float>() + M * K / 32};
    torch::Tensor xf = torch::empty({M * K}, y.options());  // rowlinear's widened activations
    const Bufs b{M, H, A, I, bits_mut(x), bits_mut(h), bits_mut(act), reinterpret_cast<uint32_t*>(pairs.data_ptr()),
                 sums.data_ptr<float>(), y.data_ptr<float>(), qa, xf.data_ptr<float>()};
    uint16_t* fp = bits_mut(feats);
    std::vector<HeadsTo> to;
    for (int64_t i = 0; i < nl; ++i)
      to.push_back(heads_to(layers_[i], cos, sin, q, keys[i], values[i], slots, nh_, Q));
    const auto start = [&](int tid, int nt) {
      rows_step(false, b, -1, taps, fp, layers_[0].ln_in, &layers_[0].qkv, tid, nt);
#pragma omp barrier
      qkv_step(layers_[0], b, to[0], tid, nt);
    };
    const int64_t S = head.size(2), L = tail.size(2);
    TORCH_CHECK(head.scalar_type() == torch::kBool && tail.scalar_type() == torch::kLong && head.dim() == 3 &&
                    tail.dim() == 3 && head.size(0) == B && head.size(1) == Q && tail.size(0) == B &&
                    tail.size(1) == Q && S <= keys[0].size(2),
                "Stack.forward: head [B, Q, S <= T] bool and tail [B, Q, L] int64");
    if (attend_grouped_takes(B, Q, kvh_, hd_, S, L)) {  // short key lists: the attention on the team too
      const torch::Tensor hc = head.contiguous(), tc = tail.contiguous();
      torch::Tensor o = torch::empty({M, A}, opt);  // each layer's attention output, read by its o
      std::vector<AttendArgs> att;
      for (int64_t i = 0; i < nl; ++i)
        att.push_back({bits(q), bits(keys[i]), bits(values[i]), bits_mut(o), B, Q, nh_, hd_, kvh_, keys[i].size(2),
                       values[i].size(3), static_cast<float>(layers_[i].scaling), hc.data_ptr<bool>(),
                       tc.data_ptr<int64_t>(), S, L});
      team([&](int tid, int nt) {
        start(tid, nt);
        for (int64_t i = 0; i < nl; ++i) {
#pragma omp barrier
          attend_grouped(att[i], tid, nt);
#pragma omp barrier
          mlp_step(i, att[i].o, b, taps, fp, i + 1 < nl ? &to[i + 1] : nullptr, tid, nt);
        }
      });
      return;
    }
    team(start);
    for (int64_t i = 0; i < nl; ++i) {
      const torch::Tensor a = attend(q, keys[i], values[i], head, tail, layers_[i].scaling);
      const uint16_t* ap = bits(a);
      team([&](int tid, int nt) { mlp_step(i, ap, b, taps, fp, i + 1 < nl ? &to[i + 1] : nullptr, tid, nt); });
    }
  }

  int64_t nh_, kvh_, hd_;
  float eps_;
  bool team_ = true;
  std::vector<Layer> layers_;
  torch::Tensor final_norm_;  // undefined: forward returns the last layer's output as it is
  std::vector<Linear> fuse_;  // a drafter's fc (`set_fuse`; empty: none), and its norm's weight
  torch::Tensor fuse_norm_;
};

void register_stack(pybind11::module& mod) {
  namespace py = pybind11;
  py::class_<Linear>(mod, "StackLinear")
      .def(py::init([](torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t kind, int64_t n_out,
                       int64_t path) { return make_linear(codes, d, m, kind, n_out, path); }));
  py::class_<Stack>(mod, "Stack")
      .def(py::init<int64_t, int64_t, int64_t, double>())
      .def("add_layer", &Stack::add_layer)
      .def("set_final_norm", &Stack::set_final_norm)
      .def("add_convs", &Stack::add_convs)
      .def("set_team", &Stack::set_team)
      .def("on_team", &Stack::on_team)
      .def("forward", &Stack::forward, py::call_guard<py::gil_scoped_release>())  // see module.cpp: nogil
      .def("context", &Stack::context, py::call_guard<py::gil_scoped_release>())
      .def("set_fuse", &Stack::set_fuse)
      .def("context_taps", &Stack::context_taps, py::call_guard<py::gil_scoped_release>())
      .def_static("silu_table", &silu_table_tensor)
      .def_static("convolve", [](torch::Tensor x, torch::Tensor dyn, torch::Tensor base, int64_t part, int64_t group,
                                 int64_t Q) {  // tests: one convolution as `forward` runs it (bf16 [M, H])
        TORCH_CHECK(x.dim() == 2 && base.dim() == 3 && x.size(0) % Q == 0 && x.size(1) % group == 0 && group % 8 == 0,
                    "Stack.convolve: x [M, H], base [2, K, H], M a multiple of Q, group a multiple of 8 dividing H");
        const Conv cv{Linear{}, base.contiguous(), base.size(1), group};
        return convolve(x.contiguous(), dyn.contiguous(), part, cv, Q, false);
      });
}
