// Row-invariant quantized linear layers with 8-bit activations: y[M, N] = q8(x)[M, K] . W[N, K]^T.
//
// Why: as llama.cpp does, each token's row is quantized to int8 per 32-block and the products are integer dot
// products, exact in int32; only the per-block scales are applied in fp32. A 4-bit weight then costs a mask or a
// shift and a quarter of a `dpbusd` lane instead of a decode to bf16 and half a `dpbf16ps` lane, so a verify block
// of a few tokens costs about what a one-token step costs (the weights' bytes, not the arithmetic, set both). This
// is a different target than rowlinear's (activations rounded to 8 bits), with its own AR baseline; exactness is
// judged against that.
//
// The arithmetic, for every output element (token t, weight row n), whatever M is and whichever path or thread
// computes it:
//   acc = 0 (fp32); for blocks b = 0, 1, ...:
//     i_b = the exact int32 sum of the block's 32 products q_w * q_x
//     acc = fma(float(i_b), d_w * d_x, acc)                  (d_w * d_x rounded to fp32 first)
//     Q4_1 only: acc = fma(m_w, s_x, acc)                     (s_x = d_x * float(sum of the block's q_x))
//   y = acc
// An integer sum has one value whatever order its products are added in, so the paths below may split and group
// them freely (8 or 16 rows per vector, any number of tokens, two partial sums per block); only the fp32 chain over
// b is fixed, and every path runs it one element per vector lane in the order above. Hence the same bits on every
// row count, on the AVX-512 VNNI path and the AVX2 path alike (tests: row counts 1-33, both paths, the plain
// definition in float64).
//
// Weights come PACKED (kernels/__init__.py, `RowLinear.packed`) in groups of 16 rows: row n is lane n % 16 of group
// n / 16 (rows past N are zeros, their outputs never stored). Per (group, block):
//   q4_1: 4 x 64 bytes; chunk p, byte 4 r + e: low nibble = q[r][8 p + e], high nibble = q[r][8 p + 4 + e]
//   q8_0: 8 x 64 bytes; chunk j, byte 4 r + e = q[r][4 j + e] (int8)
// (r: the row in the group, e < 4, q[r][k]: the code of element k of the block), so one 64-byte load holds four
// consecutive elements of 16 rows: a `dpbusd` against 4 broadcast activation bytes adds them into 16 row lanes.
// Scales d and mins m (q4_1) are fp32 [groups, blocks, 16]; for q8_0, `m` holds int32 128 * (the block's code sum)
// per row: VNNI multiplies unsigned by signed bytes, so activations enter as q_x + 128 and that term comes off.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"

#include "simd.h"

namespace {

using dflashkit::round_to_bf16;

constexpr int64_t GROUP = 16;  // weight rows per packed group (one 512-bit vector of fp32 / int32 lanes)

// One 32-block of a token's row as int8 (`quantize_row`: each block alone): d = max|x| / 127,
// q = round-half-even(x / d) (x * (1 / d), as llama.cpp), s = d * sum(q) (the Q4_1 minimum's term), u = q + 128 as
// unsigned bytes (q8_0 weights on VNNI). All block-local.
// (cvtps_epi32 rounds half to even under the default MXCSR, as nearbyint does; the max and the integer sum have one
// value in any order.)
void quantize_block(const float* xb, int8_t* q, uint8_t* u, float* d, float* s) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4], mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], magnitude));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
  __m256i qi[4], sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    sum = _mm256_add_epi32(sum, qi[i]);
  }
  // 4 x 8 int32 (each within +-127) -> 32 int8 in element order
  const __m256i p8 = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), _mm256_xor_si256(p8, _mm256_set1_epi8(-128)));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  *d = db;
  *s = db * static_cast<float>(_mm_cvtsi128_si32(s4));
}

void quantize_row(const float* x, int64_t K, int8_t* q, uint8_t* u, float* d, float* s) {
  for (int64_t b = 0; b < K / 32; ++b) quantize_block(x + 32 * b, q + 32 * b, u + 32 * b, d + b, s + b);
}

struct Packed {
  int kind;                // 1 q4_1, 2 q8_0
  const uint8_t* codes;    // [groups, blocks, chunk bytes]
  const float* d;          // [groups, blocks, 16]
  const void* m;           // q4_1: fp32 mins; q8_0: int32 corrections; [groups, blocks, 16]
  int64_t groups, nb;
  int64_t block_bytes() const { return kind == 1 ? 256 : 512; }
};

struct QActs {
  const int8_t* q;
  const uint8_t* u;
  const float* d;
  const float* s;
  int64_t K, nb;
};

inline int32_t four(const void* p) {  // 4 activation bytes as one int32 (for a broadcast)
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- CPUs with AVX512-VNNI ---------------------------------------------------------------------------------------
#define DFK_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

// MR tokens (t0 ..) x R groups (g0 ..): out lanes = rows. At one token, two integer partial sums per (group, block)
// keep two dependency chains apart (their sum is exact: any order); with more tokens there are chains enough.
template <int KIND, int MR, int R>
DFK_VNNI void vnni_tile(const Packed& W, int64_t g0, const QActs& X, int64_t t0, float* y, int64_t N) {
  __m512 acc[MR][R];
  for (int t = 0; t < MR; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  const int64_t bb = W.block_bytes();
  for (int64_t b = 0; b < W.nb; ++b) {
    constexpr bool two = MR == 1;
    __m512i s0[MR][R], s1[MR][R];
    for (int t = 0; t < MR; ++t)
      for (int r = 0; r < R; ++r) s0[t][r] = s1[t][r] = _mm512_setzero_si512();
    __m512i(&s1_or_s0)[MR][R] = two ? s1 : s0;
    // Per 64-byte chunk (pair): the R groups' codes once, then each token's two broadcast activation words against
    // them (loop order: the broadcasts are used right away rather than all held in registers).
    const uint8_t* c = W.codes + (g0 * W.nb + b) * bb;
    const int64_t stride = W.nb * bb;  // the next group's same block
    for (int p = 0; p < 4; ++p) {
      __m512i w0[R], w1[R];
      for (int r = 0; r < R; ++r) {
        if (KIND == 1) {
          const __m512i v = _mm512_loadu_si512(c + r * stride + 64 * p);
          w0[r] = _mm512_and_si512(v, _mm512_set1_epi8(0x0f));
          w1[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
        } else {
          w0[r] = _mm512_loadu_si512(c + r * stride + 128 * p);
          w1[r] = _mm512_loadu_si512(c + r * stride + 128 * p + 64);
        }
      }
      for (int t = 0; t < MR; ++t) {
        // q4_1: elements 8 p .. + 3 (low nibbles), 8 p + 4 .. + 7 (high); q8_0: chunks 2 p, 2 p + 1, the same
        // elements; q8_0 takes the activations as unsigned q + 128 (the weights are the signed operand)
        const int64_t xo = (t0 + t) * X.K + 32 * b + 8 * p;
        const __m512i x0 = _mm512_set1_epi32(KIND == 1 ? four(X.q + xo) : four(X.u + xo));
        const __m512i x1 = _mm512_set1_epi32(KIND == 1 ? four(X.q + xo + 4) : four(X.u + xo + 4));
        for (int r = 0; r < R; ++r) {
          s0[t][r] = KIND == 1 ? _mm512_dpbusd_epi32(s0[t][r], w0[r], x0) : _mm512_dpbusd_epi32(s0[t][r], x0, w0[r]);
          s1_or_s0[t][r] = KIND == 1 ? _mm512_dpbusd_epi32(s1_or_s0[t][r], w1[r], x1)
                                     : _mm512_dpbusd_epi32(s1_or_s0[t][r], x1, w1[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t o = ((g0 + r) * W.nb + b) * GROUP;
      const __m512 dw = _mm512_loadu_ps(W.d + o);
      __m512i corr = _mm512_setzero_si512();
      __m512 mw = _mm512_setzero_ps();
      if (KIND == 2) corr = _mm512_loadu_si512(static_cast<const int32_t*>(W.m) + o);
      if (KIND == 1) mw = _mm512_loadu_ps(static_cast<const float*>(W.m) + o);
      for (int t = 0; t < MR; ++t) {
        __m512i isum = two ? _mm512_add_epi32(s0[t][r], s1[t][r]) : s0[t][r];
        if (KIND == 2) isum = _mm512_sub_epi32(isum, corr);
        const int64_t xo = (t0 + t) * X.nb + b;
        acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, _mm512_set1_ps(X.d[xo])), acc[t][r]);
        if (KIND == 1) acc[t][r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(X.s[xo]), acc[t][r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t n0 = (g0 + r) * GROUP;
    if (n0 >= N) break;
    const __mmask16 keep = N - n0 >= GROUP ? 0xffff : static_cast<__mmask16>((1u << (N - n0)) - 1);
    for (int t = 0; t < MR; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * N + n0, keep, acc[t][r]);
  }
}

// MR tokens against groups g .. g + 3: in two halves from 3 tokens on (the accumulators of 4 x 4 would not fit in
// the 32 vector registers).
template <int KIND, int MR>
DFK_VNNI void vnni_four(const Packed& W, int64_t g, const QActs& X, int64_t t0, float* y, int64_t N) {
  if (MR >= 3) {
    vnni_tile<KIND, MR, 2>(W, g, X, t0, y, N);
    vnni_tile<KIND, MR, 2>(W, g + 2, X, t0, y, N);
  } else {
    vnni_tile<KIND, MR, 4>(W, g, X, t0, y, N);
  }
}

// All M tokens against groups g0 .. g1: four groups at a time (the rest one by one), tokens 4 at a time, then the
// tokens left.
template <int KIND>
DFK_VNNI void vnni_range(const Packed& W, int64_t g0, int64_t g1, const QActs& X, int64_t M, float* y, int64_t N) {
  for (int64_t g = g0; g < g1;) {
    const bool quad = g + 4 <= g1;
    int64_t t = 0;
    for (; t + 4 <= M; t += 4) quad ? vnni_four<KIND, 4>(W, g, X, t, y, N) : vnni_tile<KIND, 4, 1>(W, g, X, t, y, N);
    const int64_t left = M - t;
    if (left == 3) quad ? vnni_four<KIND, 3>(W, g, X, t, y, N) : vnni_tile<KIND, 3, 1>(W, g, X, t, y, N);
    if (left == 2) quad ? vnni_four<KIND, 2>(W, g, X, t, y, N) : vnni_tile<KIND, 2, 1>(W, g, X, t, y, N);
    if (left == 1) quad ? vnni_four<KIND, 1>(W, g, X, t, y, N) : vnni_tile<KIND, 1, 1>(W, g, X, t, y, N);
    g += quad ? 4 : 1;
  }
}

// ---- CPUs with AVX2 only: the same arithmetic, a group as two 8-lane halves ----------------------------------------
// maddubs multiplies unsigned by signed bytes into int16 pairs: exact here (q4_1: 15 * 127 * 2; q8_0 as |w| times x
// carrying w's sign: 128 * 127 * 2, both below 2^15), then madd sums the pairs into int32.
inline __m256i dot4(__m256i u, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
}

// T tokens (t0 ..) x one group: each weight load (and q8_0's |w|, q4_1's nibbles) is used for the T tokens. Up to 2
// tokens both 8-row halves run in one pass over the codes (a one-token step streams them once, as they lie); 3-4
// tokens take one half per pass (their sums would not fit the 16 registers). Per (token, row lane) the fp32 chain
// over the blocks runs in the order above.
template <int KIND, int T>
void avx2_tile(const Packed& W, int64_t g, const QActs& X, int64_t t0, float* y, int64_t N) {
  constexpr int H = T <= 2 ? 2 : 1;  // halves per pass
  const int64_t bb = W.block_bytes(), n0 = g * GROUP;
  for (int h0 = 0; h0 < 2; h0 += H) {
    __m256 acc[T][H];
    for (int t = 0; t < T; ++t)
      for (int e = 0; e < H; ++e) acc[t][e] = _mm256_setzero_ps();
    for (int64_t b = 0; b < W.nb; ++b) {
      const int8_t* xq = X.q + t0 * X.K + 32 * b;  // token t's block: xq + t * X.K
      __m256i s[T][H];
      for (int e = 0; e < H; ++e) {
        const uint8_t* c = W.codes + (g * W.nb + b) * bb + 32 * (h0 + e);
        for (int t = 0; t < T; ++t) s[t][e] = _mm256_setzero_si256();
        if (KIND == 1) {
          for (int p = 0; p < 4; ++p) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * p));
            const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));
            for (int t = 0; t < T; ++t) {
              s[t][e] = _mm256_add_epi32(s[t][e], dot4(lo, _mm256_set1_epi32(four(xq + t * X.K + 8 * p))));
              s[t][e] = _mm256_add_epi32(s[t][e], dot4(hi, _mm256_set1_epi32(four(xq + t * X.K + 8 * p + 4))));
            }
          }
        } else {
          for (int j = 0; j < 8; ++j) {
            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * j));
            const __m256i aw = _mm256_sign_epi8(w, w);  // |w| (-128 stays 128 as an unsigned byte)
            for (int t = 0; t < T; ++t) {
              const __m256i x = _mm256_set1_epi32(four(xq + t * X.K + 4 * j));
              s[t][e] = _mm256_add_epi32(s[t][e], dot4(aw, _mm256_sign_epi8(x, w)));  // x carries w's sign
            }
          }
        }
      }
      for (int e = 0; e < H; ++e) {
        const int64_t o = (g * W.nb + b) * GROUP + 8 * (h0 + e);
        const __m256 dw = _mm256_loadu_ps(W.d + o);
        for (int t = 0; t < T; ++t) {
          const int64_t xo = (t0 + t) * X.nb + b;
          acc[t][e] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t][e]), _mm256_mul_ps(dw, _mm256_set1_ps(X.d[xo])),
                                      acc[t][e]);
          if (KIND == 1) {
            const __m256 mw = _mm256_loadu_ps(static_cast<const float*>(W.m) + o);
            acc[t][e] = _mm256_fmadd_ps(mw, _mm256_set1_ps(X.s[xo]), acc[t][e]);
          }
        }
      }
    }
    for (int e = 0; e < H; ++e) {
      const int64_t n = std::min<int64_t>(8, N - n0 - 8 * (h0 + e));  // rows past N are not stored
      for (int t = 0; t < T && n > 0; ++t) {
        alignas(32) float out[8];
        _mm256_store_ps(out, acc[t][e]);
        std::memcpy(y + (t0 + t) * N + n0 + 8 * (h0 + e), out, n * sizeof(float));
      }
    }
  }
}

// Tokens four at a time, then the rest, against each group.
template <int KIND>
void avx2_groups(const Packed& W, int64_t g0, int64_t g1, const QActs& X, int64_t M, float* y, int64_t N) {
  for (int64_t g = g0; g < g1; ++g) {
    int64_t t = 0;
    for (; t + 4 <= M; t += 4) avx2_tile<KIND, 4>(W, g, X, t, y, N);
    switch (M - t) {
      case 3: avx2_tile<KIND, 3>(W, g, X, t, y, N); break;
      case 2: avx2_tile<KIND, 2>(W, g, X, t, y, N); break;
      case 1: avx2_tile<KIND, 1>(W, g, X, t, y, N); break;
      default: break;
    }
  }
}

bool vnni_path() {
  static const bool cpu = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return cpu && !dflashkit_avx2_forced();
}

}  // namespace

void qlinear_quantize(const uint16_t* x, int64_t f0, int64_t f1, const QlinearActs& a) {
  alignas(32) float xb[32];
  for (int64_t f = f0; f < f1; ++f) {  // each block alone: any split, the same bits as quantize_row's
    for (int i = 0; i < 32; ++i) xb[i] = dflashkit::widen(x[32 * f + i]);  // bf16 -> fp32 is exact
    quantize_block(xb, a.q + 32 * f, a.u + 32 * f, a.d + f, a.s + f);
  }
}

void qlinear_groups(const PackedLinear& w, const QlinearActs& a, int64_t M, int64_t g0, int64_t g1, float* y) {
  const int64_t nb = w.K / 32;
  const Packed W{static_cast<int>(w.kind), w.codes, w.d, w.m, (w.N + GROUP - 1) / GROUP, nb};
  const QActs X{a.q, a.u, a.d, a.s, w.K, nb};
  if (vnni_path()) {
    if (w.kind == 1) vnni_range<1>(W, g0, g1, X, M, y, w.N);
    else vnni_range<2>(W, g0, g1, X, M, y, w.N);
    return;
  }
  if (w.kind == 1) avx2_groups<1>(W, g0, g1, X, M, y, w.N);
  else avx2_groups<2>(W, g0, g1, X, M, y, w.N);
}

torch::Tensor qlinear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t kind,
                      int64_t n_out, bool out_bf16) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "qlinear: x must be [M, K] with K a multiple of 32");
  TORCH_CHECK(kind == 1 || kind == 2, "qlinear: kind must be 1 (q4_1) or 2 (q8_0)");
  const int64_t M = x.size(0), K = x.size(1), N = n_out, nb = K / 32, groups = (N + GROUP - 1) / GROUP;
  TORCH_CHECK(codes.is_contiguous() && codes.numel() * codes.element_size() == groups * nb * (kind == 1 ? 256 : 512),
              "qlinear: codes must be packed [groups, blocks, chunks] (RowLinear.packed)");
  TORCH_CHECK(d.scalar_type() == torch::kFloat && d.is_contiguous() && d.numel() == groups * nb * GROUP,
              "qlinear: scales must be packed fp32 [groups, blocks, 16]");
  TORCH_CHECK(m.is_contiguous() && m.numel() == groups * nb * GROUP &&
                  m.scalar_type() == (kind == 1 ? torch::kFloat : torch::kInt),
              "qlinear: m must be packed [groups, blocks, 16]: fp32 mins (q4_1) or int32 corrections (q8_0)");
  torch::Tensor xf = x.to(torch::kFloat).contiguous();  // bf16 -> fp32 is exact
  std::vector<int8_t> xq(M * K);
  std::vector<uint8_t> xu(M * K);
  std::vector<float> xd(M * nb), xs(M * nb);
  const float* xp = xf.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      quantize_row(xp + i * K, K, xq.data() + i * K, xu.data() + i * K, xd.data() + i * nb, xs.data() + i * nb);
  });
  torch::Tensor yf = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  float* yp = yf.data_ptr<float>();
  const PackedLinear w{static_cast<const uint8_t*>(codes.data_ptr()), d.data_ptr<float>(), m.data_ptr(), kind, K, N};
  const QlinearActs a{xq.data(), xu.data(), xd.data(), xs.data()};
  // Threads split the groups of weight rows (one contiguous range each): each output element is computed whole by
  // one thread, in the order above.
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) { qlinear_groups(w, a, M, g0, g1, yp); });
  return out_bf16 ? round_to_bf16(yf) : yf;
}
