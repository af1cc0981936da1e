// The lean target's key lists (backends/lean.py `_Split`) in one call: which cache slots each query reads in its
// HEAD part (in place, slot order) and which in its TAIL (gathered in position order), the two inputs of `attend`.
//
// Why in C++: built from torch ops this takes ~15 small ops a step; run right after a step has streamed ~100 MB of
// weights through the caches, each op's code and data come back from memory (measured on a 2-core AMD EPYC: ~0.2 ms
// of a ~6 ms one-token step, against ~55 us warm).
//
// For each batch row b, query q (position p = positions[b, q]) and slot s < kv_len:
//   slot_pos[s] = positions[b, j] where slots[b, j] == s (the token the step writes there), else s (slot == position
//                 for committed tokens)
//   visible     = visible[b, 0, q, s] if given, else slot_pos[s] <= p
//   split       = max(p - tail_depth, 0);  rel = slot_pos[s] - split
//   head[b, q, s]          = visible && rel < 0
//   tail[b, q, rel]        = s  where visible && 0 <= rel < L (one visible key per position), -1 where none
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"

std::tuple<torch::Tensor, torch::Tensor> key_lists(torch::Tensor positions, torch::Tensor slots, int64_t kv_len,
                                                   c10::optional<torch::Tensor> visible, int64_t tail_depth,
                                                   int64_t L) {
  TORCH_CHECK(positions.dim() == 2 && positions.sizes() == slots.sizes() &&
                  positions.scalar_type() == torch::kLong && slots.scalar_type() == torch::kLong,
              "key_lists: positions and slots must be int64 [B, Q]");
  const int64_t B = positions.size(0), Q = positions.size(1), S = kv_len;
  positions = positions.contiguous(), slots = slots.contiguous();
  const int64_t *pp = positions.data_ptr<int64_t>(), *sp = slots.data_ptr<int64_t>();
  const bool* vp = nullptr;
  torch::Tensor vis;
  if (visible.has_value()) {
    vis = visible->contiguous();
    TORCH_CHECK(vis.scalar_type() == torch::kBool && vis.dim() == 4 && vis.size(0) == B && vis.size(1) == 1 &&
                    vis.size(2) == Q && vis.size(3) == S,
                "key_lists: visible must be bool [B, 1, Q, kv_len]");
    vp = vis.data_ptr<bool>();
  }
  torch::Tensor head = torch::empty({B, Q, S}, positions.options().dtype(torch::kBool));
  torch::Tensor tail = torch::full({B, Q, L}, -1, positions.options());
  bool* hp = head.data_ptr<bool>();
  int64_t* tp = tail.data_ptr<int64_t>();
  std::vector<int64_t> slot_pos(S);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) slot_pos[s] = s;
    for (int64_t j = 0; j < Q; ++j) {
      const int64_t s = sp[b * Q + j];
      TORCH_CHECK(s >= 0 && s < S, "key_lists: slot ", s, " lies outside kv_len ", S);
      slot_pos[s] = pp[b * Q + j];
    }
    for (int64_t q = 0; q < Q; ++q) {
      const int64_t r = b * Q + q, p = pp[r], split = std::max<int64_t>(p - tail_depth, 0);
      bool* h = hp + r * S;
      int64_t* t = tp + r * L;
      for (int64_t s = 0; s < S; ++s) {
        const bool v = vp ? vp[r * S + s] : slot_pos[s] <= p;
        const int64_t rel = slot_pos[s] - split;
        h[s] = v && rel < 0;
        if (v && rel >= 0 && rel < L) t[rel] = s;
      }
    }
  }
  return {head, tail};
}
