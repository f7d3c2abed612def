// A depthwise conv's weight gradient from the block means of its input.

#include "lessmem_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

namespace {

// sum of a[x] * b[x * stride]; vectorized (reassociated) where the stride is 1
template <typename acc_t>
acc_t dot(const acc_t* a, const acc_t* b, int64_t n, int64_t stride) {
  acc_t sum = 0;
  if (stride == 1) {
#pragma omp simd reduction(+ : sum)
    for (int64_t x = 0; x < n; ++x) sum += a[x] * b[x];
  } else {
    for (int64_t x = 0; x < n; ++x) sum += a[x] * b[x * stride];
  }
  return sum;
}

}  // namespace

// Weight gradient of a depthwise conv (one input and one output channel per group) whose input is
// known by its kb x kb block means `pooled` (N, C, H/kbh, W/kbw): per channel, the block means are
// expanded into a zero-padded plane that stays in cache, and each tap's gradient is a sum of
// products over the output rows (contiguous when the stride is 1, so it vectorizes). Channels in
// parallel, images in order: no atomics. Both tensors contiguous NCHW.
at::Tensor depthwise_weight_grad(at::Tensor grad, at::Tensor pooled, int64_t kh, int64_t kw, int64_t sh,
                                 int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t kbh,
                                 int64_t kbw) {
  const int64_t N = grad.size(0), C = grad.size(1), oh = grad.size(2), ow = grad.size(3);
  const int64_t hb = pooled.size(2), wb = pooled.size(3), H = hb * kbh, W = wb * kbw;
  const int64_t Hp = H + 2 * ph, Wp = W + 2 * pw;
  auto gw = at::empty({C, 1, kh, kw}, grad.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "depthwise_weight_grad", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* gp = grad.data_ptr<scalar_t>();
    const scalar_t* pp = pooled.data_ptr<scalar_t>();
    scalar_t* wp = gw.data_ptr<scalar_t>();
    at::parallel_for(0, C, 1, [&](int64_t c0, int64_t c1) {
      // stride 1: the output gradient is laid out with the plane's row length (zeros past ow), so
      // a tap's sum over all outputs is one contiguous dot product with the plane shifted by the tap
      const bool flat = sh == 1 && sw == 1;
      std::vector<acc_t> plane(Hp * Wp + (kw - 1) * dw, acc_t(0)), grow(flat ? oh * Wp : ow, acc_t(0));
      std::vector<acc_t> acc(kh * kw);
      for (int64_t c = c0; c < c1; ++c) {
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for (int64_t n = 0; n < N; ++n) {
          const scalar_t* means = pp + (n * C + c) * hb * wb;
          for (int64_t b = 0; b < hb; ++b) {  // one row per block row, copied; the border stays zero
            acc_t* row = plane.data() + (b * kbh + ph) * Wp + pw;
            for (int64_t q = 0; q < wb; ++q) {
              const acc_t v = static_cast<acc_t>(means[b * wb + q]);
              for (int64_t t = 0; t < kbw; ++t) row[q * kbw + t] = v;
            }
            for (int64_t t = 1; t < kbh; ++t) std::memcpy(row + t * Wp, row, W * sizeof(acc_t));
          }
          const scalar_t* g = gp + (n * C + c) * oh * ow;
          if (flat) {
            for (int64_t y = 0; y < oh; ++y)
              for (int64_t x = 0; x < ow; ++x) grow[y * Wp + x] = static_cast<acc_t>(g[y * ow + x]);
            for (int64_t i = 0; i < kh; ++i)
              for (int64_t j = 0; j < kw; ++j)
                acc[i * kw + j] += dot(grow.data(), plane.data() + i * dh * Wp + j * dw, oh * Wp, 1);
            continue;
          }
          for (int64_t y = 0; y < oh; ++y) {
            for (int64_t x = 0; x < ow; ++x) grow[x] = static_cast<acc_t>(g[y * ow + x]);
            for (int64_t i = 0; i < kh; ++i) {
              const acc_t* src = plane.data() + (y * sh + i * dh) * Wp;
              for (int64_t j = 0; j < kw; ++j) {
                acc[i * kw + j] += dot(grow.data(), src + j * dw, ow, sw);
              }
            }
          }
        }
        for (int64_t t = 0; t < kh * kw; ++t) wp[c * kh * kw + t] = static_cast<scalar_t>(acc[t]);
      }
    });
  });
  return gw;
}
