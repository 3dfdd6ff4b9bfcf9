// Eight bf16 values as one 16-byte access: the glue kernels' unit of a row (glue.cu).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

namespace lynx::glue {

// Eight bf16 values: one 16-byte access.
// NOTES: held as a uint4. Held as four __nv_bfloat162, a Vec8 was copied member by member, and every
// load and store of one compiled to four 4-byte accesses (SASS at a662a2a): the same bytes, four
// times the L1 and L2 requests, in the combine and the SwiGLU kernels.
struct alignas(16) Vec8 {
  uint4 bits;
  // Elements 2p and 2p + 1 (p a compile-time constant once unrolled).
  __device__ __forceinline__ float2 pair(int p) const {
    const uint32_t w = p == 0 ? bits.x : p == 1 ? bits.y : p == 2 ? bits.z : bits.w;
    __nv_bfloat162 h;
    memcpy(&h, &w, sizeof(h));
    return __bfloat1622float2(h);
  }
  __device__ __forceinline__ void set_pair(int p, float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    uint32_t w;
    memcpy(&w, &h, sizeof(w));
    (p == 0 ? bits.x : p == 1 ? bits.y : p == 2 ? bits.z : bits.w) = w;
  }
};

}  // namespace lynx::glue
