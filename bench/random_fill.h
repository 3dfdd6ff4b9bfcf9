// Deterministic pseudo-random bf16 tensors, generated on the device and reproducible bit for bit on the
// host (integer hash, exact float scaling, round-to-nearest-even), so the benchmark's correctness check
// can rebuild any slice of a tensor without copying it back.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/hd.h"

namespace lynx::bench {

LYNX_HD uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform in [-scale, scale): 24 random bits, exact in float.
LYNX_HD float hash_uniform(uint64_t seed, uint64_t index, float scale) {
  const uint64_t h = mix64(seed ^ mix64(index));
  const float u = static_cast<float>(static_cast<int32_t>(h >> 40) - (1 << 23)) * (1.0f / float(1 << 23));
  return u * scale;
}

// dst[i] = bf16(hash_uniform(seed, i, scale)) for i < n.
void fill_uniform_bf16(uint16_t* dst, int64_t n, uint64_t seed, float scale, cudaStream_t stream);

}  // namespace lynx::bench
