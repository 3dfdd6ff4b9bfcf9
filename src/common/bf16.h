// Host-side bf16 storage and conversions (round to nearest even), independent of cuda_bf16.h.
#pragma once

#include <cstdint>
#include <cstring>

namespace lynx {

// bf16 storage in device buffers and kernel arguments (the kernels convert with cuda_bf16.h).
using bf16_t = uint16_t;

struct HostBf16 {
  uint16_t bits;
};

inline float bf16_to_float(HostBf16 v) {
  uint32_t u = uint32_t(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline HostBf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) return HostBf16{uint16_t((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return HostBf16{uint16_t(u >> 16)};
}

inline double to_double(HostBf16 v) { return bf16_to_float(v); }
inline double to_double(double v) { return v; }

}  // namespace lynx
