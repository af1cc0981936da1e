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
  // x [M, K] bf16 -> [M, n_out] bf16, or the fp32 sums before that rounding (bf16 = false: the caller rounds them
  // as it reads them, `silu_mul`, `add_rows`)
  torch::Tensor operator()(const torch::Tensor& x, bool bf16 = true) const {
    if (path == 1) return qlinear(x, codes, d, m, kind, n_out, bf16);
    if (path == 2) return plinear(x, codes, d, m, kind, n_out, bf16);
    return rowlinear(x, codes, d, m, kind, n_out, bf16);
  }
};

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

struct Layer {
  torch::Tensor ln_in, ln_post, q_norm, k_norm;  // bf16 weights; q/k norms empty where the model has none
  Linear qkv, o, gate_up, down;
  double scaling;
  std::vector<Linear> kv;  // a drafter's k/v rows alone (`Stack.context`); empty for a target's layers
};

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

  // The model's final norm (bf16 [H]), applied by `forward` to the last layer's output: one `rms_row` per row
  // instead of HF's module, whose ~8 torch ops each cost ~20 us run right after a step has streamed the weights
  // through the caches (measured on an AMD EPYC: ~0.14 ms a step, against ~18 us warm).
  void set_final_norm(torch::Tensor w) {
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 1 && w.is_contiguous(),
                "Stack.set_final_norm: the weight must be a contiguous bf16 [H]");
    final_norm_ = w;
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
    for (int64_t i = 0; i < nl; ++i) {
      const Layer& ly = layers_[i];
      const torch::Tensor& kc = keys[i];
      const torch::Tensor& vc = values[i];
      norm_rows(x, ly.ln_in, h);
      torch::Tensor qkv = ly.qkv(h);  // [M, (nh + 2 kvh) hd]
      torch::Tensor q = torch::empty({B, Q, nh_, hd_}, x.options());
      heads(qkv, ly, cos, sin, q, kc, vc, slots, nh_, Q);
      add_rows(x, ly.o(attend(q, kc, vc, head, tail, ly.scaling).view({M, nh_ * hd_}), false));
      norm_rows(x, ly.ln_post, h);
      add_rows(x, ly.down(silu_mul(ly.gate_up(h, false)), false));  // gate_up: [M, 2 I] fp32
      for (size_t t = 0; t < taps.size(); ++t)
        if (taps[t] == i) copy_tap(x, feats, t);
    }
    if (final_norm_.defined()) {
      TORCH_CHECK(final_norm_.numel() == H, "Stack.forward: the final norm's weight must have H elements");
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
      for (int64_t k = 8 * s; k < 8 * e; k += 8) {
        const __m256 ab = widen8(bf16_round8(_mm256_loadu_ps(ap + k)));
        store8x16(xp + k, bf16_round8(_mm256_add_ps(bf16x8(xp + k), ab)));
      }
    });
  }

  // gu [M, 2 I] fp32 (gate_up's sums) -> bf16(bf16(silu(g)) * u) [M, I] bf16, g and u first rounded to bf16 as
  // `round_to_bf16` would: the same bits as rounding gate_up's output, then this on bf16 rows.
  static torch::Tensor silu_mul(const torch::Tensor& gu) {
    const int64_t M = gu.size(0), I = gu.size(1) / 2, I8 = I / 8 * 8;
    torch::Tensor y = torch::empty({M, I}, gu.options().dtype(torch::kBFloat16));
    const float* gp = gu.data_ptr<float>();
    const uint16_t* silu = silu_table().data();
    const int* table = reinterpret_cast<const int*>(silu);  // 32-bit reads: the entry and the next (one padding entry)
    uint16_t* yp = bits_mut(y);
    at::parallel_for(0, M, std::max<int64_t>(1, 8192 / I), [&](int64_t a, int64_t z) {
      for (int64_t r = a; r < z; ++r) {
        const float *g = gp + r * 2 * I, *u = g + I;
        int64_t c = 0;
        for (; c < I8; c += 8) {  // the entries as fp32 bits: each read's low 16 bits moved to the top
          const __m256i idx = _mm256_cvtepu16_epi32(bf16_round8(_mm256_loadu_ps(g + c)));
          const __m256i sg = _mm256_slli_epi32(_mm256_i32gather_epi32(table, idx, 2), 16);
          const __m256 ub = widen8(bf16_round8(_mm256_loadu_ps(u + c)));
          store8x16(yp + r * I + c, bf16_round8(_mm256_mul_ps(_mm256_castsi256_ps(sg), ub)));
        }
        for (; c < I; ++c) yp[r * I + c] = bf16_round(widen(silu[bf16_round(g[c])]) * widen(bf16_round(u[c])));
      }
    });
    return y;
  }

  // Per token: split its row of nq q heads (nh_, or 0: k and v alone), then k and v heads; per-head norms (Qwen3),
  // rotary on q and k, q into `q`, k / v (+ 1.0) into the cache.
  void heads(const torch::Tensor& qkv, const Layer& ly, const torch::Tensor& cos, const torch::Tensor& sin,
             torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& slots,
             int64_t nq, int64_t Q) const {
    const int64_t M = qkv.size(0), T = kc.size(2), hd = hd_, nqkv = (nq + 2 * kvh_) * hd_;
    const uint16_t *src = bits(qkv), *cp = bits(cos), *sp = bits(sin);
    const uint16_t* qn = ly.q_norm.defined() && ly.q_norm.numel() ? bits(ly.q_norm) : nullptr;
    const uint16_t* kn = ly.k_norm.defined() && ly.k_norm.numel() ? bits(ly.k_norm) : nullptr;
    const int64_t* sl = slots.data_ptr<int64_t>();
    uint16_t* qp = nq ? bits_mut(q) : nullptr;
    uint16_t* kp = reinterpret_cast<uint16_t*>(kc.data_ptr());
    uint16_t* vp = reinterpret_cast<uint16_t*>(vc.data_ptr());
    const uint16_t one = bf16_round(1.0f);
    at::parallel_for(0, M, 4, [&](int64_t a, int64_t z) {
      std::vector<uint16_t> row(hd);
      std::vector<float> tmp(2 * hd);
      for (int64_t r = a; r < z; ++r) {
        const int64_t b = r / Q, slot = sl[r];
        const uint16_t* t = src + r * nqkv;
        for (int64_t j = 0; j < nq + kvh_; ++j) {  // q heads, then k heads
          const bool is_q = j < nq;
          uint16_t* dst = is_q ? qp + (r * nq + j) * hd : kp + ((b * kvh_ + (j - nq)) * T + slot) * hd;
          const uint16_t* norm = is_q ? qn : kn;
          if (norm) rms_row(t + j * hd, norm, hd, eps_, row.data());
          else std::memcpy(row.data(), t + j * hd, hd * 2);
          rotate_row(row.data(), cp + r * hd, sp + r * hd, hd, tmp.data());
          std::memcpy(dst, row.data(), hd * 2);
        }
        for (int64_t j = 0; j < kvh_; ++j) {
          uint16_t* dst = vp + ((b * kvh_ + j) * T + slot) * (hd + 1);
          std::memcpy(dst, t + (nq + kvh_ + j) * hd, hd * 2);
          dst[hd] = one;
        }
      }
    });
  }

  int64_t nh_, kvh_, hd_;
  float eps_;
  std::vector<Layer> layers_;
  torch::Tensor final_norm_;  // undefined: forward returns the last layer's output as it is
};

void register_stack(pybind11::module& mod) {
  namespace py = pybind11;
  py::class_<Linear>(mod, "StackLinear")
      .def(py::init([](torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t kind, int64_t n_out,
                       int64_t path) { return Linear{codes, d, m, kind, n_out, path}; }));
  py::class_<Stack>(mod, "Stack")
      .def(py::init<int64_t, int64_t, int64_t, double>())
      .def("add_layer", &Stack::add_layer)
      .def("set_final_norm", &Stack::set_final_norm)
      .def("forward", &Stack::forward, py::call_guard<py::gil_scoped_release>())  // see module.cpp: nogil
      .def("context", &Stack::context, py::call_guard<py::gil_scoped_release>())
      .def_static("silu_table", &silu_table_tensor);
}
