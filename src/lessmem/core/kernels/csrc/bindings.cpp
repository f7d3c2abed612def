// The Python module: one binding per kernel (lessmem.core.kernels.cpu wraps them).
#include <torch/extension.h>

#include "lessmem_cpu.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("clamp_pack", &clamp_pack, "clamp(x, lo, hi) into y and the packed pass mask");
  m.def("masked_grad", &masked_grad, "grad where the packed bit is set, else 0, into out");
  m.def("pool_blocks", &pool_blocks, "kh x kw block means");
  m.def("depthwise_weight_grad", &depthwise_weight_grad, "depthwise conv weight gradient from block means");
  m.def("max_pool_compact", &max_pool_compact, "max_pool2d and the uint8 argmax position in each window");
  m.def("max_pool_compact_backward", &max_pool_compact_backward, "gradient of max_pool_compact");
  m.def("quantize_groups", &quantize_groups, "b-bit codes, min and scale of each group of 128 elements");
  m.def("round_bf16", &round_bf16, "bfloat16 of x, rounded stochastically with the hash noise");
  m.def("dequantize_groups", &dequantize_groups, "the values quantize_groups stored, into out");
  m.def("normalize_quantize", &normalize_quantize, "group codes of (x - mean) * invstd per channel");
  m.def("norm_codes_times_grad", &norm_codes_times_grad, "decoded x_hat times grad, into out");
  m.def("norm_codes_input_grad", &norm_codes_input_grad, "batch-norm input gradient from x_hat's codes, into out");
  m.def("rebuild_from_norm_codes", &rebuild_from_norm_codes, "a from_bn conv input from x_hat's codes and a mask");
}
