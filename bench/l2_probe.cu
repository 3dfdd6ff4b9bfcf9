// lynx-l2-probe: which SMs share an L2 partition (docs/plan.md, item 1). Launch j (j = 1 .. SMs-1) has
// two readers: the CTA of block 0 reads a 16 MB buffer, then, after it signals, the CTA of block j
// reads it again, in the same kernel. Run under Nsight Compute (tools/gpu-l2-probe): lines homed in
// the other partition cross the L2 fabric once per partition that reads them, so the launch moves
// ~half the buffer over the fabric when block j's SM shares block 0's partition and ~all of it when
// it does not. (A first design re-read the buffer in a second launch; near copies of the other
// partition's lines did not survive from one launch to the next, so every split looked alike.)
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "common/cuda_check.h"

namespace {

constexpr int64_t kBufferBytes = int64_t(16) << 20;  // well within the L2
constexpr int kPinBytes = 120 << 10;                 // shared memory that keeps one CTA per SM
constexpr uint32_t kMaxWaitTries = 1u << 24;         // x 1 us of nanosleep: far beyond a 16 MB read

__device__ unsigned sm_id() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

__device__ unsigned long long read_all(const int4* __restrict__ buffer, int64_t vectors) {
  unsigned long long acc = 0;
  for (int64_t i = threadIdx.x; i < vectors; i += blockDim.x) {
    const int4 v = __ldcg(buffer + i);
    acc += unsigned(v.x ^ v.w);
  }
  return acc;
}

// out: [0] block 0's SM, [1] block `second`'s SM, [2] 1 when the second reader timed out waiting.
__global__ void __launch_bounds__(256, 1) two_readers(const int4* __restrict__ buffer, int64_t vectors, int second,
                                                      int* flag, int* out, unsigned long long* sink) {
  unsigned long long acc = 0;
  if (blockIdx.x == 0) {
    acc = read_all(buffer, vectors);
    __syncthreads();
    if (threadIdx.x == 0) {
      out[0] = int(sm_id());
      __threadfence();
      atomicExch(flag, 1);
    }
  } else if (int(blockIdx.x) == second) {
    if (threadIdx.x == 0) {
      uint32_t tries = 0;
      while (atomicAdd(flag, 0) == 0 && ++tries < kMaxWaitTries) __nanosleep(1000);
      out[1] = int(sm_id());
      out[2] = tries == kMaxWaitTries;  // the first reader never signalled: the map is not valid
    }
    __syncthreads();
    acc = read_all(buffer, vectors);
  }
  if (acc == 0x5EEDull) sink[0] = acc;  // never true for the buffer's contents; keeps the loads
}

}  // namespace

int main() {
  int device = 0, sms = 0;
  LYNX_CUDA(cudaGetDevice(&device));
  LYNX_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  int4* buffer = nullptr;
  int *flag = nullptr, *out = nullptr;
  unsigned long long* sink = nullptr;
  LYNX_CUDA(cudaMalloc(&buffer, kBufferBytes));
  LYNX_CUDA(cudaMalloc(&flag, sizeof(int)));
  LYNX_CUDA(cudaMalloc(&out, 3 * sizeof(int)));
  LYNX_CUDA(cudaMalloc(&sink, sizeof(unsigned long long)));
  LYNX_CUDA(cudaMemset(buffer, 0x11, kBufferBytes));
  LYNX_CUDA(cudaFuncSetAttribute(two_readers, cudaFuncAttributeMaxDynamicSharedMemorySize, kPinBytes));
  std::printf("lynx-l2-probe: %d SMs; launch j: block 0 reads, then block j re-reads (j = 1 .. %d)\n", sms, sms - 1);
  for (int j = 1; j < sms; ++j) {
    LYNX_CUDA(cudaMemset(flag, 0, sizeof(int)));
    two_readers<<<sms, 256, kPinBytes>>>(buffer, kBufferBytes / 16, j, flag, out, sink);
    LYNX_CUDA(cudaGetLastError());
    int host[3];
    LYNX_CUDA(cudaMemcpy(host, out, sizeof host, cudaMemcpyDeviceToHost));
    std::printf("launch %d: first reader SM %d, second reader SM %d%s\n", j, host[0], host[1],
                host[2] ? " (timed out waiting for the first: not valid)" : "");
    std::fflush(stdout);  // the lines survive a timeout of the profiled run
  }
  return 0;
}
