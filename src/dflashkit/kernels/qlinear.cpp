// Row-invariant quantized linear layers with 8-bit activations (AVX2): y[M, N] = q8(x)[M, K] . W[N, K]^T.
//
// Why: rowlinear.cpp widens every 4-bit weight to fp32 and multiplies in fp32 (8 products per instruction, ~7
// instructions per 8 weights), so a Q4_1 layer was no faster than bf16 at one token although it reads a third of
// the bytes. Here, as llama.cpp does, each token's row is quantized to int8 per 32-block and the products are
// integer dot products (32 products in two instructions: maddubs + madd), exact in int32; only the per-block scale
// is applied in fp32. This is a different target than rowlinear's (activations rounded to 8 bits), so it has its
// own AR baseline; exactness is judged against that.
//
// Row invariance: a token's quantization reads only its own row; each output element is, for blocks b = 0, 1, ...:
// acc = fma(float(isum8_b), d_w * d_x, acc) (8 lanes, the lanes fixed by the instruction sequence), plus for Q4_1 a
// scalar chain macc = fma(m_w, s_x, macc); y = hsum8(acc) + macc. The same instructions in the same order for every
// (token, row) whatever M is and whichever thread runs it (the 2-token and 1-token micro-kernels are one template).
//
// Weight formats (`kind`, as rowlinear.cpp): 1 q4_1 (codes [N, K / 2], GGML nibble order; w = d q + m),
// 2 q8_0 (codes [N, K] int8; w = d q). Activations: bf16 or fp32 [M, K]; output bf16 or fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

using dflashkit::hsum8;
using dflashkit::round_to_bf16;
using dflashkit::store_tile;

constexpr int64_t NR = 4;  // weight rows per tile: 2 tokens x 4 rows = 8 accumulators, weights unpacked once per pair

// One token's row as int8 per 32-block: d = max|x| / 127, q = round-half-even(x / d) (x * (1 / d), as llama.cpp),
// s = d * sum(q) (the Q4_1 minimum's term). All of it row-local.
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * id));
      q[32 * b + j] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = db;
    s[b] = db * static_cast<float>(sum);
  }
}

struct QWeights {
  int kind;
  const uint8_t* codes;
  const float* d;
  const float* m;
  int64_t nb, row_bytes;  // blocks per row, code bytes per row
};

struct QActs {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t K, nb;
};

// Block b of weight row n as 32 bytes ready for maddubs' unsigned operand (q4_1: 0..15 in element order; q8_0: the
// int8 codes, made unsigned per token by the sign trick in `dot32`).
inline __m256i unpack(const QWeights& W, int64_t n, int64_t b) {
  const uint8_t* row = W.codes + n * W.row_bytes;
  if (W.kind == 1) {  // byte j: element j (low nibble), element j + 16 (high nibble)
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b));
    const __m128i lo = _mm_and_si128(c, _mm_set1_epi8(0x0f));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(c, 4), _mm_set1_epi8(0x0f));
    return _mm256_set_m128i(hi, lo);
  }
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * b));
}

// The 32 products of a block summed into 8 int32 lanes (exact: |15 * 127 * 2| and |127 * 128 * 2| fit int16).
inline __m256i dot32(int kind, __m256i w, __m256i xq) {
  __m256i p16;
  if (kind == 1) {
    p16 = _mm256_maddubs_epi16(w, xq);
  } else {  // signed x signed: |w| (unsigned) times x carrying w's sign
    p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
  }
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

// MR tokens (rows t0.. of the quantized activations) against NR weight rows n[0..NR): out[t][r].
template <int MR>
inline void tile(const QWeights& W, const int64_t* n, const QActs& X, int64_t t0, float out[][NR]) {
  __m256 acc[MR][NR];
  float macc[MR][NR];
  for (int t = 0; t < MR; ++t)
    for (int r = 0; r < NR; ++r) acc[t][r] = _mm256_setzero_ps(), macc[t][r] = 0.0f;
  for (int64_t b = 0; b < W.nb; ++b) {
    __m256i xq[MR];
    float dx[MR], sx[MR];
    for (int t = 0; t < MR; ++t) {
      xq[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(X.q + (t0 + t) * X.K + 32 * b));
      dx[t] = X.d[(t0 + t) * X.nb + b];
      sx[t] = X.s[(t0 + t) * X.nb + b];
    }
    for (int r = 0; r < NR; ++r) {
      const __m256i w = unpack(W, n[r], b);
      const float dw = W.d[n[r] * W.nb + b];
      for (int t = 0; t < MR; ++t) {
        const __m256 f = _mm256_cvtepi32_ps(dot32(W.kind, w, xq[t]));
        acc[t][r] = _mm256_fmadd_ps(f, _mm256_set1_ps(dw * dx[t]), acc[t][r]);
      }
      if (W.kind == 1) {
        const float mw = W.m[n[r] * W.nb + b];
        for (int t = 0; t < MR; ++t) macc[t][r] = std::fma(mw, sx[t], macc[t][r]);
      }
    }
  }
  for (int t = 0; t < MR; ++t)
    for (int r = 0; r < NR; ++r) out[t][r] = hsum8(acc[t][r]) + macc[t][r];
}

}  // namespace

torch::Tensor qlinear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t kind,
                      int64_t n_out, bool out_bf16) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "qlinear: x must be [M, K] with K a multiple of 32");
  TORCH_CHECK(kind == 1 || kind == 2, "qlinear: kind must be 1 (q4_1) or 2 (q8_0)");
  TORCH_CHECK(codes.is_contiguous() && codes.size(0) == n_out, "qlinear: codes must be contiguous [N, ...]");
  const int64_t M = x.size(0), K = x.size(1), N = n_out, nb = K / 32;
  const int64_t row_bytes = kind == 1 ? K / 2 : K;
  TORCH_CHECK(codes.numel() * codes.element_size() == N * row_bytes, "qlinear: codes do not match [N, K]");
  TORCH_CHECK(d.scalar_type() == torch::kFloat && d.is_contiguous() && d.numel() == N * nb,
              "qlinear: scales must be fp32 [N, K / 32]");
  if (kind == 1) TORCH_CHECK(m.scalar_type() == torch::kFloat && m.is_contiguous() && m.numel() == N * nb,
                             "qlinear: mins must be fp32 [N, K / 32]");
  torch::Tensor xf = x.to(torch::kFloat).contiguous();  // bf16 -> fp32 is exact
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nb), xs(M * nb);
  const float* xp = xf.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      quantize_row(xp + i * K, K, xq.data() + i * K, xd.data() + i * nb, xs.data() + i * nb);
  });
  torch::Tensor yf = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  float* yp = yf.data_ptr<float>();
  const QWeights W{static_cast<int>(kind), static_cast<const uint8_t*>(codes.data_ptr()), d.data_ptr<float>(),
                   kind == 1 ? m.data_ptr<float>() : nullptr, nb, row_bytes};
  const QActs X{xq.data(), xd.data(), xs.data(), K, nb};
  const int64_t tiles = (N + NR - 1) / NR;
  // Threads split the weight rows: each output element is computed whole by one thread.
  at::parallel_for(0, tiles, 1, [&](int64_t a, int64_t z) {
    float out[2][NR];
    for (int64_t tt = a; tt < z; ++tt) {
      const int64_t n0 = tt * NR, rows = std::min(NR, N - n0);
      int64_t n[NR];
      for (int r = 0; r < NR; ++r) n[r] = n0 + std::min<int64_t>(r, rows - 1);  // past the matrix: recompute, drop
      int64_t i = 0;
      for (; i + 2 <= M; i += 2) tile<2>(W, n, X, i, out), store_tile<NR>(yp, N, i, n0, rows, out, 2);
      if (i < M) tile<1>(W, n, X, i, out), store_tile<NR>(yp, N, i, n0, rows, out, 1);
    }
  });
  return out_bf16 ? round_to_bf16(yf) : yf;
}
