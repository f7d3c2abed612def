// Max-pooling that records the argmax as a uint8 position in its window, and its gradient.

#include "lessmem_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// One output, its window scanned element by element (rows i0..i1 lie inside the plane)
template <typename scalar_t>
void max_window(const scalar_t* plane, int64_t W, int64_t r0, int64_t c0, int64_t i0, int64_t i1,
                int64_t kw, int64_t dh, int64_t dw, scalar_t* out, uint8_t* arg_out) {
  using acc_t = at::opmath_type<scalar_t>;
  int64_t j0 = 0, j1 = kw;
  while (c0 + j0 * dw < 0) ++j0;
  while (j1 > j0 && c0 + (j1 - 1) * dw >= W) --j1;
  acc_t best = -std::numeric_limits<acc_t>::infinity();
  int64_t arg = i0 * kw + j0;
  for (int64_t i = i0; i < i1; ++i) {
    const scalar_t* src = plane + (r0 + i * dh) * W + c0;
    for (int64_t j = j0; j < j1; ++j) {
      const acc_t v = static_cast<acc_t>(src[j * dw]);
      const bool take = (v > best) | std::isnan(v);
      best = take ? v : best;
      arg = take ? i * kw + j : arg;
    }
  }
  *out = static_cast<scalar_t>(best);
  *arg_out = static_cast<uint8_t>(arg);
}

// One output row, 8 outputs at a time (AVX2, float32) from a copy of the plane padded with -inf
// (the padding is never taken: -inf > best is false). Strides 1 and 2 use plain loads (a gather
// is slow on many CPUs). arg0[x]: the first in-bounds window column of output x.
#if defined(__AVX2__)
inline __m256 load_strided(const float* src, int64_t sw, __m256i lanes) {
  if (sw == 1) return _mm256_loadu_ps(src);
  if (sw == 2) {
    const __m256 even = _mm256_shuffle_ps(_mm256_loadu_ps(src), _mm256_loadu_ps(src + 8), 0x88);
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xD8));
  }
  return _mm256_i32gather_ps(src, lanes, 4);
}

void max_row_avx2(const float* padded, int64_t Wp, int64_t r0, int64_t i0, int64_t i1, int64_t kw,
                  int64_t sw, int64_t dh, int64_t dw, int64_t ow8, const int32_t* arg0, float* best_row,
                  int32_t* arg_row) {
  const __m256i lanes = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                           _mm256_set1_epi32(static_cast<int>(sw)));
  for (int64_t x_ = 0; x_ < ow8; x_ += 8) {
    __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256i arg = _mm256_add_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(arg0 + x_)),
                                   _mm256_set1_epi32(static_cast<int>(i0 * kw)));
    for (int64_t i = i0; i < i1; ++i) {
      const float* src = padded + (r0 + i * dh) * Wp + x_ * sw;
      for (int64_t j = 0; j < kw; ++j) {
        const __m256 v = load_strided(src + j * dw, sw, lanes);
        const __m256 take = _mm256_or_ps(_mm256_cmp_ps(v, best, _CMP_GT_OQ), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        best = _mm256_blendv_ps(best, v, take);
        arg = _mm256_blendv_epi8(arg, _mm256_set1_epi32(static_cast<int>(i * kw + j)), _mm256_castps_si256(take));
      }
    }
    _mm256_storeu_ps(best_row + x_, best);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(arg_row + x_), arg);
  }
}
#endif

}  // namespace

// max_pool2d on contiguous (N, C, H, W) that records, per output, the argmax position inside
// its window (row * kw + col, uint8) instead of an int64 plane index. Same choice as ATen's CPU
// kernel: the first maximum wins, a NaN wins (the last NaN), an all -inf window keeps its first
// in-bounds position. Outputs whose window lies inside the columns are computed 8 at a time
// (AVX2, float32), the rest one by one.
std::vector<at::Tensor> max_pool_compact(at::Tensor x, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                                         int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t oh,
                                         int64_t ow) {
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  auto out = at::empty({N, C, oh, ow}, x.options());
  auto local = at::empty({N, C, oh, ow}, x.options().dtype(at::kByte));
  const int64_t ow8 = (ow + 7) / 8 * 8;
  // padded plane: pw columns of -inf on the left, enough on the right for the last vector
  const int64_t Wp = std::max(pw + W, (ow8 - 1) * sw + (kw - 1) * dw + 17);
  std::vector<int32_t> arg0(ow8);
  for (int64_t x_ = 0; x_ < ow8; ++x_) {
    int64_t j0 = 0;
    while (j0 < kw - 1 && x_ * sw - pw + j0 * dw < 0) ++j0;
    arg0[x_] = static_cast<int32_t>(j0);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "max_pool_compact", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    uint8_t* lp = local.data_ptr<uint8_t>();
    at::parallel_for(0, N * C, 1, [&](int64_t p0, int64_t p1) {
      bool vec = false;
#if defined(__AVX2__)
      vec = std::is_same_v<scalar_t, float>;
      std::vector<float> padded(vec ? H * Wp : 0, -std::numeric_limits<float>::infinity());
      std::vector<float> best_row(ow8);
      std::vector<int32_t> arg_row(ow8);
#endif
      for (int64_t p = p0; p < p1; ++p) {
        const scalar_t* plane = xp + p * H * W;
#if defined(__AVX2__)
        if (vec)
          for (int64_t r = 0; r < H; ++r)
            std::memcpy(padded.data() + r * Wp + pw, plane + r * W, W * sizeof(float));
#endif
        for (int64_t y = 0; y < oh; ++y) {
          const int64_t r0 = y * sh - ph;
          int64_t i0 = 0, i1 = kh;
          while (r0 + i0 * dh < 0) ++i0;
          while (i1 > i0 && r0 + (i1 - 1) * dh >= H) --i1;
          scalar_t* orow = op + (p * oh + y) * ow;
          uint8_t* lrow = lp + (p * oh + y) * ow;
#if defined(__AVX2__)
          if (vec) {
            max_row_avx2(padded.data(), Wp, r0, i0, i1, kw, sw, dh, dw, ow8, arg0.data(),
                         best_row.data(), arg_row.data());
            std::memcpy(orow, best_row.data(), ow * sizeof(float));
            for (int64_t x_ = 0; x_ < ow; ++x_) lrow[x_] = static_cast<uint8_t>(arg_row[x_]);
            continue;
          }
#endif
          for (int64_t x_ = 0; x_ < ow; ++x_)
            max_window(plane, W, r0, x_ * sw - pw, i0, i1, kw, dh, dw, orow + x_, lrow + x_);
        }
      }
    });
  });
  return {out, local};
}

// Gradient of max_pool_compact: each output's gradient added at its argmax (planes in parallel).
at::Tensor max_pool_compact_backward(at::Tensor grad, at::Tensor local, int64_t kh, int64_t kw,
                                     int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh,
                                     int64_t dw, int64_t H, int64_t W) {
  const int64_t N = grad.size(0), C = grad.size(1), oh = grad.size(2), ow = grad.size(3);
  auto gx = at::zeros({N, C, H, W}, grad.options());
  std::vector<int64_t> offset(kh * kw);  // window position -> offset from the window origin
  for (int64_t a = 0; a < kh * kw; ++a) offset[a] = (a / kw) * dh * W + (a % kw) * dw;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "max_pool_compact_bwd", [&] {
    const scalar_t* gp = grad.data_ptr<scalar_t>();
    const uint8_t* lp = local.data_ptr<uint8_t>();
    scalar_t* xp = gx.data_ptr<scalar_t>();
    at::parallel_for(0, N * C, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        scalar_t* plane = xp + p * H * W;
        const scalar_t* g = gp + p * oh * ow;
        const uint8_t* l = lp + p * oh * ow;
        for (int64_t y = 0; y < oh; ++y) {
          scalar_t* origin = plane + (y * sh - ph) * W - pw;  // may point before the plane
          for (int64_t x_ = 0; x_ < ow; ++x_) origin[x_ * sw + offset[l[y * ow + x_]]] += g[y * ow + x_];
        }
      }
    });
  });
  return gx;
}
