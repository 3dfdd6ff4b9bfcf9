// What the FP8 quantisation kernels' files share: eight values of a bf16 row loaded as their bits and
// codes stored into a row (quantize_tiles.cu, quantize_blocks.cu), and their launchers' grid size and
// alignment checks (every one).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace lynx::fp8 {

// Eight adjacent values of a row of n from column c (c % 8 == 0) as bf16 bits, the first in the low half
// of .x, zeros past n: one 16-byte load where `vector` (n % 8 == 0 and the row 16-byte aligned).
__device__ __forceinline__ uint4 load8_bits(const __nv_bfloat16* row, int64_t c, int64_t n, bool vector) {
  if (vector) return c < n ? *reinterpret_cast<const uint4*>(row + c) : make_uint4(0, 0, 0, 0);
  uint32_t part[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) part[i] = c + i < n ? __bfloat16_as_ushort(row[c + i]) : 0u;
  return make_uint4(part[0] | part[1] << 16, part[2] | part[3] << 16, part[4] | part[5] << 16, part[6] | part[7] << 16);
}

// Stores the codes of `packed` (uint2: 8, uint4: 16; the first in the lowest byte) at columns c .. of a
// row of n: one store where `vector` (n a multiple of their count and the row aligned to their bytes),
// else those below n one at a time.
template <class Packed>
__device__ __forceinline__ void store_codes(uint8_t* row, int64_t c, int64_t n, bool vector, Packed packed) {
  constexpr int kCodes = int(sizeof(Packed));
  if (c >= n) return;
  if (vector) {
    *reinterpret_cast<Packed*>(row + c) = packed;
    return;
  }
  const uint32_t* word = reinterpret_cast<const uint32_t*>(&packed);
#pragma unroll
  for (int i = 0; i < kCodes; ++i) {
    if (c + i < n) row[c + i] = uint8_t(word[i / 4] >> (8 * (i % 4)));
  }
}

// A launch's grid size (the callers bound n).
inline int grid_of(int64_t n) { return static_cast<int>(n); }

inline bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace lynx::fp8
