// Small AVX2 helpers shared by the kernels (rowlinear.cpp, qlinear.cpp, attention.cpp, drafttree.cpp). They must
// convert and sum exactly alike: a bf16 value widens to the same fp32, an fp32 rounds to the same bf16 as torch's,
// and an 8-lane accumulator reduces in one fixed order (a different reduction order would change a logit's last bits).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace dflashkit {

// The fixed horizontal sum of an 8-lane fp32 accumulator: (lo + hi) pairwise, then the two halves.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The fixed horizontal sum of a 16-lane accumulator (AVX-512 paths only): the two 8-lane halves added, then hsum8.
__attribute__((target("avx512f"))) inline float hsum16(__m512 v) {
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return hsum8(_mm256_add_ps(lo, hi));
}

// One bf16 (its bits) -> fp32 (exact: a bf16 is the top half of an fp32).
inline float widen(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// 8 bf16 bits (an __m128i) -> 8 fp32 (exact: a bf16 is the top half of an fp32).
inline __m256 widen8(__m128i b) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)); }

// 8 bf16 in memory -> 8 fp32.
inline __m256 bf16x8(const void* p) { return widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline __m128i load8x16(const uint16_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline void store8x16(uint16_t* p, __m128i v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v); }

// fp32 -> bf16, round to nearest even, as torch's float -> bfloat16 (NaN stays a quiet NaN).
inline uint16_t bf16_round(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// 8 fp32 -> 8 bf16 bits, each exactly as `bf16_round` (the same integer rounding, lane by lane; NaN as there).
inline __m128i bf16_round8(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i top = _mm256_srli_epi32(u, 16);
  const __m256i up = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(top, _mm256_set1_epi32(1)));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, up), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));  // both sides < 2^31: signed compare
  const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));  // each lane <= 0xffff
}

// Store `count` (1 or 2) tokens' results of one weight tile, out[t][0 .. rows), at y[(i + t) * N + n0 ..].
template <int NR>
inline void store_tile(float* y, int64_t N, int64_t i, int64_t n0, int64_t rows, const float (*out)[NR], int count) {
  for (int t = 0; t < count; ++t) std::memcpy(y + (i + t) * N + n0, out[t], rows * sizeof(float));
}

// An fp32 [M, N] result as bf16, every element rounded as `bf16_round` (no library conversion in between).
inline torch::Tensor round_to_bf16(const torch::Tensor& yf) {
  torch::Tensor yb = torch::empty(yf.sizes(), yf.options().dtype(torch::kBFloat16));
  const float* yp = yf.data_ptr<float>();
  uint16_t* bp = reinterpret_cast<uint16_t*>(yb.data_ptr());
  at::parallel_for(0, yf.numel(), 4096, [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
    for (; i + 8 <= i1; i += 8) store8x16(bp + i, bf16_round8(_mm256_loadu_ps(yp + i)));
    for (; i < i1; ++i) bp[i] = bf16_round(yp[i]);
  });
  return yb;
}

// exp(x) for x <= 0, 8 lanes: x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts), e^r by a degree-7 polynomial
// (Cephes' expf coefficients, within ~1 ulp of std::exp), times 2^n built in the exponent bits. Below -87 (e^x under
// fp32's smallest normal, nothing beside a weight of 1) the lane is 0. NaN stays NaN. Elementwise and exact in its
// operation order: a lane's bits depend on its x alone, whatever shares the vector.
inline __m256 exp8(__m256 x) {
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // max(a, NaN) is the NaN: it goes on
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

}  // namespace dflashkit
