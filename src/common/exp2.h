// 2^t in fp32 from FMAs alone (host and device, the same bits): for the SwiGLU's sigmoid, whose
// special-function instructions bound the gate/up epilogue (docs/kernels.md).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/hd.h"

namespace lynx {

LYNX_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

LYNX_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// 2^t for t clamped to [-125, 127] (a NaN t gives 2^-125): t = n + r, n = round(t) (ties to even, by
// adding 1.5·2^23, which leaves n in the low mantissa bits), r in [-0.5, 0.5]; 2^r by a degree-5
// polynomial (a near-minimax fit of relative error 7.5e-8; within 2^-22 with fp32's roundings,
// Exp2.RelativeErrorBelow2ToTheMinus22), and n added to its exponent field. The clamp keeps that
// exponent normal: 2^r's is 126 or 127, so n ≥ -125 gives at least 1 and n ≤ 127 at most 254.
LYNX_HD float exp2_by_fma(float t) {
  t = fminf(fmaxf(t, -125.0f), 127.0f);
  constexpr float kRound = 12582912.0f;  // 1.5 · 2^23
  const float shifted = t + kRound;
  const float r = t - (shifted - kRound);
  float p = 0.0013276454608565017f;
  p = fmaf(p, r, 0.009675540368205992f);
  p = fmaf(p, r, 0.05550713310283761f);
  p = fmaf(p, r, 0.24022119742784695f);
  p = fmaf(p, r, 0.693146967053492f);
  p = fmaf(p, r, 1.0000000716505522f);
  const uint32_t n = float_to_bits(shifted) - float_to_bits(kRound);  // round(t), two's complement
  return bits_to_float(float_to_bits(p) + (n << 23));
}

}  // namespace lynx
