// Row-invariant linear layers on packed Q4_1 / Q8_0 codes with bf16 activations (CPUs with AVX512-BF16):
// y[M, N] = x[M, K] . W[N, K]^T, W the GGUF's own 4/8-bit values, w = d * q + m (Q8_0: d * q) per 32-block, never
// rounded.
//
// Why: rowlinear's dot-product path decodes each weight to bf16 (fma(d, q, m) rounded), sums 16 partial lanes per
// output and adds them up at the end; decoding costs ~9 instructions per 32 weights and the horizontal sums ~40 % of
// a 4-token tile's work. Here a lane is a weight ROW (16 rows per vector; packed below)
// and the codes enter the products as they are: the bf16 value 128 + q has the bits 0x4300 | q, so a 4-bit code
// becomes a bf16 operand with one mask-and-or (q < 16 needs 4 of bf16's 7 fraction bits; 128 + q is exact); an 8-bit
// code is itself a bf16 value (|q| <= 128: 8 significant bits), widened and narrowed (`q8_pair`). One `dpbf16ps`
// multiplies a pair of elements of 16 rows by a broadcast pair of activations. No horizontal sum, no buffer.
//
// The arithmetic, for every output element (token t, weight row n), whatever M is and whichever thread computes it:
//   acc = 0 (fp32); for blocks b = 0, 1, ...:
//     S = 0; for the block's 16 element pairs (a, c) in the order below:
//         S = dpbf16(S, (v_a, v_c), (x_a, x_c))   (v = 128 + q for Q4_1, v = q for Q8_0; the instruction's own
//         arithmetic: both products exact in fp32, added to S with round-to-nearest-even, the high word's first;
//         denormals flushed)
//     acc = fma(S, d, acc)
//     Q4_1: acc = fma(m - 128 d, X_b, acc)  (m - 128 d rounded to fp32 once; X_b = the block's 32 activations summed
//                                            in fp32 in element order)
//   y = acc
// so y = sum_b d (sum q x) (+ m X_b), the codes' own weights: the products are exact, the sums fp32 (far finer than
// the 2^-9 per weight that rounding a weight to bf16 costs). S is a float sum, so its order is fixed (below); every
// width runs that one chain per lane.
//
// The packed layout (kernels/packing.py, `pack_codes` with exact codes): the rows in BANDS of 32 (two groups of 16
// rows; rows past N zeros), and per (band, block) one record, the records of a band's blocks one after another, the
// bands one after another: the codes of the band's first group, of its second, then the scales d of the first and the
// second group (16 fp16 each, row order), then (Q4_1) the mins m likewise. Q4_1: 2 x 256 + 2 x 32 + 2 x 32 = 640 bytes;
// Q8_0: 2 x 512 + 2 x 32 = 1088. Why one record: a tile (one band) then reads a single forward stream, which the
// hardware prefetcher follows at the machine's streaming rate; codes, scales and mins in separate arrays per group were
// 6 streams per band, each a few KB long, and at one token that streamed at ~half the rate (a throwaway GEMV on an AMD
// EPYC, 60 MB of Q4_1 codes at K = 576, 2 threads: 13-16 GB/s vs 28-32 in records, a 512 MB sum 31). Why fp16 scales:
// they are the GGUF's own values (fp16 in every Q4_1 / Q8_0 block), widened exactly to fp32 here; fp32 copies cost a
// sixth of a Q4_1 record's bytes.
// A group's codes within its record (`pack_codes`), Q4_1: 4 chunks of 64 bytes; chunk p, byte 4 r + e: low nibble
// q[r][8 p + e], high nibble q[r][8 p + 4 + e]. Read as 16-bit words, row r owns words 2 r, 2 r + 1 (bytes
// 4 r .. 4 r + 3); nibble position s (bits 4 s .. 4 s + 3 of each word) holds the pair
//   s = 0: (8 p, 8 p + 2)   s = 1: (8 p + 4, 8 p + 6)   s = 2: (8 p + 1, 8 p + 3)   s = 3: (8 p + 5, 8 p + 7)
// and the chain takes chunks p = 0..3, within each the positions s = 0..3.
// Q8_0: 16 pairs of 32 bytes, pair i = elements (2 i, 2 i + 1), byte 2 r + h = q[r][2 i + h] (int8); the chain
// takes i = 0..15.
// The activations are laid out once per call in their pair order (`pairs`), so each pair is one 32-bit broadcast.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"

#include "simd.h"

namespace {

using dflashkit::round_to_bf16;
using dflashkit::widen;

constexpr int64_t GROUP = 16;  // weight rows per packed group
constexpr int64_t BAND = 2;    // groups per band (one record per band and block; a tile computes one band)
// Q4_1's activation pair order (`pairs`): pair 4 p + s of a block holds elements 8 p + PAIR[s] (chunk p, nibble
// position s). Q8_0's pairs are in element order (pair i = elements 2 i, 2 i + 1): the row as it is.
constexpr int PAIR[4][2] = {{0, 2}, {4, 6}, {1, 3}, {5, 7}};

#define DFK_PBF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

// One group's codes in a block (16 rows x 32 elements): Q4_1 nibbles, Q8_0 bytes.
constexpr int64_t code_bytes(int kind) { return kind == 1 ? 256 : 512; }
// One record's bytes: the band's groups' codes, then their fp16 scales d and (Q4_1) mins m, 16 x 2 bytes a group.
constexpr int64_t record_bytes(int kind) { return BAND * (code_bytes(kind) + 32 * (kind == 1 ? 2 : 1)); }

struct Codes {
  const uint8_t* records;  // [bands, blocks, record_bytes]
  int64_t nb;
};

struct Acts {
  const uint32_t* pairs;  // [M, blocks, 16]: the bf16 pair (low word, high word) for chunk p, position s at 4 p + s
  const float* sum;       // [M, blocks]: X_b
  int64_t nb;
};

// One 64-byte Q4_1 chunk's four nibble vectors as bf16 operands: nibble position s of every 16-bit word, as 128 +
// the nibble (0x4300 | n), via one ternary-logic op: B ? A ^ C : C with A = the shifted codes, B = 0x000f,
// C = 0x4300 (imm 0x6A).
DFK_PBF16 inline __m512bh nibbles(__m512i v, int s) {
  const __m512i low4 = _mm512_set1_epi16(0x000f);
  const __m512i c = _mm512_set1_epi16(0x4300);
  return (__m512bh)_mm512_ternarylogic_epi32(s ? _mm512_srli_epi16(v, 4 * s) : v, low4, c, 0x6A);
}

// 16 fp16 values in memory widened to fp32 (exact).
DFK_PBF16 inline __m512 fp16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One packed Q8_0 pair (32 bytes: row r's two codes at bytes 2 r, 2 r + 1) as bf16 operands, lane r = row r: the
// codes sign-extended to int32 and converted to fp32 (exact), rows 0-7 and 8-15 narrowed to bf16 in one
// `cvtne2ps2bf16` (exact: integers within 2^8). That instruction puts its second operand's 16 values in words
// 0-15 and its first's in 16-31, so words 2 r, 2 r + 1 (lane r) are row r's codes: the order `pack_codes` stores.
DFK_PBF16 inline __m512bh q8_pair(const uint8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// Why records are prefetched AHEAD on at 2+ tokens: there the products bound the tile (~17 GB/s of codes at 4
// tokens when they are in the caches), and a hint ~4 KB ahead keeps the stream's lines arriving while they run (a
// throwaway GEMV on an AMD EPYC, 4 tokens, K = 1536, 2 threads: 3.7 vs 5.3 ms without). At one token the hardware
// prefetcher alone follows the single stream faster than with the hints (2.1 vs 2.3-2.8 ms there). Past a band's
// last block the next records are the next band's: the layout is one stream. Hints only: no effect on bits.
template <int KIND>
constexpr int64_t AHEAD = KIND == 1 ? 6 : 4;  // records

// MR tokens (t0 ..) x one band (j): out lanes = rows. KIND 1 (Q4_1): one chain S per block over its 16 pairs.
// KIND 2 (Q8_0, codes q in -128..127): one chain S = sum q x per block over its 16 pairs, then acc = fma(S, d, acc).
// A code enters as the bf16 value q itself (at most 8 significant bits: exact), made by sign-extending the byte,
// converting to fp32 and narrowing two vectors to bf16 (`q8_pair`): ~10 instructions per 64 codes, one `dpbf16ps`
// per pair and token. Why not two chains of 128 + a nibble, as Q4_1's one: each code would then cost two products
// a token, which at 4+ tokens is what the head's time is (measured on an AMD EPYC: the head at 4 tokens ~1.6 ms of a
// ~9.6 ms step, compute-bound; the narrowing costs less than the second chain's products from 2 tokens on, and at
// one token both run under the codes' bytes / bandwidth).
template <int KIND, int MR>
DFK_PBF16 void pbf16_tile(const Codes& W, int64_t j, const Acts& X, int64_t t0, float* y, int64_t N) {
  constexpr int R = BAND;
  constexpr int64_t rec = record_bytes(KIND), codes = code_bytes(KIND), lines = rec / 64;
  constexpr int chunks = KIND == 1 ? 4 : 8;  // 64-byte chunks of a group's codes
  __m512 acc[MR][R];
  for (int t = 0; t < MR; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < W.nb; ++b) {
    __m512 S[MR][R];
    for (int t = 0; t < MR; ++t)
      for (int r = 0; r < R; ++r) S[t][r] = _mm512_setzero_ps();
    const uint8_t* c = W.records + (j * W.nb + b) * rec;
    for (int p = 0; p < chunks; ++p) {
      if (MR > 1)
        for (int64_t l = p; l < lines; l += chunks)
          _mm_prefetch(reinterpret_cast<const char*>(c + AHEAD<KIND> * rec + 64 * l), _MM_HINT_T0);
      __m512i v[R];
      if (KIND == 1)
        for (int r = 0; r < R; ++r) v[r] = _mm512_loadu_si512(c + r * codes + 64 * p);
      for (int s = 0; s < (KIND == 1 ? 4 : 2); ++s) {  // Q4_1: nibble positions; Q8_0: the chunk's two pairs
        __m512bh w[R];
        for (int r = 0; r < R; ++r) w[r] = KIND == 1 ? nibbles(v[r], s) : q8_pair(c + r * codes + 64 * p + 32 * s);
        for (int t = 0; t < MR; ++t) {
          const int64_t i = ((t0 + t) * X.nb + b) * 16 + (KIND == 1 ? 4 * p + s : 2 * p + s);  // pair i
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(X.pairs[i]);
          for (int r = 0; r < R; ++r) S[t][r] = _mm512_dpbf16_ps(S[t][r], w[r], xv);
        }
      }
    }
    const uint8_t* scales = c + R * codes;  // d of each group (fp16 x 16), then Q4_1's m likewise
    for (int r = 0; r < R; ++r) {
      const __m512 d = fp16x16(scales + 32 * r);
      __m512 m = _mm512_setzero_ps();
      if constexpr (KIND == 1) m = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), d, fp16x16(scales + 32 * (R + r)));
      for (int t = 0; t < MR; ++t) {
        acc[t][r] = _mm512_fmadd_ps(S[t][r], d, acc[t][r]);
        if constexpr (KIND == 1) acc[t][r] = _mm512_fmadd_ps(m, _mm512_set1_ps(X.sum[(t0 + t) * X.nb + b]), acc[t][r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t n0 = (j * R + r) * GROUP;
    if (n0 >= N) break;
    const __mmask16 keep = N - n0 >= GROUP ? 0xffff : static_cast<__mmask16>((1u << (N - n0)) - 1);
    for (int t = 0; t < MR; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * N + n0, keep, acc[t][r]);
  }
}

// All M tokens against bands j0 .. j1: each band against the tokens 4 at a time, then the tokens left. Why the band
// outside: past 4 tokens the later token quads read the band's record run (10-35 KB) from the caches instead of
// streaming every code from memory once per quad.
template <int KIND>
DFK_PBF16 void pbf16_range(const Codes& W, int64_t j0, int64_t j1, const Acts& X, int64_t M, float* y, int64_t N) {
  for (int64_t j = j0; j < j1; ++j) {
    int64_t t = 0;
    for (; t + 4 <= M; t += 4) pbf16_tile<KIND, 4>(W, j, X, t, y, N);
    if (M - t == 3) pbf16_tile<KIND, 3>(W, j, X, t, y, N);
    if (M - t == 2) pbf16_tile<KIND, 2>(W, j, X, t, y, N);
    if (M - t == 1) pbf16_tile<KIND, 1>(W, j, X, t, y, N);
  }
}

// Q4_1's activations as the tiles read them, for n 32-element blocks (x [M, K] is M * K / 32 blocks in a row): each
// block's words permuted into the pair order (`PAIR`; pair i = words 2 i, 2 i + 1) and X_b, its 32 elements summed
// in element order from 0.0f: ((0 + x_0) + x_1) + ... + x_31. 16 blocks at a time, a lane per block (the same
// sequence of fp32 adds in every lane, so the same bits as the scalar loop for the blocks left over). Serial work on
// the calling thread before the tiles run (the other thread waits); as a scalar loop it cost a down projection ~4 us
// at 4 tokens (the adds' latency chain), ~1.3 ms of a 16-token step.
DFK_PBF16 void lay_out(const uint16_t* x, int64_t n, uint32_t* pairs, float* sums) {
  alignas(64) uint16_t order[32];
  for (int p = 0; p < 4; ++p)
    for (int s = 0; s < 4; ++s)
      order[2 * (4 * p + s)] = 8 * p + PAIR[s][0], order[2 * (4 * p + s) + 1] = 8 * p + PAIR[s][1];
  const __m512i perm = _mm512_load_si512(order);
  for (int64_t f = 0; f < n; ++f)
    _mm512_storeu_si512(pairs + 16 * f, _mm512_permutexvar_epi16(perm, _mm512_loadu_si512(x + 32 * f)));
  const __m512i at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                        _mm512_set1_epi32(64));  // byte offsets of 16 blocks' first elements
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  int64_t f = 0;
  for (; f + 16 <= n; f += 16) {
    __m512 total = _mm512_setzero_ps();
    for (int j = 0; j < 32; j += 2) {  // elements j and j + 1 of each block: one 32-bit word
      const __m512i w = _mm512_i32gather_epi32(at, x + 32 * f + j, 1);
      total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
      total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_and_si512(w, high)));
    }
    _mm512_storeu_ps(sums + f, total);
  }
  for (; f < n; ++f) {
    float total = 0.0f;
    for (int j = 0; j < 32; ++j) total += widen(x[32 * f + j]);
    sums[f] = total;
  }
}

}  // namespace

void plinear_lay_out(const uint16_t* x, int64_t f0, int64_t f1, uint32_t* pairs, float* sums) {
  if (f1 > f0) lay_out(x + 32 * f0, f1 - f0, pairs + 16 * f0, sums + f0);  // each block alone: any split, same bits
}

void plinear_bands(const PackedLinear& w, const uint16_t* x, const uint32_t* pairs, const float* sums, int64_t M,
                   int64_t j0, int64_t j1, float* y) {
  const Codes W{w.codes, w.K / 32};
  const Acts X{w.kind == 1 ? pairs : reinterpret_cast<const uint32_t*>(x), sums, w.K / 32};
  if (w.kind == 1) pbf16_range<1>(W, j0, j1, X, M, y, w.N);
  else pbf16_range<2>(W, j0, j1, X, M, y, w.N);
}

int64_t packed_group_count(int64_t n_out) { return (n_out + GROUP - 1) / GROUP; }

int64_t plinear_band_count(int64_t n_out) { return (n_out + BAND * GROUP - 1) / (BAND * GROUP); }

int64_t plinear_record_bytes(int64_t kind) { return record_bytes(static_cast<int>(kind)); }

torch::Tensor plinear(torch::Tensor x, torch::Tensor records, int64_t kind, int64_t n_out, bool out_bf16) {
  TORCH_CHECK(plinear_available(), "plinear needs a CPU with AVX512-BF16 (and the ISA not forced to avx2)");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0 && x.scalar_type() == torch::kBFloat16,
              "plinear: x must be bf16 [M, K] with K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), N = n_out, nb = K / 32, bands = plinear_band_count(N);
  TORCH_CHECK(kind == 1 || kind == 2, "plinear: kind must be 1 (q4_1) or 2 (q8_0)");
  TORCH_CHECK(records.is_contiguous() && records.scalar_type() == torch::kUInt8 &&
                  records.numel() == bands * nb * record_bytes(static_cast<int>(kind)),
              "plinear: the codes must be packed records [bands, blocks, record] (RowLinear.packed)");
  torch::Tensor xb = x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  // Per token, once (Q4_1): the activations in the packed pair order, and each block's sum in element order. Q8_0's
  // pairs are in element order: the row itself, read as 32-bit words.
  std::vector<uint32_t> pairs(kind == 1 ? M * nb * 16 : 0);
  std::vector<float> sums(kind == 1 ? M * nb : 0);
  if (kind == 1) lay_out(xp, M * nb, pairs.data(), sums.data());
  torch::Tensor yf = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  float* yp = yf.data_ptr<float>();
  const PackedLinear w{records.data_ptr<uint8_t>(), nullptr, nullptr, kind, K, N};
  // Threads split the bands of weight rows: each output element is computed whole by one thread, in the order above.
  at::parallel_for(0, bands, 1, [&](int64_t a, int64_t z) {
    plinear_bands(w, xp, pairs.data(), sums.data(), M, a, z, yp);
  });
  return out_bf16 ? round_to_bf16(yf) : yf;
}
