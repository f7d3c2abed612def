// b-bit group quantization (lessmem.core.storage): one pass per group of GROUP elements for the
// min and max, the scale, the rounding (stochastic with lessmem.core.rounding's hash noise, or to
// nearest for int8_rn) and the packing; and one pass back. And bf16 storage's stochastic rounding. Every float operation is the one
// the torch reference makes, in the same order and precision, so codes, min, scale and decoded
// values are bit-identical to it (the build turns off FMA contraction for this).

#include "lessmem_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GROUP = 128;
constexpr int64_t GRAIN = 64;  // groups per parallel task: 8K elements

inline uint32_t hash32(uint32_t v) {  // rounding.hash32 (lowbias32)
  v ^= v >> 16;
  v *= 0x7FEB352Du;
  v ^= v >> 15;
  v *= 0x846CA68Bu;
  return v ^ (v >> 16);
}

inline float noise_at(uint32_t index_plus_key) {  // rounding.uniform_noise's element
  return static_cast<float>(hash32(index_plus_key) >> 8) * 0x1p-24f;
}

#if defined(__AVX2__)
// group_codes below, 8 lanes at a time
inline __m256i hash32_avx2(__m256i v) {
  v = _mm256_xor_si256(v, _mm256_srli_epi32(v, 16));
  v = _mm256_mullo_epi32(v, _mm256_set1_epi32(0x7FEB352D));
  v = _mm256_xor_si256(v, _mm256_srli_epi32(v, 15));
  v = _mm256_mullo_epi32(v, _mm256_set1_epi32(static_cast<int>(0x846CA68Bu)));
  return _mm256_xor_si256(v, _mm256_srli_epi32(v, 16));
}

void group_codes(const float* xs, uint8_t* cs, float lo, float scale, float levels, bool stochastic,
                 uint32_t base) {
  const __m256 vlo = _mm256_set1_ps(lo), vscale = _mm256_set1_ps(scale);
  const __m256 zero = _mm256_setzero_ps(), top = _mm256_set1_ps(levels), unit = _mm256_set1_ps(0x1p-24f);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
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
    // 8 int32 in [0, 255] -> 8 bytes
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(cs + j), _mm_packus_epi16(words, words));
  }
}

void group_range(const float* xs, float* lo, float* hi) {
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
#else
// q = (x - lo) / scale, rounded (floor(q + noise) below 8 bits, else to nearest even), clamped
// to [0, levels]: the codes of one group, one byte each
void group_codes(const float* xs, uint8_t* cs, float lo, float scale, float levels, bool stochastic,
                 uint32_t base) {
  for (int64_t j = 0; j < GROUP; ++j) {
    float q = (xs[j] - lo) / scale;
    q = stochastic ? std::floor(q + noise_at(base + static_cast<uint32_t>(j))) : std::nearbyint(q);
    cs[j] = static_cast<uint8_t>(std::min(std::max(q, 0.0f), levels));
  }
}

void group_range(const float* xs, float* lo, float* hi) {
  *lo = *std::min_element(xs, xs + GROUP);
  *hi = *std::max_element(xs, xs + GROUP);
}
#endif

// codes (one byte each) -> bytes of 8 / bits codes, the first in the low bits
void pack_codes(const uint8_t* cs, uint8_t* out, int64_t bits) {
  if (bits == 8) {
    std::memcpy(out, cs, GROUP);
    return;
  }
  const int64_t per_byte = 8 / bits;
  for (int64_t b = 0; b < GROUP / per_byte; ++b) {
    uint8_t byte = 0;
    for (int64_t k = 0; k < per_byte; ++k) byte |= static_cast<uint8_t>(cs[b * per_byte + k] << (k * bits));
    out[b] = byte;
  }
}

void unpack_codes(const uint8_t* packed, uint8_t* cs, int64_t bits) {
  if (bits == 8) {
    std::memcpy(cs, packed, GROUP);
    return;
  }
  const int64_t per_byte = 8 / bits;
  const uint8_t mask = static_cast<uint8_t>((1 << bits) - 1);
  for (int64_t b = 0; b < GROUP / per_byte; ++b) {
    for (int64_t k = 0; k < per_byte; ++k) cs[b * per_byte + k] = (packed[b] >> (k * bits)) & mask;
  }
}

// code * scale + lo (two roundings, as the reference's mul_ then add_) for one group
void group_values(const uint8_t* cs, float* vs, float lo, float scale) {
  int64_t j = 0;
#if defined(__AVX2__)
  const __m256 vlo = _mm256_set1_ps(lo), vscale = _mm256_set1_ps(scale);
  for (; j < GROUP; j += 8) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cs + j)));
    _mm256_storeu_ps(vs + j, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(c), vscale), vlo));
  }
#endif
  for (; j < GROUP; ++j) vs[j] = static_cast<float>(cs[j]) * scale + lo;
}

// p itself where a float group can be read or written in place, else nullptr (a buffer converts)
template <typename scalar_t>
float* float_view(scalar_t* p) {
  if constexpr (std::is_same_v<std::remove_const_t<scalar_t>, float>) {
    return const_cast<float*>(p);
  } else {
    return nullptr;
  }
}

}  // namespace

// x: flat, memory order, n > 0 elements; groups of GROUP, the last padded with x[n - 1].
// Returns (codes packed 8 / bits to a byte, float32 min per group, float32 scale per group);
// noise of element i (of the padded array) is hash32((i + key) mod 2^32) >> 8 times 2^-24.
std::vector<at::Tensor> quantize_groups(at::Tensor x, int64_t bits, int64_t key, bool stochastic) {
  const int64_t n = x.numel(), groups = (n + GROUP - 1) / GROUP;
  auto codes = at::empty({groups * GROUP * bits / 8}, x.options().dtype(at::kByte));
  auto lo = at::empty({groups}, x.options().dtype(at::kFloat));
  auto scale = at::empty({groups}, x.options().dtype(at::kFloat));
  const float levels = static_cast<float>((1 << bits) - 1);
  const uint32_t key32 = static_cast<uint32_t>(key);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_groups", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    uint8_t* cp = codes.data_ptr<uint8_t>();
    float* lp = lo.data_ptr<float>();
    float* sp = scale.data_ptr<float>();
    at::parallel_for(0, groups, GRAIN, [&](int64_t g0, int64_t g1) {
      alignas(32) float buf[GROUP];
      alignas(32) uint8_t cs[GROUP];
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t start = g * GROUP, valid = std::min(GROUP, n - start);
        const float* xs = valid == GROUP ? float_view(xp + start) : nullptr;
        if (xs == nullptr) {
          for (int64_t j = 0; j < valid; ++j) buf[j] = static_cast<float>(xp[start + j]);
          std::fill(buf + valid, buf + GROUP, buf[valid - 1]);
          xs = buf;
        }
        float l, h;
        group_range(xs, &l, &h);
        const float s = std::max(h - l, 1e-20f) / levels;
        group_codes(xs, cs, l, s, levels, stochastic, static_cast<uint32_t>(start) + key32);
        pack_codes(cs, cp + start * bits / 8, bits);
        lp[g] = l;
        sp[g] = s;
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
      alignas(32) uint8_t cs[GROUP];
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t start = g * GROUP, valid = std::min(GROUP, n - start);
        unpack_codes(cp + start * bits / 8, cs, bits);
        float* dst = valid == GROUP ? float_view(op + start) : nullptr;
        group_values(cs, dst != nullptr ? dst : vs, lp[g], sp[g]);
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
