// A value looked up once per device and remembered (kernel attributes, occupancy): host code.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <string>

#include "common/cuda_check.h"
#include "lynx/error.h"

namespace lynx::detail {

constexpr int kMaxDevices = 64;
using PerDeviceCache = std::atomic<int>[kMaxDevices];

// The current device's entry of `cache`, set by `lookup(device)` (which must not return 0, the mark of
// an entry not looked up yet) on the first call for that device. Two threads may both look it up the
// first time; they store the same value.
template <class Lookup>
int per_device(PerDeviceCache& cache, Lookup&& lookup) {
  int device = 0;
  LYNX_CUDA(cudaGetDevice(&device));
  if (device >= kMaxDevices) {
    throw Error("", "internal: device index " + std::to_string(device) + " >= " + std::to_string(kMaxDevices));
  }
  if (cache[device].load() == 0) cache[device].store(lookup(device));
  return cache[device].load();
}

}  // namespace lynx::detail
