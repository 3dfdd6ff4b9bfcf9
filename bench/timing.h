// Median of CUDA-event timings after warm-up.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "common/cuda_check.h"

namespace lynx::bench {

// The median of the timings (ms), the mean of the middle two for an even count.
inline double median(std::vector<float> ms) {
  std::sort(ms.begin(), ms.end());
  const size_t n = ms.size();
  return n % 2 ? double(ms[n / 2]) : 0.5 * (double(ms[n / 2 - 1]) + double(ms[n / 2]));
}

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
  return median(std::move(ms));
}

struct SplitMs {
  double total, first, second;  // medians of each, over the same iterations
};

// Times `first(); second();` as one run and each part by its own events in the same iterations: the
// parts of a sequence, which may differ from each part timed alone (caches, clocks).
template <class F, class G>
SplitMs median_split_ms(F&& first, G&& second, int warmup, int iters, cudaStream_t stream) {
  for (int i = 0; i < warmup; ++i) first(), second();
  cudaEvent_t ev[3];
  for (cudaEvent_t& e : ev) LYNX_CUDA(cudaEventCreate(&e));
  std::vector<float> total(iters), a(iters), b(iters);
  for (int i = 0; i < iters; ++i) {
    LYNX_CUDA(cudaEventRecord(ev[0], stream));
    first();
    LYNX_CUDA(cudaEventRecord(ev[1], stream));
    second();
    LYNX_CUDA(cudaEventRecord(ev[2], stream));
    LYNX_CUDA(cudaEventSynchronize(ev[2]));
    LYNX_CUDA(cudaEventElapsedTime(&total[i], ev[0], ev[2]));
    LYNX_CUDA(cudaEventElapsedTime(&a[i], ev[0], ev[1]));
    LYNX_CUDA(cudaEventElapsedTime(&b[i], ev[1], ev[2]));
  }
  for (cudaEvent_t e : ev) cudaEventDestroy(e);
  return {median(std::move(total)), median(std::move(a)), median(std::move(b))};
}

}  // namespace lynx::bench
