#include "gpu_clock.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

namespace lynx::bench {
namespace {

// From NVML's header (not shipped with the toolkit here): the values lynx-bench needs.
constexpr int kNvmlSuccess = 0;
constexpr int kNvmlClockSm = 1;
constexpr int kNvmlClockMem = 2;
constexpr unsigned long long kReasonSwPowerCap = 0x4ull;

template <class F>
F symbol(void* lib, const char* name) {
  return reinterpret_cast<F>(dlsym(lib, name));
}

}  // namespace

GpuClock::GpuClock(int cuda_device) {
  char bus_id[32] = {};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, cuda_device) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  lib_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib_) return;
  auto init = symbol<int (*)()>(lib_, "nvmlInit_v2");
  auto by_bus = symbol<int (*)(const char*, void**)>(lib_, "nvmlDeviceGetHandleByPciBusId_v2");
  clock_info_ = symbol<int (*)(void*, int, unsigned*)>(lib_, "nvmlDeviceGetClockInfo");
  // Renamed in newer drivers; the old name stays as an alias in some.
  reasons_ = symbol<int (*)(void*, unsigned long long*)>(lib_, "nvmlDeviceGetCurrentClocksEventReasons");
  if (!reasons_) reasons_ = symbol<int (*)(void*, unsigned long long*)>(lib_, "nvmlDeviceGetCurrentClocksThrottleReasons");
  shutdown_ = symbol<int (*)()>(lib_, "nvmlShutdown");
  if (!init || !by_bus || !clock_info_ || !reasons_ || !shutdown_ || init() != kNvmlSuccess) {
    dlclose(lib_);
    lib_ = nullptr;
    return;
  }
  void* device = nullptr;
  if (by_bus(bus_id, &device) == kNvmlSuccess) device_ = device;
}

GpuClock::~GpuClock() {
  if (!lib_) return;
  shutdown_();
  dlclose(lib_);
}

ClockSample GpuClock::sample() const {
  ClockSample s;
  if (!device_) return s;
  unsigned mhz = 0;
  unsigned long long reasons = 0;
  if (clock_info_(device_, kNvmlClockSm, &mhz) == kNvmlSuccess) s.sm_mhz = mhz;
  if (clock_info_(device_, kNvmlClockMem, &mhz) == kNvmlSuccess) s.mem_mhz = mhz;
  if (reasons_(device_, &reasons) == kNvmlSuccess) s.power_capped = (reasons & kReasonSwPowerCap) != 0;
  return s;
}

}  // namespace lynx::bench
