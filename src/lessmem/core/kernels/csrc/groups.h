// Groups of GROUP elements in memory order, each kept as b-bit codes with a float32 min and scale
// (lessmem.core.storage): the per-group steps the quantize kernels share (quantize.cpp, and
// norm_codes.cpp, which codes and decodes BatchNorm's x_hat in the same groups). Every float
// operation is the torch reference's, in the same order and precision (the build turns off FMA
// contraction), so codes and decoded values are bit-identical to it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace lessmem_groups {

constexpr int64_t GROUP = 128;
constexpr int64_t GRAIN = 64;  // groups per parallel task: 8K elements

inline uint32_t hash32(uint32_t v) {  // rounding.hash32 (lowbias32)
  v ^= v >> 16;
  v *= 0x7FEB352Du;
  v ^= v >> 15;
  v *= 0x846CA68Bu;
  return v ^ (v >> 16);
}

#if defined(__AVX2__)
inline __m256i hash32_avx2(__m256i v) {  // hash32, 8 lanes at a time
  v = _mm256_xor_si256(v, _mm256_srli_epi32(v, 16));
  v = _mm256_mullo_epi32(v, _mm256_set1_epi32(0x7FEB352D));
  v = _mm256_xor_si256(v, _mm256_srli_epi32(v, 15));
  v = _mm256_mullo_epi32(v, _mm256_set1_epi32(static_cast<int>(0x846CA68Bu)));
  return _mm256_xor_si256(v, _mm256_srli_epi32(v, 16));
}

// The `bits` bytes (1, 2 or 4) holding 8 packed codes, as the low bytes of a word (little-endian),
// and back: fixed-size copies, which compile to one load or store (a variable size calls memcpy)
inline uint32_t load_code_bytes(const uint8_t* p, int64_t bits) {
  if (bits == 1) return p[0];
  if (bits == 2) {
    uint16_t w;
    std::memcpy(&w, p, 2);
    return w;
  }
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

inline void store_code_bytes(uint8_t* p, uint32_t w, int64_t bits) {
  if (bits == 1) {
    p[0] = static_cast<uint8_t>(w);
  } else if (bits == 2) {
    const auto h = static_cast<uint16_t>(w);
    std::memcpy(p, &h, 2);
  } else {
    std::memcpy(p, &w, 4);
  }
}

// lane k: k * bits, where code k of 8 sits in `bits` packed bytes
inline __m256i code_shifts(int64_t bits) {
  return _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(bits)));
}

// q = (x - lo) / scale, rounded (floor(q + noise) below 8 bits, else to nearest even), clamped
// to [0, levels]: the codes of one group, packed 8 / bits to a byte (the first in the low bits)
inline void group_codes(const float* xs, uint8_t* out, float lo, float scale, float levels, bool stochastic,
                        uint32_t base, int64_t bits) {
  const __m256 vlo = _mm256_set1_ps(lo), vscale = _mm256_set1_ps(scale);
  const __m256 zero = _mm256_setzero_ps(), top = _mm256_set1_ps(levels), unit = _mm256_set1_ps(0x1p-24f);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), shifts = code_shifts(bits);
  for (int64_t j = 0; j < GROUP; j += 8) {
    __m256 q = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(xs + j), vlo), vscale);
    if (stochastic) {
      const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(base + j)), lanes);
      const __m256 noise = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(hash32_avx2(index), 8)), unit);
      q = _mm256_floor_ps(_mm256_add_ps(q, noise));
    } else {
      q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    const __m256i c = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(q, zero), top));
    if (bits == 8) {  // 8 int32 in [0, 255] -> 8 bytes
      const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + j), _mm_packus_epi16(words, words));
    } else {  // each code to its bits, then the 8 lanes or-ed into `bits` bytes
      const __m256i placed = _mm256_sllv_epi32(c, shifts);
      __m128i w = _mm_or_si128(_mm256_castsi256_si128(placed), _mm256_extracti128_si256(placed, 1));
      w = _mm_or_si128(w, _mm_unpackhi_epi64(w, w));
      w = _mm_or_si128(w, _mm_shuffle_epi32(w, 1));
      store_code_bytes(out + j * bits / 8, static_cast<uint32_t>(_mm_cvtsi128_si32(w)), bits);
    }
  }
}

inline void group_range(const float* xs, float* lo, float* hi) {
  __m256 mn = _mm256_loadu_ps(xs), mx = mn;
  for (int64_t j = 8; j < GROUP; j += 8) {
    const __m256 v = _mm256_loadu_ps(xs + j);
    mn = _mm256_min_ps(mn, v);
    mx = _mm256_max_ps(mx, v);
  }
  alignas(32) float a[8], b[8];
  _mm256_store_ps(a, mn);
  _mm256_store_ps(b, mx);
  *lo = *std::min_element(a, a + 8);
  *hi = *std::max_element(b, b + 8);
}

// code * scale + lo (two roundings, as the reference's mul_ then add_) for the GROUP codes packed
// at `packed`, into vs
inline void group_values(const uint8_t* packed, float* vs, float lo, float scale, int64_t bits) {
  const __m256 vlo = _mm256_set1_ps(lo), vscale = _mm256_set1_ps(scale);
  const __m256i shifts = code_shifts(bits), mask = _mm256_set1_epi32((1 << bits) - 1);
  for (int64_t j = 0; j < GROUP; j += 8) {
    __m256i c;
    if (bits == 8) {
      c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + j)));
    } else {  // 8 codes in `bits` bytes: each lane shifts its own down
      const auto word = static_cast<int>(load_code_bytes(packed + j * bits / 8, bits));
      c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), mask);
    }
    _mm256_storeu_ps(vs + j, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(c), vscale), vlo));
  }
}
#else
inline float noise_at(uint32_t index_plus_key) {  // rounding.uniform_noise's element
  return static_cast<float>(hash32(index_plus_key) >> 8) * 0x1p-24f;
}

// q = (x - lo) / scale, rounded (floor(q + noise) below 8 bits, else to nearest even), clamped
// to [0, levels]: the codes of one group, packed 8 / bits to a byte (the first in the low bits)
inline void group_codes(const float* xs, uint8_t* out, float lo, float scale, float levels, bool stochastic,
                        uint32_t base, int64_t bits) {
  const int64_t per_byte = 8 / bits;
  std::memset(out, 0, GROUP / per_byte);
  for (int64_t j = 0; j < GROUP; ++j) {
    float q = (xs[j] - lo) / scale;
    q = stochastic ? std::floor(q + noise_at(base + static_cast<uint32_t>(j))) : std::nearbyint(q);
    const auto code = static_cast<uint8_t>(std::min(std::max(q, 0.0f), levels));
    out[j / per_byte] |= static_cast<uint8_t>(code << (j % per_byte * bits));
  }
}

inline void group_range(const float* xs, float* lo, float* hi) {
  *lo = *std::min_element(xs, xs + GROUP);
  *hi = *std::max_element(xs, xs + GROUP);
}

// code * scale + lo (two roundings, as the reference's mul_ then add_) for the GROUP codes packed
// at `packed`, into vs
inline void group_values(const uint8_t* packed, float* vs, float lo, float scale, int64_t bits) {
  const int64_t per_byte = 8 / bits;
  const int mask = (1 << bits) - 1;
  for (int64_t j = 0; j < GROUP; ++j) {
    const int code = (packed[j / per_byte] >> (j % per_byte * bits)) & mask;
    vs[j] = static_cast<float>(code) * scale + lo;
  }
}
#endif

// p itself where a float group can be read or written in place, else nullptr (a buffer converts)
template <typename scalar_t>
inline float* float_view(scalar_t* p) {
  if constexpr (std::is_same_v<std::remove_const_t<scalar_t>, float>) {
    return const_cast<float*>(p);
  } else {
    return nullptr;
  }
}

// The codes, min and scale of group g from its GROUP float values xs (already padded).
inline void quantize_group(const float* xs, int64_t g, int64_t bits, bool stochastic, uint32_t key32,
                           uint8_t* codes, float* lo, float* scale) {
  const float levels = static_cast<float>((1 << bits) - 1);
  float l, h;
  group_range(xs, &l, &h);
  const float s = std::max(h - l, 1e-20f) / levels;
  group_codes(xs, codes + g * GROUP * bits / 8, l, s, levels, stochastic, static_cast<uint32_t>(g * GROUP) + key32,
              bits);
  lo[g] = l;
  scale[g] = s;
}

// The GROUP float values group g of `codes` stands for, into vs.
inline void decode_group(const uint8_t* codes, const float* lo, const float* scale, int64_t g, int64_t bits,
                         float* vs) {
  group_values(codes + g * GROUP * bits / 8, vs, lo[g], scale[g], bits);
}

}  // namespace lessmem_groups
