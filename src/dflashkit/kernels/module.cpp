// The Python module of our CPU kernels (one extension, built by kernels/__init__.py).
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("rowlinear", &rowlinear, "y = x @ W^T, every row computed alike whatever the row count (rowlinear.cpp)");
  mod.def("qlinear", &qlinear, "y = q8(x) . W^T for Q4_1 / Q8_0 weights, integer dot products, row-invariant");
  mod.def("attend", &attend, "the lean target's attention, row-invariant (attention.cpp)");
  mod.def("rowlinear_isa", &rowlinear_isa, "which instruction set rowlinear's bf16 path runs on this CPU");
  mod.def("rowlinear_set_isa", &rowlinear_set_isa, "'avx2' forces rowlinear's 8-lane path, 'auto' undoes it");
  register_stack(mod);  // Stack: a Llama-style target's decoder layers in one call (layers.cpp)
}
