// lynx-l2-probe: which SMs share an L2 partition (docs/plan.md, item 1). For each rule that splits
// the SMs in two by %smid, one side reads a 16 MB buffer, then the same side or the other side reads
// it again. Run under Nsight Compute with --cache-control none (tools/gpu-l2-probe): when a rule is
// the partition map, the other side's second read crosses the L2 fabric and the same side's does not.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>

#include "common/cuda_check.h"

namespace {

constexpr int kRules = 7;
constexpr int64_t kBufferBytes = int64_t(16) << 20;  // within one partition's half of the L2
constexpr int64_t kFlushBytes = int64_t(256) << 20;  // evicts the buffer between experiments
constexpr int kPinBytes = 120 << 10;                 // shared memory that keeps one CTA per SM

// The side (0 or 1) of SM `sm` under rule `rule`: 0: the upper half of the SM ids, 1-6: bit rule-1.
__device__ int side_of(int rule, unsigned sm, unsigned sms) {
  return rule == 0 ? int(sm >= sms / 2) : int((sm >> (rule - 1)) & 1u);
}

__device__ unsigned sm_id() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// One CTA per SM; the CTAs on `side` each read the whole buffer through L2 (not L1).
__global__ void __launch_bounds__(256, 1) read_side(const int4* __restrict__ buffer, int64_t vectors, int rule,
                                                    int side, unsigned sms, unsigned long long* sink) {
  if (side_of(rule, sm_id(), sms) != side) return;
  unsigned long long acc = 0;
  for (int64_t i = threadIdx.x; i < vectors; i += blockDim.x) {
    const int4 v = __ldcg(buffer + i);
    acc += unsigned(v.x ^ v.w);
  }
  if (acc == 0x5EEDull) sink[0] = acc;  // never true for the buffer's contents; keeps the loads
}

__global__ void flush(int4* dst, int64_t vectors) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < vectors; i += int64_t(gridDim.x) * blockDim.x) {
    dst[i] = make_int4(int(i), 1, 2, 3);
  }
}

}  // namespace

int main() {
  int device = 0, sms = 0;
  LYNX_CUDA(cudaGetDevice(&device));
  LYNX_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  int4 *buffer = nullptr, *flush_buffer = nullptr;
  unsigned long long* sink = nullptr;
  LYNX_CUDA(cudaMalloc(&buffer, kBufferBytes));
  LYNX_CUDA(cudaMalloc(&flush_buffer, kFlushBytes));
  LYNX_CUDA(cudaMalloc(&sink, sizeof(unsigned long long)));
  LYNX_CUDA(cudaMemset(buffer, 0x11, kBufferBytes));
  LYNX_CUDA(cudaFuncSetAttribute(read_side, cudaFuncAttributeMaxDynamicSharedMemorySize, kPinBytes));
  const int64_t vectors = kBufferBytes / 16;
  std::printf("lynx-l2-probe: %d SMs; per rule, read_side launches in this order: side 0, side 0 (same), "
              "side 0, side 1 (other); a flush kernel before each pair\n", sms);
  for (int rule = 0; rule < kRules; ++rule) {
    for (int other = 0; other < 2; ++other) {
      flush<<<sms * 4, 256>>>(flush_buffer, kFlushBytes / 16);
      read_side<<<sms, 256, kPinBytes>>>(buffer, vectors, rule, 0, unsigned(sms), sink);
      read_side<<<sms, 256, kPinBytes>>>(buffer, vectors, rule, other, unsigned(sms), sink);
    }
  }
  LYNX_CUDA(cudaGetLastError());
  LYNX_CUDA(cudaDeviceSynchronize());
  std::printf("rules: 0 = SM id >= %d, 1-6 = bit 0-5 of the SM id\n", sms / 2);
  return 0;
}
