// The SM clock of the GPU lynx-bench runs on, and whether the driver holds it at the power cap, read
// through NVML (loaded at run time: no link dependency, and "unknown" where the driver has none).
#pragma once

#include "regime.h"

namespace lynx::bench {

class GpuClock {
 public:
  explicit GpuClock(int cuda_device);  // never throws: without NVML, available() is false
  GpuClock(const GpuClock&) = delete;
  GpuClock& operator=(const GpuClock&) = delete;
  ~GpuClock();
  bool available() const { return device_ != nullptr; }
  // The clock now; a sample with 0 MHz if it cannot be read.
  ClockSample sample() const;

 private:
  void* lib_ = nullptr;
  void* device_ = nullptr;  // nvmlDevice_t
  int (*clock_info_)(void*, int, unsigned*) = nullptr;
  int (*reasons_)(void*, unsigned long long*) = nullptr;
  int (*shutdown_)() = nullptr;
};

}  // namespace lynx::bench
