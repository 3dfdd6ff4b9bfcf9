// The SwiGLU's sigmoid and SiLU on the GPU, from the special-function unit's approximations.
#pragma once

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

}  // namespace lynx
