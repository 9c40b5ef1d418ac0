// IEEE binary16 and bfloat16 conversions, rounding to nearest even, for the 16-bit reductions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace hpctrial::comm::detail {

inline std::uint32_t bits_of(float f) {
  std::uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  return x;
}

inline float float_of(std::uint32_t x) {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}

inline std::uint16_t float_to_half(float f) {
  std::uint32_t x = bits_of(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0u));
  if (x >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (x < 0x38800000u) {
    // Below the smallest normal half: a multiple of 2^-24, rounded to nearest even.
    const float scaled = float_of(x) * 16777216.0f;
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(std::nearbyint(scaled)));
  }
  x += 0xfffu + ((x >> 13) & 1u);
  x -= 0x38000000u;  // exponent bias 127 -> 15
  return static_cast<std::uint16_t>(sign | (x >> 13));
}

inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) return float_of(sign | bits_of(static_cast<float>(mantissa) * (1.0f / 16777216.0f)));
  if (exponent == 31) return float_of(sign | 0x7f800000u | (mantissa << 13));
  return float_of(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

inline std::uint16_t float_to_bfloat16(float f) {
  const std::uint32_t x = bits_of(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  return static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float bfloat16_to_float(std::uint16_t b) { return float_of(static_cast<std::uint32_t>(b) << 16); }

}  // namespace hpctrial::comm::detail
