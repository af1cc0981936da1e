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

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "simd.h"

namespace {

using dflashkit::bf16x8;
using dflashkit::hsum16;
using dflashkit::hsum8;
using dflashkit::round_to_bf16;
using dflashkit::store_tile;

constexpr int64_t TILE = 6;  // weight rows per tile; 4 tokens x 3 rows or 2 x 6 = 12 accumulators of 16 registers
constexpr int64_t FUSED_MAX_ROWS = 4;  // 4/8-bit codes: up to this many tokens decoded on the fly; more: a buffer

struct Weights {
  int kind;
  const uint8_t* codes;
  const float* d;
  const float* m;
  int64_t K, row_bytes;
};

// Weights k .. k+7 of row n as fp32 (k % 8 == 0). The ONE definition of a weight's value: `decode_block` (4/8-bit
// codes a block at a time, the fused and the buffered paths) runs these same operations, so a weight has the same
// fp32 value (hence every product the same bits) on every path.
// KIND: the weight kind as a template argument where the caller knows it (the inner loops: no branch per load), or
// -1 to read W.kind.
template <int KIND = -1>
inline __m256 load8(const Weights& W, int64_t n, int64_t k) {
  const int kind = KIND >= 0 ? KIND : W.kind;
  const uint8_t* row = W.codes + n * W.row_bytes;
  if (kind == 0) {
    return bf16x8(row + 2 * k);  // bf16 -> fp32 is exact
  }
  const int64_t b = k / 32, c = (k % 32) / 8;
  const float d = W.d[n * (W.K / 32) + b];
  if (kind == 1) {  // byte j of the block: element j (low nibble), element j + 16 (high nibble)
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
// The paths below only differ in how many (token, row) pairs they run side by side and where the weights come from.

// The next tile's weight bytes, pulled into L1 a few cache lines per k step while this tile computes. Why: the
// hardware prefetcher does not keep up with TILE row streams at once; measured on an AMD EPYC (AVX2, 2 threads), a
// one-token pass over the 49152 x 576 bf16 head streamed 16 GB/s without it and 40 GB/s with it. No effect on bits.
// `passes`: how many times the tile runs its k loop (`tile_passes`: 4 tokens x 3 rows twice per 4 tokens). The
// lines are spread evenly over all of them. Why: issued within the first pass, they came faster than memory delivers
// them, and through the passes after memory had nothing to fetch (AMD EPYC, AVX2: 4 / 8-token steps 0.86-0.90 /
// 0.77-0.92x the time once spread, `kernels-prefetch-avx2/`; finishing within half the passes was slower).
struct Prefetch {
  const char* p;
  const char* end;
  int64_t per_step;  // lines per k step, in 16ths of a line
  int64_t credit = 0;
  Prefetch(const Weights& W, int64_t n_next, int64_t n_end, int64_t passes) {
    p = reinterpret_cast<const char*>(W.codes + n_next * W.row_bytes);
    end = reinterpret_cast<const char*>(W.codes + std::max(n_next, n_end) * W.row_bytes);
    const int64_t lines = (end - p + 63) / 64, steps = W.K / 8 * std::max<int64_t>(passes, 1);
    per_step = (16 * lines + steps - 1) / steps;
  }
  inline void step() {
    for (credit += per_step; credit >= 16 && p < end; credit -= 16, p += 64) _mm_prefetch(p, _MM_HINT_T0);
  }
};

// 4/8-bit codes (KIND 1, 2): the same products in the same order, a 32-block at a time, each row's scale (and
// minimum) broadcast once per block and a Q4_1 block's 16 code bytes read once (`load8` reads them per 8 weights:
// two scalar loads, two broadcasts and a code load for every 8 weights). Each weight is fma(d, q, m) / d * q as in
// `load8`, so the bits are the same.
template <int KIND>
inline void decode_block(const Weights& W, int64_t n, int64_t b, __m256 w[4]) {
  const uint8_t* row = W.codes + n * W.row_bytes;
  const __m256 d = _mm256_set1_ps(W.d[n * (W.K / 32) + b]);
  if (KIND == 1) {  // chunk c: low nibbles of bytes 0-7 / 8-15 (c = 0, 1), high nibbles of them (c = 2, 3)
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
    const __m128i lo = _mm_and_si128(q, _mm_set1_epi8(0x0f));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0f));
    const __m256 m = _mm256_set1_ps(W.m[n * (W.K / 32) + b]);
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int c = 0; c < 4; ++c) w[c] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[c])), m);
  } else {
    for (int c = 0; c < 4; ++c) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + b * 32 + c * 8));
      w[c] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  }
}

// MR tokens x R weight rows (n0 + r0 ..), weights decoded straight from the codes: each weight is read from memory
// (or L1) and decoded once per MR tokens, with no buffer traffic. Results go to out[i][r0 + r].
template <int KIND, int MR, int R>
inline void fused_tile(const Weights& W, int64_t n0, int r0, const float* x, int64_t ldx, float out[][TILE],
                       Prefetch& pf) {
  __m256 acc[MR][R];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  if (KIND == 1 || KIND == 2) {
    for (int64_t b = 0; b < W.K / 32; ++b) {
      for (int c = 0; c < 4; ++c) pf.step();
      // Why unrolled: a loop over r left standing keeps acc[][] in memory (a store and a load around every fma)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m256 wv[4];
        decode_block<KIND>(W, n0 + r0 + r, b, wv);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c)
#pragma GCC unroll 4
          for (int i = 0; i < MR; ++i)
            acc[i][r] = _mm256_fmadd_ps(wv[c], _mm256_loadu_ps(x + i * ldx + b * 32 + c * 8), acc[i][r]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < R; ++r) out[i][r0 + r] = hsum8(acc[i][r]);
    return;
  }
  // bf16 weights: each row's start computed once per tile, and the loops unrolled so that acc[][] stays in
  // registers. Why: left to the compiler, the one-token tile (1 x 6) kept its six sums on the stack, a store and a
  // reload around every FMA (AMD EPYC, AVX2, one thread, a 384 x 576 layer in L2: 30 us a token, unrolled 20 us).
  const uint8_t* row[R];
  for (int r = 0; r < R; ++r) row[r] = W.codes + (n0 + r0 + r) * W.row_bytes;
  for (int64_t k = 0; k < W.K; k += 8) {
    pf.step();
    __m256 xv[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(x + i * ldx + k);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 wv = bf16x8(row[r] + 2 * k);  // load8<0>'s value (4/8-bit codes returned above)
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) acc[i][r] = _mm256_fmadd_ps(wv, xv[i], acc[i][r]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < R; ++r) out[i][r0 + r] = hsum8(acc[i][r]);
}

// MR tokens x R rows (r0 ..) of a decoded tile buf [TILE][K] (rows past the matrix are zeros, their sums dropped).
template <int MR, int R>
inline void buffered_tile(const float* buf, int64_t K, int r0, const float* x, int64_t ldx, float out[][TILE],
                          Prefetch& pf) {
  __m256 acc[MR][R];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {  // unrolled so that acc[][] stays in registers (see fused_tile)
    pf.step();
    __m256 xv[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(x + i * ldx + k);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_loadu_ps(buf + (r0 + r) * K + k);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) acc[i][r] = _mm256_fmadd_ps(wv, xv[i], acc[i][r]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < R; ++r) out[i][r0 + r] = hsum8(acc[i][r]);
}

// The weight rows R that 4 tokens run against at once: 3 (12 accumulators) where a row's 8 weights fit one register
// (bf16 weights, the decoded buffer): an FMA's 4-cycle latency needs 8+ independent sums to keep both FMA units
// busy, and 4 x 2 left them waiting (measured on an AMD EPYC, AVX2: 4 tokens x 3 rows ran 1.5 FMAs a cycle, 4 x 2
// 1.1, on weights in L2). 2 for 4/8-bit codes decoded on the fly: a 32-block's 4 registers of weights would not fit
// beside 12 sums.
constexpr int group_rows(bool buffered, int kind) { return buffered || kind == 0 ? 3 : 2; }

// One tile of TILE weight rows against all M tokens, 4 tokens x R rows at a time, then 2 or 1 left-over tokens x
// the whole tile. `Buffered` reads a decoded tile (4/8-bit codes: their decode is dearer than the products); else
// weights come from the codes.
template <bool Buffered, int KIND>
inline void tile_tokens(const Weights& W, const float* buf, int64_t n0, const float* xp, int64_t M, int64_t N,
                        int64_t rows, Prefetch& pf, float* yp) {
  const int64_t K = W.K;
  constexpr int R = group_rows(Buffered, KIND);
  static_assert(TILE % R == 0, "a tile's rows split into groups of R");
  float out[4][TILE];
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) {
    for (int r0 = 0; r0 < TILE; r0 += R) {
      if (Buffered) buffered_tile<4, R>(buf, K, r0, xp + i * K, K, out, pf);
      else fused_tile<KIND, 4, R>(W, n0, r0, xp + i * K, K, out, pf);
    }
    store_tile<TILE>(yp, N, i, n0, rows, out, 4);
  }
  for (; i + 2 <= M; i += 2) {
    if (Buffered) buffered_tile<2, TILE>(buf, K, 0, xp + i * K, K, out, pf);
    else fused_tile<KIND, 2, TILE>(W, n0, 0, xp + i * K, K, out, pf);
    store_tile<TILE>(yp, N, i, n0, rows, out, 2);
  }
  if (i < M) {
    if (Buffered) buffered_tile<1, TILE>(buf, K, 0, xp + i * K, K, out, pf);
    else fused_tile<KIND, 1, TILE>(W, n0, 0, xp + i * K, K, out, pf);
    store_tile<TILE>(yp, N, i, n0, rows, out, 1);
  }
}

// ---- CPUs with AVX512-BF16: bf16 weights and bf16 activations ----------------------------------------------------
// Every output element is acc = 0 (16 fp32 lanes); for k = 0, 32, 64, ...: acc = dpbf16(acc, w[k:k+32], x[k:k+32])
// (lane j adds w[2j] x[2j] + w[2j+1] x[2j+1], the instruction's own rounding); y = hsum16(acc). The instruction
// multiplies bf16 values exactly; it is 4x the FMA work per instruction of the 8-lane path, which is what a verify
// block of 16-32 tokens is bound by. Again the same sequence for every element whatever M is: tokens side by side
// (up to 4) only share the weight loads. Its bits differ from the 8-lane path's, so the engine name says which ran
// (`isa`).
#define DFK_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int64_t TILE16 = 6;  // 4 tokens x 6 rows = 24 accumulators of the 32 zmm registers

// MR tokens (rows of x, stride K) against weight rows `w[r]` (r < TILE16; a row past the matrix repeats the last).
// ahead: rows pulled into L1 meanwhile, one line of each per k step (nullptr: none; bf16 weights read from memory).
template <int MR>
DFK_AVX512BF16 void bf16_tile(const uint16_t* const* w, const uint16_t* x, int64_t K, float out[][TILE16],
                              const uint16_t* const* ahead = nullptr) {
  __m512 acc[MR][TILE16];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < TILE16; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    if (ahead)
      for (int r = 0; r < TILE16; ++r) _mm_prefetch(reinterpret_cast<const char*>(ahead[r] + k), _MM_HINT_T0);
    __m512bh xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(x + i * K + k);
    for (int r = 0; r < TILE16; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w[r] + k);
      for (int i = 0; i < MR; ++i) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], wv, xv[i]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < TILE16; ++r) out[i][r] = hsum16(acc[i][r]);
}

// 4/8-bit weights on this path: row n's weights as bf16, out[K]. Each weight is its fp32 value as `load8` computes it
// (Q4_1: fma(d, q, m); Q8_0: d * q), rounded to bf16 (nearest even) once; the products are then bf16 x bf16 like
// the bf16 kind's. Why: a Q4_1 block's scale makes the integer path pay a convert and an fma per block per token,
// and a 16-token verify on it cost ~3.4x the bf16 path (qlinear); decoded once per tile of rows, the weights serve
// every token at bf16 speed, while a one-token step still reads 4-bit codes from memory. The rounding to bf16 is
// a relative 2^-9 per weight, far below the 4-bit codes' own step (a different target than the 8-lane path's fp32
// products: the engine name says which ISA ran).
// ahead: a row whose codes, scales and minima are pulled into L1 meanwhile (-1: none); no effect on bits.
DFK_AVX512BF16 void decode_row_bf16(const Weights& W, int64_t n, uint16_t* out, int64_t ahead) {
  const int64_t nb = W.K / 32, block_bytes = W.kind == 1 ? 16 : 32;
  const uint8_t* row = W.codes + n * W.row_bytes;
  const char* next = ahead >= 0 ? reinterpret_cast<const char*>(W.codes + ahead * W.row_bytes) : nullptr;
  if (next) {  // the scale (and minimum) rows: a few lines each, their last byte included
    for (const float* t : {W.d, W.kind == 1 ? W.m : nullptr}) {
      if (!t) continue;
      const char* p = reinterpret_cast<const char*>(t + ahead * nb);
      for (int64_t o = 0; o < nb * 4; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
      _mm_prefetch(p + nb * 4 - 1, _MM_HINT_T0);
    }
  }
  for (int64_t b = 0; b < nb; ++b) {
    if (next && (b * block_bytes) % 64 == 0) _mm_prefetch(next + b * block_bytes, _MM_HINT_T0);
    if (next && b == nb - 1) _mm_prefetch(next + W.row_bytes - 1, _MM_HINT_T0);
    const __m512 d = _mm512_set1_ps(W.d[n * nb + b]);
    __m512 lo, hi;  // elements 0-15 and 16-31 of the block
    if (W.kind == 1) {  // byte j: element j (low nibble), element j + 16 (high nibble)
      // A 4-bit code has 16 values: compute them once per block (the same fma(d, q, m), rounded to bf16 once) and
      // look each code up (vpermw), instead of a convert and an fma per weight.
      const __m512 v = _mm512_fmadd_ps(d, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                       _mm512_set1_ps(W.m[n * nb + b]));
      const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(v));
      const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b)));
      const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(c, _mm256_set1_epi16(0x0f))),
                                             _mm256_srli_epi16(c, 4), 1);  // [elements 0-15, elements 16-31]
      _mm512_storeu_si512(out + 32 * b, _mm512_permutexvar_epi16(idx, table));
      continue;
    } else {
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * b));
      lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(c))));
      hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(c, 1))));
    }
    _mm512_storeu_si512(out + 32 * b, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));  // [lo, hi] in element order
  }
}

// wp: bf16 weights [N, K] (kind 0), or W's 4/8-bit codes decoded a tile at a time (`decode_row_bf16`).
DFK_AVX512BF16 void rowlinear_bf16_avx512(const uint16_t* xp, const uint16_t* wp, const Weights& W, int64_t M,
                                          int64_t N, int64_t K, float* yp) {
  const int64_t tiles = (N + TILE16 - 1) / TILE16;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    float out[4][TILE16];
    const uint16_t* w[TILE16];
    std::vector<uint16_t> buf(W.kind == 0 ? 0 : TILE16 * K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * TILE16, rows = std::min(TILE16, N - n0);
      for (int64_t r = 0; r < TILE16; ++r) {
        if (W.kind == 0) {
          w[r] = wp + (n0 + std::min(r, rows - 1)) * K;
        } else {  // rows past the matrix repeat the last one
          // Why the row two tiles on is prefetched: from memory (a step streams ~100 MB of codes, far more than
          // the caches), six row streams at once are more than the hardware prefetcher keeps up with.
          const int64_t ahead = n0 + r + 2 * TILE16;
          if (r < rows) decode_row_bf16(W, n0 + r, buf.data() + r * K, ahead < N ? ahead : -1);
          w[r] = buf.data() + std::min(r, rows - 1) * K;
        }
      }
      // bf16 weights: the rows two tiles on are prefetched during the first token group's pass (the codes are
      // prefetched as they are decoded, `decode_row_bf16`); no effect on bits.
      const uint16_t* ahead[TILE16];
      const bool pf = W.kind == 0 && n0 + 2 * TILE16 < N;
      for (int64_t r = 0; r < TILE16 && pf; ++r) ahead[r] = wp + std::min(n0 + 2 * TILE16 + r, N - 1) * K;
      const uint16_t* const* first = pf ? ahead : nullptr;
      int64_t i = 0;
      for (; i + 4 <= M; i += 4, first = nullptr)
        bf16_tile<4>(w, xp + i * K, K, out, first), store_tile<TILE16>(yp, N, i, n0, rows, out, 4);
      const int64_t left = M - i;
      if (left == 3) bf16_tile<3>(w, xp + i * K, K, out, first), store_tile<TILE16>(yp, N, i, n0, rows, out, 3);
      if (left == 2) bf16_tile<2>(w, xp + i * K, K, out, first), store_tile<TILE16>(yp, N, i, n0, rows, out, 2);
      if (left == 1) bf16_tile<1>(w, xp + i * K, K, out, first), store_tile<TILE16>(yp, N, i, n0, rows, out, 1);
    }
  });
}

// ---- Intel AMX (AMX-BF16 tiles), where the CPU has them and the OS lets this process use them.
// Every output element is c = 0 (fp32); for k = 0, 32, 64, ...: c += the 16 pairs w[k + 2j] x[k + 2j] +
// w[k + 2j + 1] x[k + 2j + 1], j = 0..15 in order (one TDPBF16PS; its own rounding, denormals flushed); y = c. The
// tile instruction computes each element of its 16 x 16 result alone, so a token's row has the same bits whichever
// tokens share its tile and whatever M is (tests: row counts 1-37). A C tile holds 16 weight rows x 16 tokens, so a
// verify of up to 16 tokens costs one tile instruction per 16 x 32 weights, like a one-token step: the weights'
// memory traffic, not the arithmetic, sets the cost. Its bits differ from the AVX-512 dot-product path's (another
// summation order), so the engine name says which ran (`isa`: "amx").
// Compilers without the AMX intrinsics (GCC < 11, clang) build without this path: the CPU then runs the dot products.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && !defined(DFK_NO_AMX)
#define DFK_HAVE_AMX 1
#define DFK_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

struct TileConfig {  // the LDTILECFG memory layout (palette 1)
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The CPU has AMX-BF16 and AMX-TILE (CPUID 7.0:EDX bits 22, 24) and Linux granted the tile data (XTILEDATA, 18) to
// this process (ARCH_REQ_XCOMP_PERM, 0x1023; Linux >= 5.16). Asked once; the grant is process-wide.
bool amx_granted() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return false;
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
}

// This thread's tile registers: seven 16 x 64-byte tiles (below). Functions, not inline code: a lambda does not
// carry its enclosing function's target attribute.
// Why a constant: GCC 12 does not see _tile_loadconfig read its argument, and drops the stores that would fill a
// local one (the instruction then faults on an invalid configuration).
const TileConfig TILES = [] {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  return cfg;
}();
DFK_AMX void amx_begin() { _tile_loadconfig(&TILES); }
DFK_AMX void amx_end() { _tile_release(); }

// Tiles 0-2: three C tiles (weight rows n0 + 16 t .. + 15 x 16 tokens, t = 0..2); 3-5: their A tiles (16 rows x 32
// k); 6: the B tile (16 k-pairs x 16 tokens). Three independent accumulators keep the tile unit busy (one waits on
// its previous product's latency). `tiles`: how many of the three hold weight rows.
constexpr int64_t AMX_ROWS = 48;
// next: `next_rows` weight rows (stride lda) pulled into L1 meanwhile, a line of each per k step (nullptr: none).
DFK_AMX void amx_block(const uint16_t* a, int64_t lda, const uint32_t* b, int64_t K, float c[3][16][16], int tiles,
                       const uint16_t* next = nullptr, int64_t next_rows = 0) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int64_t k = 0; k < K; k += 32) {
    for (int64_t r = 0; r < next_rows; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(next + r * lda + k), _MM_HINT_T0);
    _tile_loadd(6, b + (k / 2) * 16, 64);
    _tile_loadd(3, a + k, lda * 2);
    _tile_dpbf16ps(0, 3, 6);
    if (tiles > 1) {
      _tile_loadd(4, a + 16 * lda + k, lda * 2);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (tiles > 2) {
      _tile_loadd(5, a + 32 * lda + k, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
    }
  }
  _tile_stored(0, c[0], 64);
  if (tiles > 1) _tile_stored(1, c[1], 64);
  if (tiles > 2) _tile_stored(2, c[2], 64);
}

// wp: bf16 weights [N, K]. Only the bf16 kind runs here: 4/8-bit codes decoded into a buffer and read back by tile
// loads cost ~1.4x the AVX-512 path at one token (measured on a 2-core Xeon: a one-token target step 13.2 vs 9.2 ms),
// so codes stay on the AVX-512 dot products (`rowlinear_bf16_avx512`, their bits unchanged).
DFK_AMX void rowlinear_bf16_amx(const uint16_t* xp, const uint16_t* wp, int64_t M, int64_t N, int64_t K, float* yp) {
  const int64_t chunks = (M + 15) / 16, pairs = K / 2;
  // x^T as B tiles, once per call: xt[chunk][k-pair][token] = the bf16 pair x[16 chunk + token][2 k-pair ..] (a
  // token past M: zeros, its column never stored).
  std::vector<uint32_t> xt(chunks * pairs * 16, 0);
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(xp);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t p = 0; p < pairs; ++p) xt[((i / 16) * pairs + p) * 16 + i % 16] = x32[i * pairs + p];
  const int64_t blocks = (N + AMX_ROWS - 1) / AMX_ROWS;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    amx_begin();
    std::vector<uint16_t> buf;  // a last block's rows (rows past the matrix: zeros)
    alignas(64) float c[3][16][16];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = AMX_ROWS * blk, rows = std::min(AMX_ROWS, N - n0);
      const int tiles = static_cast<int>((rows + 15) / 16);
      const uint16_t* a = wp + n0 * K;
      if (rows % 16) {
        buf.assign(AMX_ROWS * K, 0);
        std::memcpy(buf.data(), a, rows * K * 2);
        a = buf.data();
      }
      // the next block's rows, prefetched during the first chunk's pass (why: see decode_row_bf16's caller)
      const int64_t next_rows = std::max<int64_t>(std::min(AMX_ROWS, N - n0 - AMX_ROWS), 0);
      for (int64_t ch = 0; ch < chunks; ++ch) {
        amx_block(a, K, xt.data() + ch * pairs * 16, K, c, tiles, ch == 0 ? wp + (n0 + AMX_ROWS) * K : nullptr,
                  ch == 0 ? next_rows : 0);
        const int64_t toks = std::min<int64_t>(16, M - 16 * ch);
        for (int64_t i = 0; i < toks; ++i)
          for (int64_t r = 0; r < rows; ++r) yp[(16 * ch + i) * N + n0 + r] = c[r / 16][r % 16][i];
      }
    }
    amx_end();
  });
}
#else
bool amx_granted() { return false; }
void rowlinear_bf16_amx(const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, float*) {}
#endif

// 0: the best this CPU has; 1: at most the AVX-512 dot products (no AMX); 2: the 8-lane AVX2 path. Set by
// rowlinear_set_isa: tests of every path on one host, A/B benchmarks.
std::atomic<int> isa_cap{0};
std::atomic<bool> avx2_only{false};

// Does the bf16 x bf16 path run the 16-lane AVX512-BF16 code here (checked on every call: a bool, not a string)?
bool bf16_dot_path() {
  static const bool cpu = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  return cpu && !avx2_only;
}

bool amx_path() { return bf16_dot_path() && isa_cap == 0 && amx_granted(); }

// How many k loops `tile_tokens` runs over one tile of M tokens (the Prefetch's passes): TILE / R per 4 tokens,
// then one for 2 left over and one for 1.
int64_t tile_passes(bool buffered, int64_t kind, int64_t M) {
  return M / 4 * (TILE / group_rows(buffered, kind)) + (M % 4 >= 2) + (M % 2);
}

// Tiles [t0, t1) of TILE weight rows: their columns of y [M, N] fp32 from x [M, K] fp32. What `rowlinear`'s threads
// and the layer stack's team (`rowlinear_tiles`) run.
void tile_range(const Weights& W, const float* xp, int64_t M, int64_t N, int64_t t0, int64_t t1, float* yp) {
  const int64_t K = W.K, kind = W.kind;
  // the decoded tile (4/8-bit codes at 5+ tokens, a last tile short of TILE rows), allocated where one is needed:
  // a zero-filled vector per call had cost a memset of up to 37 KB per linear per thread at every step
  std::unique_ptr<float[]> buf;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * TILE, rows = std::min(TILE, N - n0);
    const bool fused = rows == TILE && (kind == 0 || M <= FUSED_MAX_ROWS);
    Prefetch pf(W, n0 + TILE, std::min(n0 + 2 * TILE, N), tile_passes(!fused, kind, M));
    if (fused) {
      if (kind == 0) tile_tokens<false, 0>(W, nullptr, n0, xp, M, N, rows, pf, yp);
      if (kind == 1) tile_tokens<false, 1>(W, nullptr, n0, xp, M, N, rows, pf, yp);
      if (kind == 2) tile_tokens<false, 2>(W, nullptr, n0, xp, M, N, rows, pf, yp);
      continue;
    }
    if (!buf) buf.reset(new float[TILE * K]);
    // Decode the tile once into buf (rows past the matrix as zeros) and reuse it for all tokens.
    for (int64_t r = 0; r < TILE; ++r) {
      float* row = buf.get() + r * K;
      if (r >= rows) {
        std::fill(row, row + K, 0.0f);
        continue;
      }
      for (int64_t b = 0; b < K / 32; ++b) {
        __m256 w[4];
        if (kind == 1) decode_block<1>(W, n0 + r, b, w);
        else if (kind == 2) decode_block<2>(W, n0 + r, b, w);
        else
          for (int c = 0; c < 4; ++c) w[c] = load8<0>(W, n0 + r, b * 32 + c * 8);
        for (int c = 0; c < 4; ++c) _mm256_storeu_ps(row + b * 32 + c * 8, w[c]);
      }
    }
    tile_tokens<true, 0>(W, buf.get(), n0, xp, M, N, rows, pf, yp);
  }
}

}  // namespace

bool dflashkit_avx2_forced() { return avx2_only; }

// plinear runs where rowlinear's bf16 activations take the AVX512-BF16 dot products (same CPU test, same ISA switch).
bool plinear_available() { return bf16_dot_path(); }

// Which instruction set the bf16 x bf16 path runs here: "amx", "avx512bf16" or "avx2" (their bits differ).
std::string rowlinear_isa() { return amx_path() ? "amx" : bf16_dot_path() ? "avx512bf16" : "avx2"; }

// "avx2" forces the 8-lane path on any CPU, "avx512bf16" keeps an AMX CPU on its AVX-512 dot products, "auto" picks
// the best this CPU has. Returns the ISA now in use.
std::string rowlinear_set_isa(const std::string& isa) {
  TORCH_CHECK(isa == "auto" || isa == "avx512bf16" || isa == "avx2",
              "rowlinear_set_isa: 'auto', 'avx512bf16' or 'avx2', not '", isa, "'");
  isa_cap = isa == "auto" ? 0 : isa == "avx512bf16" ? 1 : 2;
  avx2_only = isa == "avx2";
  return rowlinear_isa();
}

bool rowlinear_fp32_path() { return !bf16_dot_path(); }

int64_t rowlinear_tile_count(int64_t n_out) { return (n_out + TILE - 1) / TILE; }

// Bytes of one weight row of K elements in `kind`'s codes (0 bf16, 1 q4_1 nibbles, 2 q8_0 bytes).
static int64_t row_bytes_of(int64_t kind, int64_t K) { return kind == 0 ? 2 * K : (kind == 1 ? K / 2 : K); }

void rowlinear_widen(const uint16_t* x, int64_t f0, int64_t f1, float* xf) {
  for (int64_t k = 32 * f0; k < 32 * f1; k += 8) _mm256_storeu_ps(xf + k, bf16x8(x + k));  // exact
}

void rowlinear_tiles(const torch::Tensor& codes, const torch::Tensor& d, const torch::Tensor& m, int64_t kind,
                     int64_t n_out, int64_t K, const float* xf, int64_t M, int64_t t0, int64_t t1, float* y) {
  const int64_t row_bytes = row_bytes_of(kind, K);
  const Weights W{static_cast<int>(kind), static_cast<const uint8_t*>(codes.data_ptr()),
                  kind != 0 ? d.data_ptr<float>() : nullptr, kind == 1 ? m.data_ptr<float>() : nullptr, K, row_bytes};
  tile_range(W, xf, M, n_out, t0, t1, y);
}

torch::Tensor rowlinear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t kind,
                        int64_t n_out, bool out_bf16) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "rowlinear: x must be [M, K] with K a multiple of 32");
  TORCH_CHECK(kind >= 0 && kind <= 2, "rowlinear: kind must be 0 (bf16), 1 (q4_1) or 2 (q8_0)");
  TORCH_CHECK(codes.is_contiguous() && codes.size(0) == n_out, "rowlinear: codes must be contiguous [N, ...]");
  const int64_t M = x.size(0), K = x.size(1), N = n_out;
  const int64_t row_bytes = row_bytes_of(kind, K);
  TORCH_CHECK(codes.numel() * codes.element_size() == N * row_bytes, "rowlinear: codes do not match [N, K]");
  if (kind != 0) TORCH_CHECK(d.scalar_type() == torch::kFloat && d.is_contiguous() && d.numel() == N * K / 32,
                             "rowlinear: scales must be fp32 [N, K / 32]");
  if (kind == 1) TORCH_CHECK(m.scalar_type() == torch::kFloat && m.is_contiguous() && m.numel() == N * K / 32,
                             "rowlinear: mins must be fp32 [N, K / 32]");
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const float* dp = kind != 0 ? d.data_ptr<float>() : nullptr;
  const float* mp = kind == 1 ? m.data_ptr<float>() : nullptr;
  const Weights W{static_cast<int>(kind), cp, dp, mp, K, row_bytes};
  if (x.scalar_type() == torch::kBFloat16 && bf16_dot_path()) {  // bf16 activations on bf16 dot products
    torch::Tensor xb = x.contiguous();
    torch::Tensor yb = torch::empty({M, N}, x.options().dtype(torch::kFloat));
    const auto* xbp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
    const auto* wbp = reinterpret_cast<const uint16_t*>(cp);
    if (kind == 0 && amx_path()) rowlinear_bf16_amx(xbp, wbp, M, N, K, yb.data_ptr<float>());
    else rowlinear_bf16_avx512(xbp, wbp, W, M, N, K, yb.data_ptr<float>());
    return out_bf16 ? round_to_bf16(yb) : yb;
  }
  torch::Tensor xf = x.to(torch::kFloat).contiguous();  // bf16 -> fp32 is exact
  torch::Tensor yf = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* yp = yf.data_ptr<float>();
  // Threads split the weight rows: each output element is computed whole by one thread, in the order above.
  at::parallel_for(0, rowlinear_tile_count(N), 1, [&](int64_t t0, int64_t t1) { tile_range(W, xp, M, N, t0, t1, yp); });
  return out_bf16 ? round_to_bf16(yf) : yf;
}
