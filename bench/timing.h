// Median of CUDA-event timings after warm-up.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
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

// With LYNX_BENCH_TIMES=1 in the environment, every timed run's ms in order on stderr, one line per
// median: whether a pass's time drifts or jumps within a process, which the median hides.
inline void print_timings(const char* what, const std::vector<float>& ms) {
  static const bool on = [] {
    const char* v = std::getenv("LYNX_BENCH_TIMES");
    return v && v[0] == '1';
  }();
  if (!on) return;
  std::fprintf(stderr, "timings %s ms:", what);
  for (const float t : ms) std::fprintf(stderr, " %.3f", t);
  std::fprintf(stderr, "\n");
}

// Host time of `run()`, in ms.
template <class F>
float host_ms(F&& run) {
  const auto t0 = std::chrono::steady_clock::now();
  run();
  return std::chrono::duration<float, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// The median over `iters` runs of the GPU time between events around `run_once()` on `stream`;
// `enqueue_ms`, when given, gets the median host time the call took to return (what the GPU may wait
// for when the passes are launched call by call).
template <class F>
double median_ms(F&& run_once, int warmup, int iters, cudaStream_t stream, double* enqueue_ms = nullptr) {
  for (int i = 0; i < warmup; ++i) run_once();
  cudaEvent_t start, stop;
  LYNX_CUDA(cudaEventCreate(&start));
  LYNX_CUDA(cudaEventCreate(&stop));
  std::vector<float> ms(iters), host(iters);
  for (int i = 0; i < iters; ++i) {
    LYNX_CUDA(cudaEventRecord(start, stream));
    host[i] = host_ms(run_once);
    LYNX_CUDA(cudaEventRecord(stop, stream));
    LYNX_CUDA(cudaEventSynchronize(stop));
    LYNX_CUDA(cudaEventElapsedTime(&ms[i], start, stop));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (enqueue_ms) *enqueue_ms = median(std::move(host));
  print_timings("pass", ms);
  return median(std::move(ms));
}

struct SplitMs {
  double total, first, second;  // medians of each, over the same iterations
  double enqueue = 0.0;         // median host time to enqueue first and second
};

// Times `first(); second();` as one run and each part by its own events in the same iterations: the
// parts of a sequence, which may differ from each part timed alone (caches, clocks).
template <class F, class G>
SplitMs median_split_ms(F&& first, G&& second, int warmup, int iters, cudaStream_t stream) {
  for (int i = 0; i < warmup; ++i) first(), second();
  cudaEvent_t ev[3];
  for (cudaEvent_t& e : ev) LYNX_CUDA(cudaEventCreate(&e));
  std::vector<float> total(iters), a(iters), b(iters), host(iters);
  for (int i = 0; i < iters; ++i) {
    LYNX_CUDA(cudaEventRecord(ev[0], stream));
    host[i] = host_ms(first);
    LYNX_CUDA(cudaEventRecord(ev[1], stream));
    host[i] += host_ms(second);
    LYNX_CUDA(cudaEventRecord(ev[2], stream));
    LYNX_CUDA(cudaEventSynchronize(ev[2]));
    LYNX_CUDA(cudaEventElapsedTime(&total[i], ev[0], ev[2]));
    LYNX_CUDA(cudaEventElapsedTime(&a[i], ev[0], ev[1]));
    LYNX_CUDA(cudaEventElapsedTime(&b[i], ev[1], ev[2]));
  }
  for (cudaEvent_t e : ev) cudaEventDestroy(e);
  print_timings("first", a);
  print_timings("second", b);
  return {median(std::move(total)), median(std::move(a)), median(std::move(b)), median(std::move(host))};
}

// What `enqueue()` puts on `stream`, captured once into a CUDA graph and replayed by launch(): one
// host call per replay instead of one per kernel, memset and tensor-map encoding.
class CapturedGraph {
 public:
  template <class F>
  CapturedGraph(cudaStream_t stream, F&& enqueue) {
    LYNX_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      enqueue();
    } catch (...) {
      cudaStreamEndCapture(stream, &graph_);  // leaves the stream usable; the partial graph is dropped
      if (graph_) cudaGraphDestroy(graph_);
      throw;
    }
    LYNX_CUDA(cudaStreamEndCapture(stream, &graph_));
    const cudaError_t err = cudaGraphInstantiate(&exec_, graph_, 0);
    if (err != cudaSuccess) {
      cudaGraphDestroy(graph_);
      ::lynx::detail::throw_cuda(err, "cudaGraphInstantiate", __FILE__, __LINE__);
    }
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  ~CapturedGraph() {
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
  }
  void launch(cudaStream_t stream) const { LYNX_CUDA(cudaGraphLaunch(exec_, stream)); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// A non-blocking stream, synchronised and destroyed when it goes out of scope (also by an exception).
class OwnedStream {
 public:
  OwnedStream() { LYNX_CUDA(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  ~OwnedStream() {
    cudaStreamSynchronize(s_);
    cudaStreamDestroy(s_);
  }
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

}  // namespace lynx::bench
