// The lean target's attention in one call per layer, row-invariant: o[b, q, h] depends on that query's row, the
// keys it may see and nothing else, computed in one fixed order whatever else shares the call.
//
// Each query sees two parts of its layer's cache (backends/lean.py, `_Split`): the HEAD, committed keys in slot
// order (slot == position there in every kind of step), and the TAIL, up to L keys gathered in POSITION order (a
// draft tree keeps ancestors at other slots than one-token decoding does; gathered, both see the same keys in the
// same order). Per (batch row, query, head), all in fp32:
//   score_s = dot(q, k_s) * scale  (8-lane accumulator over the head dim, fixed horizontal sum)
//   m = max over the visible scores
//   w_s = exp(score_s - m)  (`exp8`, elementwise)
//   den = sum w_s  (`softmax_weights`' fixed order over the visible list), num = sum w_s * v_s  (per element, head
//   keys ascending, then tail ascending)
//   o = num / den, rounded to bf16
// Hidden keys are skipped, not added as zeros: a verify block (more slots, more hidden) and a one-token step
// visit exactly the same keys in the same order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "ops.h"
#include "simd.h"

using dflashkit::bf16_round;
using dflashkit::bf16_round8;
using dflashkit::store8x16;
using dflashkit::bf16x8;
using dflashkit::exp8;
using dflashkit::hsum8;

// The slots one query sees, in the order they are summed: its head part's set slots ascending, then its tail's
// (slot -1: none). The head mask is scanned 32 bytes at a time (a bool is one byte, 0 or 1).
static void visible_slots(const bool* hv, int64_t S, const int64_t* tv, int64_t L, std::vector<int64_t>& slots) {
  slots.clear();
  slots.reserve(S + L);
  int64_t s = 0;
  for (; s + 32 <= S; s += 32) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hv + s));
    uint32_t bits = ~static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(b, _mm256_setzero_si256())));
    if (bits == 0xffffffffu) {  // the common case: 32 committed keys in a row
      const size_t n = slots.size();
      slots.resize(n + 32);
      for (int64_t j = 0; j < 32; ++j) slots[n + j] = s + j;
      continue;
    }
    for (; bits; bits &= bits - 1) slots.push_back(s + __builtin_ctz(bits));
  }
  for (; s < S; ++s)
    if (hv[s]) slots.push_back(s);
  for (int64_t j = 0; j < L; ++j)
    if (tv[j] >= 0) slots.push_back(tv[j]);
}

namespace {

// The keys of one kv head are read once for all the (query, head) pairs that attend to them: a UNIT is one batch
// row's block of up to kQueryBlock consecutive queries times some of the g query heads of one kv head, its CHAINS
// (c = query * nhq + head). The queries' slot lists agree on a first stretch (`common`: a verify block's queries all
// see the committed keys; a later query also sees the keys just before it), whose keys and values are widened to
// fp32 (exact) once per chunk and used by every chain. Each chain still computes exactly the header's sums in their
// order: a score is its own fma chain whatever key or chain runs beside it, and a value sum is per element, over
// the chain's slots ascending. So every layout below gives the same bits (tests/test_attention.py).
constexpr int64_t kQueryBlock = 8;
constexpr int64_t kSlotChunk = 256;    // a phased call's key range per work item
constexpr int64_t kWideKeys = 8192;    // floats of widened keys at a time (32 KB, in L1)
constexpr int64_t kRows = 64;          // value rows widened at a time, 16 columns of each

struct Unit {
  int64_t b, kv, q0, nq;  // batch row, kv head, first query, query count
  int64_t h0, nhq;        // the query heads h0 .. h0 + nhq of the kv head's g
  int64_t common;         // slots [0, common) of every query's list are the same
  int64_t longest;        // the longest slot list among the unit's queries
  int64_t first_chain;    // this unit's chains are rows first_chain.. of the phased score buffer
};

struct Call {
  const uint16_t *q, *k, *v;
  uint16_t* o;
  int64_t Q, nh, hd, kvh, T, vd, g;
  float sc;
  const std::vector<std::vector<int64_t>>* slots;  // [B * Q]: each query's visible slots in summing order

  int64_t chains(const Unit& u) const { return u.nq * u.nhq; }
  const std::vector<int64_t>& slots_of(const Unit& u, int64_t c) const {
    return (*slots)[u.b * Q + u.q0 + c / u.nhq];
  }
  int64_t row(const Unit& u, int64_t c) const {  // the chain's (query, head) row of q and o
    return (u.b * Q + u.q0 + c / u.nhq) * nh + u.kv * g + u.h0 + c % u.nhq;
  }
  const uint16_t* keys(const Unit& u) const { return k + (u.b * kvh + u.kv) * T * hd; }
  const uint16_t* values(const Unit& u) const { return v + (u.b * kvh + u.kv) * T * vd; }
};

inline __m256 load8(const uint16_t* p) { return bf16x8(p); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// score[i] = dot(q, key row i) * sc for i in [i0, i1): an 8-lane fma chain over the head dim, then `hsum8`; the same
// bits whether the key is read as bf16 or as its exact fp32 widening. row(i): the key's first element. HD: the head
// dim where the caller knows it (q stays in registers; four keys' chains run side by side), or 0.
template <int HD, typename Row>
void score_rows(const uint16_t* qrow, int64_t hd_rt, Row row, int64_t i0, int64_t i1, float sc, float* score) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  int64_t i = i0;
  if constexpr (HD > 0) {
    constexpr int NV = HD / 8;
    __m256 qv[NV];
    for (int j = 0; j < NV; ++j) qv[j] = bf16x8(qrow + 8 * j);
    for (; i + 4 <= i1; i += 4) {
      const auto *k0 = row(i), *k1 = row(i + 1), *k2 = row(i + 2), *k3 = row(i + 3);
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int j = 0; j < NV; ++j) {
        a0 = _mm256_fmadd_ps(qv[j], load8(k0 + 8 * j), a0);
        a1 = _mm256_fmadd_ps(qv[j], load8(k1 + 8 * j), a1);
        a2 = _mm256_fmadd_ps(qv[j], load8(k2 + 8 * j), a2);
        a3 = _mm256_fmadd_ps(qv[j], load8(k3 + 8 * j), a3);
      }
      score[i] = hsum8(a0) * sc, score[i + 1] = hsum8(a1) * sc;
      score[i + 2] = hsum8(a2) * sc, score[i + 3] = hsum8(a3) * sc;
    }
  }
  for (; i < i1; ++i) {
    const auto* kr = row(i);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < hd / 8; ++j) acc = _mm256_fmadd_ps(bf16x8(qrow + 8 * j), load8(kr + 8 * j), acc);
    score[i] = hsum8(acc) * sc;
  }
}

// rows[n][width] fp32 = the bf16 rows src + slots[i] * ld + d0 .. + width, widened (exact). The next n rows (up to
// `ahead` of them) are prefetched meanwhile: the hardware's prefetcher stops at each 4 KB page of the cache.
void widen(const uint16_t* src, int64_t ld, const int64_t* slots, int64_t n, int64_t ahead, int64_t d0, int64_t width,
           float* rows) {
  for (int64_t i = 0; i < n; ++i) {
    if (i < ahead) {
      const char* p = reinterpret_cast<const char*>(src + slots[n + i] * ld + d0);
      for (int64_t b = 0; b < width * 2; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
      _mm_prefetch(p + width * 2 - 1, _MM_HINT_T0);
    }
    for (int64_t d = 0; d < width; d += 8) _mm256_storeu_ps(rows + i * width + d, bf16x8(src + slots[i] * ld + d0 + d));
  }
}

// The unit's scores for the shared slot indices [i0, i1) (below `common`): the keys widened to fp32 32 KB at a time,
// once for all chains. Its own function: the per-(query, head) layout, which shares nothing, reserves no buffer.
template <int HD>
__attribute__((noinline)) void shared_scores(const Call& x, const Unit& u, int64_t i0, int64_t i1, float* score,
                                             int64_t stride) {
  const uint16_t* kb = x.keys(u);
  const int64_t hd = x.hd, step = std::max<int64_t>(1, kWideKeys / hd);
  float kf[kWideKeys];
  for (int64_t s0 = i0; s0 < i1; s0 += step) {
    const int64_t e = std::min(s0 + step, i1);
    widen(kb, hd, x.slots_of(u, 0).data() + s0, e - s0, std::min(step, u.common - e), 0, hd, kf);
    const float* base = kf - s0 * hd;  // row(i) for i in [s0, e)
    for (int64_t c = 0; c < x.chains(u); ++c)
      score_rows<HD>(x.q + x.row(u, c) * hd, hd, [&](int64_t i) { return base + i * hd; }, s0, e, x.sc,
                     score + c * stride);
  }
}

// The unit's scores for slot indices [i0, i1): the shared keys, then each chain's own keys as bf16. score [C, stride].
template <int HD>
void unit_scores(const Call& x, const Unit& u, int64_t i0, int64_t i1, float* score, int64_t stride) {
  if (i0 < std::min(i1, u.common)) shared_scores<HD>(x, u, i0, std::min(i1, u.common), score, stride);
  const uint16_t* kb = x.keys(u);
  const int64_t hd = x.hd;
  for (int64_t c = 0; c < x.chains(u); ++c) {
    const int64_t* sl = x.slots_of(u, c).data();
    const int64_t e = std::min(i1, static_cast<int64_t>(x.slots_of(u, c).size()));
    const auto row = [&](int64_t i) { return kb + sl[i] * (HD > 0 ? HD : hd); };
    score_rows<HD>(x.q + x.row(u, c) * hd, hd, row, std::max(i0, u.common), e, x.sc, score + c * stride);
  }
}

// One chain's softmax weights in place: exp(score - max) (`exp8`; the last n % 8 through a padded vector, the same
// per-lane arithmetic) and their sum, den: an 8-lane sum over the full groups of 8 (lane j: slots j, j + 8, ...),
// `hsum8`, then the last n % 8 in slot order. A fixed order for a given list, whatever else shares the call.
float softmax_weights(float* score, int64_t n) {
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());  // the max, 8 lanes at a time (any order)
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(score + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, mv);
  float m = lanes[0];
  for (int j = 1; j < 8; ++j) m = std::max(m, lanes[j]);
  for (; i < n; ++i) m = std::max(m, score[i]);
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(score + i), mb));
    _mm256_storeu_ps(score + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  float den = hsum8(sum);
  if (i < n) {
    float rest[8] = {};
    std::memcpy(rest, score + i, (n - i) * sizeof(float));
    _mm256_storeu_ps(rest, exp8(_mm256_sub_ps(_mm256_loadu_ps(rest), mb)));
    for (int64_t j = 0; j < n - i; ++j) score[i + j] = rest[j], den += rest[j];
  }
  return den;
}

// num[c][d .. d + 8W) += sum over rows [0, n) of w[c][s0 + i] * vf[i], for NB chains from c0: each widened value row
// is loaded once for the NB chains; every element is its own fma chain over the slots ascending (the header's order).
template <int NB, int W>
void shared_values(const float* vf, int64_t n, int64_t c0, int64_t s0, const float* w, int64_t stride, float* num,
                   int64_t hd, int64_t d) {
  __m256 acc[NB][W];
  for (int c = 0; c < NB; ++c)
    for (int j = 0; j < W; ++j) acc[c][j] = _mm256_loadu_ps(num + (c0 + c) * hd + d + 8 * j);
  for (int64_t i = 0; i < n; ++i) {
    __m256 vv[W];
    for (int j = 0; j < W; ++j) vv[j] = _mm256_loadu_ps(vf + i * 8 * W + 8 * j);
    for (int c = 0; c < NB; ++c) {
      const __m256 ev = _mm256_set1_ps(w[(c0 + c) * stride + s0 + i]);
      for (int j = 0; j < W; ++j) acc[c][j] = _mm256_fmadd_ps(ev, vv[j], acc[c][j]);
    }
  }
  for (int c = 0; c < NB; ++c)
    for (int j = 0; j < W; ++j) _mm256_storeu_ps(num + (c0 + c) * hd + d + 8 * j, acc[c][j]);
}

template <int W>
void shared_values_chains(const float* vf, int64_t n, int64_t c0, int64_t nb, int64_t s0, const float* w,
                          int64_t stride, float* num, int64_t hd, int64_t d) {
  switch (nb) {
    case 1: return shared_values<1, W>(vf, n, c0, s0, w, stride, num, hd, d);
    case 2: return shared_values<2, W>(vf, n, c0, s0, w, stride, num, hd, d);
    case 3: return shared_values<3, W>(vf, n, c0, s0, w, stride, num, hd, d);
    default: return shared_values<4, W>(vf, n, c0, s0, w, stride, num, hd, d);
  }
}

// num[0 .. D) += sum over i in [i0, i1) of w[i] * v row slots[i] (from vb), one chain's own slots; for D = HD > 0 the
// sums stay in registers.
template <int HD>
void own_values(const uint16_t* vb, int64_t vd, const int64_t* slots, int64_t i0, int64_t i1, const float* w,
                float* num, int64_t D = HD) {
  if constexpr (HD > 0) {
    constexpr int NV = HD / 8;
    __m256 acc[NV];
    for (int j = 0; j < NV; ++j) acc[j] = _mm256_loadu_ps(num + 8 * j);
    for (int64_t i = i0; i < i1; ++i) {
      const __m256 ev = _mm256_set1_ps(w[i]);
      const uint16_t* vr = vb + slots[i] * vd;  // vd may be odd (hd + 1): unaligned 16-byte loads of bf16
      for (int j = 0; j < NV; ++j) acc[j] = _mm256_fmadd_ps(ev, bf16x8(vr + 8 * j), acc[j]);
    }
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(num + 8 * j, acc[j]);
  } else {
    for (int64_t i = i0; i < i1; ++i) {
      const __m256 ev = _mm256_set1_ps(w[i]);
      const uint16_t* vr = vb + slots[i] * vd;
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(num + d, _mm256_fmadd_ps(ev, bf16x8(vr + d), _mm256_loadu_ps(num + d)));
    }
  }
}

// The unit's outputs for head-dim elements [d0, d1) (multiples of 8): the shared slots for all chains (their value
// columns widened kRows x 16 at a time, 4 chains at a time), then each chain's own slots continue its sums, then
// o = num / den rounded to bf16. w: the weights [chains, stride]; den [chains]; num: [chains, hd] scratch.
template <int HD>
void unit_values(const Call& x, const Unit& u, int64_t d0, int64_t d1, const float* w, int64_t stride,
                 const float* den, float* num) {
  const int64_t C = x.chains(u), hd = x.hd;
  const uint16_t* vb = x.values(u);
  const int64_t* shared = x.slots_of(u, 0).data();
  float vf[kRows * 16];
  for (int64_t c = 0; c < C; ++c) std::fill(num + c * hd + d0, num + c * hd + d1, 0.0f);
  for (int64_t s0 = 0; s0 < u.common; s0 += kRows) {
    const int64_t n = std::min(kRows, u.common - s0);
    for (int64_t d = d0; d < d1; d += 16) {
      const int64_t width = std::min<int64_t>(16, d1 - d);  // vd may be odd (hd + 1): unaligned rows
      widen(vb, x.vd, shared + s0, n, std::min(kRows, u.common - s0 - n), d, width, vf);
      for (int64_t c0 = 0; c0 < C; c0 += 4) {
        if (width == 16)
          shared_values_chains<2>(vf, n, c0, std::min<int64_t>(4, C - c0), s0, w, stride, num, hd, d);
        else
          shared_values_chains<1>(vf, n, c0, std::min<int64_t>(4, C - c0), s0, w, stride, num, hd, d);
      }
    }
  }
  for (int64_t c = 0; c < C; ++c) {
    const std::vector<int64_t>& sl = x.slots_of(u, c);
    float* nc = num + c * hd;
    if (HD > 0 && d0 == 0 && d1 == HD)
      own_values<HD>(vb, x.vd, sl.data(), u.common, sl.size(), w + c * stride, nc);
    else
      own_values<0>(vb + d0, x.vd, sl.data(), u.common, sl.size(), w + c * stride, nc + d0, d1 - d0);
    uint16_t* out = x.o + x.row(u, c) * hd;
    for (int64_t d = d0; d < d1; ++d) out[d] = bf16_round(nc[d] / den[c]);
  }
}

// Head dims 64 and 128 run their own code (q and the sums in registers), other multiples of 8 the generic loops.
void unit_values_any(const Call& x, const Unit& u, int64_t d0, int64_t d1, const float* w, int64_t stride,
                     const float* den, float* num) {
  x.hd == 64    ? unit_values<64>(x, u, d0, d1, w, stride, den, num)
  : x.hd == 128 ? unit_values<128>(x, u, d0, d1, w, stride, den, num)
                : unit_values<0>(x, u, d0, d1, w, stride, den, num);
}

void unit_scores_any(const Call& x, const Unit& u, int64_t i0, int64_t i1, float* score, int64_t stride) {
  x.hd == 64    ? unit_scores<64>(x, u, i0, i1, score, stride)
  : x.hd == 128 ? unit_scores<128>(x, u, i0, i1, score, stride)
                : unit_scores<0>(x, u, i0, i1, score, stride);
}

// Where sharing pays (2 threads, bench/attention.py): widening the shared keys and values to fp32 once for a
// unit's chains costs more than it saves while they sit in L1/L2 (lists under ~2k slots, ~1.5k where 8 queries share
// them); phasing a unit over the threads costs two more fork/joins, paid back only by longer lists.
constexpr int64_t kShareSlots = 2048;
constexpr int64_t kShareSlotsBlock = 1536;  // ... or this many, for full blocks of queries (a prefill chunk)
constexpr int64_t kPhasedSlots = 3072;

// The units of a call: per batch row, blocks of kQueryBlock queries, times the kv heads.
std::vector<Unit> make_units(const Call& x, int64_t B) {
  std::vector<Unit> units;
  units.reserve(B * ((x.Q + kQueryBlock - 1) / kQueryBlock) * x.kvh);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t q0 = 0; q0 < x.Q; q0 += kQueryBlock) {
      const int64_t nq = std::min(kQueryBlock, x.Q - q0);
      const std::vector<int64_t>& first = (*x.slots)[b * x.Q + q0];
      int64_t common = static_cast<int64_t>(first.size()), most = 0;
      for (int64_t j = 0; j < nq; ++j) {
        const std::vector<int64_t>& s = (*x.slots)[b * x.Q + q0 + j];
        most = std::max(most, static_cast<int64_t>(s.size()));
        common = std::mismatch(first.begin(), first.begin() + std::min<int64_t>(common, s.size()), s.begin()).first -
                 first.begin();
      }
      for (int64_t kv = 0; kv < x.kvh; ++kv) units.push_back({b, kv, q0, nq, 0, x.g, common, most, 0});
    }
  return units;
}

// Few units (a one-token or verify step of one row) with long slot lists: each phase is spread over the threads
// (scores by key chunk, softmax by chain, values by 16 head-dim elements), at the cost of two more fork/joins.
void run_phased(const Call& x, std::vector<Unit>& units) {
  int64_t rows = 0, stride = 0;
  for (Unit& u : units) u.first_chain = rows, rows += x.chains(u), stride = std::max(stride, u.longest);
  std::vector<float> w(rows * stride), den(rows), num(rows * x.hd);
  const int64_t chunks = (stride + kSlotChunk - 1) / kSlotChunk, dblocks = (x.hd + 15) / 16;
  at::parallel_for(0, static_cast<int64_t>(units.size()) * chunks, 1, [&](int64_t a, int64_t e) {
    for (int64_t it = a; it < e; ++it) {
      const Unit& u = units[it / chunks];
      const int64_t s0 = (it % chunks) * kSlotChunk;
      unit_scores_any(x, u, s0, std::min(s0 + kSlotChunk, u.longest), w.data() + u.first_chain * stride, stride);
    }
  });
  std::vector<const Unit*> unit_of(rows);
  for (const Unit& u : units)
    for (int64_t c = 0; c < x.chains(u); ++c) unit_of[u.first_chain + c] = &u;
  at::parallel_for(0, rows, 1, [&](int64_t a, int64_t e) {
    for (int64_t r = a; r < e; ++r) {
      const Unit& u = *unit_of[r];
      den[r] = softmax_weights(w.data() + r * stride, x.slots_of(u, r - u.first_chain).size());
    }
  });
  at::parallel_for(0, static_cast<int64_t>(units.size()) * dblocks, 1, [&](int64_t a, int64_t e) {
    for (int64_t it = a; it < e; ++it) {
      const Unit& u = units[it / dblocks];
      const int64_t d0 = (it % dblocks) * 16, f = u.first_chain;
      unit_values_any(x, u, d0, std::min(d0 + 16, x.hd), w.data() + f * stride, stride, den.data() + f,
                      num.data() + f * x.hd);
    }
  });
}

// Many units: each is one thread's work, start to end.
void run_units(const Call& x, const std::vector<Unit>& units) {
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t a, int64_t e) {
    std::vector<float> w, den, num;
    for (int64_t it = a; it < e; ++it) {
      const Unit& u = units[it];
      const int64_t C = x.chains(u), stride = u.longest;
      w.resize(C * stride), den.resize(C), num.resize(C * x.hd);
      unit_scores_any(x, u, 0, u.longest, w.data(), stride);
      for (int64_t c = 0; c < C; ++c) den[c] = softmax_weights(w.data() + c * stride, x.slots_of(u, c).size());
      unit_values_any(x, u, 0, x.hd, w.data(), stride, den.data(), num.data());
    }
  });
}

// Short lists: one unit per (query, head), as many work items as heads. Each thread lists the visible slots of the
// queries it serves itself (kept while consecutive items share a query), in its own cache.
void run_split(const Call& shared, int64_t B, const bool* hp, int64_t S, const int64_t* tp, int64_t L) {
  at::parallel_for(0, B * shared.Q * shared.nh, 1, [&](int64_t a, int64_t e) {
    std::vector<std::vector<int64_t>> lists(B * shared.Q);
    Call x = shared;
    x.slots = &lists;
    std::vector<float> w, num(x.hd);
    int64_t listed = -1;
    for (int64_t it = a; it < e; ++it) {
      const int64_t r = it / x.nh, h = it % x.nh;  // r = b * Q + query
      if (r != listed) {  // one list buffer per thread, moved to the query it now holds
        if (listed >= 0) lists[r].swap(lists[listed]);
        visible_slots(hp + r * S, S, tp + r * L, L, lists[r]);
        listed = r;
      }
      const int64_t n = static_cast<int64_t>(lists[r].size());
      const Unit u{r / x.Q, h / x.g, r % x.Q, 1, h % x.g, 1, 0, n, 0};
      w.resize(n);
      unit_scores_any(x, u, 0, n, w.data(), n);
      const float den = softmax_weights(w.data(), n);
      unit_values_any(x, u, 0, x.hd, w.data(), n, &den, num.data());
    }
  });
}

// Short lists, `grouped`: one unit per (batch row, query, kv head), its g query heads as chains that share one slot
// list. Each key and value row is widened once for the unit's chains instead of once per chain. On AVX-512 two
// keys' 8-lane score chains share a 16-lane register (key a in lanes 0-7, key b in 8-15: each half is exactly the
// 8-lane chain of `score_rows`), eight keys' horizontal sums run as one tree (each key's adds in `hsum8`'s pairs),
// and the value sums, per element, run 16 elements a register; on AVX2 (`grouped_scores8`, `grouped_values8`) 8
// lanes do the same. The same bits as `run_split` (tests/test_attention.py compares the three on one CPU:
// `set_attention_layout("split")` forces the per-(query, head) layout, `set_isa("avx2")` the 8-lane grouped one).
#define DFK_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

bool split_forced = false;  // attend_set_layout("split"): tests and A/B benchmarks (the same bits either way)

bool grouped_path(int64_t hd) { return !split_forced && (hd == 64 || hd == 128); }

// The grouped layout's instruction path: 16 lanes on AVX-512 CPUs, 8 elsewhere or under `set_isa("avx2")`.
bool wide_grouped() {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return cpu && !dflashkit_avx2_forced();
}

// 16 bf16 in memory -> 16 fp32 (exact).
DFK_AVX512 inline __m512 widen16(const uint16_t* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// The scores of eight keys for one chain, times sc, in key order. A[p] holds keys 2p (lanes 0-7) and 2p + 1 (lanes
// 8-15), each 8-lane half a finished `score_rows` accumulator. `hsum8` adds lane i + lane i + 4, then lanes 0 + 2 and
// 1 + 3, then those two: the tree below makes exactly these adds for all eight halves at once.
DFK_AVX512 inline __m256 hsum8_x8(const __m512* A, float sc) {
  const __m512 s0 = _mm512_add_ps(_mm512_shuffle_f32x4(A[0], A[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(A[0], A[1], _MM_SHUFFLE(3, 1, 3, 1)));  // 128-bit lane k: key k
  const __m512 s1 = _mm512_add_ps(_mm512_shuffle_f32x4(A[2], A[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(A[2], A[3], _MM_SHUFFLE(3, 1, 3, 1)));  // ... key 4 + k
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(s0, s1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(s0, s1, _MM_SHUFFLE(3, 2, 3, 2)));  // [k: s0+s2, s1+s3, k+4: ..]
  const __m512 r = _mm512_mul_ps(_mm512_add_ps(u, _mm512_movehdup_ps(u)), _mm512_set1_ps(sc));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, r));
}

// Scores of NC chains (q rows qr[c]) over slots [0, n) of sl: eight keys at a time, the rest by `score_rows`.
template <int HD, int NC>
DFK_AVX512 void grouped_scores(const uint16_t* kb, const int64_t* sl, int64_t n, const uint16_t* const* qr, float sc,
                               float* score, int64_t stride) {
  constexpr int NV = HD / 8;
  alignas(64) float qd[NC][NV][16];  // each chain's q, 8 elements at a time, twice: [q 8j.. | q 8j..]
  for (int c = 0; c < NC; ++c)
    for (int j = 0; j < NV; ++j) {
      const __m256 h = bf16x8(qr[c] + 8 * j);
      _mm256_store_ps(qd[c][j], h);
      _mm256_store_ps(qd[c][j] + 8, h);
    }
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m512 A[NC][4];
    for (int c = 0; c < NC; ++c)
      for (int p = 0; p < 4; ++p) A[c][p] = _mm512_setzero_ps();
    for (int e = 0; e < HD / 16; ++e)  // elements 16e .. 16e + 15: fma steps j = 2e, 2e + 1 (ascending, per lane)
      for (int p = 0; p < 4; ++p) {
        const __m512 ka = widen16(kb + sl[i + 2 * p] * HD + 16 * e);
        const __m512 kbv = widen16(kb + sl[i + 2 * p + 1] * HD + 16 * e);
        const __m512 lo = _mm512_shuffle_f32x4(ka, kbv, _MM_SHUFFLE(1, 0, 1, 0));  // [a 16e..+7 | b 16e..+7]
        const __m512 hi = _mm512_shuffle_f32x4(ka, kbv, _MM_SHUFFLE(3, 2, 3, 2));  // [a 16e+8.. | b 16e+8..]
        for (int c = 0; c < NC; ++c) {
          A[c][p] = _mm512_fmadd_ps(_mm512_load_ps(qd[c][2 * e]), lo, A[c][p]);
          A[c][p] = _mm512_fmadd_ps(_mm512_load_ps(qd[c][2 * e + 1]), hi, A[c][p]);
        }
      }
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(score + c * stride + i, hsum8_x8(A[c], sc));
  }
  for (int c = 0; c < NC; ++c)
    score_rows<HD>(qr[c], HD, [&](int64_t r) { return kb + sl[r] * HD; }, i, n, sc, score + c * stride);
}

// o rows out[c] = (sum over slots ascending of w[c][i] * v row sl[i]) / den[c], rounded to bf16: per element the
// `own_values` chain, 16 elements a register, each value row widened once for the NC chains.
template <int HD, int NC>
DFK_AVX512 void grouped_values(const uint16_t* vb, int64_t vd, const int64_t* sl, int64_t n, const float* w,
                               int64_t stride, const float* den, uint16_t* const* out) {
  constexpr int NE = HD / 16;
  __m512 acc[NC][NE];
  for (int c = 0; c < NC; ++c)
    for (int e = 0; e < NE; ++e) acc[c][e] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t* vr = vb + sl[i] * vd;  // vd may be odd (hd + 1): unaligned loads
    __m512 v[NE];
    for (int e = 0; e < NE; ++e) v[e] = widen16(vr + 16 * e);
    for (int c = 0; c < NC; ++c) {
      const __m512 ev = _mm512_set1_ps(w[c * stride + i]);
      for (int e = 0; e < NE; ++e) acc[c][e] = _mm512_fmadd_ps(ev, v[e], acc[c][e]);
    }
  }
  for (int c = 0; c < NC; ++c) {
    const __m512 dv = _mm512_set1_ps(den[c]);
    for (int e = 0; e < NE; ++e) {  // a division is exact IEEE: the same quotient as the scalar one
      const __m512 o = _mm512_div_ps(acc[c][e], dv);
      store8x16(out[c] + 16 * e, bf16_round8(_mm512_castps512_ps256(o)));
      store8x16(out[c] + 16 * e + 8, bf16_round8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(o), 1))));
    }
  }
}

// The grouped unit on 8 lanes (AVX2 CPUs, or `set_isa("avx2")`): up to 3 chains, each still the header's sums in
// their order. Each key row is widened once for the chains; four keys' score chains per chain run side by side (q
// read from its fp32 widening in L1) and their horizontal sums as one tree (`hsum8_x4`); the value sums run 32 or
// 64 elements at a time, each value row's elements widened once for the chains.

// The scores of four keys for one chain, times sc, in key order. A[p] is key p's finished `score_rows`
// accumulator; `hsum8` adds lane i + lane i + 4, then lanes 0 + 2 and 1 + 3, then those two: the tree below makes
// exactly these adds for the four keys at once (key p's result lands in lane 0, 4, 2, 6 for p = 0, 1, 2, 3).
inline __m128 hsum8_x4(const __m256* A, float sc) {
  const __m256 t01 = _mm256_add_ps(_mm256_permute2f128_ps(A[0], A[1], 0x20),
                                   _mm256_permute2f128_ps(A[0], A[1], 0x31));  // [key 0: lo + hi | key 1: lo + hi]
  const __m256 t23 = _mm256_add_ps(_mm256_permute2f128_ps(A[2], A[3], 0x20),
                                   _mm256_permute2f128_ps(A[2], A[3], 0x31));  // [key 2 | key 3]
  const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 2, 3, 2)));  // [0+2, 1+3] of each key
  const __m256 r = _mm256_add_ps(u, _mm256_movehdup_ps(u));
  const __m256 keys = _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 2, 6, 0, 0, 0, 0));
  return _mm_mul_ps(_mm256_castps256_ps128(keys), _mm_set1_ps(sc));
}

// Scores of NC chains (q rows qr[c]) over slots [0, n) of sl: KEYS keys at a time (8 for one chain, so that 8
// independent fma chains hide the fma's latency), the rest by `score_rows`.
template <int HD, int NC>
void grouped_scores8(const uint16_t* kb, const int64_t* sl, int64_t n, const uint16_t* const* qr, float sc,
                     float* score, int64_t stride) {
  constexpr int KEYS = NC == 1 ? 8 : 4;
  alignas(32) float qf[NC][HD];  // each chain's q widened (exact), read by the fmas from L1
  for (int c = 0; c < NC; ++c)
    for (int j = 0; j < HD; j += 8) _mm256_store_ps(qf[c] + j, bf16x8(qr[c] + j));
  int64_t i = 0;
  for (; i + KEYS <= n; i += KEYS) {
    const uint16_t* kr[KEYS];
    for (int p = 0; p < KEYS; ++p) kr[p] = kb + sl[i + p] * HD;
    __m256 A[NC][KEYS];
    for (int c = 0; c < NC; ++c)
      for (int p = 0; p < KEYS; ++p) A[c][p] = _mm256_setzero_ps();
    for (int j = 0; j < HD; j += 8)  // per chain and key: elements 8j.. ascending, as `score_rows`
#pragma GCC unroll 8
      for (int p = 0; p < KEYS; ++p) {
        const __m256 k = bf16x8(kr[p] + j);
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) A[c][p] = _mm256_fmadd_ps(_mm256_load_ps(qf[c] + j), k, A[c][p]);
      }
    for (int c = 0; c < NC; ++c)
      for (int p = 0; p < KEYS; p += 4) _mm_storeu_ps(score + c * stride + i + p, hsum8_x4(A[c] + p, sc));
  }
  for (int c = 0; c < NC; ++c)
    score_rows<HD>(qr[c], HD, [&](int64_t r) { return kb + sl[r] * HD; }, i, n, sc, score + c * stride);
}

// o rows out[c] = (sum over slots ascending of w[c][i] * v row sl[i]) / den[c], rounded to bf16: per element the
// `own_values` chain, 8 * E elements at a time (64 for one chain, 32 for more: 8+ independent fma chains to hide
// the fma's latency, all in registers), each value row's elements widened once for the NC chains.
template <int HD, int NC>
void grouped_values8(const uint16_t* vb, int64_t vd, const int64_t* sl, int64_t n, const float* w, int64_t stride,
                     const float* den, uint16_t* const* out) {
  constexpr int E = NC == 1 ? 8 : 4;
  for (int d = 0; d < HD; d += 8 * E) {
    __m256 acc[NC][E];
    for (int c = 0; c < NC; ++c)
      for (int e = 0; e < E; ++e) acc[c][e] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t* vr = vb + sl[i] * vd + d;  // vd may be odd (hd + 1): unaligned loads
      __m256 ev[NC];
      for (int c = 0; c < NC; ++c) ev[c] = _mm256_set1_ps(w[c * stride + i]);
#pragma GCC unroll 8
      for (int e = 0; e < E; ++e) {
        const __m256 v = bf16x8(vr + 8 * e);
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) acc[c][e] = _mm256_fmadd_ps(ev[c], v, acc[c][e]);
      }
    }
    for (int c = 0; c < NC; ++c) {  // a division is exact IEEE: the same quotient as the scalar one
      const __m256 dv = _mm256_set1_ps(den[c]);
      for (int e = 0; e < E; ++e) store8x16(out[c] + d + 8 * e, bf16_round8(_mm256_div_ps(acc[c][e], dv)));
    }
  }
}

// One unit's NC chains (query heads h0 .. h0 + NC of kv head kv) over the query's slot list sl [n], on 16 lanes
// (WIDE: AVX-512) or 8; w: [NC, n].
template <int HD, bool WIDE, int NC>
void grouped_chains(const Call& x, int64_t r, int64_t kv, int64_t h0, const std::vector<int64_t>& sl, float* w) {
  const int64_t n = static_cast<int64_t>(sl.size()), b = r / x.Q;
  const uint16_t* qr[NC];
  uint16_t* out[NC];
  float den[NC];
  for (int c = 0; c < NC; ++c) {
    const int64_t h = kv * x.g + h0 + c;
    qr[c] = x.q + (r * x.nh + h) * HD;
    out[c] = x.o + (r * x.nh + h) * HD;
  }
  const uint16_t* kb = x.k + (b * x.kvh + kv) * x.T * HD;
  const uint16_t* vb = x.v + (b * x.kvh + kv) * x.T * x.vd;
  if constexpr (WIDE)
    grouped_scores<HD, NC>(kb, sl.data(), n, qr, x.sc, w, n);
  else
    grouped_scores8<HD, NC>(kb, sl.data(), n, qr, x.sc, w, n);
  for (int c = 0; c < NC; ++c) den[c] = softmax_weights(w + c * n, n);
  if constexpr (WIDE)
    grouped_values<HD, NC>(vb, x.vd, sl.data(), n, w, n, den, out);
  else
    grouped_values8<HD, NC>(vb, x.vd, sl.data(), n, w, n, den, out);
}

// Chains h0 .. h1 of one unit, at most `most` a call: on 16 lanes the value sums stay in registers (HD / 16 each),
// on 8 lanes the score chains (4 keys each).
template <int HD, bool WIDE>
void grouped_unit_on(const Call& x, int64_t r, int64_t kv, int64_t h0, int64_t h1, const std::vector<int64_t>& sl,
                     std::vector<float>& w) {
  constexpr int most = !WIDE ? 3 : HD == 64 ? 4 : 2;
  w.resize(most * std::max<size_t>(sl.size(), 1));
  for (; h0 < h1; h0 += most) {
    switch (std::min<int64_t>(most, h1 - h0)) {
      case 1: grouped_chains<HD, WIDE, 1>(x, r, kv, h0, sl, w.data()); break;
      case 2: grouped_chains<HD, WIDE, 2>(x, r, kv, h0, sl, w.data()); break;
      case 3: if constexpr (most >= 3) grouped_chains<HD, WIDE, 3>(x, r, kv, h0, sl, w.data()); break;
      default: if constexpr (most >= 4) grouped_chains<HD, WIDE, 4>(x, r, kv, h0, sl, w.data()); break;
    }
  }
}

template <int HD>
void grouped_unit(const Call& x, int64_t r, int64_t kv, int64_t h0, int64_t h1, const std::vector<int64_t>& sl,
                  std::vector<float>& w) {
  if (wide_grouped())
    grouped_unit_on<HD, true>(x, r, kv, h0, h1, sl, w);
  else
    grouped_unit_on<HD, false>(x, r, kv, h0, h1, sl, w);
}

// Short lists, grouped: a work item per (batch row, query, kv head), or per part of its heads where there are
// fewer units than twice the threads (a one-token step: 3 units on 2 threads would leave one thread half idle).
// Each thread lists the slots of the query it serves (kept while consecutive items share it).
// Work items [a, e) of the grouped layout's units * parts (each thread its share, whoever splits them).
void grouped_share(const Call& x, int64_t parts, const bool* hp, int64_t S, const int64_t* tp, int64_t L, int64_t a,
                   int64_t e) {
  const int64_t size = (x.g + parts - 1) / parts;  // heads per item
  std::vector<int64_t> sl;
  std::vector<float> w;
  int64_t listed = -1;
  for (int64_t it = a; it < e; ++it) {
    const int64_t r = it / (x.kvh * parts), kv = it / parts % x.kvh, h0 = it % parts * size;  // r = b * Q + query
    if (h0 >= x.g) continue;
    if (r != listed) visible_slots(hp + r * S, S, tp + r * L, L, sl), listed = r;
    const int64_t h1 = std::min(x.g, h0 + size);
    x.hd == 64 ? grouped_unit<64>(x, r, kv, h0, h1, sl, w) : grouped_unit<128>(x, r, kv, h0, h1, sl, w);
  }
}

// The parts each (batch row, query, kv head) unit is cut into: more than one where there are fewer units than twice
// the threads (a one-token step: 3 units on 2 threads would leave one thread half idle).
int64_t grouped_parts(int64_t units, int64_t g, int64_t threads) {
  return std::min(g, (2 * threads + units - 1) / units);
}

void run_grouped(const Call& x, int64_t B, const bool* hp, int64_t S, const int64_t* tp, int64_t L) {
  const int64_t units = B * x.Q * x.kvh, parts = grouped_parts(units, x.g, at::get_num_threads());
  at::parallel_for(0, units * parts, 1, [&](int64_t a, int64_t e) { grouped_share(x, parts, hp, S, tp, L, a, e); });
}

// The layouts `attend` chooses between (each gives the same bits): short lists grouped (or split per (query, head)
// where `set_attention_layout("split")` says so); long lists shared by a kv head's queries, phased over the threads
// where there are few units (one batch row) or one unit per work item. The one place that chooses (`attend`,
// `attend_grouped_takes`).
enum class Layout { grouped, split, phased, units };

Layout layout_of(int64_t B, int64_t Q, int64_t kvh, int64_t hd, int64_t S, int64_t L) {
  const bool few = B * ((Q + kQueryBlock - 1) / kQueryBlock) * kvh < 2 * at::get_num_threads();
  const bool share = S + L >= kShareSlots || (Q >= kQueryBlock && S + L >= kShareSlotsBlock);
  if (!share || (few && S + L < kPhasedSlots)) return grouped_path(hd) ? Layout::grouped : Layout::split;
  return few ? Layout::phased : Layout::units;
}

}  // namespace

// q [B, Q, nh, hd] bf16; keys [B, kvh, T, hd] bf16; values [B, kvh, T, vd >= hd] bf16 (the first hd columns are
// used); head [B, Q, S] bool (S <= T: key slot s is in this query's head part); tail [B, Q, L] int64 (the slot of
// the query's j-th tail key in position order, -1 where there is none). Returns o [B, Q, nh * hd] bf16.
torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor head, torch::Tensor tail,
                     double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && keys.scalar_type() == torch::kBFloat16 &&
                  values.scalar_type() == torch::kBFloat16, "attend: q, keys and values must be bfloat16");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && head.dim() == 3 && tail.dim() == 3,
              "attend: q [B, Q, nh, hd], keys/values [B, kvh, T, d], head [B, Q, S], tail [B, Q, L]");
  const int64_t B = q.size(0), Q = q.size(1), nh = q.size(2), hd = q.size(3);
  const int64_t kvh = keys.size(1), T = keys.size(2), vd = values.size(3), S = head.size(2), L = tail.size(2);
  TORCH_CHECK(hd % 8 == 0 && keys.size(3) == hd && vd >= hd && nh % kvh == 0 && S <= T,
              "attend: shapes do not fit (head dim a multiple of 8, heads a multiple of kv heads, S <= T)");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "attend: the cache layers must be contiguous");
  TORCH_CHECK(head.scalar_type() == torch::kBool && tail.scalar_type() == torch::kLong,
              "attend: head must be bool, tail int64");
  q = q.contiguous();
  head = head.contiguous();
  tail = tail.contiguous();
  torch::Tensor o = torch::empty({B, Q, nh * hd}, q.options());
  const bool* hp = head.data_ptr<bool>();
  const int64_t* tp = tail.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> slots(B * Q);
  Call x{reinterpret_cast<const uint16_t*>(q.data_ptr()), reinterpret_cast<const uint16_t*>(keys.data_ptr()),
         reinterpret_cast<const uint16_t*>(values.data_ptr()), reinterpret_cast<uint16_t*>(o.data_ptr()),
         Q, nh, hd, kvh, T, vd, nh / kvh, static_cast<float>(scale), &slots};
  const Layout layout = layout_of(B, Q, kvh, hd, S, L);
  if (layout == Layout::grouped) {
    run_grouped(x, B, hp, S, tp, L);
    return o;
  }
  if (layout == Layout::split) {
    run_split(x, B, hp, S, tp, L);
    return o;
  }
  at::parallel_for(0, B * Q, 16, [&](int64_t a, int64_t e) {  // a one-row step lists its few queries inline
    for (int64_t r = a; r < e; ++r) visible_slots(hp + r * S, S, tp + r * L, L, slots[r]);
  });
  std::vector<Unit> shared = make_units(x, B);
  if (layout == Layout::phased)
    run_phased(x, shared);
  else
    run_units(x, shared);
  return o;
}

bool attend_grouped_takes(int64_t B, int64_t Q, int64_t kvh, int64_t hd, int64_t S, int64_t L) {
  return layout_of(B, Q, kvh, hd, S, L) == Layout::grouped;
}

void attend_grouped(const AttendArgs& a, int tid, int nt) {
  const Call x{a.q, a.k, a.v, a.o, a.Q, a.nh, a.hd, a.kvh, a.T, a.vd, a.nh / a.kvh, a.scale, nullptr};
  const int64_t units = a.B * a.Q * a.kvh, parts = grouped_parts(units, x.g, nt);
  const auto [i0, i1] = thread_share(units * parts, tid, nt);
  grouped_share(x, parts, a.head, a.S, a.tail, a.L, i0, i1);
}

// "split" keeps short lists on the per-(query, head) layout, "auto" groups them (head dims 64 and 128); returns
// the layout that was set before. Process-wide; both give the same bits.
std::string attend_set_layout(const std::string& layout) {
  TORCH_CHECK(layout == "auto" || layout == "split", "attend_set_layout: 'auto' or 'split', not '", layout, "'");
  const std::string was = split_forced ? "split" : "auto";
  split_forced = layout == "split";
  return was;
}
