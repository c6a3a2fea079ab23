// Scalar conversions between float and the 16-bit storage types, bit-exact
// with torch (round to nearest even, NaN stays NaN, fp16 subnormals kept).
// Every function has internal linkage: each translation unit, whatever its
// target flags, gets its own copy.
#pragma once

#include <math.h>
#include <cstdint>
#include <cstring>

#include "cpu_attn.h"

namespace vattn {
namespace cpu_attn {

// Storage types of the cache: 16 raw bits each.
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

namespace {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return bits_float(static_cast<uint32_t>(x.bits) << 16); }

inline float to_float(f16 x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1fu;
  const uint32_t mantissa = x.bits & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

inline void from_float(float x, float* out) { *out = x; }

inline void from_float(float x, bf16* out) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it quiet
    out->bits = static_cast<uint16_t>((u >> 16) | 0x40u);
    return;
  }
  out->bits = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline void from_float(float x, f16* out) {
  const uint32_t u = float_bits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) {  // inf, NaN
    out->bits = sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u);
  } else if (a >= 0x477ff000u) {  // >= 65520 rounds to infinity
    out->bits = sign | 0x7c00u;
  } else if (a < 0x38800000u) {  // below 2^-14: subnormal (a * 2^24 is exact, round to even)
    out->bits = sign | static_cast<uint16_t>(__builtin_nearbyintf(bits_float(a) * 16777216.0f));
  } else {  // normal: round to nearest even at bit 13, rebias the exponent (127 - 15)
    out->bits = sign | static_cast<uint16_t>((a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u) >> 13);
  }
}

inline int64_t element_size(DType d) { return d == DType::kF32 ? 4 : 2; }

// Calls f(T{}) with T the storage type of `d` (float, bf16, f16): the one
// switch over dtypes that typed code is reached through.
template <class F>
inline void with_storage_type(DType d, F&& f) {
  switch (d) {
    case DType::kF32: f(float{}); break;
    case DType::kBF16: f(bf16{}); break;
    case DType::kF16: f(f16{}); break;
  }
}

}  // namespace
}  // namespace cpu_attn
}  // namespace vattn
