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
// acc[b % 2] = fma(float(isum8_b), d_w * d_x, acc[b % 2]) (two 8-lane accumulators, even and odd blocks; lane i of
// isum8_b = the exact int32 sum of the block's products 4i..4i+3), plus for Q4_1 a scalar chain
// macc = fma(m_w, s_x, macc) over b ascending; y = hsum8(acc[0] + acc[1]) + macc. Every path computes exactly this
// for every (token, row) whatever M is and whichever thread runs it: the AVX2 tile (two ymm accumulators) and, on
// CPUs with AVX512-VNNI, the 16-lane tile (one `dpbusd` for blocks b, b + 1: lanes 0-7 are acc[0], 8-15 acc[1]).
// The integer sums are exact in both, so both give the same bits, and a call may pick either by its row count.
//
// Weight formats (`kind`, as rowlinear.cpp): 1 q4_1 (codes [N, K / 2], GGML nibble order; w = d q + m),
// 2 q8_0 (codes [N, K] int8; w = d q). Activations: bf16 or fp32 [M, K]; output bf16 or fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "ops.h"

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
  __m256 acc[2][MR][NR];  // even and odd blocks
  float macc[MR][NR];
  for (int t = 0; t < MR; ++t)
    for (int r = 0; r < NR; ++r) acc[0][t][r] = acc[1][t][r] = _mm256_setzero_ps(), macc[t][r] = 0.0f;
  for (int64_t b = 0; b < W.nb; ++b) {
    __m256(&a)[MR][NR] = acc[b & 1];
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
        a[t][r] = _mm256_fmadd_ps(f, _mm256_set1_ps(dw * dx[t]), a[t][r]);
      }
      if (W.kind == 1) {
        const float mw = W.m[n[r] * W.nb + b];
        for (int t = 0; t < MR; ++t) macc[t][r] = std::fma(mw, sx[t], macc[t][r]);
      }
    }
  }
  for (int t = 0; t < MR; ++t)
    for (int r = 0; r < NR; ++r) out[t][r] = hsum8(_mm256_add_ps(acc[0][t][r], acc[1][t][r])) + macc[t][r];
}

// ---- CPUs with AVX512-VNNI: the same arithmetic, two blocks per instruction ----------------------------------
// Blocks b, b + 1 go through one `dpbusd` (unsigned weights x signed activations, 4 products per int32 lane) into
// 16 lanes: lanes 0-7 block b (the even accumulator), 8-15 block b + 1 (the odd one); the scales d_w d_x of b and
// b + 1 fill the two halves. An odd last block updates the low half only (a masked fma: the odd half is left
// untouched, not added a zero, which could flip the sign of a zero). Q8_0's signed weights enter as w + 128 and the
// exact 128 * (sum of each lane's 4 activations) is subtracted in int32. y = hsum16(acc) = hsum8(low + high).
#define DFK_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

// Blocks b (and b + 1 when `two`) of weight row n as 64 unsigned bytes in element order (one block: the high half
// is zero).
DFK_VNNI inline __m512i unpack2(const QWeights& W, int64_t n, int64_t b, bool two) {
  const uint8_t* row = W.codes + n * W.row_bytes;
  if (W.kind == 1) {
    const __m256i c = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * b))
                          : _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b)));
    const __m256i lo = _mm256_and_si256(c, _mm256_set1_epi8(0x0f));  // [lo(b), lo(b + 1)]
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), _mm256_set1_epi8(0x0f));
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // [lo(b), lo(b+1), hi(b), hi(b+1)]
    const __m512i w = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));   // [lo(b), hi(b), lo(b+1), hi(b+1)]
    return two ? w : _mm512_maskz_mov_epi64(0x0f, w);
  }
  const __m512i q = _mm512_maskz_loadu_epi8(two ? ~0ULL : 0xffffffffULL, row + 32 * b);
  return _mm512_maskz_xor_epi64(two ? 0xff : 0x0f, q, _mm512_set1_epi8(static_cast<char>(0x80)));  // w + 128
}

// [p[0] x 8, p[1] x 8] (p[1] only when `two`).
DFK_VNNI inline __m512 pair(const float* p, bool two) {
  const __m128 v = two ? _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p))) : _mm_load_ss(p);
  return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                               _mm512_castps128_ps512(v));
}

template <int MR>
DFK_VNNI void tile16(const QWeights& W, const int64_t* n, const QActs& X, int64_t t0, float out[][NR]) {
  __m512 acc[MR][NR];
  float macc[MR][NR];
  for (int t = 0; t < MR; ++t)
    for (int r = 0; r < NR; ++r) acc[t][r] = _mm512_setzero_ps(), macc[t][r] = 0.0f;
  for (int64_t b = 0; b < W.nb; b += 2) {
    const bool two = b + 1 < W.nb;
    const __mmask16 lanes = two ? 0xffff : 0x00ff;
    __m512i xq[MR], corr[MR];
    __m512 dx[MR];
    for (int t = 0; t < MR; ++t) {
      const int64_t row = t0 + t;
      xq[t] = _mm512_maskz_loadu_epi8(two ? ~0ULL : 0xffffffffULL, X.q + row * X.K + 32 * b);
      corr[t] = W.kind == 2 ? _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1),
                                                                    xq[t]), 7)
                            : _mm512_setzero_si512();
      dx[t] = pair(X.d + row * X.nb + b, two);
    }
    for (int r = 0; r < NR; ++r) {
      const __m512i w = unpack2(W, n[r], b, two);
      const __m512 dw = pair(W.d + n[r] * W.nb + b, two);
      for (int t = 0; t < MR; ++t) {
        const __m512i isum = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xq[t]), corr[t]);
        acc[t][r] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, dx[t]), acc[t][r], lanes);
      }
      if (W.kind == 1) {
        const float* mw = W.m + n[r] * W.nb + b;
        for (int t = 0; t < MR; ++t) {
          const float* sx = X.s + (t0 + t) * X.nb + b;
          macc[t][r] = std::fma(mw[0], sx[0], macc[t][r]);
          if (two) macc[t][r] = std::fma(mw[1], sx[1], macc[t][r]);
        }
      }
    }
  }
  for (int t = 0; t < MR; ++t)
    for (int r = 0; r < NR; ++r) out[t][r] = dflashkit::hsum16(acc[t][r]) + macc[t][r];
}

// Where the 16-lane tile runs (the bits are the same either way). Measured on an AMD EPYC with AVX512-VNNI, one
// layer in cache: Q8_0 (the 49152 x 576 head) 2.1 vs 2.6 ms at one row, 7.9 vs 9.0 at 16; Q4_1 (3072 x 576) 0.092
// vs 0.066 ms at one row (slower: the nibble unpack to 512 bits), even from 4 rows.
constexpr int64_t VNNI_Q4_FROM_ROWS = 4;

bool vnni_path(int kind, int64_t M) {
  static const bool cpu = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return cpu && !dflashkit_avx2_forced() && (kind == 2 || M >= VNNI_Q4_FROM_ROWS);
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
  if (vnni_path(static_cast<int>(kind), M)) {
    at::parallel_for(0, tiles, 1, [&](int64_t a, int64_t z) {
      float out[4][NR];
      for (int64_t tt = a; tt < z; ++tt) {
        const int64_t n0 = tt * NR, rows = std::min(NR, N - n0);
        int64_t n[NR];
        for (int r = 0; r < NR; ++r) n[r] = n0 + std::min<int64_t>(r, rows - 1);
        int64_t i = 0;
        for (; i + 4 <= M; i += 4) tile16<4>(W, n, X, i, out), store_tile<NR>(yp, N, i, n0, rows, out, 4);
        const int64_t left = M - i;
        if (left == 3) tile16<3>(W, n, X, i, out), store_tile<NR>(yp, N, i, n0, rows, out, 3);
        if (left == 2) tile16<2>(W, n, X, i, out), store_tile<NR>(yp, N, i, n0, rows, out, 2);
        if (left == 1) tile16<1>(W, n, X, i, out), store_tile<NR>(yp, N, i, n0, rows, out, 1);
      }
    });
    return out_bf16 ? round_to_bf16(yf) : yf;
  }
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
