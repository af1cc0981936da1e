// Rows copied between a step's features and the drafter's feature store by host index lists, in one call: the
// commit step writes each row's accepted path (nodes of the verify pass) at its positions. In torch that was a
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
