// The Python module of our CPU kernels (one extension, built by kernels/__init__.py).
#include <torch/extension.h>

#include "ops.h"

// Why the compute runs without the GIL (`nogil`): these calls touch no Python object between reading their
// arguments and returning, and the layer stack's forward is a whole decoder pass (a long prompt's prefill: seconds).
// Holding the GIL through it froze every other Python thread: the server's HTTP thread could not answer /health.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  mod.def("rowlinear", &rowlinear, nogil,
          "y = x @ W^T, every row computed alike whatever the row count (rowlinear.cpp)");
  mod.def("qlinear", &qlinear, nogil, "y = q8(x) . W^T for Q4_1 / Q8_0 weights, integer dot products, row-invariant");
  mod.def("plinear", &plinear, nogil, "y = x . W^T for packed Q4_1 codes, bf16 activations, row-invariant");
  mod.def("plinear_available", &plinear_available, "whether plinear runs here (AVX512-BF16, not forced to avx2)");
  mod.def("attend", &attend, nogil, "the lean target's attention, row-invariant (attention.cpp)");
  mod.def("attend_set_layout", &attend_set_layout,
          "'split': short lists one unit per (query, head); 'auto': grouped on AVX-512 (attention.cpp)");
  mod.def("key_lists", &key_lists, "each query's head-part slots and tail slots for attend (keylists.cpp)");
  mod.def("argmax_bf16", &argmax_bf16, nogil, "each row's argmax over bf16 logits, as torch.argmax (argmax.cpp)");
  mod.def("draft_topk", &draft_topk, nogil, "each row's k best ids and log-probabilities (drafttree.cpp)");
  mod.def("beam_tree", &beam_tree, nogil, "the n likeliest paths through a drafter's top-k per slot (drafttree.cpp)");
  mod.def("tree_build", &tree_build, "the verify tree from drafter nodes and a lookup branch (verifytree.cpp)");
  mod.def("tree_inputs", &tree_inputs, "each verify node's position, slot and visible slots (verifytree.cpp)");
  mod.def("tree_accept", &tree_accept, "the accepted path and the per-source counts (verifytree.cpp)");
  mod.def("copy_rows", &copy_rows, "store[r, 0, positions[r][t]] = rows[r, nodes[r][t]] (rowcopy.cpp)");
  mod.def("move_slots", &move_slots, "layer[r, h, dst[r][t]] = layer[r, h, src[r][t]] in every layer (rowcopy.cpp)");
  mod.def("corpus_match", &corpus_match, nogil, "Corpus.match's longest suffix and its continuation (corpusmatch.cpp)");
  mod.def("rowlinear_isa", &rowlinear_isa, "which instruction set rowlinear's bf16 path runs on this CPU");
  mod.def("rowlinear_set_isa", &rowlinear_set_isa, "'avx2': rowlinear's 8-lane path; 'avx512bf16': no AMX; 'auto': the best");
  register_stack(mod);  // Stack: a Llama-style target's decoder layers in one call (layers.cpp)
}
