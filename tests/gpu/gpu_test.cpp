#include "gpu/gpu_test.h"

#include <algorithm>

namespace lynx::test {

const std::string& gpu_unavailable_reason() {
  static const std::string reason = [] {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
      return std::string("no CUDA GPU (") + (err != cudaSuccess ? cudaGetErrorString(err) : "0 devices") + ")";
    }
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return std::string("cannot read device properties");
    if (prop.major != 9) {
      return std::string("GPU 0 is ") + prop.name + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) +
             "), lynx needs Hopper sm_90";
    }
    return std::string();
  }();
  return reason;
}

int32_t peer_group_gpus() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  int32_t R = 1;
  while (R * 2 <= std::min(count, 8)) R *= 2;
  for (int a = 0; a < R; ++a) {
    for (int b = 0; b < R; ++b) {
      int ok = 1;
      if (a != b && (cudaDeviceCanAccessPeer(&ok, a, b) != cudaSuccess || !ok)) return 0;
    }
  }
  return R >= 2 ? R : 0;
}

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    ADD_FAILURE() << what << " failed: " << cudaGetErrorString(err);
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
  }
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes) LYNX_TEST_CUDA(cudaMalloc(&ptr_, bytes));
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void DeviceBuffer::fill_bytes(int byte) {
  if (bytes_ == 0) return;
  LYNX_TEST_CUDA(cudaMemset(ptr_, byte, bytes_));
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
}

void upload(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  LYNX_TEST_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  LYNX_TEST_CUDA(cudaDeviceSynchronize());
}

}  // namespace lynx::test
