"""Fused C++ kernels on CPU for what lessmem adds around the stock ops (built on first use).

The torch reference makes several passes over memory where these make one, with ATen's thread
pool (AVX2 paths for float32 where the compiler has it):

- ``clamp_and_pack(x, lo, hi)``: y = clamp(x, lo, hi) and the packed 1-bit pass mask.
- ``masked_grad(grad, bits)``: grad where the bit is set, else 0.
- ``pool_blocks(x, kernel)``: k×k block means (the saved copy of a conv input), summed in the
  reference's order, so the values are identical.
- ``max_pool_compact`` / ``max_pool_compact_backward``: max-pooling that records the argmax as
  a uint8 position in its window (not an int64 plane index), and its gradient scatter.
- ``depthwise_weight_grad``: a depthwise conv's weight gradient from its block means, each
  channel expanded in cache (the pooled grid saves depthwise convs nothing; a full-size expanded
  copy costs more than the gradient).

Same bit layout as ``ops.pack_bits`` (element i of each group of 8, in memory order, in bit i).
Compiled with ``torch.utils.cpp_extension.load_inline`` the first time a compressed model runs
on CPU (about a minute; cached in ``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``;
prebuild with ``lessmem-kernels``). Without a C++ compiler, or with
``LESSMEM_CPU_KERNELS=0``, the torch reference is used (one warning).
"""

from __future__ import annotations

import os
import threading
import warnings

import torch
from torch import Tensor

from lessmem.core.layout import flat_memory_order

_SOURCE = r"""
#include <torch/extension.h>
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

// Work in chunks of CHUNK elements: a vectorizable elementwise loop into a byte buffer, then
// 8 flags -> 1 byte with one multiply per byte (and back), so every loop is branch-free.
// float32 on AVX2 skips the byte buffer: one compare + movemask gives the 8 bits directly.
constexpr int64_t CHUNK = 4096;
constexpr uint64_t GATHER = 0x0102040810204080ULL;  // byte i's bit 0 -> bit 56 + i
constexpr uint64_t SPREAD = 0x0101010101010101ULL;
constexpr uint64_t SELECT = 0x8040201008040201ULL;  // lane i keeps bit i

template <typename scalar_t>
void clamp_pack_scalar(const scalar_t* xs, scalar_t* ys, uint8_t* bs, int64_t len, scalar_t lo_s,
                       scalar_t hi_s, bool has_hi) {
  alignas(64) uint8_t flag[CHUNK];
  if (has_hi) {
    for (int64_t i = 0; i < len; ++i) {
      scalar_t t = xs[i];
      t = t < lo_s ? lo_s : t;
      t = t > hi_s ? hi_s : t;
      ys[i] = t;
      flag[i] = (t > lo_s) & (t < hi_s);
    }
  } else {
    for (int64_t i = 0; i < len; ++i) {
      scalar_t t = xs[i];
      t = t < lo_s ? lo_s : t;
      ys[i] = t;
      flag[i] = t > lo_s;
    }
  }
  const int64_t full = (len + 7) / 8;
  std::memset(flag + len, 0, full * 8 - len);
  for (int64_t b = 0; b < full; ++b) {
    uint64_t w;
    std::memcpy(&w, flag + 8 * b, 8);
    bs[b] = static_cast<uint8_t>((w * GATHER) >> 56);
  }
}

template <typename scalar_t>
void clamp_pack_chunk(const scalar_t* xs, scalar_t* ys, uint8_t* bs, int64_t len, scalar_t lo_s,
                      scalar_t hi_s, bool has_hi) {
  clamp_pack_scalar(xs, ys, bs, len, lo_s, hi_s, has_hi);
}

#if defined(__AVX2__)
template <>
void clamp_pack_chunk<float>(const float* xs, float* ys, uint8_t* bs, int64_t len, float lo_s,
                             float hi_s, bool has_hi) {
  const int64_t vec = len / 8 * 8;
  const __m256 lo = _mm256_set1_ps(lo_s), hi = _mm256_set1_ps(hi_s);
  for (int64_t i = 0; i < vec; i += 8) {
    __m256 t = _mm256_max_ps(lo, _mm256_loadu_ps(xs + i));  // NaN stays NaN (second operand)
    __m256 pass = _mm256_cmp_ps(t, lo, _CMP_GT_OQ);
    if (has_hi) {
      t = _mm256_min_ps(hi, t);
      pass = _mm256_and_ps(pass, _mm256_cmp_ps(t, hi, _CMP_LT_OQ));
    }
    _mm256_storeu_ps(ys + i, t);
    bs[i / 8] = static_cast<uint8_t>(_mm256_movemask_ps(pass));
  }
  // the last < 8 elements (vec is a multiple of 8: their bits start a fresh byte)
  if (vec < len) clamp_pack_scalar(xs + vec, ys + vec, bs + vec / 8, len - vec, lo_s, hi_s, has_hi);
}
#endif

// y = clamp(x, lo, hi) (NaN stays NaN, like torch.clamp); bit i of byte b: y[8b+i] strictly
// inside (lo, hi). x, y: flat, memory order; y may alias x.
at::Tensor clamp_pack(at::Tensor x, at::Tensor y, double lo, double hi, bool has_hi) {
  const int64_t n = x.numel();
  auto bits = at::empty({(n + 7) / 8}, x.options().dtype(at::kByte));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "clamp_pack", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    uint8_t* bp = bits.data_ptr<uint8_t>();
    const scalar_t lo_s = static_cast<scalar_t>(lo), hi_s = static_cast<scalar_t>(hi);
    at::parallel_for(0, (n + CHUNK - 1) / CHUNK, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t start = c * CHUNK;
        clamp_pack_chunk<scalar_t>(xp + start, yp + start, bp + start / 8,
                                   std::min(CHUNK, n - start), lo_s, hi_s, has_hi);
      }
    });
  });
  return bits;
}

template <typename scalar_t>
void masked_grad_scalar(const scalar_t* gs, const uint8_t* bs, scalar_t* os, int64_t len) {
  alignas(64) uint8_t flag[CHUNK];
  const int64_t full = (len + 7) / 8;
  for (int64_t b = 0; b < full; ++b) {
    const uint64_t w = (static_cast<uint64_t>(bs[b]) * SPREAD) & SELECT;
    std::memcpy(flag + 8 * b, &w, 8);
  }
  const scalar_t zero = static_cast<scalar_t>(0);
  for (int64_t i = 0; i < len; ++i) {
    os[i] = flag[i] ? gs[i] : zero;
  }
}

template <typename scalar_t>
void masked_grad_chunk(const scalar_t* gs, const uint8_t* bs, scalar_t* os, int64_t len) {
  masked_grad_scalar(gs, bs, os, len);
}

#if defined(__AVX2__)
template <>
void masked_grad_chunk<float>(const float* gs, const uint8_t* bs, float* os, int64_t len) {
  const int64_t vec = len / 8 * 8;
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int64_t i = 0; i < vec; i += 8) {
    const __m256i byte = _mm256_set1_epi32(bs[i / 8]);
    const __m256i keep = _mm256_cmpeq_epi32(_mm256_and_si256(byte, lane_bit), lane_bit);
    _mm256_storeu_ps(os + i, _mm256_and_ps(_mm256_loadu_ps(gs + i), _mm256_castsi256_ps(keep)));
  }
  if (vec < len) masked_grad_scalar(gs + vec, bs + vec / 8, os + vec, len - vec);
}
#endif

// out[i] = bit i set ? grad[i] : 0; flat, memory order.
at::Tensor masked_grad(at::Tensor grad, at::Tensor bits, at::Tensor out) {
  const int64_t n = grad.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "masked_grad", [&] {
    const scalar_t* gp = grad.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const uint8_t* bp = bits.data_ptr<uint8_t>();
    at::parallel_for(0, (n + CHUNK - 1) / CHUNK, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t start = c * CHUNK;
        masked_grad_chunk<scalar_t>(gp + start, bp + start / 8, op + start, std::min(CHUNK, n - start));
      }
    });
  });
  return out;
}

// kh x kw block means of x (N, C, H, W), H and W multiples of the block; one pass, sums in
// float (double for double) in the torch reference's order (rows of a block first, then its
// columns). Contiguous or channels-last in, the same layout out.
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

// Weight gradient of a depthwise conv (one input and one output channel per group) whose input is
// known by its kb x kb block means `pooled` (N, C, H/kbh, W/kbw): per channel, the block means are
// expanded into a zero-padded plane that stays in cache, and each tap's gradient is a sum of
// products over the output rows (contiguous when the stride is 1, so it vectorizes). Channels in
// parallel, images in order: no atomics. Both tensors contiguous NCHW.
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

// max_pool2d on contiguous (N, C, H, W) that records, per output, the argmax position inside
// its window (row * kw + col, uint8) instead of an int64 plane index. Same choice as ATen's CPU
// kernel: the first maximum wins, a NaN wins (the last NaN), an all -inf window keeps its first
// in-bounds position. Outputs whose window lies inside the columns are computed 8 at a time
// (AVX2, float32), the rest one by one.
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
"""

_lock = threading.Lock()
_module = None
_failed = False


def _load():
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is None and not _failed:
            try:
                import logging

                from torch.utils.cpp_extension import load_inline

                # it warns that there is no CUDA runtime, which a CPU build does not need
                logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
                _module = load_inline(
                    name="lessmem_cpu_kernels_v3", cpp_sources=[_SOURCE],
                    functions=["clamp_pack", "masked_grad", "pool_blocks", "max_pool_compact",
                               "max_pool_compact_backward", "depthwise_weight_grad"],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as e:  # no compiler, headers, ...: the torch reference still works
                _failed = True
                warnings.warn(f"lessmem: fused CPU kernels unavailable ({type(e).__name__}: "
                              f"{str(e)[:200]}); using the slower torch reference", stacklevel=3)
    return _module


def enabled_for(t: Tensor) -> bool:
    if os.environ.get("LESSMEM_CPU_KERNELS", "1") == "0" or t.device.type != "cpu":
        return False
    if torch.compiler.is_compiling() or t.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return False
    return _load() is not None


def clamp_and_pack(x: Tensor, lo: float, hi: float | None, inplace: bool = False) -> tuple[Tensor, Tensor]:
    """(clamp(x, lo, hi), packed pass mask in x's memory order); x dense (contiguous or
    channels-last); written into x itself when ``inplace``."""
    y = x if inplace else torch.empty_like(x)
    bits = _module.clamp_pack(flat_memory_order(x), flat_memory_order(y), float(lo),
                              float(hi if hi is not None else 0.0), hi is not None)
    return y, bits


def masked_grad(grad: Tensor, bits: Tensor, channels_last: bool) -> Tensor:
    """grad where the packed bit is set, else 0, in the activation's layout."""
    grad = grad.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    out = torch.empty_like(grad)
    _module.masked_grad(flat_memory_order(grad), bits, flat_memory_order(out))
    return out


def pool_blocks(x: Tensor, kernel: tuple[int, int]) -> Tensor:
    """k×k block means of a dense 4-d x whose height and width are multiples of the block."""
    return _module.pool_blocks(x, kernel[0], kernel[1])


def depthwise_weight_grad(grad: Tensor, pooled: Tensor, weight_hw, stride, padding, dilation, kernel) -> Tensor:
    """Weight gradient (C, 1, kh, kw) of a depthwise conv from its output gradient and the k×k block
    means of its input; both contiguous NCHW, the blocks tiling the input."""
    return _module.depthwise_weight_grad(grad, pooled, *weight_hw, *stride, *padding, *dilation, *kernel)


def max_pool_compact(x: Tensor, kernel, stride, padding, dilation, out_hw) -> tuple[Tensor, Tensor]:
    """(max_pool2d(x), argmax position in each window as uint8); x contiguous 4-d."""
    return tuple(_module.max_pool_compact(x, *kernel, *stride, *padding, *dilation, *out_hw))


def max_pool_compact_backward(grad: Tensor, local: Tensor, kernel, stride, padding, dilation, in_hw) -> Tensor:
    return _module.max_pool_compact_backward(grad.contiguous(), local, *kernel, *stride, *padding, *dilation, *in_hw)

