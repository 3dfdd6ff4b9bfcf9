#include <cuda_bf16.h>

#include "common/cuda_check.h"
#include "random_fill.h"

namespace lynx::bench {
namespace {

// grid-stride, one element per thread per step.
__global__ void fill_uniform_bf16_kernel(__nv_bfloat16* dst, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    dst[i] = __float2bfloat16_rn(hash_uniform(seed, uint64_t(i), scale));
  }
}

}  // namespace

void fill_uniform_bf16(uint16_t* dst, int64_t n, uint64_t seed, float scale, cudaStream_t stream) {
  if (n == 0) return;
  fill_uniform_bf16_kernel<<<132 * 16, 256, 0, stream>>>(reinterpret_cast<__nv_bfloat16*>(dst), n, seed, scale);
  LYNX_CHECK_LAUNCH();
}

}  // namespace lynx::bench
