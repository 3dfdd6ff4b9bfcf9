#include "gpu/spin_kernel.h"

namespace lynx::test {
namespace {

__device__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spin_kernel(uint64_t ns) {
  const uint64_t start = globaltimer();
  while (globaltimer() - start < ns) __nanosleep(1000);
}

}  // namespace

void spin_on_stream(cudaStream_t stream, uint64_t ns) { spin_kernel<<<1, 1, 0, stream>>>(ns); }

}  // namespace lynx::test
