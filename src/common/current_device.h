// A scope in which a given device is current, the previous one current again after it: host code.
#pragma once

#include <cuda_runtime_api.h>

#include <new>

#include "common/cuda_check.h"

namespace lynx::detail {

// NOTES: two constructors because the code that switches devices is of two kinds. A call that can
// fail throws when the switch fails (nothing of the call has run). A destructor must not throw: it
// asks with std::nothrow and does only what needs the device where switched() says so. Either way
// the previous device is made current again when the scope ends, by every path out of it.
class CurrentDevice {
 public:
  explicit CurrentDevice(int device) {
    LYNX_CUDA(cudaGetDevice(&previous_));
    LYNX_CUDA(cudaSetDevice(device));
    switched_ = true;
  }
  CurrentDevice(int device, std::nothrow_t) noexcept {
    switched_ = cudaGetDevice(&previous_) == cudaSuccess && cudaSetDevice(device) == cudaSuccess;
  }
  ~CurrentDevice() {
    if (switched_) cudaSetDevice(previous_);
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

  bool switched() const { return switched_; }
  // Makes `device` current within the scope (the previous device still restored at its end).
  void set(int device) { LYNX_CUDA(cudaSetDevice(device)); }

 private:
  int previous_ = -1;
  bool switched_ = false;
};

}  // namespace lynx::detail
