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
    std::vector<float> score, qf(hd), num(hd);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / (Q * nh), qi = (w / nh) % Q, h = w % nh, kv = h / g;
      for (int64_t d = 0; d < hd; d += 8) _mm256_storeu_ps(qf.data() + d, bf16x8(qp + (w * hd) + d));
      slots.clear();
      const bool* hv = hp + (b * Q + qi) * S;
      for (int64_t s = 0; s < S; ++s)
        if (hv[s]) slots.push_back(s);
      const int64_t* tv = tp + (b * Q + qi) * L;
      for (int64_t j = 0; j < L; ++j)
        if (tv[j] >= 0) slots.push_back(tv[j]);
      const uint16_t* kb = kp + (b * kvh + kv) * T * hd;
      const uint16_t* vb = vp + (b * kvh + kv) * T * vd;
      score.resize(slots.size());
      float m = -std::numeric_limits<float>::infinity();
      for (size_t i = 0; i < slots.size(); ++i) {
        const uint16_t* k = kb + slots[i] * hd;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < hd; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qf.data() + d), bf16x8(k + d), acc);
        score[i] = hsum8(acc) * sc;
        m = std::max(m, score[i]);
      }
      std::fill(num.begin(), num.end(), 0.0f);
      float den = 0.0f;
      for (size_t i = 0; i < slots.size(); ++i) {
        const float e = std::exp(score[i] - m);
        den += e;
        const __m256 ev = _mm256_set1_ps(e);
        const uint16_t* v = vb + slots[i] * vd;
        for (int64_t d = 0; d < hd; d += 8)  // vd may be odd (hd + 1): unaligned 16-byte loads of bf16
          _mm256_storeu_ps(num.data() + d, _mm256_fmadd_ps(ev, bf16x8(v + d), _mm256_loadu_ps(num.data() + d)));
      }
      uint16_t* out = op + w * hd;
      for (int64_t d = 0; d < hd; ++d) out[d] = bf16_round(num[d] / den);
    }
  });
  return o;
}
