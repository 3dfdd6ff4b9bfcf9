// The SwiGLU's sigmoid and SiLU on the GPU, from the special-function unit's approximations, and the
// GEMM epilogues' SiLU with its exponential from FMAs.
#pragma once

#include "common/exp2.h"

namespace lynx {

// NOTES: 1 / (1 + __expf(-z)) compiles to an IEEE division: a reciprocal, four dependent FMAs and a
// range check that calls a slow path, each division in its own reconvergence region, so the 64 of a
// SwiGLU epilogue thread run one after the other with their latencies exposed. ex2.approx and
// rcp.approx (relative error about 2^-22 each, far below the bf16 rounding of every output) are one
// MUFU instruction each and let the compiler interleave the elements. Flushed to zero: z below
// about -87 gives exp(-z) = inf and sigmoid 0 (silu -0); above about 87, sigmoid 1. NaN stays NaN.
__device__ __forceinline__ float sigmoid(float z) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(z * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return r;
}

__device__ __forceinline__ float silu(float z) { return z * sigmoid(z); }

// NOTES: the gate/up GEMMs' epilogues take the exponential from exp2_by_fma (about ten FMA-pipe
// instructions, within 2^-22 like ex2.approx) and only the reciprocal from the MUFU unit: at 16 MUFU
// results a clock an SM, a [128, 256] tile's 64 sigmoids a thread of 256 took ~2 k clocks with two
// instructions each, while both consumer warpgroups' products waited. The row-streaming glue kernels,
// bound by memory, keep `silu` (with exp2_by_fma the bf16 SwiGLU backward spilled 8 bytes). Below
// about -87 the sigmoid (the reciprocal of about 2^126 or more) is under fp32's normal range, 0 (silu
// -0); above about 87, 1. NaN stays NaN (z times the sigmoid).
__device__ __forceinline__ float epilogue_silu(float z) {
  const float e = exp2_by_fma(z * -1.4426950408889634f);
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return z * r;
}

}  // namespace lynx
