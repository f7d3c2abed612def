// The fused CPU kernels lessmem binds (bindings.cpp), each defined in the file of its concern.
// Built once per instruction set: the AVX2 paths are compiled only where __AVX2__ is defined.
#pragma once

#include <ATen/ATen.h>

#include <vector>

// masks.cpp
at::Tensor clamp_pack(at::Tensor x, at::Tensor y, double lo, double hi, bool has_hi);
at::Tensor masked_grad(at::Tensor grad, at::Tensor bits, at::Tensor out);

// pooling.cpp
at::Tensor pool_blocks(at::Tensor x, int64_t kh, int64_t kw);

// depthwise.cpp
at::Tensor depthwise_weight_grad(at::Tensor grad, at::Tensor pooled, int64_t kh, int64_t kw, int64_t sh,
                                 int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t kbh,
                                 int64_t kbw);

// maxpool.cpp
std::vector<at::Tensor> max_pool_compact(at::Tensor x, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                                         int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t oh,
                                         int64_t ow);
at::Tensor max_pool_compact_backward(at::Tensor grad, at::Tensor local, int64_t kh, int64_t kw,
                                     int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh,
                                     int64_t dw, int64_t H, int64_t W);

// quantize.cpp
std::vector<at::Tensor> quantize_groups(at::Tensor x, int64_t bits, int64_t key, bool stochastic);
at::Tensor round_bf16(at::Tensor x, int64_t key);
at::Tensor dequantize_groups(at::Tensor codes, at::Tensor lo, at::Tensor scale, int64_t bits, at::Tensor out);

// norm_codes.cpp
std::vector<at::Tensor> normalize_quantize(at::Tensor x, at::Tensor mean, at::Tensor invstd, int64_t bits,
                                           int64_t key, bool stochastic);
at::Tensor norm_codes_times_grad(at::Tensor codes, at::Tensor lo, at::Tensor scale, int64_t bits, at::Tensor grad,
                                 at::Tensor out);
at::Tensor norm_codes_input_grad(at::Tensor codes, at::Tensor lo, at::Tensor scale, int64_t bits, at::Tensor grad,
                                 at::Tensor proj, at::Tensor shift, at::Tensor factor, at::Tensor out);
at::Tensor rebuild_from_norm_codes(at::Tensor codes, at::Tensor lo, at::Tensor scale, int64_t bits, at::Tensor mask,
                                   at::Tensor weight, at::Tensor bias, double low, double high, bool has_hi,
                                   at::Tensor out);
