// BatchNorm's integer codes of x_hat = (x - mean) * invstd (lessmem.core.ops.batchnorm) in one pass
// each: made from x in forward (no x_hat tensor), and read in backward for the batch-norm
// gradient and for a from_bn conv's rebuilt input (lessmem.core.ops.rebuilt_input). Each does the
// float operations of the torch ops it replaces, elementwise in the same order and precision, so
// its codes and values are theirs bit for bit. Tensors are 4-d (N, C, H, W), contiguous or
// channels-last, and walked in memory order, where the code groups run.

#include "groups.h"
#include "lessmem_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

using namespace lessmem_groups;

namespace {

// Which channel each memory-order position of an (N, C, H, W) tensor holds.
struct ChannelOrder {
  int64_t channels, plane;  // C, H * W
  bool nhwc;

  explicit ChannelOrder(const at::Tensor& t)
      : channels(t.size(1)), plane(t.size(2) * t.size(3)), nhwc(!t.is_contiguous()) {}

  // Splits positions [i0, i0 + len) into runs, calling run(offset, length, c): positions of one
  // channel c (NCHW), or of the consecutive channels c, c + 1, ... (NHWC).
  template <typename F>
  void runs(int64_t i0, int64_t len, F&& run) const {
    for (int64_t j = 0; j < len;) {
      const int64_t i = i0 + j;
      const int64_t c = nhwc ? i % channels : (i / plane) % channels;
      const int64_t n = std::min(len - j, nhwc ? channels - c : plane - i % plane);
      run(j, n, c);
      j += n;
    }
  }
};

// f(k, c) for k < n over a run starting at channel c: c itself (NCHW) or c + k (NHWC); two plain
// loops, so that each vectorizes
template <typename F>
inline void each(const ChannelOrder& order, int64_t n, int64_t c, F&& f) {
  if (order.nhwc) {
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) f(k, c + k);
  } else {
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) f(k, c);
  }
}

// The first `valid` mask bits of group g (from byte g * GROUP / 8) as 1.0f / 0.0f (AVX2: the
// flags of whole bytes, up to 7 past `valid`).
inline void group_flags(const uint8_t* bits, int64_t g, int64_t valid, float* flags) {
  const uint8_t* bs = bits + g * GROUP / 8;
  int64_t j = 0;
#if defined(__AVX2__)
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; j < valid; j += 8) {
    const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bs[j >> 3]), lane_bit), lane_bit);
    _mm256_storeu_ps(flags + j, _mm256_and_ps(_mm256_castsi256_ps(set), one));
  }
#endif
  for (; j < valid; ++j) flags[j] = static_cast<float>((bs[j >> 3] >> (j & 7)) & 1);
}

}  // namespace

// (codes, min, scale) of x_hat = (x - mean) * invstd, per channel, in opmath precision (float for
// float and half inputs, double for double; x_hat rounded to float32 before coding), as
// quantize_groups packs the x_hat tensor: same noise of element i, same groups, same bits.
std::vector<at::Tensor> normalize_quantize(at::Tensor x, at::Tensor mean, at::Tensor invstd, int64_t bits,
                                           int64_t key, bool stochastic) {
  const int64_t n = x.numel(), groups = (n + GROUP - 1) / GROUP;
  const ChannelOrder order(x);
  auto codes = at::empty({groups * GROUP * bits / 8}, x.options().dtype(at::kByte));
  auto lo = at::empty({groups}, x.options().dtype(at::kFloat));
  auto scale = at::empty({groups}, x.options().dtype(at::kFloat));
  const uint32_t key32 = static_cast<uint32_t>(key);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "normalize_quantize", [&] {
    using op_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const op_t* mp = mean.data_ptr<op_t>();
    const op_t* ip = invstd.data_ptr<op_t>();
    uint8_t* cp = codes.data_ptr<uint8_t>();
    float* lp = lo.data_ptr<float>();
    float* sp = scale.data_ptr<float>();
    at::parallel_for(0, groups, GRAIN, [&](int64_t g0, int64_t g1) {
      alignas(32) float buf[GROUP];
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t start = g * GROUP, valid = std::min(GROUP, n - start);
        order.runs(start, valid, [&](int64_t j, int64_t len, int64_t c) {
          const scalar_t* xs = xp + start + j;
          float* out = buf + j;
          each(order, len, c, [&](int64_t k, int64_t ck) {
            out[k] = static_cast<float>((static_cast<op_t>(xs[k]) - mp[ck]) * ip[ck]);
          });
        });
        std::fill(buf + valid, buf + GROUP, buf[valid - 1]);
        quantize_group(buf, g, bits, stochastic, key32, cp, lp, sp);
      }
    });
  });
  return {codes, lo, scale};
}

// out = decoded x_hat * grad (float32, flat, memory order; the product of the batch-norm
// gradient's dot term before its per-channel sum).
at::Tensor norm_codes_times_grad(at::Tensor codes, at::Tensor lo, at::Tensor scale, int64_t bits, at::Tensor grad,
                                 at::Tensor out) {
  const int64_t n = out.numel(), groups = (n + GROUP - 1) / GROUP;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* lp = lo.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float* gp = grad.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, groups, GRAIN, [&](int64_t g0, int64_t g1) {
    alignas(32) float vs[GROUP];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t start = g * GROUP, valid = std::min(GROUP, n - start);
      decode_group(cp, lp, sp, g, bits, vs);
      const float* gs = gp + start;
      float* os = op + start;
#pragma omp simd
      for (int64_t j = 0; j < valid; ++j) os[j] = vs[j] * gs[j];
    }
  });
  return out;
}

// The batch-norm input gradient from x_hat's codes: out = (grad - (x_hat * proj + shift)) * factor,
// proj, shift and factor per channel (float32; out may be grad itself).
at::Tensor norm_codes_input_grad(at::Tensor codes, at::Tensor lo, at::Tensor scale, int64_t bits, at::Tensor grad,
                                 at::Tensor proj, at::Tensor shift, at::Tensor factor, at::Tensor out) {
  const int64_t n = out.numel(), groups = (n + GROUP - 1) / GROUP;
  const ChannelOrder order(out);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* lp = lo.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float* gp = grad.data_ptr<float>();
  const float* pp = proj.data_ptr<float>();
  const float* hp = shift.data_ptr<float>();
  const float* fp = factor.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, groups, GRAIN, [&](int64_t g0, int64_t g1) {
    alignas(32) float vs[GROUP];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t start = g * GROUP, valid = std::min(GROUP, n - start);
      decode_group(cp, lp, sp, g, bits, vs);
      order.runs(start, valid, [&](int64_t j, int64_t len, int64_t c) {
        const float* gs = gp + start + j;
        const float* v = vs + j;
        float* os = op + start + j;
        each(order, len, c, [&](int64_t k, int64_t ck) {
          const float x = v[k] * pp[ck] + hp[ck];
          os[k] = (gs[k] - x) * fp[ck];
        });
      });
    }
  });
  return out;
}

// A from_bn conv's input rebuilt from x_hat's codes and the activation's packed pass mask (same
// memory order): z = x_hat * weight + bias per channel; out = z * flag (ReLU: 0 off the mask), or
// with has_hi (ReLU6 / Hardtanh) z on the mask and off it the bound on z's side of (lo + hi) / 2.
at::Tensor rebuild_from_norm_codes(at::Tensor codes, at::Tensor lo, at::Tensor scale, int64_t bits, at::Tensor mask,
                                   at::Tensor weight, at::Tensor bias, double low, double high, bool has_hi,
                                   at::Tensor out) {
  const int64_t n = out.numel(), groups = (n + GROUP - 1) / GROUP;
  const ChannelOrder order(out);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* lp = lo.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const uint8_t* mp = mask.data_ptr<uint8_t>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float lo_f = static_cast<float>(low), hi_f = static_cast<float>(high);
  const float mid = static_cast<float>((low + high) / 2);
  at::parallel_for(0, groups, GRAIN, [&](int64_t g0, int64_t g1) {
    alignas(32) float vs[GROUP];
    alignas(32) float flags[GROUP];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t start = g * GROUP, valid = std::min(GROUP, n - start);
      decode_group(cp, lp, sp, g, bits, vs);
      group_flags(mp, g, valid, flags);
      order.runs(start, valid, [&](int64_t j, int64_t len, int64_t c) {
        const float* v = vs + j;
        const float* f = flags + j;
        float* os = op + start + j;
        if (has_hi) {
          each(order, len, c, [&](int64_t k, int64_t ck) {
            const float z = v[k] * wp[ck] + bp[ck];
            os[k] = f[k] != 0.0f ? z : (z > mid ? hi_f : lo_f);
          });
        } else {
          each(order, len, c, [&](int64_t k, int64_t ck) { os[k] = (v[k] * wp[ck] + bp[ck]) * f[k]; });
        }
      });
    }
  });
  return out;
}
