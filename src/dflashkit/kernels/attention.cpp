// The lean target's attention in one call per layer, row-invariant: o[b, q, h] depends on that query's row, the
// keys it may see and nothing else, computed in one fixed order whatever else shares the call.
//
// Each query sees two parts of its layer's cache (backends/lean.py, `_Split`): the HEAD, committed keys in slot
// order (slot == position there in every kind of step), and the TAIL, up to L keys gathered in POSITION order (a
// draft tree keeps ancestors at other slots than one-token decoding does; gathered, both see the same keys in the
// same order). Per (batch row, query, head), all in fp32:
//   score_s = dot(q, k_s) * scale  (8-lane accumulator over the head dim, fixed horizontal sum)
//   m = max over the visible scores
//   den = sum exp(score_s - m), num = sum exp(score_s - m) * v_s  (head keys ascending, then tail ascending)
//   o = num / den, rounded to bf16
// Hidden keys are skipped, not added as zeros: a verify block (more slots, more hidden) and a one-token step
// visit exactly the same keys in the same order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

using dflashkit::bf16_round;
using dflashkit::bf16x8;
using dflashkit::hsum8;

// The slots one query sees, in the order they are summed: its head part's set slots ascending, then its tail's
// (slot -1: none). The head mask is scanned 32 bytes at a time (a bool is one byte, 0 or 1).
static void visible_slots(const bool* hv, int64_t S, const int64_t* tv, int64_t L, std::vector<int64_t>& slots) {
  slots.clear();
  int64_t s = 0;
  for (; s + 32 <= S; s += 32) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hv + s));
    uint32_t bits = ~static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(b, _mm256_setzero_si256())));
    if (bits == 0xffffffffu) {  // the common case: 32 committed keys in a row
      for (int64_t j = 0; j < 32; ++j) slots.push_back(s + j);
      continue;
    }
    for (; bits; bits &= bits - 1) slots.push_back(s + __builtin_ctz(bits));
  }
  for (; s < S; ++s)
    if (hv[s]) slots.push_back(s);
  for (int64_t j = 0; j < L; ++j)
    if (tv[j] >= 0) slots.push_back(tv[j]);
}

// One (query, head): o[HD] = softmax(q . k_s * sc) . v_s over `slots`, in the order the header states. HD: the head
// dim where the caller knows it (the compiler keeps q and the running sums in registers), or 0 (any multiple of 8).
// Why per lane and not wider vectors: a score is an 8-lane accumulator with a fixed horizontal sum (its bits); the
// value sums are per element, so each lane's fma sequence is the same whatever the vector width.
template <int HD>
static void attend_one(const uint16_t* qrow, const uint16_t* kb, const uint16_t* vb, int64_t vd, int64_t hd_rt,
                       const std::vector<int64_t>& slots, float sc, std::vector<float>& score, float* num,
                       uint16_t* out) {
  const int64_t hd = HD > 0 ? HD : hd_rt, nv = hd / 8;
  constexpr int NV = HD > 0 ? HD / 8 : 1;
  __m256 qv[HD > 0 ? NV : 1];
  if constexpr (HD > 0)
    for (int j = 0; j < NV; ++j) qv[j] = bf16x8(qrow + 8 * j);
  score.resize(slots.size());
  float m = -std::numeric_limits<float>::infinity();
  size_t i = 0;
  if constexpr (HD > 0) {  // four keys at a time: four independent fma chains instead of one (same chains, bits)
    for (; i + 4 <= slots.size(); i += 4) {
      const uint16_t* k0 = kb + slots[i] * HD;
      const uint16_t* k1 = kb + slots[i + 1] * HD;
      const uint16_t* k2 = kb + slots[i + 2] * HD;
      const uint16_t* k3 = kb + slots[i + 3] * HD;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int j = 0; j < NV; ++j) {
        a0 = _mm256_fmadd_ps(qv[j], bf16x8(k0 + 8 * j), a0);
        a1 = _mm256_fmadd_ps(qv[j], bf16x8(k1 + 8 * j), a1);
        a2 = _mm256_fmadd_ps(qv[j], bf16x8(k2 + 8 * j), a2);
        a3 = _mm256_fmadd_ps(qv[j], bf16x8(k3 + 8 * j), a3);
      }
      score[i] = hsum8(a0) * sc, score[i + 1] = hsum8(a1) * sc;
      score[i + 2] = hsum8(a2) * sc, score[i + 3] = hsum8(a3) * sc;
      m = std::max(std::max(m, std::max(score[i], score[i + 1])), std::max(score[i + 2], score[i + 3]));
    }
  }
  for (; i < slots.size(); ++i) {
    const uint16_t* k = kb + slots[i] * hd;
    __m256 acc = _mm256_setzero_ps();
    if constexpr (HD > 0) {
      for (int j = 0; j < NV; ++j) acc = _mm256_fmadd_ps(qv[j], bf16x8(k + 8 * j), acc);
    } else {
      for (int64_t j = 0; j < nv; ++j) acc = _mm256_fmadd_ps(bf16x8(qrow + 8 * j), bf16x8(k + 8 * j), acc);
    }
    score[i] = hsum8(acc) * sc;
    m = std::max(m, score[i]);
  }
  float den = 0.0f;
  for (size_t i = 0; i < slots.size(); ++i) {  // the weights first: exp calls back to back, den in slot order
    score[i] = std::exp(score[i] - m);
    den += score[i];
  }
  if constexpr (HD > 0) {
    __m256 acc[NV];
    for (int j = 0; j < NV; ++j) acc[j] = _mm256_setzero_ps();
    for (size_t i = 0; i < slots.size(); ++i) {
      const __m256 ev = _mm256_set1_ps(score[i]);
      const uint16_t* v = vb + slots[i] * vd;  // vd may be odd (hd + 1): unaligned 16-byte loads of bf16
      for (int j = 0; j < NV; ++j) acc[j] = _mm256_fmadd_ps(ev, bf16x8(v + 8 * j), acc[j]);
    }
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(num + 8 * j, acc[j]);
  } else {
    std::fill(num, num + hd, 0.0f);
    for (size_t i = 0; i < slots.size(); ++i) {
      const __m256 ev = _mm256_set1_ps(score[i]);
      const uint16_t* v = vb + slots[i] * vd;
      for (int64_t d = 0; d < hd; d += 8)
        _mm256_storeu_ps(num + d, _mm256_fmadd_ps(ev, bf16x8(v + d), _mm256_loadu_ps(num + d)));
    }
  }
  for (int64_t d = 0; d < hd; ++d) out[d] = bf16_round(num[d] / den);
}

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
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(keys.data_ptr());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(values.data_ptr());
  const bool* hp = head.data_ptr<bool>();
  const int64_t* tp = tail.data_ptr<int64_t>();
  uint16_t* op = reinterpret_cast<uint16_t*>(o.data_ptr());
  const int64_t g = nh / kvh;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * Q * nh, 1, [&](int64_t w0, int64_t w1) {
    std::vector<int64_t> slots;  // the visible keys of one query, in the order they are summed
    std::vector<float> score, num(hd);
    int64_t slots_of = -1;  // the (batch row, query) `slots` belongs to: its heads share it
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / (Q * nh), qi = (w / nh) % Q, h = w % nh, kv = h / g;
      if (slots_of != b * Q + qi) {
        visible_slots(hp + (b * Q + qi) * S, S, tp + (b * Q + qi) * L, L, slots);
        slots_of = b * Q + qi;
      }
      const uint16_t* kb = kp + (b * kvh + kv) * T * hd;
      const uint16_t* vb = vp + (b * kvh + kv) * T * vd;
      if (hd == 64)
        attend_one<64>(qp + w * hd, kb, vb, vd, hd, slots, sc, score, num.data(), op + w * hd);
      else if (hd == 128)
        attend_one<128>(qp + w * hd, kb, vb, vd, hd, slots, sc, score, num.data(), op + w * hd);
      else
        attend_one<0>(qp + w * hd, kb, vb, vd, hd, slots, sc, score, num.data(), op + w * hd);
    }
  });
  return o;
}
