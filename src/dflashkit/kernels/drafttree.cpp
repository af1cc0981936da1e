// A drafting pass's tree from its logits in two calls instead of ~40 small torch ops: each slot's k best draft
// tokens with their log-probabilities (`draft_topk`), and the beam over the slots that keeps the n likeliest paths
// (`beam_tree`: the rule of tree.py `topk_tree`, which keeps the torch version for other devices and DFlash2).
//
// Why: right after a target step (it streams ~100 MB of weights through the caches) every small torch op costs
// 5-10 us; the ops between a block-4 drafting pass's logits and its tree took ~340 us of its ~2.1 ms (AMD EPYC,
// one row).
//
// Ties: among equal values the lower index comes first (the order of a stable descending sort), in the per-slot
// top-k and in the beam. Which of two tied candidates is drafted changes what is verified, never the output.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ops.h"
#include "simd.h"

using dflashkit::bf16x8;
using dflashkit::exp8;
using dflashkit::hsum8;
using dflashkit::widen;

namespace {

// At most k (value, index) pairs, best first. Pairs are pushed in ascending index order; a new pair goes after the
// equal values already held (lower indices), so the list is in (value descending, index ascending) order. A NaN
// ranks as -infinity (below every number): the list still fills to k, so a drafter's NaN drafts garbage, never
// reads past the list.
template <typename T>
struct Best {
  int64_t k;
  std::vector<T> val;
  std::vector<int64_t> idx;
  explicit Best(int64_t k_) : k(k_) { val.reserve(k + 1), idx.reserve(k + 1); }
  bool full() const { return static_cast<int64_t>(val.size()) == k; }
  void push(T v, int64_t i) {
    if (v != v) v = -std::numeric_limits<T>::infinity();
    if (full() && !(v > val.back())) return;
    const auto at = std::upper_bound(val.begin(), val.end(), v, [](T a, T b) { return a > b; }) - val.begin();
    val.insert(val.begin() + at, v), idx.insert(idx.begin() + at, i);
    if (static_cast<int64_t>(val.size()) > k) val.pop_back(), idx.pop_back();
  }
};

// One row of V bf16 logits -> its k best ids and their log-probabilities (x - max) - log(sum exp(x - max)), fp32.
void row_topk(const uint16_t* x, int64_t V, int64_t k, float* lp, int64_t* ix) {
  const int64_t V8 = V / 8 * 8;
  float m = -std::numeric_limits<float>::infinity();
  __m256 mv = _mm256_set1_ps(m);
  for (int64_t i = 0; i < V8; i += 8) mv = _mm256_max_ps(mv, bf16x8(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  for (int j = 0; j < 8; ++j) m = std::max(m, lanes[j]);
  for (int64_t i = V8; i < V; ++i) m = std::max(m, widen(x[i]));
  const __m256 mb = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  Best<float> best(k);
  for (int64_t i = 0; i < V8; i += 8) {
    const __m256 v = bf16x8(x + i);
    acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(v, mb)));
    // Why test the whole vector first: once k are held, few of V values beat the k-th; skip those 8 at once.
    int hit = 0xff;
    if (best.full()) hit = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(best.val.back()), _CMP_GE_OQ));
    while (hit) {
      const int j = __builtin_ctz(hit);
      hit &= hit - 1;
      best.push(widen(x[i + j]), i + j);
    }
  }
  float s = hsum8(acc);
  for (int64_t i = V8; i < V; ++i) {
    const float v = widen(x[i]);
    alignas(32) float e[8];
    _mm256_store_ps(e, exp8(_mm256_set1_ps(v - m)));
    s += e[0];
    best.push(v, i);
  }
  const float ls = std::log(s);
  for (int64_t j = 0; j < k; ++j) lp[j] = (best.val[j] - m) - ls, ix[j] = best.idx[j];  // k <= V: the list is full
}

// One row's beam (tree.py `topk_tree`): per depth j the K best paths of (depth j-1's K paths) x (slot j's K
// tokens), scores summed in double; then the n best of all D*K kept paths, ties to the shallower node (a key of
// score - 1e-9 * depth, computed as torch computes it: the product in fp32). Out: every kept path's flat index
// (depth-major) in key order, and the per-path score, token and flat parent (-1: the anchor).
struct Beam {
  std::vector<double> score;
  std::vector<int64_t> tok, par, top;
};

Beam row_beam(const int64_t* tk, const float* lp, int64_t D, int64_t K, int64_t n) {
  Beam b;
  b.score.resize(D * K), b.tok.resize(D * K), b.par.resize(D * K);
  for (int64_t c = 0; c < K; ++c) b.score[c] = lp[c], b.tok[c] = tk[c], b.par[c] = -1;
  for (int64_t j = 1; j < D; ++j) {
    Best<double> best(K);
    for (int64_t a = 0; a < K; ++a)
      for (int64_t c = 0; c < K; ++c) best.push(b.score[(j - 1) * K + a] + static_cast<double>(lp[j * K + c]), a * K + c);
    for (int64_t i = 0; i < K; ++i) {
      const int64_t f = best.idx[i];
      b.score[j * K + i] = best.val[i];
      b.tok[j * K + i] = tk[j * K + f % K];
      b.par[j * K + i] = (j - 1) * K + f / K;
    }
  }
  Best<double> best(std::min(n, D * K));
  for (int64_t f = 0; f < D * K; ++f)
    best.push(b.score[f] - static_cast<double>(static_cast<float>(f / K + 1) * 1e-9f), f);
  b.top = best.idx;
  return b;
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> draft_topk(torch::Tensor logits, int64_t k) {
  TORCH_CHECK(logits.scalar_type() == torch::kBFloat16 && logits.dim() >= 1 && k >= 1 && k <= logits.size(-1),
              "draft_topk: logits must be bf16 [..., V] and 1 <= k <= V");
  const torch::Tensor x = logits.contiguous();
  const int64_t V = x.size(-1), rows = x.numel() / V;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = k;
  torch::Tensor lp = torch::empty(shape, x.options().dtype(torch::kFloat32));
  torch::Tensor ix = torch::empty(shape, x.options().dtype(torch::kLong));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  float* lpp = lp.data_ptr<float>();
  int64_t* ixp = ix.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t a, int64_t z) {
    for (int64_t r = a; r < z; ++r) row_topk(xp + r * V, V, k, lpp + r * k, ixp + r * k);
  });
  return {lp, ix};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> beam_tree(
    torch::Tensor tokens, torch::Tensor logp, int64_t n, double log_min_prob) {
  TORCH_CHECK(tokens.dim() == 3 && tokens.scalar_type() == torch::kLong && logp.scalar_type() == torch::kFloat32 &&
                  logp.sizes() == tokens.sizes() && n >= 1,
              "beam_tree: tokens int64 and logp float32, both [b, D, K], and n >= 1");
  const torch::Tensor tk = tokens.contiguous(), lp = logp.contiguous();
  const int64_t b = tk.size(0), D = tk.size(1), K = tk.size(2), DK = D * K;
  std::vector<Beam> beams(b);
  at::parallel_for(0, b, 2, [&](int64_t a, int64_t z) {
    for (int64_t r = a; r < z; ++r)
      beams[r] = row_beam(tk.data_ptr<int64_t>() + r * DK, lp.data_ptr<float>() + r * DK, D, K, n);
  });
  // keys: a row's chosen flat indices in the order they become nodes. Without a floor, its n best sorted (parents
  // first). With one (log_min_prob > -inf), the kept ones first (sorted), then the dropped ones (sorted) as dead
  // padding, cut to the widest row's kept count: flat + DK marks a dropped one.
  const bool floor = log_min_prob > -std::numeric_limits<double>::infinity();
  std::vector<std::vector<int64_t>> keys(b);
  int64_t width = 0;
  for (int64_t r = 0; r < b; ++r) {
    int64_t kept = 0;
    for (const int64_t f : beams[r].top) {
      const bool keep = !floor || beams[r].score[f] >= log_min_prob;
      keys[r].push_back(keep ? f : f + DK);
      kept += keep;
    }
    std::sort(keys[r].begin(), keys[r].end());
    width = std::max(width, floor ? kept : static_cast<int64_t>(keys[r].size()));
  }
  const auto opt = tk.options();
  torch::Tensor out_tok = torch::empty({b, width}, opt), parent = torch::empty({b, width}, opt);
  torch::Tensor depth = torch::empty({b, width}, opt), alive = torch::empty({b, width}, opt.dtype(torch::kBool));
  torch::Tensor score = torch::empty({b, width}, opt.dtype(torch::kFloat32));
  int64_t *tp = out_tok.data_ptr<int64_t>(), *pp = parent.data_ptr<int64_t>(), *dp = depth.data_ptr<int64_t>();
  bool* ap = alive.data_ptr<bool>();
  float* sp = score.data_ptr<float>();
  for (int64_t r = 0; r < b; ++r) {
    const Beam& bm = beams[r];
    std::vector<int64_t> node(DK + 1, 0);  // flat index + 1 -> node index (0: the anchor)
    for (int64_t i = 0; i < width; ++i) node[keys[r][i] % DK + 1] = i + 1;
    for (int64_t i = 0; i < width; ++i) {
      const int64_t f = keys[r][i] % DK, o = r * width + i;
      tp[o] = bm.tok[f], pp[o] = node[bm.par[f] + 1], dp[o] = f / K + 1;
      ap[o] = keys[r][i] < DK, sp[o] = static_cast<float>(bm.score[f]);
    }
  }
  return {out_tok, parent, depth, alive, score};
}
