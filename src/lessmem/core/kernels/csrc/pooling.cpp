// k x k block means of a conv input: the pooled copy its weight gradient is taken from.

#include "lessmem_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// `rows` output rows of a contiguous NCHW input, each from kh input rows of width W
template <typename scalar_t, int KW>
void pool_rows(const scalar_t* src, scalar_t* dst, int64_t rows, int64_t kh, int64_t kw_rt, int64_t W,
               at::opmath_type<scalar_t> scale) {
  // KW > 0: the block width is a compile-time constant, so the horizontal sums vectorize
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t kw = KW > 0 ? KW : kw_rt, wb = W / kw;
  for (int64_t r = 0; r < rows; ++r, src += kh * W, dst += wb) {
    int64_t b = 0;
#if defined(__AVX2__)
    if constexpr (std::is_same_v<scalar_t, float> && KW == 2) {
      if (kh == 2) {
        const __m256 quarter = _mm256_set1_ps(scale);
        for (; 2 * b + 16 <= W; b += 8) {
          const float* a0 = src + 2 * b;
          const __m256 s0 = _mm256_add_ps(_mm256_loadu_ps(a0), _mm256_loadu_ps(a0 + W));
          const __m256 s1 = _mm256_add_ps(_mm256_loadu_ps(a0 + 8), _mm256_loadu_ps(a0 + W + 8));
          const __m256 pairs = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(s0, s1)), 0xD8));
          _mm256_storeu_ps(dst + b, _mm256_mul_ps(pairs, quarter));
        }
      }
    }
#endif
    for (; b < wb; ++b) {
      acc_t s = 0;
      for (int64_t j = 0; j < kw; ++j) {
        acc_t col = static_cast<acc_t>(src[b * kw + j]);
        for (int64_t i = 1; i < kh; ++i) col += static_cast<acc_t>(src[i * W + b * kw + j]);
        s = j == 0 ? col : s + col;
      }
      dst[b] = static_cast<scalar_t>(s * scale);
    }
  }
}

}  // namespace

// kh x kw block means of x (N, C, H, W), H and W multiples of the block; one pass, sums in
// float (double for double) in the torch reference's order (rows of a block first, then its
// columns). Contiguous or channels-last in, the same layout out.
at::Tensor pool_blocks(at::Tensor x, int64_t kh, int64_t kw) {
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t hb = H / kh, wb = W / kw;
  const bool nhwc = !x.is_contiguous();
  auto out = at::empty({N, C, hb, wb}, x.options().memory_format(
      nhwc ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "pool_blocks", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const acc_t scale = acc_t(1) / static_cast<acc_t>(kh * kw);
    if (!nhwc) {
      // output rows (plane, block row) follow each other in memory, kh input rows each
      const int64_t rows = N * C * hb, grain = std::max<int64_t>(1, 4096 / (kh * W));
      at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
        const scalar_t* src = xp + r0 * kh * W;
        scalar_t* dst = op + r0 * wb;
        if (kw == 2) pool_rows<scalar_t, 2>(src, dst, r1 - r0, kh, kw, W, scale);
        else if (kw == 4) pool_rows<scalar_t, 4>(src, dst, r1 - r0, kh, kw, W, scale);
        else pool_rows<scalar_t, 0>(src, dst, r1 - r0, kh, kw, W, scale);
      });
    } else {
      // one output pixel per task: sums of kh * kw contiguous channel vectors
      at::parallel_for(0, N * hb * wb, 16, [&](int64_t p0, int64_t p1) {
        std::vector<acc_t> acc(C), col(C);
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t n = p / (hb * wb), b = p % (hb * wb), bh = b / wb, bw = b % wb;
          for (int64_t j = 0; j < kw; ++j) {
            const scalar_t* src = xp + ((n * H + bh * kh) * W + bw * kw + j) * C;
            // column sums of the block, then their running sum (the reference's order)
            for (int64_t c = 0; c < C; ++c) col[c] = static_cast<acc_t>(src[c]);
            for (int64_t i = 1; i < kh; ++i)
              for (int64_t c = 0; c < C; ++c) col[c] += static_cast<acc_t>(src[i * W * C + c]);
            if (j == 0) std::copy(col.begin(), col.end(), acc.begin());
            else for (int64_t c = 0; c < C; ++c) acc[c] += col[c];
          }
          scalar_t* dst = op + p * C;
          for (int64_t c = 0; c < C; ++c) dst[c] = static_cast<scalar_t>(acc[c] * scale);
        }
      });
    }
  });
  return out;
}
