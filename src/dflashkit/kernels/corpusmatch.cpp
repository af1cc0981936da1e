// corpus.py `Corpus.match` in one call: the longest suffix of a sequence found in the corpus' index (one binary
// search per token back from the anchor, each inside the previous range), then the continuation most of its
// occurrences share, token by token. The same rules, the same answer (a test compares the two on many queries);
// the Python version stays where the kernels do not run.
//
// Why: a query is ~60 key reads through Python's bisect plus a few numpy calls per proposed token: ~100 us warm and
// ~210 us right after a target step, every step that looks up the corpus (AMD EPYC, one row).
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

using Match = std::tuple<std::vector<int64_t>, int64_t, int64_t, int64_t>;  // tokens, n, support, occurrences

template <typename T>
Match match(const T* padded, const int64_t* order, const int64_t* starts, int64_t n_starts, const int64_t* ids,
            int64_t S, int64_t max_tokens, int64_t min_n, int64_t max_n, int64_t sampled) {
  const Match none{{}, 0, 0, 0};
  const int64_t a = ids[S - 1] + 1;  // stored ids are token + 1 (0: a border)
  if (!(0 < a && a < n_starts - 1)) return none;
  int64_t lo = starts[a], hi = starts[a + 1], n = hi > lo ? 1 : 0;
  while (lo < hi && n < std::min(max_n, S)) {
    const int64_t t = ids[S - 1 - n] + 1;
    auto key = [&](int64_t p) { return static_cast<int64_t>(padded[p - n]); };
    const int64_t* f = std::lower_bound(order + lo, order + hi, t, [&](int64_t p, int64_t v) { return key(p) < v; });
    const int64_t* z = std::upper_bound(order + lo, order + hi, t, [&](int64_t v, int64_t p) { return v < key(p); });
    if (f >= z) break;
    lo = f - order, hi = z - order, ++n;
  }
  if (n < min_n || n == 0) return none;
  // The occurrences read: all, or `sampled` evenly spaced as numpy's linspace(lo, hi - 1, sampled) truncated.
  std::vector<int64_t> pick;
  if (hi - lo <= sampled) {
    pick.assign(order + lo, order + hi);
  } else {
    const double step = static_cast<double>(hi - 1 - lo) / static_cast<double>(sampled - 1);
    for (int64_t i = 0; i < sampled; ++i) {
      // volatile: the product rounded on its own, then the sum (as numpy computes it; a fused multiply-add would
      // round once and could land on the other side of an integer)
      volatile double y = static_cast<double>(i) * step;
      const double at = i == sampled - 1 ? static_cast<double>(hi - 1) : y + static_cast<double>(lo);
      pick.push_back(order[static_cast<int64_t>(at)]);
    }
  }
  const int64_t m = pick.size();
  auto next = [&](int64_t row, int64_t j) { return static_cast<int64_t>(padded[pick[row] + 1 + j]); };
  std::vector<int64_t> rows(m), out;
  for (int64_t r = 0; r < m; ++r) rows[r] = r;
  int64_t support = 0, j = 0;
  while (j < max_tokens) {
    // The columns from j on which every remaining occurrence continues alike: taken without a vote.
    int64_t run = 0;
    while (j + run < max_tokens &&
           std::all_of(rows.begin(), rows.end(), [&](int64_t r) { return next(r, j + run) == next(rows[0], j + run); }))
      ++run;
    if (run) {
      int64_t c = 0;
      while (c < run && next(rows[0], j + c) != 0) ++c;  // a border ends it
      if (j == 0 && c) support = rows.size();
      for (int64_t i = 0; i < c; ++i) out.push_back(next(rows[0], j + i) - 1);
      if (c < run) break;
      j += run;
      continue;
    }
    // A vote: the most frequent next token (ties: the smallest, as numpy's unique + argmax).
    std::vector<int64_t> col;
    for (const int64_t r : rows) col.push_back(next(r, j));
    std::sort(col.begin(), col.end());
    int64_t best = col[0], count = 0;
    for (size_t i = 0; i < col.size();) {
      size_t e = i;
      while (e < col.size() && col[e] == col[i]) ++e;
      if (static_cast<int64_t>(e - i) > count) best = col[i], count = e - i;
      i = e;
    }
    if (best == 0) break;  // most occurrences end here (a border)
    if (j == 0) support = count;
    out.push_back(best - 1);
    std::vector<int64_t> kept;
    for (const int64_t r : rows)
      if (next(r, j) == best) kept.push_back(r);
    rows.swap(kept);
    ++j;
  }
  if (out.empty()) return none;  // a match with nothing to copy: none
  return Match{out, n, support, m};
}

}  // namespace

std::tuple<std::vector<int64_t>, int64_t, int64_t, int64_t> corpus_match(torch::Tensor padded, torch::Tensor order,
                                                                          torch::Tensor starts, torch::Tensor ids,
                                                                          int64_t max_tokens, int64_t min_n,
                                                                          int64_t max_n, int64_t sampled) {
  TORCH_CHECK((padded.scalar_type() == torch::kShort || padded.scalar_type() == torch::kInt) && padded.dim() == 1 &&
                  padded.is_contiguous() && order.scalar_type() == torch::kLong && order.is_contiguous() &&
                  starts.scalar_type() == torch::kLong && starts.is_contiguous() && ids.scalar_type() == torch::kLong &&
                  ids.dim() == 1 && ids.is_contiguous() && sampled >= 2,
              "corpus_match: padded tokens (16 or 32 bits, read unsigned), order, starts and ids int64, contiguous");
  const int64_t S = ids.numel();
  if (S == 0 || max_tokens <= 0) return {{}, 0, 0, 0};
  const int64_t* o = order.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  if (padded.scalar_type() == torch::kShort)
    return match(reinterpret_cast<const uint16_t*>(padded.data_ptr()), o, st, starts.numel(), id, S, max_tokens,
                 min_n, max_n, sampled);
  return match(reinterpret_cast<const uint32_t*>(padded.data_ptr()), o, st, starts.numel(), id, S, max_tokens, min_n,
               max_n, sampled);
}
