// The kernels' entry points, declared once: module.cpp binds them to Python, layers.cpp calls them per layer.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

// y = x @ W^T, every row computed alike whatever the row count (rowlinear.cpp)
torch::Tensor rowlinear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t kind,
                        int64_t n_out, bool out_bf16);
// y = q8(x) . W^T for Q4_1 / Q8_0 weights, integer dot products, row-invariant (qlinear.cpp)
torch::Tensor qlinear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t kind,
                      int64_t n_out, bool out_bf16);
// y = x . W^T for packed Q4_1 / Q8_0 codes (their exact values) and bf16 activations, row-invariant (plinear.cpp)
torch::Tensor plinear(torch::Tensor x, torch::Tensor records, int64_t kind, int64_t n_out, bool out_bf16);
// This thread's share [a, z) of n work items among nt threads: contiguous chunks, as at::parallel_for splits at grain
// 1 (the team forward's steps, layers.cpp, and the attention's units there).
inline std::pair<int64_t, int64_t> thread_share(int64_t n, int tid, int nt) {
  const int64_t c = (n + nt - 1) / nt;
  return {std::min(n, tid * c), std::min(n, (tid + 1) * c)};
}
// A packed linear's codes as plinear and qlinear read them (`RowLinear.packed`). qlinear: groups of 16 rows, codes,
// scales and corrections in three arrays; plinear: bands of 32 rows, one record per band and block holding the
// codes and their fp16 scales (plinear.cpp), d and m unused.
struct PackedLinear {
  const uint8_t* codes;  // qlinear [groups, blocks, 256 / 512 bytes]; plinear [bands, blocks, record]
  const float* d;        // qlinear [groups, blocks, 16]
  const void* m;         // qlinear [groups, blocks, 16]: Q4_1 fp32 mins; Q8_0 int32 corrections
  int64_t kind, K, N;    // kind 1 q4_1, 2 q8_0
};
int64_t packed_group_count(int64_t n_out);  // groups of 16 weight rows (qlinear)
int64_t plinear_band_count(int64_t n_out);  // bands of 32 weight rows (plinear)
int64_t plinear_record_bytes(int64_t kind);  // one (band, block) record's bytes
// plinear's and qlinear's two phases for a caller's own parallel region (layers.cpp's team forward), a barrier
// between them: the activations prepared for blocks [f0, f1) of x's bf16 32-element blocks (`plinear_lay_out`:
// Q4_1 only, pairs [blocks, 16] and sums [blocks]; `qlinear_quantize`: int8 per block), then the tiles of weight
// groups [g0, g1) (plinear: bands [j0, j1)) into y [M, N] fp32. The same arithmetic as `plinear` / `qlinear`
// (each output element whole in one thread, in one order): the same bits.
void plinear_lay_out(const uint16_t* x, int64_t f0, int64_t f1, uint32_t* pairs, float* sums);
void plinear_bands(const PackedLinear& w, const uint16_t* x, const uint32_t* pairs, const float* sums, int64_t M,
                   int64_t j0, int64_t j1, float* y);
struct QlinearActs {
  int8_t* q;   // [M K]: each block's int8 values
  uint8_t* u;  // [M K]: q + 128
  float* d;    // [M K / 32]: each block's scale
  float* s;    // [M K / 32]: d * sum(q)
};
void qlinear_quantize(const uint16_t* x, int64_t f0, int64_t f1, const QlinearActs& a);
void qlinear_groups(const PackedLinear& w, const QlinearActs& a, int64_t M, int64_t g0, int64_t g1, float* y);
bool plinear_available();  // an AVX512-BF16 CPU, the ISA not forced to avx2 (rowlinear.cpp)
// rowlinear's 8-lane fp32 path in a caller's own parallel region (layers.cpp's team forward), a barrier between the
// two phases: blocks [f0, f1) of x's bf16 32-element blocks widened to fp32 (exact), then tiles [t0, t1) of its
// `rowlinear_tile_count` tiles of weight rows into y [M, n_out] fp32, from its own codes (`RowLinear.codes`, scales,
// minima; kind 0 bf16, 1 q4_1, 2 q8_0). The same arithmetic as `rowlinear` where it runs that path (for bf16
// activations: `rowlinear_fp32_path`, a CPU without AVX512-BF16 or the ISA forced to avx2): the same bits.
bool rowlinear_fp32_path();
int64_t rowlinear_tile_count(int64_t n_out);
void rowlinear_widen(const uint16_t* x, int64_t f0, int64_t f1, float* xf);
void rowlinear_tiles(const torch::Tensor& codes, const torch::Tensor& d, const torch::Tensor& m, int64_t kind,
                     int64_t n_out, int64_t K, const float* xf, int64_t M, int64_t t0, int64_t t1, float* y);
// the lean target's attention, row-invariant (attention.cpp)
torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor head, torch::Tensor tail,
                     double scale);
// attend's short-list layout (AVX-512, grouped) for a caller's own parallel region (layers.cpp's team forward): whether
// `attend` would take it for these shapes, and this thread's share of its work items. The same bits as `attend`.
struct AttendArgs {
  const uint16_t *q, *k, *v;  // q [B, Q, nh, hd], the cache layer's keys [B, kvh, T, hd] and values [B, kvh, T, vd]
  uint16_t* o;                // [B, Q, nh * hd]
  int64_t B, Q, nh, hd, kvh, T, vd;
  float scale;
  const bool* head;     // [B, Q, S]
  const int64_t* tail;  // [B, Q, L]
  int64_t S, L;
};
bool attend_grouped_takes(int64_t B, int64_t Q, int64_t kvh, int64_t hd, int64_t S, int64_t L);
void attend_grouped(const AttendArgs& a, int tid, int nt);
std::string attend_set_layout(const std::string& layout);  // "split" or "auto": short lists' layout (same bits)
// each query's key lists for `attend`: its head part's slots and its tail's, from positions and slots (keylists.cpp)
std::tuple<torch::Tensor, torch::Tensor> key_lists(torch::Tensor positions, torch::Tensor slots, int64_t kv_len,
                                                   c10::optional<torch::Tensor> visible, int64_t tail_depth, int64_t L);
// the first index of each row's maximum over bf16 logits, as torch.argmax (argmax.cpp)
torch::Tensor argmax_bf16(torch::Tensor logits);
// each row's k best ids under log_softmax and their log-probabilities; the beam of a drafter's tree (drafttree.cpp)
std::tuple<torch::Tensor, torch::Tensor> draft_topk(torch::Tensor logits, int64_t k);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> beam_tree(
    torch::Tensor tokens, torch::Tensor logp, int64_t n, double log_min_prob);
// the verify step's tree: built from drafter nodes and a lookup branch, each node's position, slot and visible slots,
// the accepted path with the drafted / accepted counts per source (verifytree.cpp; the rules of tree.py)
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> tree_build(
    torch::Tensor anchor, torch::Tensor d_tok, torch::Tensor d_par, torch::Tensor d_dep, torch::Tensor d_alive,
    int64_t d_max, const std::vector<std::vector<int64_t>>& branch);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> tree_inputs(torch::Tensor parent, torch::Tensor depth,
                                                                     torch::Tensor start, int64_t kv_len,
                                                                     int64_t max_depth);
// tree_accept: the path [b, span] as a tensor, then on the host per row: the committed tokens [span] (the target's
// choice at each path node), the accepted depth, the path's nodes [span], the 4 per-source counts
using AcceptedRows = std::tuple<torch::Tensor, std::vector<std::vector<int64_t>>, std::vector<int64_t>,
                                std::vector<std::vector<int64_t>>, std::vector<std::vector<int64_t>>>;
AcceptedRows tree_accept(torch::Tensor tokens, torch::Tensor parent, torch::Tensor depth, torch::Tensor alive,
                         torch::Tensor source, torch::Tensor choices, int64_t max_depth, int64_t span);
// store[r, 0, positions[r][t]] = rows[r, nodes[r][t]]: the drafter's features of a step's accepted paths (rowcopy.cpp)
void copy_rows(torch::Tensor dst, const std::vector<std::vector<int64_t>>& positions, torch::Tensor src,
               const std::vector<std::vector<int64_t>>& nodes);
// layer[r, h, dst[r][t]] = layer[r, h, src[r][t]] in every cache layer: an accepted tree branch moved (rowcopy.cpp)
void move_slots(const std::vector<torch::Tensor>& layers, const std::vector<std::vector<int64_t>>& src,
                const std::vector<std::vector<int64_t>>& dst);
// corpus.py `Corpus.match` in one call: (tokens, matched n, support, occurrences read) (corpusmatch.cpp)
std::tuple<std::vector<int64_t>, int64_t, int64_t, int64_t> corpus_match(torch::Tensor padded, torch::Tensor order,
                                                                          torch::Tensor starts, torch::Tensor ids,
                                                                          int64_t max_tokens, int64_t min_n,
                                                                          int64_t max_n, int64_t sampled);
std::string rowlinear_isa();
std::string rowlinear_set_isa(const std::string& isa);
bool dflashkit_avx2_forced();  // rowlinear_set_isa("avx2") also keeps qlinear on its AVX2 tile (same bits there)
void register_stack(pybind11::module& mod);  // layers.cpp
