// Row-invariant linear layers for x86 CPUs with AVX2 + FMA: y[M, N] = x[M, K] @ W[N, K]^T.
//
// Why this file exists: speculative decoding is exact by construction only if a token's logits have the same bits
// whether the token is decoded alone (M = 1) or verified inside a block (M = 16 ... 64). Library GEMMs choose their
// blocking from M (MKL sgemm), and torch's bf16 path on CPUs without bf16 units costs time linear in M. Here every
// output element y[m, n] is ONE dot product over K computed in a fixed order (one 8-lane accumulator over k, a fixed
// horizontal sum), whatever M is and whichever thread computes it. Speed comes from reuse: a tile
// of weight rows is dequantized once into a small fp32 buffer (in L1/L2) and applied to all M tokens, so the weights
// are read from memory once per call, as a one-token step must read them anyway.
//
// Weight formats (`kind`):
//   0  bf16       codes = bf16 bits [N, K] (int16), no scales
//   1  q4_1       codes = [N, K / 2] uint8, GGML's Q4_1 nibble order (byte j of a 32-block holds element j in its
//                 low nibble and element j + 16 in its high nibble); w = d * q + m per 32-block (d, m fp32 [N, K/32])
//   2  q8_0       codes = [N, K] int8; w = d * q per 32-block (d fp32 [N, K / 32])
// Activations: bf16 or fp32 [M, K] (converted to fp32 exactly); output: bf16 (round to nearest even) or fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

using dflashkit::bf16x8;
using dflashkit::hsum8;
using dflashkit::round_to_bf16;
using dflashkit::store_tile;

constexpr int64_t TILE = 6;  // weight rows per tile; 2 tokens x 6 rows = 12 accumulators in 16 AVX2 registers
constexpr int64_t FUSED_MAX_ROWS = 4;  // up to this many tokens, decode weights on the fly; more: through a buffer

struct Weights {
  int kind;
  const uint8_t* codes;
  const float* d;
  const float* m;
  int64_t K, row_bytes;
};

// Weights k .. k+7 of row n as fp32 (k % 8 == 0). The ONE place weights are decoded: the fused one-token path and
// the buffered path both call it, so a weight has the same fp32 value (hence every product the same bits) in both.
inline __m256 load8(const Weights& W, int64_t n, int64_t k) {
  const uint8_t* row = W.codes + n * W.row_bytes;
  if (W.kind == 0) {
    return bf16x8(row + 2 * k);  // bf16 -> fp32 is exact
  }
  const int64_t b = k / 32, c = (k % 32) / 8;
  const float d = W.d[n * (W.K / 32) + b];
  if (W.kind == 1) {  // byte j of the block: element j (low nibble), element j + 16 (high nibble)
    __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + b * 16 + (c & 1) * 8));
    if (c >= 2) q = _mm_srli_epi16(q, 4);
    q = _mm_and_si128(q, _mm_set1_epi8(0x0f));
    return _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)),
                           _mm256_set1_ps(W.m[n * (W.K / 32) + b]));
  }
  __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k));
  return _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
}

// Every output element is acc = 0; for k = 0, 8, 16, ...: acc = fma(w[k:k+8], x[k:k+8], acc); y = hsum8(acc).
// The three paths below only differ in how many (token, row) pairs they run side by side.

// MR tokens, a full tile, weights decoded straight from the codes: few tokens (a one-token step, small batches) read
// each weight once from memory and decode it once per MR tokens, with no buffer traffic.
template <int MR>
inline void fused_tile(const Weights& W, int64_t n0, const float* x, int64_t ldx, float out[][TILE]) {
  __m256 acc[MR][TILE];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < TILE; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < W.K; k += 8) {
    __m256 xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(x + i * ldx + k);
    for (int r = 0; r < TILE; ++r) {
      __m256 wv = load8(W, n0 + r, k);
      for (int i = 0; i < MR; ++i) acc[i][r] = _mm256_fmadd_ps(wv, xv[i], acc[i][r]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < TILE; ++r) out[i][r] = hsum8(acc[i][r]);
}

// MR tokens against a decoded tile buf [TILE][K] (rows past the matrix are zeros, their sums discarded).
template <int MR>
inline void buffered_tile(const float* buf, int64_t K, const float* x, int64_t ldx, float out[][TILE]) {
  __m256 acc[MR][TILE];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < TILE; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(x + i * ldx + k);
    for (int r = 0; r < TILE; ++r) {
      __m256 wv = _mm256_loadu_ps(buf + r * K + k);
      for (int i = 0; i < MR; ++i) acc[i][r] = _mm256_fmadd_ps(wv, xv[i], acc[i][r]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < TILE; ++r) out[i][r] = hsum8(acc[i][r]);
}

}  // namespace

torch::Tensor rowlinear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t kind,
                        int64_t n_out, bool out_bf16) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "rowlinear: x must be [M, K] with K a multiple of 32");
  TORCH_CHECK(kind >= 0 && kind <= 2, "rowlinear: kind must be 0 (bf16), 1 (q4_1) or 2 (q8_0)");
  TORCH_CHECK(codes.is_contiguous() && codes.size(0) == n_out, "rowlinear: codes must be contiguous [N, ...]");
  const int64_t M = x.size(0), K = x.size(1), N = n_out;
  const int64_t row_bytes = kind == 0 ? 2 * K : (kind == 1 ? K / 2 : K);
  TORCH_CHECK(codes.numel() * codes.element_size() == N * row_bytes, "rowlinear: codes do not match [N, K]");
  if (kind != 0) TORCH_CHECK(d.scalar_type() == torch::kFloat && d.is_contiguous() && d.numel() == N * K / 32,
                             "rowlinear: scales must be fp32 [N, K / 32]");
  if (kind == 1) TORCH_CHECK(m.scalar_type() == torch::kFloat && m.is_contiguous() && m.numel() == N * K / 32,
                             "rowlinear: mins must be fp32 [N, K / 32]");
  torch::Tensor xf = x.to(torch::kFloat).contiguous();  // bf16 -> fp32 is exact
  torch::Tensor yf = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* yp = yf.data_ptr<float>();
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const float* dp = kind != 0 ? d.data_ptr<float>() : nullptr;
  const float* mp = kind == 1 ? m.data_ptr<float>() : nullptr;
  const int64_t tiles = (N + TILE - 1) / TILE;
  const Weights W{static_cast<int>(kind), cp, dp, mp, K, row_bytes};
  // Threads split the weight rows: each output element is computed whole by one thread, in the order above.
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(TILE * K);
    float out[2][TILE];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * TILE, rows = std::min(TILE, N - n0);
      if (M <= FUSED_MAX_ROWS && rows == TILE) {
        int64_t i = 0;
        for (; i + 2 <= M; i += 2)
          fused_tile<2>(W, n0, xp + i * K, K, out), store_tile<TILE>(yp, N, i, n0, TILE, out, 2);
        if (i < M) fused_tile<1>(W, n0, xp + i * K, K, out), store_tile<TILE>(yp, N, i, n0, TILE, out, 1);
        continue;
      }
      // More tokens: decode the tile once into buf (rows past the matrix as zeros) and reuse it for all of them.
      for (int64_t r = 0; r < TILE; ++r)
        for (int64_t k = 0; k < K; k += 8)
          _mm256_storeu_ps(buf.data() + r * K + k, r < rows ? load8(W, n0 + r, k) : _mm256_setzero_ps());
      int64_t i = 0;
      for (; i + 2 <= M; i += 2)
        buffered_tile<2>(buf.data(), K, xp + i * K, K, out), store_tile<TILE>(yp, N, i, n0, rows, out, 2);
      if (i < M) buffered_tile<1>(buf.data(), K, xp + i * K, K, out), store_tile<TILE>(yp, N, i, n0, rows, out, 1);
    }
  });
  return out_bf16 ? round_to_bf16(yf) : yf;
}
