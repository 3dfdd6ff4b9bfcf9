// Shared pieces of the GPU tests: the skip-without-Hopper fixture and small device-buffer helpers.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace lynx::test {

// Empty when a Hopper (sm_90) GPU is usable, else the reason it is not.
const std::string& gpu_unavailable_reason();

// The GPUs an expert-parallel group across GPUs uses here: the largest power of two up to 8 of those
// visible (the tests' E and T divide by it), each with peer access to the others; 0 when there are
// fewer than two, or two cannot reach each other (the multi-GPU tests then skip).
int32_t peer_group_gpus();

// Every GPU test derives from this: without a Hopper GPU it is skipped (CTest shows it as skipped).
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_unavailable_reason().empty()) GTEST_SKIP() << gpu_unavailable_reason();
  }
};

void check_cuda(cudaError_t err, const char* what);
#define LYNX_TEST_CUDA(call) ::lynx::test::check_cuda((call), #call)

// Owning device allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; o.bytes_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  template <class T> T* as() const { return static_cast<T*>(ptr_); }

  // Fills every byte with `byte` (0xFF poisons bf16/fp32 with NaN and int32 with -1), and waits for it
  // (as upload).
  void fill_bytes(int byte);

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Copies `bytes` from host memory to the device and waits until they are there. NOTES: a cudaMemcpy from
// pageable memory may return before its DMA lands, and a cudaStreamNonBlocking stream does not wait for
// the legacy stream: a kernel queued there next could read the old bytes (ScheduleDevice.ReusedBuffers
// did, its new routing's ids at the address of the routing just freed).
void upload(void* dst, const void* src, size_t bytes);

template <class T>
DeviceBuffer to_device(const std::vector<T>& host) {
  DeviceBuffer buf(host.size() * sizeof(T));
  if (!host.empty()) upload(buf.get(), host.data(), host.size() * sizeof(T));
  return buf;
}

template <class T>
std::vector<T> to_host(const DeviceBuffer& buf, size_t count) {
  std::vector<T> host(count);
  if (count) LYNX_TEST_CUDA(cudaMemcpy(host.data(), buf.get(), count * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

}  // namespace lynx::test
