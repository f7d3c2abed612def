// b-bit group quantization (lessmem.core.storage): one pass per group of GROUP elements for the
// min and max, the scale, the rounding (stochastic with lessmem.core.rounding's hash noise, or to
// nearest for int8_rn) and the packing; and one pass back. And bf16 storage's stochastic rounding. Every float operation is the one
// the torch reference makes, in the same order and precision, so codes, min, scale and decoded
// values are bit-identical to it (the build turns off FMA contraction for this).

#include "groups.h"
#include "lessmem_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

using namespace lessmem_groups;

// x: flat, memory order, n > 0 elements; groups of GROUP, the last padded with x[n - 1].
// Returns (codes packed 8 / bits to a byte, float32 min per group, float32 scale per group);
// noise of element i (of the padded array) is hash32((i + key) mod 2^32) >> 8 times 2^-24.
std::vector<at::Tensor> quantize_groups(at::Tensor x, int64_t bits, int64_t key, bool stochastic) {
  const int64_t n = x.numel(), groups = (n + GROUP - 1) / GROUP;
  auto codes = at::empty({groups * GROUP * bits / 8}, x.options().dtype(at::kByte));
  auto lo = at::empty({groups}, x.options().dtype(at::kFloat));
  auto scale = at::empty({groups}, x.options().dtype(at::kFloat));
  const uint32_t key32 = static_cast<uint32_t>(key);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_groups", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    uint8_t* cp = codes.data_ptr<uint8_t>();
    float* lp = lo.data_ptr<float>();
    float* sp = scale.data_ptr<float>();
    at::parallel_for(0, groups, GRAIN, [&](int64_t g0, int64_t g1) {
      alignas(32) float buf[GROUP];
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t start = g * GROUP, valid = std::min(GROUP, n - start);
        const float* xs = valid == GROUP ? float_view(xp + start) : nullptr;
        if (xs == nullptr) {
          for (int64_t j = 0; j < valid; ++j) buf[j] = static_cast<float>(xp[start + j]);
          std::fill(buf + valid, buf + GROUP, buf[valid - 1]);
          xs = buf;
        }
        quantize_group(xs, g, bits, stochastic, key32, cp, lp, sp);
      }
    });
  });
  return {codes, lo, scale};
}

// The values quantize_groups stored, into out: flat, memory order, of the original dtype.
at::Tensor dequantize_groups(at::Tensor codes, at::Tensor lo, at::Tensor scale, int64_t bits, at::Tensor out) {
  const int64_t n = out.numel(), groups = (n + GROUP - 1) / GROUP;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize_groups", [&] {
    const uint8_t* cp = codes.data_ptr<uint8_t>();
    const float* lp = lo.data_ptr<float>();
    const float* sp = scale.data_ptr<float>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, groups, GRAIN, [&](int64_t g0, int64_t g1) {
      alignas(32) float vs[GROUP];
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t start = g * GROUP, valid = std::min(GROUP, n - start);
        float* dst = valid == GROUP ? float_view(op + start) : nullptr;
        decode_group(cp, lp, sp, g, bits, dst != nullptr ? dst : vs);
        if (dst == nullptr) {
          for (int64_t j = 0; j < valid; ++j) op[start + j] = static_cast<scalar_t>(vs[j]);
        }
      }
    });
  });
  return out;
}

// x: flat, memory order. bfloat16 words of x rounded stochastically: element i's float32 bits plus
// hash32((i + key) mod 2^32) >> 16, truncated to the top 16 bits; NaN becomes 0x7FC0.
at::Tensor round_bf16(at::Tensor x, int64_t key) {
  const int64_t n = x.numel();
  auto out = at::empty({n}, x.options().dtype(at::kBFloat16));
  const uint32_t key32 = static_cast<uint32_t>(key);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "round_bf16", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    at::parallel_for(0, n, GRAIN * GROUP, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const float f = static_cast<float>(xp[i]);
        uint32_t b;
        std::memcpy(&b, &f, sizeof b);
        const uint32_t noise = hash32(static_cast<uint32_t>(i) + key32) >> 16;
        op[i] = std::isnan(f) ? uint16_t{0x7FC0} : static_cast<uint16_t>((b + noise) >> 16);
      }
    });
  });
  return out;
}
