// A stream-ordered scratch allocator for the tests (cudaMallocAsync / cudaFreeAsync): every block is
// poisoned when handed out (0xFF bytes: NaN in bf16 and fp32, -1 in int32), so that a read of scratch no
// kernel wrote cannot pass; it counts what it lends.
#pragma once

#include <cstddef>

#include "gpu/gpu_test.h"
#include "lynx/allocator.h"

namespace lynx::test {

class PoisoningAllocator final : public ScratchAllocator {
 public:
  void* allocate(size_t bytes, cudaStream_t stream) override {
    void* p = nullptr;
    LYNX_TEST_CUDA(cudaMallocAsync(&p, bytes, stream));
    LYNX_TEST_CUDA(cudaMemsetAsync(p, 0xFF, bytes, stream));
    ++allocations;
    ++outstanding;
    last_bytes = bytes;
    return p;
  }
  void deallocate(void* p, size_t, cudaStream_t stream) override {
    cudaFreeAsync(p, stream);
    --outstanding;
  }
  int allocations = 0;
  int outstanding = 0;
  size_t last_bytes = 0;
};

}  // namespace lynx::test
