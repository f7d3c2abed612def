// 1-bit activation masks: clamp + pack the pass mask in one pass, and the masked gradient.
// Bit layout of lessmem.core.functions.masks.pack_bits: element i of each group of 8, in
// memory order, in bit i.

#include "lessmem_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

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
