// Median of CUDA-event timings after warm-up.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <vector>

#include "common/cuda_check.h"

namespace lynx::bench {

template <class F>
double median_ms(F&& run_once, int warmup, int iters, cudaStream_t stream) {
  for (int i = 0; i < warmup; ++i) run_once();
  cudaEvent_t start, stop;
  LYNX_CUDA(cudaEventCreate(&start));
  LYNX_CUDA(cudaEventCreate(&stop));
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) {
    LYNX_CUDA(cudaEventRecord(start, stream));
    run_once();
    LYNX_CUDA(cudaEventRecord(stop, stream));
    LYNX_CUDA(cudaEventSynchronize(stop));
    LYNX_CUDA(cudaEventElapsedTime(&ms[i], start, stop));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return iters % 2 ? ms[iters / 2] : 0.5 * (ms[iters / 2 - 1] + ms[iters / 2]);
}

}  // namespace lynx::bench
