// The recipe's power-of-two scale exponent from a bf16 magnitude's bits, without branches, for host and
// device (e4m3.cuh uses it; the CPU tests check it against src/reference/fp8.h's pow2_scale over every
// finite bf16 magnitude, tests/cpu/test_fp8_reference.cpp).
#pragma once

#include <cstdint>

#include "common/hd.h"

namespace lynx::fp8 {

constexpr int kMinScaleExponent = -126;  // scales stay normal floats

// The exponent e of the smallest power of two 2^e with m's value <= 448 · 2^e, at least -126, and 0 for
// m = 0: e4m3::scale_exponent of m's value, for a finite bf16 magnitude m (bits below 0x7F80).
// NOTES: where a column's many scales are computed at once, scale_exponent's early returns made each
// its own branch (the dgrad of down's epilogue, gemm/swiglu_backward_epilogue.cuh). A bf16 value's
// fraction is its fp32 one's top 7 bits, so "m <= 0.875" in frexp's terms is fraction <= 0x60; a
// subnormal's p - 9 lies below -126.
LYNX_HD int scale_exponent_of_bf16_bits(uint32_t m) {
  const int p = int((m >> 7) & 0xFFu) - 126;
  const int e = (m & 0x7Fu) <= 0x60u ? p - 9 : p - 8;
  return m == 0 ? 0 : (e < kMinScaleExponent ? kMinScaleExponent : e);
}

}  // namespace lynx::fp8
