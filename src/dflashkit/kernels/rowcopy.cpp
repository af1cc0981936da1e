// Rows copied by host index lists, in one call: the commit step writes each row's accepted path (nodes of the verify
// pass) into the drafter's feature store at its positions (`copy_rows`), and moves an accepted tree branch's K/V to
// slot == position in every cache layer (`move_slots`). In torch that was a
// gather, the positions' tensor and an index_put (~6 small ops, each 15-70 us right after a target step, when the
// step's ~100 MB of weights have pushed torch's code and data out of the caches).
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"

void copy_rows(torch::Tensor dst, const std::vector<std::vector<int64_t>>& positions, torch::Tensor src,
               const std::vector<std::vector<int64_t>>& nodes) {
  TORCH_CHECK(dst.dim() == 4 && dst.size(1) == 1 && dst.stride(3) == 1 && src.dim() == 3 && src.stride(2) == 1 &&
                  dst.scalar_type() == src.scalar_type() && dst.size(3) == src.size(2) &&
                  static_cast<int64_t>(positions.size()) == src.size(0) && positions.size() == nodes.size() &&
                  src.size(0) <= dst.size(0),
              "copy_rows: a store [B, 1, S, F] and rows [b, W, F] of one dtype (last dims contiguous), b <= B, and one "
              "list of positions and of nodes per row");
  const int64_t F = src.size(2), S = dst.size(2), W = src.size(1), bytes = F * src.element_size();
  char* d = static_cast<char*>(dst.data_ptr());
  const char* s = static_cast<const char*>(src.data_ptr());
  const int64_t e = src.element_size();
  for (int64_t r = 0; r < static_cast<int64_t>(nodes.size()); ++r) {
    TORCH_CHECK(positions[r].size() == nodes[r].size(), "copy_rows: a row's positions and nodes differ in length");
    for (size_t t = 0; t < nodes[r].size(); ++t) {
      const int64_t p = positions[r][t], n = nodes[r][t];
      TORCH_CHECK(p >= 0 && p < S && n >= 0 && n < W, "copy_rows: a position or node out of range");
      std::memcpy(d + (r * dst.stride(0) + p * dst.stride(2)) * e, s + (r * src.stride(0) + n * src.stride(1)) * e,
                  bytes);
    }
  }
}

// Every layer [B, kvh, S, D] (last dim contiguous, each its own D): layer[r, h, dst[r][t]] = layer[r, h, src[r][t]],
// all of a (row, head)'s reads before its writes (src and dst may overlap). In torch: one index_put per layer of K
// and of V (60 for SmolLM2), ~3 ms a move right after a target step.
void move_slots(const std::vector<torch::Tensor>& layers, const std::vector<std::vector<int64_t>>& src,
                const std::vector<std::vector<int64_t>>& dst) {
  TORCH_CHECK(src.size() == dst.size(), "move_slots: one list of sources and of destinations per row");
  std::vector<char> buf;
  for (const torch::Tensor& l : layers) {
    TORCH_CHECK(l.dim() == 4 && l.stride(3) == 1 && static_cast<int64_t>(src.size()) <= l.size(0),
                "move_slots: cache layers [B, kvh, S, D] with a contiguous last dim, a row per list");
    const int64_t e = l.element_size(), bytes = l.size(3) * e, S = l.size(2);
    char* base = static_cast<char*>(l.data_ptr());
    for (size_t r = 0; r < src.size(); ++r) {
      const size_t T = src[r].size();
      TORCH_CHECK(dst[r].size() == T, "move_slots: a row's sources and destinations differ in length");
      for (size_t t = 0; t < T; ++t)
        TORCH_CHECK(src[r][t] >= 0 && src[r][t] < S && dst[r][t] >= 0 && dst[r][t] < S,
                    "move_slots: a slot out of range");
      buf.resize(T * bytes);
      for (int64_t h = 0; h < l.size(1); ++h) {
        char* head = base + (r * l.stride(0) + h * l.stride(1)) * e;
        for (size_t t = 0; t < T; ++t) std::memcpy(buf.data() + t * bytes, head + src[r][t] * l.stride(2) * e, bytes);
        for (size_t t = 0; t < T; ++t) std::memcpy(head + dst[r][t] * l.stride(2) * e, buf.data() + t * bytes, bytes);
      }
    }
  }
}
