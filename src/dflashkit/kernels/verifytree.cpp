// The verify step's tree work in one call each, where tree.py spends ~10-40 small torch ops: the tree from the
// drafter's nodes and the lookup branch (`tree_build`), each node's position, slot and visible slots (`tree_inputs`),
// and the accepted path with the per-source counts (`tree_accept`). The same rules as tree.py's `build`,
// `verify_inputs`, `accept` and `source_counts`, which stay for other devices and for the tests that compare the two.
//
// Why: right after a target step (it streams ~100 MB of weights through the caches) a small torch op costs 5-10 us;
// these four took ~380 us of a ~6.5 ms step of the default system at batch 1 (AMD EPYC).
//
// Where tree.py iterates a fixed number of rounds (a node on the branch's / accepted path iff it and its ancestors
// match, rounds = the deepest depth), so do these: the same result for any parent order.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

constexpr int8_t kAnchor = 0, kDrafter = 1, kLookup = 2;  // tree.py SOURCE_*

// on[i] = ok[i] && on[parent[i]], `rounds` times from on = ok (node 0 always on): tree.py's loops over max_depth.
void on_path(const std::vector<char>& ok, const int64_t* parent, int64_t W, int64_t rounds, std::vector<char>& on) {
  on = ok;
  std::vector<char> prev(W);
  for (int64_t r = 0; r < rounds; ++r) {
    prev = on;
    for (int64_t i = 0; i < W; ++i) on[i] = ok[i] && prev[parent[i]];
  }
}

// The deepest node that is on (the first one at that depth): (depth, node). Node 0 is always on.
std::pair<int64_t, int64_t> deepest(const std::vector<char>& on, const int64_t* depth, int64_t W) {
  int64_t c = -1, at = 0;
  for (int64_t i = 0; i < W; ++i) {
    const int64_t s = on[i] ? depth[i] : -1;
    if (s > c) c = s, at = i;
  }
  return {c, at};
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> tree_build(
    torch::Tensor anchor, torch::Tensor d_tok, torch::Tensor d_par, torch::Tensor d_dep, torch::Tensor d_alive,
    int64_t d_max, const std::vector<std::vector<int64_t>>& branch) {
  // No drafter nodes: empty tensors of any shape (m = 0).
  if (d_tok.numel() == 0) {
    d_tok = d_par = d_dep = torch::empty({anchor.size(0), 0}, anchor.options());
    d_alive = torch::Tensor();
  }
  const int64_t b = anchor.size(0), m = d_tok.size(1);
  int64_t k = 0;  // the widest row's lookup tokens (the others padded with dead nodes of token 0)
  for (const auto& row : branch) k = std::max<int64_t>(k, row.size());
  const int64_t W = 1 + m + k;
  TORCH_CHECK(anchor.scalar_type() == torch::kLong && d_tok.scalar_type() == torch::kLong &&
                  d_par.scalar_type() == torch::kLong && d_dep.scalar_type() == torch::kLong,
              "tree_build: int64 tokens, parents and depths");
  TORCH_CHECK(d_tok.size(0) == b && d_par.sizes() == d_tok.sizes() && d_dep.sizes() == d_tok.sizes() &&
                  (branch.empty() || static_cast<int64_t>(branch.size()) == b) &&
                  (!d_alive.defined() || d_alive.numel() == 0 ||
                   (d_alive.scalar_type() == torch::kBool && d_alive.sizes() == d_tok.sizes())),
              "tree_build: drafter nodes [b, m] (alive [b, m] bool or empty), anchor [b], a branch per row or none");
  const torch::Tensor an = anchor.contiguous(), dt = d_tok.contiguous(), dp = d_par.contiguous(),
                      dd = d_dep.contiguous();
  const torch::Tensor da = d_alive.defined() && d_alive.numel() ? d_alive.contiguous() : torch::Tensor();
  const auto opt = an.options();
  torch::Tensor tok = torch::empty({b, W}, opt), parent = torch::empty({b, W}, opt), depth = torch::empty({b, W}, opt);
  torch::Tensor alive = torch::empty({b, W}, opt.dtype(torch::kBool));
  torch::Tensor source = torch::empty({b, W}, opt.dtype(torch::kChar));
  std::vector<char> match(1 + m), on;
  std::vector<int64_t> l(k);
  for (int64_t r = 0; r < b; ++r) {
    int64_t *t = tok.data_ptr<int64_t>() + r * W, *p = parent.data_ptr<int64_t>() + r * W;
    int64_t* d = depth.data_ptr<int64_t>() + r * W;
    bool* a = alive.data_ptr<bool>() + r * W;
    int8_t* s = source.data_ptr<int8_t>() + r * W;
    const int64_t len = branch.empty() ? 0 : branch[r].size();
    std::fill(l.begin(), l.end(), 0);
    if (len) std::copy(branch[r].begin(), branch[r].end(), l.begin());
    t[0] = an.data_ptr<int64_t>()[r], p[0] = 0, d[0] = 0, a[0] = true, s[0] = kAnchor;
    for (int64_t i = 0; i < m; ++i) {
      t[1 + i] = dt.data_ptr<int64_t>()[r * m + i], p[1 + i] = dp.data_ptr<int64_t>()[r * m + i];
      d[1 + i] = dd.data_ptr<int64_t>()[r * m + i], s[1 + i] = kDrafter;
      a[1 + i] = da.defined() ? da.data_ptr<bool>()[r * m + i] : true;
    }
    // c: the depth of the deepest drafter node whose path spells l_1..l_c; the branch hangs off it (`attach`).
    match.assign(1 + m, 0);
    match[0] = 1;
    if (m && k)
      for (int64_t i = 1; i <= m; ++i)
        match[i] = d[i] <= len && d[i] <= k && d[i] >= 1 && t[i] == l[d[i] - 1] && a[i];
    on_path(match, p, 1 + m, m && k ? d_max : 0, on);
    const auto [c, attach] = deepest(on, d, 1 + m);
    for (int64_t j = 1; j <= k; ++j) {
      const int64_t i = m + j;
      t[i] = l[j - 1], d[i] = j, s[i] = kLookup;
      p[i] = j == c + 1 ? attach : m + j - 1;
      a[i] = j > c && j <= len;
    }
  }
  return {tok, parent, depth, alive, source};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> tree_inputs(torch::Tensor parent, torch::Tensor depth,
                                                                     torch::Tensor start, int64_t kv_len,
                                                                     int64_t max_depth) {
  TORCH_CHECK(parent.dim() == 2 && parent.scalar_type() == torch::kLong && depth.scalar_type() == torch::kLong &&
                  depth.sizes() == parent.sizes() && start.scalar_type() == torch::kLong &&
                  start.numel() == parent.size(0),
              "tree_inputs: parent and depth [b, W] and start [b], int64");
  const torch::Tensor pa = parent.contiguous(), de = depth.contiguous(), st = start.contiguous();
  const int64_t b = pa.size(0), W = pa.size(1);
  torch::Tensor positions = torch::empty({b, W}, pa.options()), slots = torch::empty({b, W}, pa.options());
  torch::Tensor mask = torch::zeros({b, 1, W, kv_len}, pa.options().dtype(torch::kBool));
  for (int64_t r = 0; r < b; ++r) {
    const int64_t s0 = st.data_ptr<int64_t>()[r];
    const int64_t *p = pa.data_ptr<int64_t>() + r * W, *d = de.data_ptr<int64_t>() + r * W;
    TORCH_CHECK(s0 >= 0 && s0 + W <= kv_len, "tree_inputs: a row's tree runs past kv_len");
    for (int64_t q = 0; q < W; ++q) {
      // node q: position start + its depth (RoPE), slot start + q (its K/V while it is verified)
      positions.data_ptr<int64_t>()[r * W + q] = s0 + d[q], slots.data_ptr<int64_t>()[r * W + q] = s0 + q;
      bool* row = mask.data_ptr<bool>() + (r * W + q) * kv_len;
      std::fill(row, row + s0, true);
      // The node and its ancestors, found in max_depth + 1 rounds (tree.py `ancestors`).
      int64_t node = q;
      for (int64_t i = 0; i <= max_depth; ++i) row[s0 + node] = true, node = p[node];
    }
  }
  return {positions, slots, mask};
}

AcceptedRows tree_accept(torch::Tensor tokens, torch::Tensor parent, torch::Tensor depth, torch::Tensor alive,
                         torch::Tensor source, torch::Tensor choices, int64_t max_depth, int64_t span) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == torch::kLong && parent.scalar_type() == torch::kLong &&
                  depth.scalar_type() == torch::kLong && choices.scalar_type() == torch::kLong &&
                  alive.scalar_type() == torch::kBool && parent.sizes() == tokens.sizes() &&
                  depth.sizes() == tokens.sizes() && alive.sizes() == tokens.sizes() &&
                  choices.sizes() == tokens.sizes() &&
                  (source.numel() == 0 || (source.scalar_type() == torch::kChar && source.sizes() == tokens.sizes())),
              "tree_accept: tokens, parent, depth, choices int64 [b, W], alive bool, source int8 [b, W] or empty");
  const torch::Tensor tk = tokens.contiguous(), pa = parent.contiguous(), de = depth.contiguous(),
                      al = alive.contiguous(), ch = choices.contiguous();
  const torch::Tensor so = source.numel() ? source.contiguous() : source;
  const int64_t b = tk.size(0), W = tk.size(1), D = W == 1 ? 0 : max_depth;  // the anchor alone: depth 0
  TORCH_CHECK(span >= D + 1, "tree_accept: span must hold the deepest path (max_depth + 1)");
  torch::Tensor path = torch::empty({b, span}, tk.options());
  AcceptedRows out;
  auto& [path_t, committed, got, nodes, counts] = out;
  path_t = path;
  committed.assign(b, std::vector<int64_t>(span)), got.assign(b, 0), nodes.assign(b, std::vector<int64_t>(span));
  counts.assign(b, std::vector<int64_t>(4, 0));
  std::vector<char> ok(W), on;
  for (int64_t r = 0; r < b; ++r) {
    const int64_t *t = tk.data_ptr<int64_t>() + r * W, *p = pa.data_ptr<int64_t>() + r * W;
    const int64_t *d = de.data_ptr<int64_t>() + r * W, *c = ch.data_ptr<int64_t>() + r * W;
    const bool* a = al.data_ptr<bool>() + r * W;
    // A node is ok where the target chose its token at its parent; on the path iff it and its ancestors are ok.
    for (int64_t i = 0; i < W; ++i) ok[i] = i == 0 || (a[i] && t[i] == c[p[i]]);
    on_path(ok, p, W, D, on);
    const auto [deep, end] = deepest(on, d, W);
    std::vector<int64_t>& n = nodes[r];
    int64_t node = end;
    for (int64_t j = span - 1; j >= 0; --j) {  // walk up from the end; depths past the accepted one repeat the end
      if (j > deep) {
        n[j] = end;
      } else {
        n[j] = node, node = p[node];
      }
    }
    got[r] = deep;
    for (int64_t j = 0; j < span; ++j) path.data_ptr<int64_t>()[r * span + j] = n[j], committed[r][j] = c[n[j]];
    if (so.numel() && W > 1) {  // drafted and accepted nodes per source (tree.py `source_counts`)
      const int8_t* s = so.data_ptr<int8_t>() + r * W;
      for (int64_t i = 0; i < W; ++i) counts[r][0] += a[i] && s[i] == kDrafter, counts[r][1] += a[i] && s[i] == kLookup;
      for (int64_t j = 1; j <= deep; ++j) counts[r][2] += s[n[j]] == kDrafter, counts[r][3] += s[n[j]] == kLookup;
    }
  }
  return out;
}
