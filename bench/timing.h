// Median of CUDA-event timings, in a clock regime (bench/regime.h).
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <utility>
#include <vector>

#include "common/cuda_check.h"
#include "gpu_clock.h"
#include "regime.h"

namespace lynx::bench {

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

// What a row's timed passes gave: the median GPU time between events around each pass, the median
// host time the enqueue took (what the GPU may wait for when the passes are launched call by call),
// and the SM clock read after each pass.
struct Timing {
  double ms = 0.0, enqueue_ms = 0.0;
  ClockSummary clocks;
};

namespace detail {

struct Timed {
  float ms, host_ms;
  ClockSample clock;
};

inline void idle_ms(cudaStream_t stream, int ms) {
  LYNX_CUDA(cudaStreamSynchronize(stream));
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

inline double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline ClockSummary clocks_of(const std::vector<Timed>& runs) {
  std::vector<ClockSample> s;
  for (const Timed& t : runs) {
    if (t.clock.sm_mhz > 0) s.push_back(t.clock);
  }
  return summarize_clocks(std::move(s));
}

}  // namespace detail

// `run_once()` on `stream`, timed in the order `p` sets (bench/regime.h); `clock` may be null.
template <class F>
Timing time_pass(F&& run_once, const Protocol& p, cudaStream_t stream, const GpuClock* clock) {
  cudaEvent_t start, stop;
  LYNX_CUDA(cudaEventCreate(&start));
  LYNX_CUDA(cudaEventCreate(&stop));
  auto warm = [&] {
    run_once();
    LYNX_CUDA(cudaStreamSynchronize(stream));
  };
  auto timed = [&] {
    detail::Timed t{};
    LYNX_CUDA(cudaEventRecord(start, stream));
    t.host_ms = host_ms(run_once);
    LYNX_CUDA(cudaEventRecord(stop, stream));
    LYNX_CUDA(cudaEventSynchronize(stop));
    LYNX_CUDA(cudaEventElapsedTime(&t.ms, start, stop));
    if (clock) t.clock = clock->sample();
    return t;
  };
  const std::vector<detail::Timed> runs =
      run_protocol(p, warm, timed, [&](int ms) { detail::idle_ms(stream, ms); }, detail::now_ms);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::vector<float> ms, host;
  for (const detail::Timed& t : runs) ms.push_back(t.ms), host.push_back(t.host_ms);
  print_timings("pass", ms);
  return {median_of(std::move(ms)), median_of(std::move(host)), detail::clocks_of(runs)};
}

struct SplitMs {
  double total, first, second;  // medians of each, over the same iterations
  double enqueue = 0.0;         // median host time to enqueue first and second
  ClockSummary clocks;
};

// Times `first(); second();` as one run and each part by its own events in the same iterations (the
// parts of a sequence, which may differ from each part timed alone: caches, clocks), in `p`'s order.
template <class F, class G>
SplitMs time_split(F&& first, G&& second, const Protocol& p, cudaStream_t stream, const GpuClock* clock) {
  cudaEvent_t ev[3];
  for (cudaEvent_t& e : ev) LYNX_CUDA(cudaEventCreate(&e));
  std::vector<float> a, b;
  auto warm = [&] {
    first();
    second();
    LYNX_CUDA(cudaStreamSynchronize(stream));
  };
  auto timed = [&] {
    detail::Timed t{};
    LYNX_CUDA(cudaEventRecord(ev[0], stream));
    t.host_ms = host_ms(first);
    LYNX_CUDA(cudaEventRecord(ev[1], stream));
    t.host_ms += host_ms(second);
    LYNX_CUDA(cudaEventRecord(ev[2], stream));
    LYNX_CUDA(cudaEventSynchronize(ev[2]));
    float fa = 0, fb = 0;
    LYNX_CUDA(cudaEventElapsedTime(&t.ms, ev[0], ev[2]));
    LYNX_CUDA(cudaEventElapsedTime(&fa, ev[0], ev[1]));
    LYNX_CUDA(cudaEventElapsedTime(&fb, ev[1], ev[2]));
    a.push_back(fa);
    b.push_back(fb);
    if (clock) t.clock = clock->sample();
    return t;
  };
  const std::vector<detail::Timed> runs =
      run_protocol(p, warm, timed, [&](int ms) { detail::idle_ms(stream, ms); }, detail::now_ms);
  for (cudaEvent_t e : ev) cudaEventDestroy(e);
  std::vector<float> total, host;
  for (const detail::Timed& t : runs) total.push_back(t.ms), host.push_back(t.host_ms);
  print_timings("first", a);
  print_timings("second", b);
  return {median_of(std::move(total)), median_of(std::move(a)), median_of(std::move(b)), median_of(std::move(host)),
          detail::clocks_of(runs)};
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
