// Host loops spread over threads: the reference's passes, the tests' and lynx-bench's host checks.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace lynx {

// How many threads parallel_for(n, threads, ...) runs on: `threads` (0: the machine's), at most n, at
// least 1.
inline int64_t parallel_threads(int64_t n, int threads) {
  const int64_t machine = std::max(1u, std::thread::hardware_concurrency());
  return std::max<int64_t>(1, std::min<int64_t>(n, threads > 0 ? threads : machine));
}

// body(i, worker) for every i in [0, n), each once, taken in order by whichever thread is free;
// `worker` in [0, parallel_threads(n, threads)) names the thread (the caller's is 0), so that a body can
// keep state of its own per thread. The first exception a body throws stops the others taking more
// and is rethrown here; a thread that cannot be started leaves its share to the others.
template <class F>
void parallel_for(int64_t n, int threads, const F& body) {
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  const auto work = [&](int64_t worker) {
    try {
      for (int64_t i = next++; i < n; i = next++) body(i, worker);
    } catch (...) {
      const std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      next = n;
    }
  };
  std::vector<std::thread> pool;
  try {
    for (int64_t w = 1; w < parallel_threads(n, threads); ++w) pool.emplace_back(work, w);
  } catch (const std::system_error&) {
    // No thread to be had: those started and this one take every i.
  }
  work(0);
  for (std::thread& thread : pool) thread.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace lynx
